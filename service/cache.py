"""Query cache: Redis when configured, else an in-process LRU with TTL.

What is cached (small payloads only, see :data:`Settings.cache_max_payload_bytes`):
text-query embeddings (``d`` float32) and text→audio results (``k`` scores and
rows), keyed by bundle id + kind + SHA-256 of the normalized query. Entries of
another bundle are never read because the bundle id is in the key; they expire
by TTL. We do not own Redis's ``maxmemory`` policy, so every key we write has a
TTL and values stay a few KB.

A configured Redis that fails is bypassed (searches go straight to the encoder)
behind :class:`RedisHealth`: after a failure no Redis call is attempted until an
exponentially growing back-off has passed, so a dead Redis adds no latency;
the first call after the back-off probes it, and success restores caching.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
import unicodedata
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from service.metrics import ServiceMetrics

log = logging.getLogger(__name__)

CACHE_FORMAT = "v1"


def normalize_query(text: str) -> str:
    """NFC + collapsed whitespace. Case is kept: the tokenizer may be case-sensitive, and the
    normalized text is what gets encoded, so two queries sharing a key share an embedding."""
    return unicodedata.normalize("NFC", " ".join(text.split()))


def cache_key(*, prefix: str, bundle_id: str, kind: str, text: str) -> str:
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:40]
    return f"{prefix}:{CACHE_FORMAT}:{bundle_id}:{kind}:{digest}"


# --- payload codecs (no pickle: fixed little-endian layouts) ---

def encode_vector(vector: np.ndarray) -> bytes:
    return np.ascontiguousarray(vector, dtype="<f4").tobytes()


def decode_vector(data: bytes, dim: int) -> np.ndarray | None:
    """The float32 vector, or None when the payload has the wrong size (stale format)."""
    if len(data) != 4 * dim:
        return None
    return np.frombuffer(data, dtype="<f4").astype(np.float32)


def encode_hits(scores: np.ndarray, rows: np.ndarray) -> bytes:
    n = int(scores.shape[0])
    return struct.pack("<I", n) + np.asarray(scores, "<f4").tobytes() + np.asarray(rows, "<i8").tobytes()


def decode_hits(data: bytes) -> tuple[np.ndarray, np.ndarray] | None:
    if len(data) < 4:
        return None
    (n,) = struct.unpack_from("<I", data)
    if len(data) != 4 + 12 * n:
        return None
    scores = np.frombuffer(data, dtype="<f4", count=n, offset=4).astype(np.float32)
    rows = np.frombuffer(data, dtype="<i8", count=n, offset=4 + 4 * n).astype(np.int64)
    return scores, rows


class QueryCache(Protocol):
    """Byte-valued cache; implementations never raise for backend failures."""

    backend: str

    def get(self, key: str, *, kind: str) -> bytes | None:
        """The cached value or None; counts a hit, miss or bypass under ``kind``."""
        ...

    def set(self, key: str, value: bytes) -> None: ...


class LocalCache:
    """Thread-safe in-process LRU bounded by entry count, with per-entry TTL."""

    backend = "local"

    def __init__(
        self,
        *,
        max_entries: int,
        ttl_seconds: float,
        metrics: ServiceMetrics,
        max_payload_bytes: int = 16_384,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics
        self.max_payload_bytes = max_payload_bytes
        self.max_entries = max_entries
        self.ttl = ttl_seconds
        self._clock = clock
        self._data: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str, *, kind: str) -> bytes | None:
        value = self._lookup(key)
        self.metrics.cache.labels(kind=kind, result="miss" if value is None else "hit").inc()
        return value

    def _lookup(self, key: str) -> bytes | None:
        with self._lock:
            item = self._data.get(key)
            if item is None:
                return None
            expires, value = item
            if expires <= self._clock():
                del self._data[key]
                return None
            self._data.move_to_end(key)
            return value

    def set(self, key: str, value: bytes) -> None:
        if self.max_entries == 0 or len(value) > self.max_payload_bytes:
            return
        with self._lock:
            self._data[key] = (self._clock() + self.ttl, value)
            self._data.move_to_end(key)
            while len(self._data) > self.max_entries:
                self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)


class RedisHealth:
    """Circuit breaker for Redis: failures open it for a doubling back-off; a success closes it."""

    def __init__(
        self,
        *,
        metrics: ServiceMetrics,
        backoff_min: float = 0.25,
        backoff_max: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics
        self.backoff_min = backoff_min
        self.backoff_max = backoff_max
        self._clock = clock
        self._lock = threading.Lock()
        self._backoff = backoff_min
        self._retry_at = 0.0
        self._up = True
        metrics.redis_up.set(1)

    @property
    def up(self) -> bool:
        return self._up

    def available(self) -> bool:
        """Whether a Redis call may be attempted now (closed breaker, or back-off elapsed)."""
        return self._up or self._clock() >= self._retry_at

    def failure(self, op: str, err: Exception) -> None:
        self.metrics.redis_errors.labels(op=op).inc()
        with self._lock:
            if self._up:
                log.warning("redis unavailable (%s: %s); cache bypassed, retrying with back-off", op, err)
                self._backoff = self.backoff_min
            else:
                self._backoff = min(self._backoff * 2, self.backoff_max)
            self._up = False
            self._retry_at = self._clock() + self._backoff
        self.metrics.redis_up.set(0)

    def success(self) -> None:
        if self._up:
            return
        with self._lock:
            if not self._up:
                log.info("redis reachable again; cache restored")
            self._up = True
            self._backoff = self.backoff_min
        self.metrics.redis_up.set(1)


def make_redis_client(url: str, *, socket_timeout: float) -> redis.Redis:
    """A client that fails fast: short socket timeouts and no client-side retries (the breaker
    decides when to try again)."""
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_timeout,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
    )


class RedisCache:
    """Cache over Redis with TTL on every key; failures are counted and bypassed, never raised."""

    backend = "redis"

    def __init__(
        self, client: redis.Redis, *, health: RedisHealth, ttl_seconds: int, max_payload_bytes: int = 16_384
    ) -> None:
        self.max_payload_bytes = max_payload_bytes
        self.client = client
        self.health = health
        self.ttl = ttl_seconds

    def get(self, key: str, *, kind: str) -> bytes | None:
        counter = self.health.metrics.cache
        if not self.health.available():
            counter.labels(kind=kind, result="bypass").inc()
            return None
        try:
            value = self.client.get(key)
        except redis.RedisError as err:
            self.health.failure("get", err)
            counter.labels(kind=kind, result="bypass").inc()
            return None
        self.health.success()
        if not isinstance(value, bytes):
            counter.labels(kind=kind, result="miss").inc()
            return None
        counter.labels(kind=kind, result="hit").inc()
        return value

    def set(self, key: str, value: bytes) -> None:
        if len(value) > self.max_payload_bytes or not self.health.available():
            return
        try:
            self.client.set(key, value, ex=self.ttl)
        except redis.RedisError as err:
            self.health.failure("set", err)
            return
        self.health.success()
