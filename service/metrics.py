"""Prometheus metrics of one app instance (its own registry, so several apps can share a process)."""

from __future__ import annotations

import collections
import gc
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
GC_PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class ServiceMetrics:
    """Request latency per route, cache hits/misses, Redis health, the active bundle, activations."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.latency = Histogram(
            "tonearm_request_duration_seconds", "Request latency per route template",
            ["route", "method", "status"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.cache = Counter(
            "tonearm_cache_requests", "Cache look-ups by payload kind and result (hit/miss/bypass)",
            ["kind", "result"], registry=r,
        )
        self.redis_errors = Counter(
            "tonearm_redis_errors", "Redis operations that failed (cache bypassed meanwhile)",
            ["op"], registry=r,
        )
        self.redis_up = Gauge("tonearm_redis_up", "1 when the last Redis operation succeeded", registry=r)
        self.bundle_info = Gauge(
            "tonearm_active_bundle_info", "1 for the active bundle", ["bundle_id", "embed_dim", "languages"],
            registry=r,
        )
        self.activations = Counter(
            "tonearm_activations", "Bundle activations by outcome", ["outcome"], registry=r,
        )
        self.items_quarantined = Gauge(
            "tonearm_items_quarantined", "Added items whose stored audio cannot be embedded (not searchable; "
            "GET /v1/items?status=quarantined lists them)", registry=r,
        )
        self.items_quarantine_events = Counter(
            "tonearm_items_quarantine_events", "Stored audio files found unembeddable, by reason", ["reason"], registry=r,
        )
        self.items_corrupt_lines = Gauge(
            "tonearm_items_corrupt_lines", "Lines of the item log that are not records (skipped by every reader)",
            registry=r,
        )
        self.items_ready = Gauge(
            "tonearm_items_ready", "1 when the item log is open and writable (items configured); 0: not ready",
            registry=r,
        )

        self.gc_pause = Histogram(
            "tonearm_gc_pause_seconds",
            "CPython cyclic garbage collections by generation (the GIL is held: every request waits)",
            ["generation"], buckets=GC_PAUSE_BUCKETS, registry=r,
        )

    def observe_request(self, *, route: str, method: str, status: int, seconds: float) -> None:
        self.latency.labels(route=route, method=method, status=str(status)).observe(seconds)

    def set_active_bundle(self, *, bundle_id: str, embed_dim: int, languages: list[str]) -> None:
        self.bundle_info.clear()
        self.bundle_info.labels(bundle_id=bundle_id, embed_dim=str(embed_dim), languages=",".join(languages)).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class GcPauses:
    """Times every cyclic garbage collection of the process into ``tonearm_gc_pause_seconds``
    (``gc.callbacks``; a few microseconds per collection) while installed.

    A collection runs in whichever thread triggered it, holding the GIL, so nothing else of the
    process runs meanwhile: long ones are the service's tail latency (service/allocator.py)."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self._histogram = metrics.gc_pause
        self._started = 0.0
        self._unrecorded: collections.deque[tuple[int, float]] = collections.deque(maxlen=1024)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        # A collection runs inside whatever allocated, possibly code at the recursion limit (a parser
        # refusing ~1,000 nested levels): here only C calls, and the histogram — a few Python frames —
        # behind a RecursionError guard; a pause it could not record waits for the next collection.
        now = time.perf_counter()
        if phase == "start":
            self._started = now
            return
        self._unrecorded.append((info["generation"], now - self._started))
        try:
            while self._unrecorded:
                generation, seconds = self._unrecorded[0]
                self._histogram.labels(generation=str(generation)).observe(seconds)
                self._unrecorded.popleft()
        except RecursionError:
            pass

    def install(self) -> None:
        gc.callbacks.append(self._callback)

    def remove(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


class LatencyMiddleware:
    """Pure ASGI middleware timing each HTTP request under its route template (bounded label set)."""

    def __init__(self, app: Any, *, metrics: ServiceMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.observe_request(
                route=template, method=scope["method"], status=status, seconds=time.perf_counter() - start
            )
