"""The embedded demo bundle of `tonearm serve` when no bundle is configured (docs/service.md).

Built once — synthetic corpus (``small``, seed 0) → short training with
``configs/demo.yaml`` → export — with visible progress, and cached under
``$TONEARM_HOME/demo`` (default ``~/.cache/tonearm/demo``) so later starts take
seconds. A lock file serializes concurrent starts: the second one waits and then
reuses the first one's bundle. Each step's output is reused when present, so an
interrupted build resumes at the step that did not finish.

This module imports ``training`` lazily (it is not part of ``service``): building
the demo needs the ``train`` extra; serving a built one does not.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tonearm.errors import TonearmError

log = logging.getLogger(__name__)

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
MARKER = "bundle.path"


def demo_root(home: Path) -> Path:
    return Path(home).expanduser() / "demo"


def cached_demo_bundle(home: Path) -> Path | None:
    """The demo bundle directory if a previous start built it."""
    marker = demo_root(home) / MARKER
    if not marker.is_file():
        return None
    path = Path(marker.read_text().strip())
    return path if (path / "manifest.json").is_file() else None


@contextmanager
def _build_lock(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building the demo bundle in %s; waiting for it", root)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_demo_bundle(home: Path) -> Path:
    """Path of the demo bundle, building it first if needed (minutes on two cores, once)."""
    found = cached_demo_bundle(home)
    if found is not None:
        return found
    root = demo_root(home)
    with _build_lock(root):
        found = cached_demo_bundle(home)  # built by the process we waited for
        if found is not None:
            return found
        bundle = _build(root)
        tmp = root / (MARKER + ".tmp")
        tmp.write_text(str(bundle.resolve()))
        os.replace(tmp, root / MARKER)
        return bundle


def _build(root: Path, *, size: str = "small", config: Path = DEMO_CONFIG) -> Path:
    """synth → train → export into ``root``; ``size``/``config`` let tests run the same path on ``tiny``."""
    try:
        from training.config import load_train_config
        from training.data.synth import generate_corpus
        from training.export import export_bundle
        from training.loop import train
    except ModuleNotFoundError as err:
        raise TonearmError(
            f"building the demo bundle needs {err.name!r}: pip install 'tonearm[train]', "
            "or pass --bundle DIR / set TONEARM_BUNDLE"
        ) from err
    if not config.is_file():
        raise TonearmError(f"{config}: demo training config missing; pass --bundle DIR instead")

    corpus_dir, run_dir, bundles_dir = root / "corpus", root / "run", root / "bundles"
    manifest = corpus_dir / "manifest.jsonl"
    if not manifest.is_file():
        log.info("demo bundle [1/3]: generating the synthetic corpus (%s, seed 0) in %s", size, corpus_dir)
        shutil.rmtree(corpus_dir, ignore_errors=True)
        manifest = generate_corpus(size=size, seed=0, out_dir=corpus_dir)
    checkpoint = run_dir / "best"
    if not (checkpoint / "model.safetensors").is_file():
        log.info("demo bundle [2/3]: training %s (a few minutes on two cores)", config.name)
        shutil.rmtree(run_dir, ignore_errors=True)
        cfg = load_train_config(config, [f"data.manifest={manifest}", f"out_dir={run_dir}"])
        checkpoint = train(cfg) / "best"
    log.info("demo bundle [3/3]: exporting ONNX encoders and FAISS indices to %s", bundles_dir)
    if bundles_dir.exists():
        shutil.rmtree(bundles_dir)  # an interrupted export; bundles are published atomically
    bundle = export_bundle(checkpoint, manifest=manifest, out_dir=bundles_dir, progress=True)
    log.info("demo bundle ready: %s", bundle)
    return bundle
