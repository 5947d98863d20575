"""Real redis-server: cache across outages, activations reaching every replica."""

from __future__ import annotations

import time

import pytest

from service.app import create_app
from tests.service.conftest import ADMIN, fake_opener, make_settings, running_client, wait_until

pytestmark = pytest.mark.redis


def redis_settings(bundles, url: str, prefix: str, **extra):
    return make_settings(
        bundles_dir=bundles,
        bundle="fake-a",
        redis_url=url,
        key_prefix=prefix,
        pubsub_channel=f"{prefix}:activations",
        redis_backoff_max=0.2,
        gate_metric="t2a_R@1_mean",
        **extra,
    )


def cache_count(app, result: str) -> float:
    value = app.state.tonearm.metrics.registry.get_sample_value
    return value("tonearm_cache_requests_total", {"kind": "results", "result": result}) or 0.0


def test_searches_survive_redis_outage_and_cache_hits_resume(fake_bundles, redis_server, key_prefix):
    app = create_app(redis_settings(fake_bundles, redis_server.url, key_prefix), opener=fake_opener)
    query = {"query": "a dog", "k": 2}
    with running_client(app) as client:
        assert client.post("/v1/search/text", json=query).status_code == 200
        assert client.post("/v1/search/text", json=query).status_code == 200
        assert cache_count(app, "hit") == 1

        redis_server.stop()
        for _ in range(5):
            r = client.post("/v1/search/text", json=query)
            assert r.status_code == 200 and r.json()["hits"][0]["id"] == "clip-dog"
        assert cache_count(app, "bypass") >= 1
        metrics = client.get("/metrics").text
        assert "tonearm_redis_up 0.0" in metrics
        assert 'tonearm_redis_errors_total{op="get"}' in metrics

        redis_server.start()
        hits_before = cache_count(app, "hit")

        def hits_again() -> bool:
            client.post("/v1/search/text", json=query)
            return cache_count(app, "hit") > hits_before

        wait_until(hits_again, timeout=20, interval=0.1, what="cache hits after redis restart")
        assert "tonearm_redis_up 1.0" in client.get("/metrics").text


def test_activation_reaches_every_replica_and_late_starters(fake_bundles, shared_redis, key_prefix):
    settings = redis_settings(fake_bundles, shared_redis.url, key_prefix)
    app1, app2 = create_app(settings, opener=fake_opener), create_app(settings, opener=fake_opener)
    with running_client(app1) as c1, running_client(app2) as c2:
        wait_until(app2.state.tonearm.bus.subscribed.is_set, timeout=10, what="replica 2 subscribed")
        r = c1.post("/v1/bundles/activate", json={"bundle_id": "fake-b"}, headers=ADMIN)
        assert r.status_code == 200, r.text
        wait_until(lambda: app2.state.tonearm.registry.active_id == "fake-b", timeout=20, what="replica 2 swap")
        assert c2.post("/v1/search/text", json={"query": "dog"}).json()["bundle_id"] == "fake-b"

        # a replica started now reads the active id recorded in redis
        app3 = create_app(settings, opener=fake_opener)
        with running_client(app3) as c3:
            assert c3.get("/readyz").json()["bundle_id"] == "fake-b"

        assert c2.post("/v1/bundles/rollback", headers=ADMIN).json()["bundle_id"] == "fake-a"
        wait_until(lambda: app1.state.tonearm.registry.active_id == "fake-a", timeout=20, what="replica 1 rollback")


def test_activation_made_while_redis_is_down_reaches_replicas_when_it_returns(fake_bundles, redis_server, key_prefix):
    settings = redis_settings(fake_bundles, redis_server.url, key_prefix)
    app1, app2 = create_app(settings, opener=fake_opener), create_app(settings, opener=fake_opener)
    with running_client(app1) as c1, running_client(app2):
        bus2 = app2.state.tonearm.bus
        wait_until(bus2.subscribed.is_set, timeout=10, what="replica 2 subscribed")
        redis_server.stop()
        # redis is down: the activation happens locally and cannot be published
        assert c1.post("/v1/bundles/activate", json={"bundle_id": "fake-b"}, headers=ADMIN).status_code == 200
        time.sleep(0.3)
        assert app2.state.tonearm.registry.active_id == "fake-a"
        redis_server.start()  # empty: no persistence; replica 1 re-publishes its pending activation
        wait_until(lambda: app2.state.tonearm.registry.active_id == "fake-b", timeout=20, what="catch-up")
