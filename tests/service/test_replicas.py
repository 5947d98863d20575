"""Two replicas (two `tonearm serve` processes) sharing one real Redis and one bundles
directory: an activation through one reaches both under load with zero failed requests,
and a rollback through the other comes back the same way. Also: a replica whose Redis is
unreachable at start serves alone, says so in its log, and is ready.

The propagation time (activation answered by the origin → first answer of the new bundle
from the other replica) is printed; docs/deploy.md quotes it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT
from tests.service.conftest import free_port, wait_until

TOKEN = "replica-test-admin-token-0123456789"


@dataclass
class Replica:
    process: subprocess.Popen
    url: str
    log: Path

    def logged(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120) -> None:
        def ready() -> bool:
            assert self.process.poll() is None, f"replica exited:\n{self.logged()[-3000:]}"
            try:
                return httpx.get(self.url + "/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout=timeout, interval=0.1, what=f"{self.url}/readyz")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_replica(tmp_path: Path, name: str, *, bundles_dir: Path, bundle: str, redis_url: str, prefix: str) -> Replica:
    """`tonearm serve` in a subprocess; an empty ``bundle`` or ``redis_url`` leaves that setting unset."""
    port = free_port()
    settings = {
        "TONEARM_ENVIRONMENT": "production",
        "TONEARM_BUNDLES_DIR": str(bundles_dir),
        "TONEARM_BUNDLE": bundle,
        "TONEARM_REDIS_URL": redis_url,
        "TONEARM_KEY_PREFIX": prefix,
        "TONEARM_PUBSUB_CHANNEL": f"{prefix}:activations",
        "TONEARM_ADMIN_TOKEN": TOKEN,
        "TONEARM_SEARCH_THREADS": "2",
        "TONEARM_HOME": str(tmp_path / "home"),
    }
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("TONEARM_")}
    env = {**inherited, "OMP_NUM_THREADS": "1", **{k: v for k, v in settings.items() if v}}
    log = tmp_path / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "tonearm.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    return Replica(process, f"http://127.0.0.1:{port}", log)


def _load(replica_index: int, url: str, stop: threading.Event, log: list) -> None:
    """Closed-loop text searches against one replica: (replica, start, end, status, bundle_id)."""
    queries = ["a dog barks", "un chien aboie", "rain on a roof", "犬が吠える", "eine Sirene"]
    with httpx.Client(base_url=url, timeout=30) as client:
        i = 0
        while not stop.is_set():
            start = time.monotonic()
            try:
                r = client.post("/v1/search/text", json={"query": f"{queries[i % 5]} {i}", "k": 5})
                body = r.json().get("bundle_id") if r.status_code == 200 else r.text
                log.append((replica_index, start, time.monotonic(), r.status_code, body))
            except Exception as err:  # a failed request is what this test looks for
                log.append((replica_index, start, time.monotonic(), -1, repr(err)))
            i += 1


def _admin(url: str, path: str, body: dict | None = None) -> dict:
    r = httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _first_answer_of(replica: int, bundle: str, log: list, after: float, timeout: float = 60) -> float:
    """Seconds from ``after`` to the end of the first request of ``replica`` started after it that ``bundle`` answered."""
    def answered() -> bool:
        return any(e[0] == replica and e[1] >= after and e[4] == bundle for e in list(log))

    wait_until(answered, timeout=timeout, interval=0.01, what=f"replica {replica} to serve {bundle}")
    return min(e[2] for e in list(log) if e[0] == replica and e[1] >= after and e[4] == bundle) - after


@pytest.mark.slow
@pytest.mark.redis
def test_activation_and_rollback_reach_both_replicas_under_load(real_bundles, redis_server, key_prefix, tmp_path):
    a, b = real_bundles.id("a"), real_bundles.id("b")
    bundles_dir = real_bundles.a.parent
    replicas = [
        start_replica(tmp_path, f"replica{i}", bundles_dir=bundles_dir, bundle=a, redis_url=redis_server.url, prefix=key_prefix)
        for i in range(2)
    ]
    stop, log = threading.Event(), []
    clients = [threading.Thread(target=_load, args=(i % 2, replicas[i % 2].url, stop, log)) for i in range(4)]
    try:
        for replica in replicas:
            replica.wait_ready()
        for thread in clients:
            thread.start()
        wait_until(lambda: len(log) >= 40, timeout=60, what="traffic before the activation")

        # Activate b through replica 0 (force: the gate is tested elsewhere; these tiny bundles
        # are two seeds of the same run and either may win it).
        activate_called = time.monotonic()
        result = _admin(replicas[0].url, "/v1/bundles/activate", {"bundle_id": b, "force": True})
        assert result["bundle_id"] == b and result["changed"] is True
        activated = time.monotonic()
        propagation_b = _first_answer_of(1, b, log, activated)
        wait_until(lambda: sum(1 for e in list(log) if e[1] > activated + propagation_b) >= 40, what="traffic on b")

        # Roll back through the other replica.
        rollback_called = time.monotonic()
        assert _admin(replicas[1].url, "/v1/bundles/rollback")["bundle_id"] == a
        rolled_back = time.monotonic()
        propagation_a = _first_answer_of(0, a, log, rolled_back)
        wait_until(lambda: sum(1 for e in list(log) if e[1] > rolled_back + propagation_a) >= 40, what="traffic on a")
    finally:
        stop.set()
        for thread in clients:
            thread.join(timeout=60)
        for replica in replicas:
            replica.stop()

    failures = [e for e in log if e[3] != 200]
    assert failures == [], failures[:5]
    # Before the activation only a answered; once each replica served b it never went back
    # to a until the rollback; after the rollback reached it, only a.
    assert {e[4] for e in log if e[2] < activate_called} == {a}
    for replica in (0, 1):
        switched = min(e[2] for e in log if e[0] == replica and e[1] >= activated and e[4] == b)
        assert {e[4] for e in log if e[0] == replica and e[1] > switched and e[2] < rollback_called} == {b}
        returned = min(e[2] for e in log if e[0] == replica and e[1] >= rolled_back and e[4] == a)
        assert {e[4] for e in log if e[0] == replica and e[1] > returned} == {a}
    counts = {r: sum(1 for e in log if e[0] == r) for r in (0, 1)}
    print(
        f"\npropagation to the other replica: activation {propagation_b * 1000:.0f} ms, "
        f"rollback {propagation_a * 1000:.0f} ms; requests {counts}, failed 0; load {os.getloadavg()[0]:.1f}"
    )


def test_redis_unreachable_at_start_serves_alone_and_is_ready(real_bundles, tmp_path, key_prefix):
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    replica = start_replica(
        tmp_path, "alone", bundles_dir=real_bundles.a.parent, bundle=real_bundles.id("a"), redis_url=dead, prefix=key_prefix
    )
    try:
        replica.wait_ready()
        r = httpx.post(replica.url + "/v1/search/text", json={"query": "a dog barks", "k": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["bundle_id"] == real_bundles.id("a")
        assert httpx.get(replica.url + "/readyz", timeout=5).status_code == 200
        metrics = httpx.get(replica.url + "/metrics", timeout=5).text
        assert "tonearm_redis_up 0.0" in metrics
    finally:
        replica.stop()
    assert "redis unavailable" in replica.logged()


@pytest.mark.parametrize(
    ("prepare", "expected"),
    [
        (lambda p: None, "no such directory (is the bundles volume mounted?)"),
        (lambda p: p.write_text("not a directory"), "not a directory"),
    ],
)
def test_serve_refuses_a_bundles_dir_it_cannot_list(tmp_path, prepare, expected):
    missing = tmp_path / "bundles"
    prepare(missing)
    env = {**os.environ, "TONEARM_BUNDLES_DIR": str(missing), "TONEARM_ADMIN_ENABLED": "false"}
    result = subprocess.run(
        [sys.executable, "-m", "tonearm.cli", "serve"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == f"error: TONEARM_BUNDLES_DIR={missing}: {expected}"


def test_serve_in_production_without_the_admin_token_fails_at_start(tmp_path):
    env = {
        **os.environ,
        "TONEARM_ENVIRONMENT": "production",
        "TONEARM_ADMIN_ENABLED": "true",
        "TONEARM_BUNDLES_DIR": str(tmp_path),
    }
    env.pop("TONEARM_ADMIN_TOKEN", None)
    result = subprocess.run(
        [sys.executable, "-m", "tonearm.cli", "serve"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2 and "set TONEARM_ADMIN_TOKEN" in result.stderr


def test_a_deployment_without_a_bundle_waits_instead_of_building_the_demo(tmp_path, key_prefix):
    bundles = tmp_path / "bundles"
    bundles.mkdir()
    replica = start_replica(tmp_path, "empty", bundles_dir=bundles, bundle="", redis_url="", prefix=key_prefix)
    try:
        def live() -> bool:
            assert replica.process.poll() is None, replica.logged()[-3000:]
            try:
                return httpx.get(replica.url + "/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(live, timeout=60, interval=0.1, what="/healthz")
        assert httpx.get(replica.url + "/readyz", timeout=5).status_code == 503
    finally:
        replica.stop()
    assert not (tmp_path / "home" / "demo").exists()
    assert "not ready until one is activated" in replica.logged()
