from __future__ import annotations

import time

import numpy as np
import pytest
import redis

from service.cache import (
    LocalCache,
    RedisCache,
    RedisHealth,
    cache_key,
    decode_hits,
    decode_vector,
    encode_hits,
    encode_vector,
    make_redis_client,
    normalize_query,
)
from service.metrics import ServiceMetrics


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def counter(metrics: ServiceMetrics, kind: str, result: str) -> float:
    return metrics.registry.get_sample_value("tonearm_cache_requests_total", {"kind": kind, "result": result}) or 0.0


def test_normalize_query_collapses_whitespace_and_composes_unicode():
    assert normalize_query("  un   chien\taboie \n") == "un chien aboie"
    decomposed = "sire\u0300ne"  # e + combining grave
    assert normalize_query(decomposed) == "sir\u00e8ne"
    assert normalize_query("Dog") == "Dog"  # case kept


def test_cache_key_separates_bundles_kinds_and_texts():
    keys = {
        cache_key(prefix="p", bundle_id=b, kind=k, text=t)
        for b in ("a", "b")
        for k in ("temb", "t2a-k10")
        for t in ("x", "y")
    }
    assert len(keys) == 8
    assert cache_key(prefix="p", bundle_id="a", kind="temb", text="x").startswith("p:v1:a:temb:")


def test_vector_and_hits_codecs_roundtrip_and_reject_wrong_sizes():
    v = np.array([0.5, -1.25, 3.0], dtype=np.float32)
    assert np.array_equal(decode_vector(encode_vector(v), 3), v)
    assert decode_vector(encode_vector(v), 4) is None
    scores, rows = np.array([0.9, 0.1], np.float32), np.array([7, -1], np.int64)
    got = decode_hits(encode_hits(scores, rows))
    assert got is not None
    assert np.array_equal(got[0], scores) and np.array_equal(got[1], rows)
    assert decode_hits(encode_hits(scores, rows)[:-1]) is None
    assert decode_hits(b"") is None


def test_local_cache_evicts_least_recently_used_and_expires():
    clock, metrics = FakeClock(), ServiceMetrics()
    cache = LocalCache(max_entries=2, ttl_seconds=10, metrics=metrics, clock=clock)
    cache.set("a", b"1")
    cache.set("b", b"2")
    assert cache.get("a", kind="x") == b"1"  # a is now most recent
    cache.set("c", b"3")  # evicts b
    assert cache.get("b", kind="x") is None
    assert cache.get("c", kind="x") == b"3"
    clock.now += 10.5
    assert cache.get("a", kind="x") is None
    assert len(cache) == 1
    assert counter(metrics, "x", "hit") == 2 and counter(metrics, "x", "miss") == 2


def test_payloads_over_the_bound_are_not_cached():
    cache = LocalCache(max_entries=5, ttl_seconds=10, metrics=ServiceMetrics(), max_payload_bytes=8)
    cache.set("small", b"12345678")
    cache.set("big", b"123456789")
    assert cache.get("small", kind="x") == b"12345678"
    assert cache.get("big", kind="x") is None


def test_redis_health_backs_off_exponentially_and_recovers():
    clock, metrics = FakeClock(), ServiceMetrics()
    health = RedisHealth(metrics=metrics, backoff_min=1.0, backoff_max=4.0, clock=clock)
    assert health.available()
    health.failure("get", RuntimeError("x"))
    assert not health.available()
    clock.now += 1.0
    assert health.available()  # probe allowed
    health.failure("get", RuntimeError("x"))  # backoff doubles to 2
    clock.now += 1.5
    assert not health.available()
    clock.now += 0.5
    assert health.available()
    for _ in range(5):
        health.failure("get", RuntimeError("x"))
    clock.now += 4.0
    assert health.available()  # capped at backoff_max
    health.success()
    assert health.up and health.available()
    assert metrics.registry.get_sample_value("tonearm_redis_up") == 1.0
    assert metrics.registry.get_sample_value("tonearm_redis_errors_total", {"op": "get"}) == 7.0


@pytest.mark.redis
def test_redis_cache_sets_ttl_and_bypasses_when_down(redis_server, key_prefix):
    metrics = ServiceMetrics()
    client = make_redis_client(redis_server.url, socket_timeout=0.2)
    health = RedisHealth(metrics=metrics, backoff_min=0.05, backoff_max=0.2)
    cache = RedisCache(client, health=health, ttl_seconds=30, max_payload_bytes=64)
    key = f"{key_prefix}:k"
    cache.set(key, b"value")
    assert cache.get(key, kind="results") == b"value"
    assert 0 < client.ttl(key) <= 30
    assert cache.get(f"{key_prefix}:missing", kind="results") is None
    cache.set(f"{key_prefix}:big", b"x" * 65)
    assert client.exists(f"{key_prefix}:big") == 0

    redis_server.stop()
    start = time.perf_counter()
    assert cache.get(key, kind="results") is None  # error → bypass, no exception
    cache.set(key, b"other")  # breaker open: skipped
    assert cache.get(key, kind="results") is None
    assert time.perf_counter() - start < 5  # sanity only: no hang on a dead redis
    assert not health.up
    assert counter(metrics, "results", "bypass") == 2

    redis_server.start()
    time.sleep(0.25)  # back-off elapsed
    cache.set(key, b"again")
    assert cache.get(key, kind="results") == b"again"
    assert health.up
    assert counter(metrics, "results", "hit") == 2
    with pytest.raises(redis.RedisError):
        make_redis_client("redis://127.0.0.1:1/0", socket_timeout=0.1).ping()
