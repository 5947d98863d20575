"""The embedded demo bundle of `tonearm serve` when no bundle is configured (docs/service.md).

Built once — synthetic corpus (``small``, seed 0) → short training with
``configs/demo.yaml`` → export — with visible progress, and cached under
``$TONEARM_HOME/demo`` (default ``~/.cache/tonearm/demo``) so later starts take
seconds. A lock file serializes concurrent starts: the second one waits and then
reuses the first one's bundle. Each step's output is reused when present, so an
interrupted build resumes at the step that did not finish. The cache is keyed by a
fingerprint of the demo config, so a changed ``configs/demo.yaml`` retrains (the corpus
is reused). The build's log goes to ``$TONEARM_HOME/demo/build.log`` as well as the terminal.

This module imports ``training`` lazily (it is not part of ``service``): building
the demo needs the ``train`` extra; serving a built one does not.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tonearm.demo_progress import attached
from tonearm.errors import TonearmError

log = logging.getLogger(__name__)

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
BUILD_LOG = "build.log"


def demo_root(home: Path) -> Path:
    return Path(home).expanduser() / "demo"


def config_fingerprint(config: Path = DEMO_CONFIG) -> str:
    """Short hash of the demo config and the file it extends (a changed recipe → a new build)."""
    digest = hashlib.sha256()
    for path in (config, config.parent / "default.yaml"):
        digest.update(path.read_bytes() if path.is_file() else b"")
    return digest.hexdigest()[:12]


def _marker(root: Path) -> Path:
    return root / f"bundle-{config_fingerprint()}.path"


def build_log_path(home: Path) -> Path:
    return demo_root(home) / BUILD_LOG


def cached_demo_bundle(home: Path) -> Path | None:
    """The demo bundle directory if a previous start built it with the current demo config."""
    marker = _marker(demo_root(home))
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
        with _logging_to(root / BUILD_LOG):
            bundle = _build(root)
        marker = _marker(root)
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(str(bundle.resolve()))
        os.replace(tmp, marker)
        return bundle


@contextmanager
def _logging_to(path: Path) -> Iterator[None]:
    """Copy every INFO record of the build to ``path`` (progress visible without a terminal)."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    try:
        with attached(handler, [logging.getLogger()]):
            yield
    finally:
        handler.close()


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

    corpus_dir, bundles_dir = root / "corpus", root / "bundles"
    run_dir = root / f"run-{config_fingerprint(config)}"
    manifest = corpus_dir / "manifest.jsonl"
    if not manifest.is_file():
        log.info("demo bundle [1/3]: generating the synthetic corpus (%s, seed 0) in %s", size, corpus_dir,
                 extra={"demo_stage": 1})
        shutil.rmtree(corpus_dir, ignore_errors=True)
        manifest = generate_corpus(size=size, seed=0, out_dir=corpus_dir)
    checkpoint = run_dir / "best"
    if not (checkpoint / "model.safetensors").is_file():
        shutil.rmtree(run_dir, ignore_errors=True)
        cfg = load_train_config(config, [f"data.manifest={manifest}", f"out_dir={run_dir}"])
        log.info("demo bundle [2/3]: training %s, %d epochs (a few minutes on two cores)", config.name,
                 cfg.optim.epochs, extra={"demo_stage": 2, "demo_epochs": cfg.optim.epochs})
        checkpoint = train(cfg) / "best"
    log.info("demo bundle [3/3]: exporting ONNX encoders and FAISS indices to %s", bundles_dir,
             extra={"demo_stage": 3})
    if bundles_dir.exists():
        shutil.rmtree(bundles_dir)  # an interrupted export; bundles are published atomically
    bundle = export_bundle(checkpoint, manifest=manifest, out_dir=bundles_dir, progress=True)
    log.info("demo bundle ready: %s", bundle)
    return bundle
