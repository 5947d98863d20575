"""Shared session fixtures: a tiny synthetic corpus and a tiny trained checkpoint.

Both are built once per test session in a temporary directory and reused by every
part's tests (training, export, service). Treat them as read-only.
"""

from __future__ import annotations

import fcntl
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
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


# ---------------------------------------------------------------- two workers (pytest-xdist, `make test`)

SHARED_RESOURCE_GROUPS: dict[str, tuple[frozenset[str], str]] = {
    "demo": (frozenset({"demo_home"}), "demo"),
    "milvus": (frozenset({"milvus_server", "milvus_uri"}), "milvus"),
    "real_size": (frozenset({"real_pe_audio_dir", "pe_bundle", "real_clap_pretrained_bundle"}), "real_size"),
}
"""xdist group → (fixtures, a word of the test file's name) that put a test in it. A group runs on one
worker, so that what its tests share is built, held and waited for once: the real demo build; the
session's Milvus server (a second one would idle at a quarter of a core); the full-size random-weight
models, several GB each, that two workers would otherwise both hold. Fixtures a test takes through
``request.getfixturevalue`` are not in its closure, hence the file names."""


SHARED_RESOURCE_GROUPS_ORDER = ("real_size", "milvus", "demo")
"""The order the groups are handed out in, before every test file: the longest first (measured
2026-11-29: real-size ~18 min on a fresh test-model cache and ~3 min warm, Milvus ~12 min, the demo's
tests ~2 min — after the Milvus group its background build has had time to finish)."""


def _shared_resource_group(item: pytest.Item) -> str | None:
    names = set(getattr(item, "fixturenames", ()))
    path = item.nodeid.split("::", 1)[0]
    for group, (fixtures, file_word) in SHARED_RESOURCE_GROUPS.items():
        real_size = group == "real_size" and any(n.startswith("real_") and n.endswith(("_dir", "_run")) for n in names)
        if names & fixtures or real_size or file_word in Path(path).name:
            return group
    return None


GROUPS_FILE_ENV = "TONEARM_XDIST_GROUPS_FILE"
"""Where the workers leave each grouped test's group for the controller's scheduler (set by the
controller in :func:`pytest_configure`; the workers inherit it). xdist's own ``xdist_group`` mark
cannot carry it: it renames the node id, which pytest 9.2 no longer lets a plugin do."""


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own (the hook takes the first answer)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadscope`` (`make test`): work units of a test file, or of a shared-resource group
    (:data:`SHARED_RESOURCE_GROUPS`) — a file's module fixtures (servers, bundles) are built by one
    worker, not both; the groups are handed out first, then the files with the most tests."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFileOrGroup(LoadScopeScheduling):  # type: ignore[misc]
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # written by the workers before they sent their collections
                path = Path(os.environ[GROUPS_FILE_ENV])
                self.groups = json.loads(path.read_text(encoding="utf-8")) if path.stat().st_size else {}
            return self.groups.get(nodeid) or nodeid.split("::", 1)[0]

        def _assign_work_unit(self, node: object) -> None:
            # the groups first, longest first (on a fresh cache the real-size group builds for ~18 min):
            # started last, one worker would run it alone at the end
            if not getattr(self, "_groups_first", False):
                for group in reversed(SHARED_RESOURCE_GROUPS_ORDER):
                    if group in self.workqueue:
                        self.workqueue.move_to_end(group, last=False)
                self._groups_first = True
            super()._assign_work_unit(node)

    return ByFileOrGroup(config, log)


def _write_groups(items: list[pytest.Item]) -> None:
    """An xdist worker: each grouped test's group, for the controller (both workers write the same)."""
    groups = {item.nodeid: group for item in items if (group := _shared_resource_group(item)) is not None}
    path = Path(os.environ[GROUPS_FILE_ENV])
    partial = path.with_name(f"{path.name}.{os.environ.get('PYTEST_XDIST_WORKER', 'w')}")
    partial.write_text(json.dumps(groups), encoding="utf-8")
    os.replace(partial, path)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests using ``demo_home`` time only their body: the demo build they may wait for (5 min
    idle, 30+ min at load 10) is watched for progress by the fixture instead of a clock. When
    any collected test needs the demo and it is not built yet, its build starts now in the
    background (:func:`_start_background_demo_build`). Under xdist, the tests that share a heavy
    resource are named for the scheduler (:data:`SHARED_RESOURCE_GROUPS`)."""
    if _xdist_worker(config) and GROUPS_FILE_ENV in os.environ:
        _write_groups(items)
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
    same build log. Under xdist every worker collects every test and comes here: the first starts
    the build and records its pid (:func:`_builder_pid_file`), the others see it running."""
    global _background_build
    from tonearm.demo import build_log_path, cached_demo_bundle

    home = _demo_test_home()
    if cached_demo_bundle(home) is not None:
        return
    log = build_log_path(home)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(_builder_pid_file(), "a+") as pid_file:
        fcntl.flock(pid_file, fcntl.LOCK_EX)  # two workers collecting at once start one build
        pid_file.seek(0)
        if _running_builder(pid_file.read().strip()) is not None:
            return
        with open(log.parent / "builder.out", "ab") as sink:
            _background_build = subprocess.Popen([sys.executable, "-m", "tonearm.demo", "--home", str(home)],
                                                 stdout=sink, stderr=subprocess.STDOUT,
                                                 preexec_fn=lambda: os.nice(19))
        pid_file.seek(0)
        pid_file.truncate()
        pid_file.write(str(_background_build.pid))


def _builder_pid_file() -> Path:
    """Where this session's background demo build leaves its pid: beside the build log."""
    from tonearm.demo import build_log_path

    return build_log_path(_demo_test_home()).parent / "builder.pid"


def _running_builder(pid_text: str) -> int | None:
    """The pid when it is a live ``tonearm.demo`` process (a stale file's pid may be anyone's now)."""
    try:
        cmdline = Path(f"/proc/{int(pid_text)}/cmdline").read_bytes()
    except (ValueError, OSError):
        return None
    return int(pid_text) if b"tonearm.demo" in cmdline else None


def _xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """xdist controller: a worker's changed cache entries (its exit status does not reach ours)."""
    _changed_cache_entries.extend(Path(p) for p in getattr(node, "workeroutput", {}).get(CHANGED_CACHE_KEY, []))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A background demo build still running (no demo test reached, e.g. after -x) is stopped — by
    the process that runs the session as a whole (under xdist the controller: a worker that ends
    early must not stop the build another worker's demo tests wait for). A per-machine cache entry
    (tests/model_cache.py) that changed while this session used it fails the run (its marker is
    dropped: the next run rebuilds it)."""
    from tests.model_cache import changed_entries

    if not _xdist_worker(session.config):
        builder = _background_build.pid if _background_build is not None else None
        if builder is None and _builder_pid_file().is_file():
            builder = _running_builder(_builder_pid_file().read_text(encoding="utf-8").strip())
        if builder is not None and _running_builder(str(builder)) is not None:
            os.kill(builder, signal.SIGTERM)
            if _background_build is not None:
                _background_build.wait(timeout=30)
    _changed_cache_entries.extend(changed_entries())
    if _xdist_worker(session.config):
        session.config.workeroutput[CHANGED_CACHE_KEY] = [str(p) for p in _changed_cache_entries]  # type: ignore[attr-defined]
    elif _changed_cache_entries:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


CHANGED_CACHE_KEY = "tonearm-changed-cache-entries"
_changed_cache_entries: list[Path] = []


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


# ---------------------------------------------------------------- the slowest tests, with what each guards


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slowest", type=int, default=0, metavar="N",
                     help="at the end, the N slowest test calls and setups with what each guards: the first "
                          "paragraph of the test's docstring (else its module's), and for a setup the fixtures "
                          "it built, each with its own time and docstring")


GUARD_CHARS = 150
"""A docstring's first paragraph is cut to this many characters in the summary."""
GUARD_PROPERTY, FIXTURES_PROPERTY = "tonearm-guards", "tonearm-fixtures"
"""The ``user_properties`` names under which a report carries its guard and its setup's fixtures."""


def _first_paragraph(doc: str | None) -> str:
    text = " ".join((doc or "").strip().split("\n\n")[0].split())
    return text if len(text) <= GUARD_CHARS else text[: GUARD_CHARS - 1] + "…"


class SlowestSummary:
    """``--slowest N`` (`make test`: 30): at the end, the slowest test calls and setups with what each
    guards — what a slow test costs is judged against that. Replaces ``--durations``, which names the
    tests only. Registered as a plugin (:func:`pytest_configure`), not as this conftest's hooks: pytest
    sends a session fixture's ``pytest_fixture_setup`` only to the conftests above the root directory."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.running: str | None = None
        """The node id of the test whose protocol runs now (fixtures set up meanwhile are charged to it)."""
        self.guards: dict[str, str] = {}
        """Node id → what the test guards (its docstring's first paragraph, else its module's)."""
        self.fixtures: dict[str, list[tuple[float, str, str]]] = {}
        """Node id → (own seconds, fixture name, what it guards) of each fixture set up for it."""
        self.stack: list[float] = []
        """Per fixture being set up: the seconds its nested fixtures took (subtracted: own time only)."""

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> object:
        guard = _first_paragraph(getattr(getattr(item, "function", None), "__doc__", None))
        if not guard and getattr(item, "module", None) is not None:
            guard = f"(module) {_first_paragraph(item.module.__doc__)}"  # type: ignore[attr-defined]
        self.guards[item.nodeid], self.running = guard, item.nodeid
        try:
            return (yield)
        finally:
            self.running = None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
        """What the summary needs rides on the report (``user_properties`` are sent from an xdist
        worker to the controller, which prints the summary): the guard, and a setup's fixtures."""
        report: pytest.TestReport = yield
        if report.when == "call":
            report.user_properties.append((GUARD_PROPERTY, self.guards.get(item.nodeid, "")))
        elif report.when == "setup":
            built = [list(f) for f in self.fixtures.get(item.nodeid, [])]
            report.user_properties.append((FIXTURES_PROPERTY, built))
        return report

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[object], request: pytest.FixtureRequest) -> object:
        self.stack.append(0.0)
        start = time.perf_counter()
        try:
            return (yield)
        finally:
            elapsed = time.perf_counter() - start
            nested = self.stack.pop()
            if self.stack:
                self.stack[-1] += elapsed
            if self.running is not None and elapsed - nested >= 0.05:
                self.fixtures.setdefault(self.running, []).append(
                    (elapsed - nested, fixturedef.argname, _first_paragraph(fixturedef.func.__doc__)))

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        write = terminalreporter.write_line
        reports = [r for group in terminalreporter.stats.values() for r in group
                   if isinstance(r, pytest.TestReport) and r.when in ("setup", "call")]
        slowest = sorted(reports, key=lambda r: r.duration, reverse=True)[: self.count]
        terminalreporter.write_sep("=", f"{len(slowest)} slowest test calls and setups, and what each guards")
        for report in slowest:
            carried = dict(report.user_properties)
            write(f"{report.duration:7.1f}s {report.when:<5} {report.nodeid}")
            if report.when == "call":
                write(f"{'':15}guards: {carried.get(GUARD_PROPERTY) or '(no docstring)'}")
                continue
            # a setup: the fixtures it built (a session fixture is charged to the first test of each
            # process that needs it: under xdist, of each worker)
            built = sorted((tuple(f) for f in carried.get(FIXTURES_PROPERTY, [])), reverse=True)
            for own, name, guard in [f for f in built if f[0] >= 0.1 * report.duration][:4] or built[:1]:
                write(f"{'':15}{own:6.1f}s fixture {name}: {guard or '(no docstring)'}")
        total = sum(r.duration for r in reports)
        write(f"(setups and calls of all {len({r.nodeid for r in reports})} tests: {total / 60:.1f} min)")


def pytest_configure(config: pytest.Config) -> None:
    count = config.getoption("--slowest")
    if count:
        config.pluginmanager.register(SlowestSummary(count), "tonearm-slowest")
    if config.getoption("numprocesses", None) and not _xdist_worker(config):  # the xdist controller
        global _groups_file
        handle, path = tempfile.mkstemp(prefix="tonearm-xdist-groups-", suffix=".json")
        os.close(handle)
        os.environ[GROUPS_FILE_ENV] = path  # the workers, started after this, inherit it
        _groups_file = Path(path)


_groups_file: Path | None = None
"""The groups file this process made (only the xdist controller makes one, and only it deletes it)."""


def pytest_unconfigure(config: pytest.Config) -> None:
    if _groups_file is not None:
        _groups_file.unlink(missing_ok=True)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Names the cache entries this session changed (:func:`pytest_sessionfinish` failed the run;
    under xdist the controller prints what its workers reported)."""
    if _changed_cache_entries:
        terminalreporter.write_sep("=", "cache entries changed by this session (tests must not write into them)",
                                   red=True)
        for entry in _changed_cache_entries:
            terminalreporter.write_line(f"{entry}: changed since it was handed out; its done marker is removed, "
                                        "the next run rebuilds it")
