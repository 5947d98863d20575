"""The process's upload memory budget: request bodies, decodes and decoded audio in one byte semaphore.

What an audio upload holds in memory is its body (read before anything else: up to
``TONEARM_MAX_UPLOAD_BYTES``, 8× that for ``items:batch``), its decode (one block of every channel
and the mono output, :func:`index.audio.decode.decode_estimate`) and then its decoded audio until the
encoder has run. Each of those is held in one :class:`MemoryBudget` of ``TONEARM_DECODE_MEMORY_BYTES``
per process, so a crowd of legitimate uploads costs the budget, not the crowd (docs/service.md,
"Limits: what an upload may cost"):

* a request's **body** reserves its bytes before they are read — its ``Content-Length``, or step by
  step as a body without one streams in — through its :class:`UploadLease`; when the budget has no room
  within ``TONEARM_UPLOAD_WAIT_S`` the request is refused with 503 ``overloaded`` and ``Retry-After``,
  its body unread;
* a **decode** holds its estimate while it runs; a request's decode then keeps the bytes of its decoded
  audio in its lease until the request ends (the search routes give the body back once it is decoded);
* everything a lease holds goes back when the request ends, however it ends (answer, error,
  disconnect, cancellation: :meth:`UploadLease.close` in a ``finally``).

No request can wait forever on bytes held by requests that wait too (a request holding a body then
waits for room for its decode): bodies may fill at most ``capacity − reserve`` (:attr:`MemoryBudget.reserve`,
a quarter of the budget), decodes the whole of it, and a decode is charged at most the reserve. So when
no decode holds bytes, the bodies leave room for any decode, and a decode, once it runs, waits on
nothing else. Waits on the event loop (:meth:`MemoryBudget.take_async`) never occupy a thread of the
pool that the requests holding bytes need to finish.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from service.errors import ServiceError

RETRY_AFTER_S = 1
"""``Retry-After`` of a request refused for want of room in the budget."""
RESERVE_FRACTION = 4
"""The budget's part kept for decodes: ``capacity // RESERVE_FRACTION`` (32 MiB of the default 128 MiB)."""


class MemoryBudget:
    """A byte semaphore of ``capacity`` bytes with two kinds of holders: bodies, which may fill
    ``capacity − reserve``, and decodes, which may fill all of it (``reserve=0``: one kind).

    A hold larger than its kind may ever get is charged what it may get (it runs once the others are
    done). Threads wait in :meth:`take` / :meth:`hold`, coroutines in :meth:`take_async`."""

    def __init__(self, capacity: int, reserve: int = 0) -> None:
        self.capacity = capacity
        self.reserve = max(0, min(reserve, capacity // 2))
        self.used = 0
        self.peak = 0
        self.refused = 0
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    @property
    def body_capacity(self) -> int:
        """The most the bodies of requests may hold together."""
        return self.capacity - self.reserve

    def charge(self, nbytes: int, *, body: bool) -> int:
        """What a hold of ``nbytes`` is charged: at most what its kind may ever hold."""
        most = self.body_capacity if body else (self.reserve or self.capacity)
        return max(0, min(nbytes, most))

    def _try(self, nbytes: int, body: bool) -> bool:
        """Take ``nbytes`` (already charged) if they fit; the caller holds ``self._cond``. Nothing always fits."""
        if nbytes and self.used + nbytes > (self.body_capacity if body else self.capacity):
            return False
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        return True

    def _refuse(self, nbytes: int, body: bool) -> ServiceError:
        with self._cond:
            self.refused += 1
        what = "request bodies and decodes" if body else "decodes and request bodies"
        return ServiceError(
            "overloaded", f"the uploads in progress hold the memory budget of {self.capacity} bytes "
            f"({what}; {nbytes} more needed); retry after {RETRY_AFTER_S} s", retry_after=RETRY_AFTER_S,
        )

    def take(self, nbytes: int, timeout: float, *, body: bool = False) -> int:
        """Wait (this thread) up to ``timeout`` s for room, take it and return the bytes charged; 503
        ``overloaded`` when there is none."""
        nbytes = self.charge(nbytes, body=body)
        with self._cond:
            if self._cond.wait_for(lambda: self._try(nbytes, body), timeout):
                return nbytes
        raise self._refuse(nbytes, body)

    async def take_async(self, nbytes: int, timeout: float, *, body: bool = True) -> int:
        """:meth:`take` for a coroutine: waits on the event loop, never in a thread."""
        nbytes = self.charge(nbytes, body=body)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            with self._cond:
                if self._try(nbytes, body):
                    return nbytes
                waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] = (loop, loop.create_future())
                self._waiters.append(waiter)
            try:
                remaining = deadline - loop.time()
                if remaining > 0:
                    await asyncio.wait({waiter[1]}, timeout=remaining)
            finally:  # woken, timed out or cancelled: this waiter is done either way
                with self._cond:
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)
            if loop.time() >= deadline:
                with self._cond:
                    if self._try(nbytes, body):
                        return nbytes
                raise self._refuse(nbytes, body)

    def give(self, nbytes: int) -> None:
        """Hand back ``nbytes`` taken before; wakes every waiter (threads and coroutines)."""
        if nbytes <= 0:
            return
        with self._cond:
            self.used -= nbytes
            assert self.used >= 0, "gave back more than was taken"
            waiters, self._waiters = self._waiters, []
            self._cond.notify_all()
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:  # that loop is closed: nobody waits there any more
                pass

    @contextmanager
    def hold(self, nbytes: int, timeout: float) -> Iterator[int]:
        """Hold ``nbytes`` (a decode) while the block runs; yields the bytes charged."""
        taken = self.take(nbytes, timeout)
        try:
            yield taken
        finally:
            self.give(taken)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


_BUDGETS: dict[int, MemoryBudget] = {}
_BUDGETS_LOCK = threading.Lock()


def process_budget(capacity: int) -> MemoryBudget:
    """The process's budget of this capacity — one per process: every upload route, every decode and
    the item sync share it. A quarter of it is kept for decodes (:data:`RESERVE_FRACTION`)."""
    with _BUDGETS_LOCK:
        budget = _BUDGETS.get(capacity)
        if budget is None:
            budget = _BUDGETS[capacity] = MemoryBudget(capacity, capacity // RESERVE_FRACTION)
        return budget


class UploadLease:
    """What one request holds in the budget: its body's bytes and its decoded audio's. Everything goes
    back at :meth:`close` (``async with``), on every path out of the request."""

    def __init__(self, budget: MemoryBudget, wait_s: float) -> None:
        self.budget = budget
        self.wait_s = wait_s
        self.body = 0
        self.kept = 0
        self.closed = False
        self._lock = threading.Lock()

    async def reserve_body(self, nbytes: int) -> None:
        """Reserve ``nbytes`` more of body before reading them; 503 ``overloaded`` after ``wait_s``."""
        taken = await self.budget.take_async(nbytes, self.wait_s, body=True)
        with self._lock:
            if not self.closed:
                self.body += taken
                return
        self.budget.give(taken)  # closed meanwhile (cannot happen from the request's own task)

    def release_body(self) -> None:
        """The body is no longer held (the search routes, once it is decoded): its bytes go back."""
        with self._lock:
            nbytes, self.body = self.body, 0
        self.budget.give(nbytes)

    def keep(self, nbytes: int) -> None:
        """Bytes already taken from the budget (a decode's output) are held by this request from now on;
        a lease closed meanwhile (a decode outliving its cancelled request) hands them straight back."""
        with self._lock:
            if not self.closed:
                self.kept += nbytes
                return
        self.budget.give(nbytes)

    @property
    def held(self) -> int:
        return self.body + self.kept

    def close(self) -> None:
        with self._lock:
            nbytes, self.body, self.kept, self.closed = self.body + self.kept, 0, 0, True
        self.budget.give(nbytes)

    async def __aenter__(self) -> UploadLease:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()


def upload_lease(settings: Any) -> UploadLease:
    """A lease on the process's budget for one request (``settings``: service.settings.Settings)."""
    return UploadLease(process_budget(settings.decode_memory_bytes), settings.upload_wait_s)


# ---------------------------------------------------------------- what a replica may hold (the pod's limit)

WAITING_CONNECTION_BYTES = 256 << 10
"""What one connection costs while its request waits for room, its body unread: uvicorn's 64-KiB read buffer
and the kernel's receive buffer (charged to the pod's memory cgroup too), rounded up."""
WAITING_CONNECTIONS = 160
"""Connections waiting at once that the shipped limits allow for (the crowd of issue 55): those that arrive
within ``TONEARM_UPLOAD_WAIT_S``; each one more costs :data:`WAITING_CONNECTION_BYTES`."""
ALLOCATOR_HEADROOM = 0.10
"""Allocator slack on top of the sum (freed pages glibc holds until the next ``malloc_trim``)."""
TMP_VOLUME_BYTES = 64 << 20
"""The pod's ``/tmp``: a memory-backed ``emptyDir`` (k8s/base/deployment.yaml) charged to the pod's limit."""


def upload_memory_bytes(settings: Any, *, waiting: int = WAITING_CONNECTIONS) -> int:
    """The most the uploads in flight may add to a replica (docs/service.md, "Memory: the pod's limit"):
    the budget, the one copy of a body made on the event loop at a time (``b"".join``, a file part's
    read: the largest file an upload may send — ``POST /v1/items``'s, ``TONEARM_MAX_ITEM_UPLOAD_BYTES`` as
    applied, or ``TONEARM_MAX_UPLOAD_BYTES`` — + 64 KiB) plus the multipart buffers' over-allocation (an eighth
    of the bodies' share), and the connections waiting for room."""
    budget = int(settings.decode_memory_bytes)
    bodies = budget - budget // RESERVE_FRACTION
    largest = max(int(settings.max_upload_bytes), int(getattr(settings, "item_upload_limit", 0)))
    copies = largest + (64 << 10) + bodies // 8
    return budget + copies + waiting * WAITING_CONNECTION_BYTES


def pod_memory_bytes(settings: Any, *, serving: int, tmp: int = TMP_VOLUME_BYTES,
                     waiting: int = WAITING_CONNECTIONS) -> int:
    """The memory limit a replica's pod needs: (``serving`` — the replica's resident set serving its
    bundles under load, uploads aside: about 3 × the bundle + 300 MiB, the demo's 642 MiB measured by the
    soak — + :func:`upload_memory_bytes` + ``tmp``) × (1 + :data:`ALLOCATOR_HEADROOM`)."""
    return int((serving + upload_memory_bytes(settings, waiting=waiting) + tmp) * (1 + ALLOCATOR_HEADROOM))
