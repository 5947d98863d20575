"""Micro-batching of encoder calls and their index searches (as Hugging Face TEI does).

One :class:`MicroBatcher` per encoder (text, audio). Requests wait in a bounded
queue; each worker thread, whenever it is free, takes *what is waiting* — up to
``max_batch`` items and at most its share of the queue (waiting / workers) — and runs
them as one batch: one encoder call and one
index search per micro-batch. It never waits for a batch to fill: under light
load a request is a batch of one and pays no extra latency; under load requests
that arrived while the encoder was busy share the next call.

* **Order and isolation** — results go back to their own request, in the order
  the batch function returns them. When a batch fails as a whole, each of its
  requests is retried alone, so one bad request only fails itself — unless it failed with a
  503 (the index backend unreachable): then every request gets that answer at once.
* **Disconnects** — a request whose client has gone (or whose task was
  cancelled) is marked; workers skip marked requests, so a disconnected client
  costs no encode.
* **Backpressure** — past ``max_queue`` waiting items a request is refused at
  once with the ``overloaded`` problem (HTTP 503 with ``Retry-After``), never
  queued into an unbounded backlog.
* **Metrics** — queue depth, batch size, time in queue, refusals and skipped
  (cancelled) requests per encoder, on the app's ``/metrics``.

Workers are plain threads: the encoders (ONNX Runtime) and FAISS release the GIL.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from service.errors import ServiceError

log = logging.getLogger(__name__)

I = TypeVar("I")  # noqa: E741 - the request item type
O = TypeVar("O")  # noqa: E741 - the per-item result type

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
QUEUE_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
RETRY_AFTER_SECONDS = 1


class BatchMetrics:
    """The micro-batchers' Prometheus series, registered in the app's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queue_depth = Gauge(
            "tonearm_batch_queue_depth", "Items waiting for an encoder", ["encoder"], registry=registry
        )
        self.batch_size = Histogram(
            "tonearm_batch_size", "Items per micro-batch (one encoder call)", ["encoder"],
            buckets=BATCH_SIZE_BUCKETS, registry=registry,
        )
        self.queue_seconds = Histogram(
            "tonearm_batch_queue_seconds", "Time a request waited before its micro-batch started", ["encoder"],
            buckets=QUEUE_SECONDS_BUCKETS, registry=registry,
        )
        self.rejected = Counter(
            "tonearm_batch_rejected", "Requests refused with 503 because the queue was full", ["encoder"],
            registry=registry,
        )
        self.skipped = Counter(
            "tonearm_batch_skipped", "Queued requests not encoded because their client had gone", ["encoder"],
            registry=registry,
        )


@dataclass(eq=False)
class _Job(Generic[I, O]):
    item: I
    size: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[O]
    enqueued: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # written on the event loop, read by workers (atomic under the GIL)


BatchFn = Callable[[Sequence[I]], Sequence[O]]


class MicroBatcher(Generic[I, O]):
    """A bounded queue drained by ``workers`` threads, ``max_batch`` items at a time.

    ``run_batch`` maps a list of items to a list of results of the same length and
    order. ``size`` of an item counts toward ``max_batch`` and ``max_queue`` (a
    request with 5 queries is 5).
    """

    def __init__(
        self,
        name: str,
        run_batch: BatchFn[I, O],
        *,
        max_batch: int,
        max_queue: int,
        workers: int,
        metrics: BatchMetrics,
    ) -> None:
        if max_batch < 1 or max_queue < 1 or workers < 1:
            raise ValueError(f"batcher {name}: max_batch, max_queue and workers must be >= 1")
        self.name = name
        self.run_batch = run_batch
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.metrics = metrics
        self._queue: deque[_Job[I, O]] = deque()
        self._waiting = 0  # sum of sizes in the queue
        self._cond = threading.Condition()
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._work, name=f"tonearm-batch-{name}-{i}", daemon=True) for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ event-loop side

    async def submit(
        self, item: I, *, size: int = 1, disconnected: Callable[[], Awaitable[Any]] | None = None
    ) -> O:
        """Queue ``item`` and wait for its result; ``overloaded`` (503) when the queue is full.

        ``disconnected`` (e.g. a wait for the client's ``http.disconnect``) ends the
        wait early; the queued item is then skipped, not encoded."""
        loop = asyncio.get_running_loop()
        job: _Job[I, O] = _Job(item=item, size=size, loop=loop, future=loop.create_future())
        self._put(job)
        watcher = asyncio.ensure_future(disconnected()) if disconnected is not None else None
        try:
            if watcher is None:
                return await job.future
            done, _ = await asyncio.wait({job.future, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if job.future not in done:
                raise ServiceError("client-disconnected", "the client disconnected before its result was ready")
            return job.future.result()
        finally:
            if not job.future.done() or job.future.cancelled():  # cancelling the task cancels the future too
                job.cancelled = True
                job.future.cancel()
            if watcher is not None and not watcher.done():
                watcher.cancel()

    def _put(self, job: _Job[I, O]) -> None:
        with self._cond:
            if self._stopping:
                raise ServiceError("not-ready", f"the {self.name} encoder queue is shut down")
            if self._waiting + job.size > self.max_queue and self._queue:
                self.metrics.rejected.labels(encoder=self.name).inc()
                raise ServiceError(
                    "overloaded",
                    f"the {self.name} encoder queue is full ({self._waiting} waiting, limit {self.max_queue}); "
                    f"retry after {RETRY_AFTER_SECONDS} s",
                    retry_after=RETRY_AFTER_SECONDS,
                )
            self._queue.append(job)
            self._waiting += job.size
            self.metrics.queue_depth.labels(encoder=self.name).set(self._waiting)
            self._cond.notify()

    # ------------------------------------------------------------------ worker side

    def _take(self) -> list[_Job[I, O]] | None:
        """Block until work is waiting; take what is there, up to ``max_batch`` (skipping cancelled)."""
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            batch: list[_Job[I, O]] = []
            total = 0
            limit = min(self.max_batch, self._fair_share())
            while self._queue and (not batch or total + self._queue[0].size <= limit):
                job = self._queue.popleft()
                self._waiting -= job.size
                if job.cancelled:
                    self.metrics.skipped.labels(encoder=self.name).inc()
                    continue
                batch.append(job)
                total += job.size
            self.metrics.queue_depth.labels(encoder=self.name).set(self._waiting)
            return batch

    def _fair_share(self) -> int:
        """At most the waiting work divided among the workers (rounded up).

        With several workers, one worker taking *everything* that waits leaves the others idle
        and makes every request of that big batch wait for its last item: on a CPU, where a
        batch of n costs about n single calls, that doubled p99 (docs/BENCHMARKS.md, real_size
        tail). Half the queue each keeps both cores busy and the batches short."""
        return max(1, -(-self._waiting // len(self._threads)))

    def _work(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            if not batch:
                continue
            started = time.perf_counter()
            for job in batch:
                self.metrics.queue_seconds.labels(encoder=self.name).observe(started - job.enqueued)
            self.metrics.batch_size.labels(encoder=self.name).observe(sum(job.size for job in batch))
            for job, outcome in zip(batch, self._run(batch), strict=True):
                job.loop.call_soon_threadsafe(_resolve, job.future, outcome)

    def _run(self, batch: list[_Job[I, O]]) -> list[Any]:
        """Results (or exceptions) per job; a failed batch is retried one job at a time."""
        try:
            results = list(self.run_batch([job.item for job in batch]))
            if len(results) != len(batch):
                raise RuntimeError(f"batch function returned {len(results)} results for {len(batch)} items")
            return results
        except Exception as err:
            if len(batch) == 1 or _not_the_requests_fault(err):
                return [err] * len(batch)
            log.warning("%s micro-batch of %d failed (%s); retrying each request alone", self.name, len(batch), err)
        outcomes: list[Any] = []
        for job in batch:
            try:
                outcomes.append(self.run_batch([job.item])[0])
            except Exception as err:
                outcomes.append(err)
        return outcomes

    def close(self) -> None:
        """Stop the workers after their current batch; waiting requests get ``not-ready``."""
        with self._cond:
            self._stopping = True
            pending = list(self._queue)
            self._queue.clear()
            self._waiting = 0
            self._cond.notify_all()
        for job in pending:
            error = ServiceError("not-ready", f"the {self.name} encoder queue was shut down")
            job.loop.call_soon_threadsafe(_resolve, job.future, error)
        for thread in self._threads:
            thread.join(timeout=10)


def _not_the_requests_fault(err: BaseException) -> bool:
    """A 503 (the index backend unreachable, ...) fails every request of the batch alike: retrying
    them one by one would only multiply the backend's deadline while the worker stalls."""
    return isinstance(err, ServiceError) and err.status == 503


def _resolve(future: asyncio.Future[Any], outcome: Any) -> None:
    if future.done():  # cancelled meanwhile
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


async def wait_for_disconnect(receive: Callable[[], Awaitable[MutableMapping[str, Any]]]) -> None:
    """Return when the ASGI ``receive`` channel reports ``http.disconnect`` (call after the body is read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
