"""Session fixture: the tiny bundle, exported once from `tiny_checkpoint` over `tiny_corpus`.

Treat it as read-only (its files are read-only anyway); tests that corrupt a
bundle copy it first with :func:`copy_bundle`.
"""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_bundle(tiny_checkpoint: Path, tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Bundle directory exported with the defaults (exact Flat indices, fp32 encoders)."""
    from index.export import export_bundle

    out_dir = tmp_path_factory.mktemp("bundles")
    return export_bundle(tiny_checkpoint, manifest=tiny_corpus, out_dir=out_dir, progress=False)


def copy_bundle(source: Path, destination: Path) -> Path:
    """A writable copy of a bundle directory."""
    shutil.copytree(source, destination)
    for path in destination.rglob("*"):
        path.chmod(path.stat().st_mode | stat.S_IWUSR)
    return destination
