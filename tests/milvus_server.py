"""A real Milvus standalone server for the tests: the one embedded in the ``milvus`` PyPI package.

``milvus`` 2.3.5 ships the standalone server binary (etcd embedded, rocksmq, local storage) and a
small launcher; we drive the launcher with our own settings:

* its base directory (binaries, config, data, logs) under the test's temporary directory;
* every component's port chosen free on 127.0.0.1 up front and kept for restarts (a restarted
  server must come back where the clients look for it); every component registers itself as
  127.0.0.1 (``<component>.ip``) and the embedded etcd listens on localhost. Milvus 2.3 has no
  listen-address setting: its gRPC servers bind the wildcard address on their (random, free)
  ports, reachable only as far as the test machine's network is;
* :meth:`kill` (SIGKILL: an outage, not a clean stop) and :meth:`start` again on the same data
  for the fault tests.

One server per test session (``milvus_server`` fixture in tests/conftest.py); it starts in ~10 s.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

COMPONENTS = ("rootCoord", "proxy", "queryCoord", "queryNode", "indexNode", "dataCoord", "dataNode")
PORT_KEYS = (
    "etcd_port", "root_coord_port", "proxy_port", "proxy_internal_port", "query_coord_port",
    "query_node_port", "index_coord_port", "index_node_port", "data_coord_port", "data_node_port",
)
START_TIMEOUT_S = 180.0


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class MilvusStandalone:
    """The ``milvus`` package's standalone server in ``base_dir`` on fixed free loopback ports."""

    def __init__(self, base_dir: Path) -> None:
        from milvus import MilvusServer, MilvusServerConfig

        class Config(MilvusServerConfig):  # type: ignore[misc]
            def try_bind_port(self, port: int) -> socket.socket | None:
                """The launcher's port probe, with SO_REUSEADDR: a restart after a kill finds the
                proxy port in TIME_WAIT, which the server itself (Go) binds through."""
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind(("127.0.0.1", port))
                    sock.listen()
                    return sock
                except OSError:
                    sock.close()
                    return None

        self.base_dir = Path(base_dir)
        ports = free_ports(len(PORT_KEYS) + 2)
        self.ports = dict(zip(PORT_KEYS, ports, strict=False))
        self.health_port, self.etcd_peer_port = ports[-2], ports[-1]
        config = Config(**self.ports)
        config.template_text = _with_quick_flushes(_with_private_etcd(config.template_text, self._etcd_config()))
        self._server = MilvusServer(config)
        self._server.webservice_port = self.health_port
        self._server.set_base_dir(str(self.base_dir))
        # A killed server's sessions expire after this TTL before a restarted one serves again
        # (Milvus's default 30 s); 5 s keeps the outage tests short.
        self._server.config.set("common.session.ttl", 5)
        # Shorter server-side polling than the defaults (1000 ms, 500 ms, 200 ms): a release waited ~1 s
        # for queryCoord's next check and a Strong search ~0.3 s for the next time tick; measured on two
        # cores, release 1.01 -> 0.20 s, Strong search 0.33 -> 0.10 s, and test_milvus_backend.py +
        # service/test_milvus.py 285 -> 245 s. Same server and code paths, only its intervals.
        for key, value in {"queryCoord.checkInterval": 100, "queryCoord.distPullInterval": 100,
                           "proxy.timeTickInterval": 50}.items():
            self._server.config.set(key, value)
        for component in COMPONENTS:
            self._server.config.set(f"{component}.ip", "127.0.0.1")

    def _etcd_config(self) -> Path:
        """The embedded etcd's own settings (``etcd.config.path``). Without them it listens on etcd's
        default ports 2379/2380 whatever ``etcd.endpoints`` says, so a second server on the machine
        (a helper's soak beside the suite, or one that survived a killed run) cannot start
        ('Milvus not startd in 180.0 seconds'); with them each server has its own free ports."""
        client, peer = self.ports["etcd_port"], self.etcd_peer_port
        path = self.base_dir / "etcd.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            "name: tonearm-test\n"
            f"data-dir: {self.base_dir / 'etcd.data'}\n"
            f"listen-client-urls: http://127.0.0.1:{client}\n"
            f"advertise-client-urls: http://127.0.0.1:{client}\n"
            f"listen-peer-urls: http://127.0.0.1:{peer}\n"
            f"initial-advertise-peer-urls: http://127.0.0.1:{peer}\n"
            f"initial-cluster: tonearm-test=http://127.0.0.1:{peer}\n"
            "initial-cluster-state: new\n",
            encoding="utf-8",
        )
        return path

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.ports['proxy_port']}"

    @property
    def pid(self) -> int | None:
        proc = self._server.server_proc
        return proc.pid if proc is not None else None

    def start(self) -> None:
        """Start (or restart on the same data and ports) and wait until it answers its health check."""
        self._server.start()  # the launcher waits for /healthz on health_port
        atexit.register(self.kill)  # never outlive the test session, even on an interrupt
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._proxy_accepts():
            if time.monotonic() > deadline:
                raise TimeoutError(f"Milvus proxy did not open {self.uri}; logs in {self.base_dir / 'logs'}")
            time.sleep(0.1)

    def _proxy_accepts(self) -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", self.ports["proxy_port"])) == 0

    def kill(self) -> None:
        """SIGKILL the server (and its children): what an outage looks like to clients."""
        proc = self._server.server_proc
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL) if _own_group(proc) else proc.kill()
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        self._server.server_proc = None
        for handle in self._server.proc_fds.values():
            handle.close()
        self._server.proc_fds.clear()

    def stop(self) -> None:
        self.kill()


def _with_private_etcd(template: str, etcd_yaml: Path) -> str:
    """The launcher's milvus.yaml template with ``etcd.config.path`` set (the template lacks the key,
    so the launcher's ``config.set`` cannot add it)."""
    anchor = "  use:\n    embed: true"
    if anchor not in template:
        raise RuntimeError("the milvus package's config template changed: etcd.use.embed not found")
    return template.replace(anchor, f"{anchor}\n  config:\n    path: {etcd_yaml}", 1)


ASSIGNMENT_EXPIRATION_MS = 200
"""``dataCoord.segment.assignmentExpiration`` of the test server (default 2,000 ms). A flush seals the
collection's segments, and a sealed segment is written only once its insert allocations have expired:
every flush waited ~2.5 s on the default (measured), and the service's item writes, publishes and
registry rows all flush. The semantics under test are unchanged; only that wait is shorter."""


def _with_quick_flushes(template: str) -> str:
    anchor = "    assignmentExpiration: 2000"
    if anchor not in template:
        raise RuntimeError("the milvus package's config template changed: dataCoord.segment.assignmentExpiration not found")
    return template.replace(anchor, f"    assignmentExpiration: {ASSIGNMENT_EXPIRATION_MS}", 1)


def _own_group(proc: subprocess.Popen) -> bool:
    try:
        return os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return False


# ----------------------------------------------------------------------------- pytest fixtures

IN_CI = os.environ.get("CI", "").lower() == "true"
ENGINES = ("server", "lite")
"""The two engines every Milvus backend test runs on: the standalone server and milvus-lite 3.x."""


def require_milvus() -> None:
    """Skip (fail under CI=true) when the `milvus` extra is missing."""
    try:
        import milvus  # noqa: F401
        import milvus_lite  # noqa: F401
        import pymilvus  # noqa: F401
    except ImportError:
        if IN_CI:
            raise
        pytest.skip("the milvus extra is not installed: scripts/install.sh train,service,milvus,dev")


@pytest.fixture(scope="session")
def milvus_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MilvusStandalone]:
    """One real Milvus standalone server per test session (tests that kill it start it again)."""
    require_milvus()
    server = MilvusStandalone(tmp_path_factory.mktemp("milvus-server"))
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(params=ENGINES)
def milvus_uri(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Each engine in turn: the session's server, or a fresh milvus-lite 3.x file."""
    require_milvus()
    if request.param == "server":
        return str(request.getfixturevalue("milvus_server").uri)
    return str(tmp_path_factory.mktemp("milvus-lite") / "tonearm.db")


def unpublish(uri: str, *bundle_ids: str) -> None:
    """Remove bundles from a Milvus the session shares (its two collections and its registry row), for a
    test that needs a bundle *not* published: other tests publish the same session bundles to the
    session's server (tests/service/test_items_in_milvus.py publishes ``real_bundles`` a and b)."""
    from index.engines.milvus_index import KINDS, MilvusTarget, alias_target

    target = MilvusTarget(uri=uri)
    client = target.client()
    doomed = {target.collection(bundle_id, kind) for bundle_id in bundle_ids for kind in KINDS}
    for kind in KINDS:  # Milvus refuses to drop a collection an alias names
        if alias_target(target, kind) in doomed:
            client.drop_alias(target.alias(kind))
    for bundle_id in bundle_ids:
        for kind in KINDS:
            if client.has_collection(target.collection(bundle_id, kind)):
                client.drop_collection(target.collection(bundle_id, kind))
        if client.has_collection(target.registry):
            client.delete(target.registry, filter=f"key == {json.dumps(bundle_id)}")
            client.flush(target.registry)
