"""Service test fixtures: our own redis-server, a fake keyword bundle, real uvicorn servers,
and real bundles (a second differently-trained one, a tampered copy, a worse one)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from service.app import create_app
from service.settings import Settings
from tests.service.fakes import KeywordBundle

IN_CI = os.environ.get("CI", "").lower() == "true"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, *, timeout: float = 30.0, interval: float = 0.02, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class RedisServer:
    """A redis-server process of our own on a free port; can be stopped and restarted."""

    def __init__(self, binary: str, port: int) -> None:
        self.binary, self.port = binary, port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url, socket_timeout=0.2, socket_connect_timeout=0.2)
        wait_until(lambda: _pings(client), timeout=10, what="redis-server to start")
        client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def _redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        if IN_CI:
            pytest.fail("redis-server is required in CI (CI=true): apt-get install redis-server")
        pytest.skip("redis-server not found; install it with: apt-get install redis-server")
    return binary


def _private_redis() -> Iterator[RedisServer]:
    server = RedisServer(_redis_binary(), free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server per test (for stop/restart tests)."""
    yield from _private_redis()


@pytest.fixture(scope="session")
def shared_redis() -> Iterator[RedisServer]:
    """One private redis-server for the session (tests isolate themselves by key prefix)."""
    yield from _private_redis()


@pytest.fixture
def key_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


# ---------------------------------------------------------------- fake bundle app


@pytest.fixture
def fake_bundles(tmp_path: Path) -> Path:
    """A bundles directory with two fake bundle directories (fake-a, fake-b) and a worse one."""
    for name in ("fake-a", "fake-b", "fake-worse"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
    return tmp_path


def fake_opener(path: Path) -> KeywordBundle:
    return KeywordBundle(path, bundle_id=path.name, degrade=path.name.endswith("worse"))


def make_settings(**overrides) -> Settings:
    """Development settings for tests. The gate's minimum set size is 1 here: fake and tiny bundles
    hold 5–8 held-out clips; tests of the minimum (tests/service/test_gate_real.py) set it."""
    values = {"environment": "development", "admin_token": "test-admin-token-123456", "search_threads": 2,
              "gate_min_clips": 1,
              # the test process is not a service: each swap's full collection walks pytest's whole heap
              # (~0.1-0.3 s, hundreds of app starts); tests/service/test_allocator.py turns it on, and
              # the services tests start as processes (uvicorn, bench) keep the default
              "gc_freeze": False}
    values.update(overrides)
    return Settings(**values)


@contextlib.contextmanager
def running_client(app, *, ready: bool = True):
    """TestClient (runs the lifespan) that waits until the initial bundle is loaded."""
    from fastapi.testclient import TestClient

    with TestClient(app, raise_server_exceptions=False) as client:
        if ready:
            registry = app.state.tonearm.registry
            assert registry.ready.wait(60), "initial bundle did not load"
        yield client


@pytest.fixture
def fake_client(fake_bundles: Path):
    settings = make_settings(bundles_dir=fake_bundles, bundle="fake-a", gate_metric="t2a_R@1_mean")
    app = create_app(settings, opener=fake_opener)
    with running_client(app) as client:
        yield client


ADMIN = {"Authorization": "Bearer test-admin-token-123456"}


# ---------------------------------------------------------------- uvicorn


class UvicornServer:
    """Runs an app under real uvicorn in a thread on a free port."""

    def __init__(self, app) -> None:
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> UvicornServer:
        self.thread.start()
        wait_until(lambda: self.server.started, timeout=30, what="uvicorn to start")
        return self

    def wait_ready(self, timeout: float = 120) -> None:
        def ready() -> bool:
            try:
                return httpx.get(self.url + "/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout=timeout, interval=0.1, what="/readyz")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@contextlib.contextmanager
def fake_bundles_server(bundles: Path) -> Iterator[UvicornServer]:
    """A ready uvicorn server over two fake bundles in ``bundles`` (``fake-a`` active, ``fake-b`` to swap to)."""
    for name in ("fake-a", "fake-b"):
        (bundles / name).mkdir()
        (bundles / name / "manifest.json").write_text("{}")
    app = create_app(make_settings(bundles_dir=bundles, bundle="fake-a"), opener=fake_opener)
    with UvicornServer(app) as server:
        server.wait_ready()
        yield server


@pytest.fixture
def uvicorn_runner():
    """Factory: ``with uvicorn_runner(app) as server: server.url``."""
    return UvicornServer


# ---------------------------------------------------------------- real bundles


@pytest.fixture(scope="session")
def real_bundles(tiny_corpus, tiny_bundle, tmp_path_factory):  # noqa: F811
    """Bundles a, b (differently seeded), worse (collapsed audio encoder) in one bundles dir."""
    from tests.service.bundle_factory import build_real_bundles

    return build_real_bundles(
        tiny_corpus=tiny_corpus, tiny_bundle=tiny_bundle, work=tmp_path_factory.mktemp("service_bundles")
    )
