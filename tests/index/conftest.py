"""Bundle helpers for index tests; the session fixture ``tiny_bundle`` is in tests/conftest.py.

Tests that corrupt a bundle copy it first with :func:`copy_bundle`.
"""

from __future__ import annotations

import shutil
import stat
from pathlib import Path


def copy_bundle(source: Path, destination: Path) -> Path:
    """A writable copy of a bundle directory."""
    shutil.copytree(source, destination)
    for path in destination.rglob("*"):
        path.chmod(path.stat().st_mode | stat.S_IWUSR)
    return destination
