"""Milvus frozen, killed and restarted under load, through the real service (uvicorn) on the real server.

While Milvus is down every search answers 503 `index-unavailable` with Retry-After, each within
the Milvus deadline (plus the encoder's time); no request hangs (bounded client timeouts), no
other 5xx; once Milvus answers again the service does too, without a restart. The scenario is
bench/milvus_outage.py's; the bench times it, this test checks what must hold.
"""

from __future__ import annotations

import time

import pytest

from bench.milvus_outage import run_outage
from tests.milvus_server import require_milvus

require_milvus()

pytestmark = pytest.mark.timeout(600)

DEADLINE_S = 1.0
SLACK_S = 3.0  # encoding the query and the HTTP round trip, on a loaded 2-core machine


def test_searches_answer_503_while_milvus_is_down_and_recover_when_it_returns(milvus_server, tiny_bundle):
    run = run_outage(milvus_server, tiny_bundle, clients=4, deadline_s=DEADLINE_S, client_timeout_s=15.0,
                     before_s=1.5, freeze_s=2.5, down_s=2.0, after_s=2.0)
    s = run.summary()
    assert s["hung"] == 0, s
    assert s["other_5xx"] == 0 and s["other_errors"] == 0, s
    assert s["index_unavailable"] > 0 and s["without_retry_after"] == 0, s
    assert s["frozen_503"] > 0 and s["503_latency_max_s"] <= DEADLINE_S + SLACK_S, s  # frozen: the deadline bounds it
    assert run.service_ok is not None, f"the service never answered again after Milvus came back: {s}"
    assert s["failed_after_recovery"] == 0, s
    assert any(r.status == 200 for r in run.requests if r.sent < run.killed), "no search succeeded before the kill"


def test_a_service_started_while_milvus_is_down_becomes_ready_when_it_returns(milvus_server, tiny_bundle):
    """Startup used to give up on the first failure (log line, never ready): now it retries."""
    import httpx

    from index.errors import IndexUnavailable
    from index.milvus_index import MilvusTarget, publish
    from service.app import create_app
    from tests.service.conftest import UvicornServer, make_settings

    # The test before this one killed and restarted the server: its proxy accepts before the
    # registry collection is loaded again, so the setup's publish waits for it (what is under
    # test here is the service's startup, not this publish).
    deadline = time.monotonic() + 120
    while True:
        try:
            publish(tiny_bundle, MilvusTarget(uri=milvus_server.uri, timeout_s=10.0))
            break
        except IndexUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    settings = make_settings(bundles_dir=tiny_bundle.parent, bundle=tiny_bundle.name, index_backend="milvus",
                             milvus_uri=milvus_server.uri, milvus_timeout_s=DEADLINE_S)
    milvus_server.kill()
    try:
        with UvicornServer(create_app(settings)) as server:
            assert httpx.get(server.url + "/readyz", timeout=5).status_code == 503
            milvus_server.start()
            server.wait_ready(timeout=180)
            found = httpx.post(server.url + "/v1/search/text", json={"query": "a dog barks", "k": 3}, timeout=15)
            assert found.status_code == 200, found.text
    finally:
        if milvus_server.pid is None:
            milvus_server.start()
