"""FastAPI dependencies as ``Annotated`` aliases: the state, a leased searcher, admin auth.

All are ``async def``: FastAPI runs plain ``def`` dependencies in the thread pool, a
thread hop per dependency per request for what is an attribute read here.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

import anyio
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.batching import BatchMetrics
from service.bundles import BundleRegistry
from service.cache import QueryCache
from service.encoder_queues import Batchers
from service.errors import ServiceError
from service.metrics import ServiceMetrics
from service.pubsub import ActivationBus
from service.searcher import Searcher
from service.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Pool:
    """The bounded thread pool where encoders and FAISS run (they release the GIL)."""

    size: int
    limiter: anyio.CapacityLimiter | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.limiter is None:  # created lazily inside the event loop
            self.limiter = anyio.CapacityLimiter(self.size)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)


@dataclass
class AppState:
    settings: Settings
    metrics: ServiceMetrics
    cache: QueryCache
    registry: BundleRegistry
    pool: Pool
    batch_metrics: BatchMetrics
    bus: ActivationBus | None = None
    batchers: Batchers | None = None
    items: Any = None
    """The item store: the file log and overlay sync (service.items.ItemStore) or the store in Milvus
    (service.milvus_items.MilvusCatalogue); None when items are off or unusable."""
    items_dir: Any = None
    """Where the item log is configured (a Path; the Milvus store: its audio URL; None: items off)."""
    items_opener: Any = None
    """Opens the configured item store (a callable → bool; tried again while it fails); None: items off."""
    items_error: str | None = None
    """Why the configured item log cannot be used (then the replica is not ready); None: usable or off."""
    """The encoder micro-batchers; running between the app's startup and shutdown."""
    started: threading.Event = field(default_factory=threading.Event)
    """Set when the startup thread finished (initial bundle loaded or given up)."""


async def get_state(request: Request) -> AppState:
    return request.app.state.tonearm


StateDep = Annotated[AppState, Depends(get_state)]


async def get_settings(state: StateDep) -> Settings:
    return state.settings


async def get_pool(state: StateDep) -> Pool:
    return state.pool


async def get_registry(state: StateDep) -> BundleRegistry:
    return state.registry


async def get_searcher(state: StateDep) -> AsyncIterator[Searcher]:
    """Lease the active bundle for the whole request: a swap meanwhile does not affect it."""
    entry = state.registry.acquire()
    try:
        yield entry.searcher
    finally:
        state.registry.release(entry)


_bearer = HTTPBearer(auto_error=False, description="Admin token (TONEARM_ADMIN_TOKEN)")


async def require_admin(
    state: StateDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """Bearer-token check of the admin routes (constant-time comparison)."""
    token = state.settings.admin_token
    if token is None:  # only possible in development (Settings refuses it otherwise)
        return
    given = credentials.credentials if credentials is not None else ""
    if not hmac.compare_digest(given.encode(), token.get_secret_value().encode()):
        raise ServiceError("unauthorized", "admin routes need 'Authorization: Bearer <TONEARM_ADMIN_TOKEN>'")


async def require_items_writer(
    state: StateDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """Bearer-token check of the item routes: the items token (TONEARM_ITEMS_TOKEN) or the admin token."""
    tokens = [t.get_secret_value().encode() for t in (state.settings.items_token, state.settings.admin_token)
              if t is not None]
    if not tokens:  # only possible in development (Settings refuses it otherwise)
        return
    given = (credentials.credentials if credentials is not None else "").encode()
    matches = [hmac.compare_digest(given, token) for token in tokens]  # every token compared: constant time
    if not any(matches):
        raise ServiceError("unauthorized", "item routes need 'Authorization: Bearer <TONEARM_ITEMS_TOKEN or "
                           "TONEARM_ADMIN_TOKEN>'")


async def get_batchers(state: StateDep) -> Batchers:
    if state.batchers is None:
        raise ServiceError("not-ready", "the encoder queues are not running (the app has not started)")
    return state.batchers


SettingsDep = Annotated[Settings, Depends(get_settings)]
PoolDep = Annotated[Pool, Depends(get_pool)]
RegistryDep = Annotated[BundleRegistry, Depends(get_registry)]
SearcherDep = Annotated[Searcher, Depends(get_searcher)]
AdminDep = Annotated[None, Depends(require_admin)]
ItemsWriterDep = Annotated[None, Depends(require_items_writer)]
BatchersDep = Annotated[Batchers, Depends(get_batchers)]
