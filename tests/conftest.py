"""Shared session fixtures: a tiny synthetic corpus and a tiny trained checkpoint.

Both are built once per test session in a temporary directory and reused by every
part's tests (training, export, service). Treat them as read-only.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.milvus_server import milvus_server, milvus_uri  # noqa: F401  (session Milvus server; both engines)

ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIG = ROOT / "configs" / "tiny.yaml"


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Manifest path of `tonearm synth --size tiny --seed 0` (train/val/test splits, 8 languages)."""
    from training.data.synth import generate_corpus

    return generate_corpus(size="tiny", seed=0, out_dir=tmp_path_factory.mktemp("tiny_corpus"))


@pytest.fixture(scope="session")
def tiny_run(tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run directory of configs/tiny.yaml trained on `tiny_corpus` (best/, last/, metrics.jsonl, curves.png)."""
    from training.config import load_train_config
    from training.loop import train

    out_dir = tmp_path_factory.mktemp("tiny_run")
    cfg = load_train_config(TINY_CONFIG, [f"data.manifest={tiny_corpus}", f"out_dir={out_dir}"])
    return train(cfg)


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_run: Path) -> Path:
    """Checkpoint directory (`best/`) of the tiny run: load with training.checkpoint.load_checkpoint."""
    return tiny_run / "best"


@pytest.fixture(scope="session")
def tiny_bundle(tiny_checkpoint: Path, tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Bundle directory exported with the defaults (exact Flat indices, fp32 encoders)."""
    from training.bundle.export import export_bundle

    out_dir = tmp_path_factory.mktemp("bundles")
    return export_bundle(tiny_checkpoint, manifest=tiny_corpus, out_dir=out_dir, progress=False)


@pytest.fixture(scope="session")
def large_bundle(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bundle of the demo's size (3,000 clips, 120,000 captions; random unit vectors in exact Flat
    indices, the tiny bundle's encoders): tests/large_bundle.py. Built in seconds; read-only."""
    from tests.large_bundle import build_large_bundle

    return build_large_bundle(tiny_bundle, tmp_path_factory.mktemp("large_bundle"))


DEMO_TEST_TIMEOUT = 600
"""Wall-clock limit of a real-demo test's own body; the build it may wait for is not under it."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests using ``demo_home`` time only their body: the demo build they may wait for (5 min
    idle, 30+ min at load 10) is watched for progress by the fixture instead of a clock. When
    any collected test needs the demo and it is not built yet, its build starts now in the
    background (:func:`_start_background_demo_build`)."""
    wanted = False
    for item in items:
        if "demo_home" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(DEMO_TEST_TIMEOUT, func_only=True), append=False)
            wanted = True
    if wanted:
        _start_background_demo_build()


_background_build: subprocess.Popen[bytes] | None = None


def _demo_test_home() -> Path:
    from service.settings import default_home

    given = os.environ.get("TONEARM_DEMO_TEST_HOME") or os.environ.get("TONEARM_HOME")
    return Path(given).expanduser() if given else default_home()


def _start_background_demo_build() -> None:
    """Start the demo build at nice 19 when the session begins, so that it runs on the CPU time
    the tests before the first demo test leave idle (they wait on servers and subprocesses much
    of the time) instead of adding its 5 minutes to the run; the weight of nice 19 leaves busy
    tests their cores. ``demo_home`` then waits for this build: a second builder waits for the
    build lock and reuses the result (tonearm/demo.py), and the fixture's watchdog follows the
    same build log."""
    global _background_build
    from tonearm.demo import build_log_path, cached_demo_bundle

    home = _demo_test_home()
    if cached_demo_bundle(home) is not None:
        return
    log = build_log_path(home)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log.parent / "builder.out", "ab") as sink:
        _background_build = subprocess.Popen([sys.executable, "-m", "tonearm.demo", "--home", str(home)],
                                             stdout=sink, stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(19))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A background demo build still running (no demo test reached, e.g. after -x) is stopped."""
    if _background_build is not None and _background_build.poll() is None:
        _background_build.terminate()
        _background_build.wait(timeout=30)


@pytest.fixture(scope="session")
def demo_home() -> Path:
    """`$TONEARM_HOME` holding the real demo bundle — the **same cached build `make serve` uses**
    (``$TONEARM_HOME``, default ``~/.cache/tonearm``; ``TONEARM_DEMO_TEST_HOME`` overrides it),
    built on first use by the path `tonearm serve` takes (synth small → configs/demo.yaml →
    export; about 5 minutes on two idle cores) and reused while its recipe (config + training
    and index code) is unchanged. Read-only: a test that needs a fresh build uses its own home.

    The build runs in a subprocess under the demo build lock (a concurrent `make serve` or
    test session waits for the one build) and is waited for on progress: the fixture fails when
    the build fails or its log stops growing for ``TONEARM_DEMO_STALL_SECONDS`` (default 900),
    never because a loaded machine is slow."""
    from tonearm.demo_wait import DEFAULT_STALL_SECONDS, wait_for_demo_bundle

    home = _demo_test_home()
    stall = float(os.environ.get("TONEARM_DEMO_STALL_SECONDS", DEFAULT_STALL_SECONDS))
    wait_for_demo_bundle(home, stall_seconds=stall)
    return home


@pytest.fixture(autouse=True)
def _thaw_the_gc_after_each_test():
    """A service app created in this process freezes every object alive at its bundle swap out of the
    cyclic GC (service/allocator.py: right for a service, whose objects then live until the next swap).
    In the test process that would include earlier fixtures' GB-size models, whose cycles would then
    outlive their fixtures; ``gc.unfreeze`` (O(1): one list splice) after each test undoes it."""
    yield
    gc.unfreeze()
