"""The embedded demo bundle of `tonearm serve` when no bundle is configured (docs/service.md).

Built once — synthetic corpus (``small``, seed 0) → short training with
``configs/demo.yaml`` → export, with three long recordings, and a moment head trained on
`tonearm synth --moments` recordings (:func:`add_moment_head`) — with visible progress, and cached under
``$TONEARM_HOME/demo`` (default ``~/.cache/tonearm/demo``) so later starts take
seconds. A lock file serializes concurrent starts: the second one waits and then
reuses the first one's bundle. Each step's output is reused when present, so an
interrupted build resumes at the step that did not finish.

The cache is keyed by a fingerprint of the **recipe**: ``configs/demo.yaml`` and the file it
extends, plus the source of every module the build runs (``training/`` and ``index/``), so a
changed config or changed training/export code rebuilds instead of serving a stale bundle.
The corpus has its own, narrower key (the synthesizer's code and size): a changed training
recipe retrains on the corpus already there. `make serve`, the test suite
(``tests/conftest.py`` ``demo_home``) and the benchmarks share one build in
``~/.cache/tonearm/demo`` this way. The build's log goes to
``$TONEARM_HOME/demo/build.log`` as well as the terminal (:func:`wait_for_demo_bundle`
watches it to tell a slow build from a stuck one).

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

from index.languages import DEFAULT_LANGUAGES
from tonearm.demo_progress import attached
from tonearm.errors import TonearmError

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "configs" / "demo.yaml"
DEMO_SIZE = "small"
"""Synthetic corpus size of the demo (``tonearm synth --size``)."""
BUILD_LOG = "build.log"
CORPUS_KEY = ".recipe"
RECIPE_CODE = ("training", "index", "tonearm/demo.py")
"""Packages (and this file) whose source is part of the recipe fingerprint (the build runs their code)."""
CORPUS_CODE = ("training/data", "index/languages.py")


def demo_root(home: Path) -> Path:
    return Path(home).expanduser() / "demo"


def _sources(parts: tuple[str, ...]) -> list[Path]:
    files: list[Path] = []
    for part in parts:
        path = ROOT / part
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return files


def _digest(files: list[Path], *extra: str) -> str:
    digest = hashlib.sha256()
    for value in extra:
        digest.update(value.encode() + b"\0")
    for path in files:
        digest.update(str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path).encode() + b"\0")
        digest.update(path.read_bytes() if path.is_file() else b"")
    return digest.hexdigest()[:12]


def config_fingerprint(config: Path | None = None) -> str:
    """Short hash of the recipe: the demo config, the file it extends, the corpus size and the
    source of ``training/`` and ``index/`` (a changed config or build code → a new build)."""
    config = config or DEMO_CONFIG
    return _digest([config, config.parent / "default.yaml", *_sources(RECIPE_CODE)], DEMO_SIZE)


def corpus_fingerprint(size: str) -> str:
    """Short hash of what the corpus depends on: the synthesizer's code and the size (seed 0)."""
    return _digest(_sources(CORPUS_CODE), size)


def _marker(root: Path, key: str | None = None) -> Path:
    return root / f"bundle-{key or config_fingerprint()}.path"


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
        key = config_fingerprint()  # before the build: code edited meanwhile must not bless this bundle
        with _logging_to(root / BUILD_LOG):
            bundle = _build(root)
        marker = _marker(root, key)
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


def _build(root: Path, *, size: str | None = None, config: Path | None = None) -> Path:
    """synth → train → export into ``root``; ``size``/``config`` (default :data:`DEMO_SIZE`,
    :data:`DEMO_CONFIG`) let tests run the same path on ``tiny``."""
    size, config = size or DEMO_SIZE, config or DEMO_CONFIG
    try:
        from training.bundle.export import export_bundle
        from training.config import load_train_config
        from training.data.synth import generate_corpus
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
    manifest, corpus_key = corpus_dir / "manifest.jsonl", corpus_fingerprint(size)
    key_file = corpus_dir / CORPUS_KEY
    if not manifest.is_file() or not key_file.is_file() or key_file.read_text().strip() != corpus_key:
        log.info("demo bundle [1/3]: generating the synthetic corpus (%s, seed 0) in %s", size, corpus_dir,
                 extra={"demo_stage": 1})
        shutil.rmtree(corpus_dir, ignore_errors=True)
        manifest = generate_corpus(size=size, seed=0, out_dir=corpus_dir)
        key_file.write_text(corpus_key + "\n")
        _remove_stale_runs(root, keep=None)  # trained on the old corpus
    checkpoint = run_dir / "best"
    if not (checkpoint / "model.safetensors").is_file():
        _remove_stale_runs(root, keep=None)  # older recipes' runs (and an interrupted one): disk stays bounded
        cfg = load_train_config(config, [f"data.manifest={manifest}", f"out_dir={run_dir}"])
        log.info("demo bundle [2/3]: training %s, %d epochs (a few minutes on two cores)", config.name,
                 cfg.optim.epochs, extra={"demo_stage": 2, "demo_epochs": cfg.optim.epochs})
        checkpoint = train(cfg) / "best"
    log.info("demo bundle [3/3]: exporting ONNX encoders and FAISS indices to %s, then training its moment head",
             bundles_dir, extra={"demo_stage": 3})
    if bundles_dir.exists():
        shutil.rmtree(bundles_dir)  # an interrupted export; bundles are published atomically
    with_long = add_long_recordings(manifest, corpus_dir / "long")
    windows_only = export_bundle(checkpoint, manifest=with_long, out_dir=bundles_dir, progress=True)
    bundle = add_moment_head(windows_only, corpus_dir / "long" / "manifest.jsonl", with_long)
    log.info("demo bundle ready: %s", bundle)
    return bundle


MOMENT_HEAD_STEPS = 300
"""Steps of the demo's moment head (`tonearm train-moments`' code): ~20 s on two cores, a small part of the build."""


def add_moment_head(windows_only: Path, moment_manifest: Path, with_long: Path) -> Path:
    """The demo bundle that is served: ``windows_only`` plus a moment head trained (:data:`MOMENT_HEAD_STEPS`
    steps, seed 0) on the ``train`` split of the demo's moment corpus (``moment_manifest``: the recordings of
    `tonearm synth --moments` the long ones were taken from), measured on the long recordings ``long-1`` … (split
    ``long`` of ``with_long``: the corpus's ``test`` split, never trained on) — both scorers in its held-out
    report, the recordings kept for the quality gate. The windows-only bundle stays beside it (hard links)."""
    from training.data.manifest import load_manifest
    from training.moment_head import attach_moment_head

    train = load_manifest(moment_manifest, languages=DEFAULT_LANGUAGES, split="train")
    heldout = load_manifest(with_long, languages=DEFAULT_LANGUAGES, split="long")
    log.info("demo bundle [3/3]: training the moment head (%d steps on %d recordings) for %s", MOMENT_HEAD_STEPS,
             len(train), windows_only.name, extra={"demo_moment_head": True})  # bench/demo_build.py times it
    training = {"data_manifest": str(moment_manifest), "split": "train", "heldout_split": "long (the demo's long "
                "recordings)"}
    return attach_moment_head(windows_only, train, windows_only.parent / f"{windows_only.name}-head", seed=0,
                              steps=MOMENT_HEAD_STEPS, heldout_records=heldout, training=training)


LONG_RECORDINGS = 3
"""Long recordings the demo bundle holds beside its clips, to try moment search on (docs/service.md)."""
LONG_SECONDS = (60.0, 90.0)
"""Their length: `tonearm synth --moments` beds of 1 to 1.5 min."""


def add_long_recordings(manifest: Path, out_dir: Path) -> Path:
    """A manifest of the corpus plus :data:`LONG_RECORDINGS` long recordings of `tonearm synth --moments`
    (seed 0; renamed ``long-1`` … and put in split ``long``, so they are never held out), each moment
    with its captions in the eight languages."""
    from dataclasses import replace

    from training.data.manifest import read_manifest, write_manifest
    from training.data.synth_moments import generate_moment_corpus

    records = [record for _, record in read_manifest(manifest, languages=None)]
    long_manifest = generate_moment_corpus(size="tiny", seed=0, out_dir=out_dir, progress=False, seconds=LONG_SECONDS)
    recordings = [record for _, record in read_manifest(long_manifest, languages=None) if record.split == "test"]
    long_records = [replace(record, id=f"long-{i + 1}", split="long")
                    for i, record in enumerate(recordings[:LONG_RECORDINGS])]
    out = manifest.parent / "manifest_with_long.jsonl"
    write_manifest([*records, *long_records], out)
    return out


def _remove_stale_runs(root: Path, *, keep: Path | None) -> None:
    for run in root.glob("run-*"):
        if run != keep and run.is_dir():
            shutil.rmtree(run, ignore_errors=True)
    for marker in root.glob("bundle-*.path"):
        marker.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m tonearm.demo [--home DIR]``: build (or find) the demo bundle; print its path."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m tonearm.demo", description=main.__doc__)
    parser.add_argument("--home", type=Path, default=None, help="TONEARM_HOME (default: the service's setting)")
    args = parser.parse_args(argv)
    if args.home is None:
        from service.settings import Settings

        args.home = Settings().home
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        bundle = ensure_demo_bundle(args.home)
    except TonearmError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    sys.stdout.write(f"{bundle}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
