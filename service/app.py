"""The FastAPI application: ``create_app(settings)`` + a lifespan that loads the bundle.

Nothing happens at import time. ``create_app`` wires settings, metrics, cache,
bundle registry and routes; the lifespan connects Redis, starts loading the
initial bundle in a background thread (``/healthz`` answers at once,
``/readyz`` once the bundle is verified and warm), and starts the activation
subscriber. Errors are RFC 9457 problem+json, mapped in :func:`install_error_handlers`.
"""

from __future__ import annotations

import errno
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

import tonearm
from index.errors import BundleError, IndexBackendError
from service.allocator import PeriodicTrim, limit_arenas
from service.apidocs import install_api_docs
from service.batching import BatchMetrics
from service.bundles import BUNDLE_ID_PATTERN, BundleRegistry, Opener
from service.cache import LocalCache, QueryCache, RedisCache, RedisHealth, make_redis_client
from service.deps import AppState, Pool
from service.encoder_queues import Batchers
from service.errors import PROBLEM_MEDIA_TYPE, ServiceError, problem_body, slug_for_status
from service.items import ItemStore, items_dir_of
from service.metrics import GcPauses, LatencyMiddleware, ServiceMetrics
from service.openapi_contract import install_language_enums
from service.pubsub import ActivationBus
from service.routes import audio, bundles, demo, diagnostics, health, items, search
from service.searcher import index_problem
from service.settings import Settings

log = logging.getLogger(__name__)

DESCRIPTION = """Multilingual audio–text retrieval over a versioned bundle (ONNX encoders + FAISS).

* **search** — text → audio clips (any served language), audio upload → captions.
* **diagnostics** — cross-language consistency of one query group; the bundle's held-out report.
* **bundles** — admin (bearer token): list, activate with a quality gate, roll back.

Every response names the `bundle_id` that answered. Errors are `application/problem+json`
(RFC 9457) with a stable `type` (`urn:tonearm:problem:<slug>`).
"""


def bundles_dir_of(settings: Settings) -> Path | None:
    """The bundles directory: the setting, else the parent of a ``bundle`` given as a path."""
    if settings.bundles_dir is not None:
        return settings.bundles_dir
    if settings.bundle is not None and (Path(settings.bundle) / "manifest.json").is_file():
        return Path(settings.bundle).resolve().parent
    return None


def resolve_bundle(spec: str, bundles_dir: Path | None) -> Path:
    """A bundle directory from a path or an id inside ``bundles_dir``; BundleError otherwise."""
    path = Path(spec).expanduser()
    if (path / "manifest.json").is_file():
        return path
    if bundles_dir is not None and BUNDLE_ID_PATTERN.match(spec) and (bundles_dir / spec / "manifest.json").is_file():
        return bundles_dir / spec
    raise BundleError(f"bundle {spec!r} is neither a bundle directory nor a bundle id in {bundles_dir}")


def _problem(status_slug: str, detail: str, request: Request, **extra: Any) -> JSONResponse:
    body = problem_body(status_slug, detail, instance=request.url.path, **extra)
    headers = {"WWW-Authenticate": "Bearer"} if status_slug == "unauthorized" else None
    if "retry_after" in extra:  # backpressure (overloaded): tell clients when to come back
        headers = {"Retry-After": str(extra["retry_after"])}
    return JSONResponse(body, status_code=body["status"], media_type=PROBLEM_MEDIA_TYPE, headers=headers)


HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """Every method some route of ``app`` fully matches at ``path`` (the ``Allow`` header of a 405)."""
    allowed = []
    for method in HTTP_METHODS:
        scope = {"type": "http", "path": path, "method": method, "root_path": "", "path_params": {}}
        if any(route.matches(scope)[0] is Match.FULL for route in app.router.routes):
            allowed.append(method)
    return allowed


JSON_HINT = "send the body as JSON with the header `Content-Type: application/json`"


def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def body_problem(exc: RequestValidationError, content_type: str | None) -> tuple[str, str] | None:
    """(slug, detail) when a JSON body could not be read at all, None for schema errors.

    Invalid JSON is 400 ``malformed-body`` naming the position (FastAPI reports it as a
    ``json_invalid`` error at ``("body", offset)``); a non-empty body that was not declared as
    JSON reaches validation as raw bytes and is 415 ``unsupported-media-type`` with a hint.
    """
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            offset = int(error["loc"][1]) if len(error.get("loc", ())) > 1 else 0
            doc = exc.body if isinstance(exc.body, str) else ""
            line = doc.count("\n", 0, offset) + 1
            column = offset - (doc.rfind("\n", 0, offset) + 1) + 1
            reason = str((error.get("ctx") or {}).get("error", "JSON decode error"))
            return "malformed-body", f"invalid JSON at line {line}, column {column} (character {offset}): {reason}"
    if isinstance(exc.body, bytes | bytearray) and exc.body and not _is_json(content_type):
        declared = f"`{content_type}`" if content_type else "no content type"
        return "unsupported-media-type", f"the body was sent with {declared}; {JSON_HINT}"
    return None


def install_error_handlers(app: FastAPI) -> None:
    """The one place where errors become HTTP responses."""

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return _problem(exc.slug, exc.detail, request, **exc.extra)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        unreadable = body_problem(exc, request.headers.get("content-type"))
        if unreadable is not None:
            return _problem(*unreadable, request)
        errors = [
            {"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in exc.errors()
        ]
        summary = "; ".join(f"{'.'.join(e['loc'])}: {e['msg']}" for e in errors[:5])
        return _problem("validation-error", summary or "invalid request", request, errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        slug = slug_for_status(exc.status_code)
        detail = str(exc.detail)
        if detail == "There was an error parsing the body":  # FastAPI's words for a body json.loads refused
            detail = f"the body cannot be read as JSON (not UTF-8?); {JSON_HINT}"
        body = problem_body(slug, detail, status=exc.status_code, instance=request.url.path)
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # Starlette names only the first matching route's methods
            headers["Allow"] = ", ".join(allowed_methods(app, request.url.path))
        return JSONResponse(body, status_code=exc.status_code, media_type=PROBLEM_MEDIA_TYPE, headers=headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, IndexBackendError):  # an index store call outside `index_calls`: still not a bug
            log.error("index backend error on %s: %s", request.url.path, exc)
            mapped = index_problem(exc)
            return _problem(mapped.slug, mapped.detail, request, **mapped.extra)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):  # not a bug: a full volume
            log.error("no room to store the request on %s: %s", request.url.path, exc)
            return _problem("insufficient-storage", f"no space left to store the request ({exc.strerror})", request)
        if isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            # not a bug either: the item volume turned read-only (or lost its permissions) after start-up
            log.error("the volume refused a write on %s: %s", request.url.path, exc)
            return _problem("items-unavailable", f"the item volume refused the write ({exc.strerror}"
                            f"{f': {exc.filename}' if exc.filename else ''}); mount it read-write", request)
        log.exception("unhandled error on %s", request.url.path)
        return _problem("internal-error", "internal error; see the service log", request)


def _build_cache(settings: Settings, metrics: ServiceMetrics) -> tuple[QueryCache, RedisHealth | None, Any]:
    if settings.redis_url is None:
        local = LocalCache(
            max_entries=settings.cache_max_entries,
            ttl_seconds=settings.cache_ttl_seconds,
            metrics=metrics,
            max_payload_bytes=settings.cache_max_payload_bytes,
        )
        return local, None, None
    client = make_redis_client(settings.redis_url, socket_timeout=settings.redis_socket_timeout)
    health = RedisHealth(metrics=metrics, backoff_max=settings.redis_backoff_max)
    cache = RedisCache(
        client, health=health, ttl_seconds=settings.cache_ttl_seconds, max_payload_bytes=settings.cache_max_payload_bytes
    )
    return cache, health, client


ITEMS_RETRY_S = 5.0
"""How often a replica whose item log cannot be used tries it again (it is not ready meanwhile)."""


def open_items(state: AppState, items_dir: Path) -> bool:
    """Open the item log at ``items_dir`` and hook it into the registry; on failure record why on the
    state (``/readyz`` answers 503 with it) and log it. True when the log is usable."""
    try:
        store = ItemStore(items_dir, state.settings, metrics=state.metrics)
    except OSError as err:
        reason = (f"the item log at {items_dir} cannot be opened for writing: {err.strerror or err}"
                  f"{f' ({err.filename})' if err.filename else ''}; items are configured "
                  "(TONEARM_ITEMS_DIR, else <TONEARM_BUNDLES_DIR>/.items), so this replica is not ready: mount "
                  "that directory read-write on every replica, or set TONEARM_ITEMS_ENABLED=false")
        return _items_unusable(state, reason)
    return _items_usable(state, store)


def _items_unusable(state: AppState, reason: str) -> bool:
    """Not ready with ``reason`` (logged once per distinct reason); False, for the openers."""
    if reason != state.items_error:
        log.error("items: %s", reason)
    state.items_error = reason
    state.metrics.items_ready.set(0)
    return False


def _items_usable(state: AppState, store: Any) -> bool:
    """Hook an opened item store (the file log's or Milvus's) into the registry; True, for the openers."""
    state.registry.prepare = store.sync
    state.items = store
    return True


def _items_stale(state: AppState, reason: str | None) -> None:
    """The follower could not read the item log for ``items_stale_s`` (reason) or reads it again (None)."""
    state.items_error = reason
    state.metrics.items_ready.set(0 if reason else 1)


def open_milvus_items(state: AppState, audio_url: str) -> bool:
    """Open the item store in Milvus (records collection, audio store) and hook it into the registry;
    on failure record why on the state (``/readyz`` answers 503 with it). True when it is usable."""
    from service.milvus_items import open_catalogue

    try:
        store = open_catalogue(state.settings, audio_url, metrics=state.metrics)
    except Exception as err:  # Milvus unreachable, the object store refusing writes, bad credentials …
        reason = (f"the item store in Milvus ({state.settings.milvus_uri}) with its audio at {audio_url} cannot be "
                  f"opened: {err}; items are configured (TONEARM_ITEMS_STORE={state.settings.items_store}), so "
                  "this replica is not ready until both answer")
        return _items_unusable(state, reason)
    return _items_usable(state, store)


def _retry_items(state: AppState, opener: Callable[[], bool], stop: threading.Event) -> None:
    """Background thread while the item store is unusable: try again every :data:`ITEMS_RETRY_S`; once it
    opens, sync the active bundle, follow the store and become ready."""
    while not stop.wait(ITEMS_RETRY_S):
        if not opener():
            continue
        store = state.items
        try:
            active = state.registry.active_searcher()
            if active is not None:
                store.sync(active)
        except Exception:
            log.exception("items: syncing the active bundle after the item log opened failed; retrying")
            state.items = None
            continue
        store.start(state.registry.active_searcher, on_stale=functools.partial(_items_stale, state))
        state.items_error = None
        state.metrics.items_ready.set(1)
        log.info("items: the item store is usable now; ready")
        return


def _configure_items(state: AppState) -> Callable[[], bool] | None:
    """Open the configured item store (the file log, or Milvus: ``TONEARM_ITEMS_STORE``); returns how to
    try again while it cannot be opened (None: items are off)."""
    settings, registry = state.settings, state.registry
    items_dir = items_dir_of(settings, registry.bundles_dir)
    if settings.items_in_milvus and settings.items_enabled is not False:
        audio_url = settings.items_audio_url or (str(items_dir / "audio") if items_dir is not None else None)
        if audio_url is None:
            _items_off(state, "there is nowhere to store the items' audio: set TONEARM_ITEMS_AUDIO_URL "
                              "(e.g. s3://bucket/prefix)")
            return None
        state.items_dir = audio_url
        opener: Callable[[], bool] = lambda: open_milvus_items(state, audio_url)  # noqa: E731
    else:
        state.items_dir = items_dir
        if items_dir is None:
            _items_off(state, "there is no directory for the item log: set TONEARM_ITEMS_DIR (a volume every "
                              "replica mounts read-write)")
            return None
        opener = lambda: open_items(state, items_dir)  # noqa: E731
    opener()
    return opener


def _items_off(state: AppState, missing: str) -> None:
    """No item store can be configured: items are off, and with TONEARM_ITEMS_ENABLED=true the replica
    is not ready (``missing`` says what to set)."""
    if state.settings.items_enabled:
        state.items_error = f"TONEARM_ITEMS_ENABLED=true but {missing}"
        log.error("items: %s; not ready", state.items_error)


def create_app(settings: Settings | None = None, *, opener: Opener | None = None) -> FastAPI:
    """Build the app. ``opener`` replaces ``LoadedBundle.open`` (tests with a fake bundle)."""
    settings = settings or Settings()
    metrics = ServiceMetrics()
    cache, health_, client = _build_cache(settings, metrics)
    registry = BundleRegistry(
        settings=settings, bundles_dir=bundles_dir_of(settings), cache=cache, metrics=metrics, opener=opener
    )
    state = AppState(
        settings=settings, metrics=metrics, cache=cache, registry=registry, pool=Pool(settings.search_threads),
        batch_metrics=BatchMetrics(metrics.registry),
    )
    if client is not None and health_ is not None:
        state.bus = ActivationBus(
            make_redis_client(settings.redis_url or "", socket_timeout=max(1.0, settings.redis_socket_timeout)),
            channel=settings.pubsub_channel,
            key_prefix=settings.key_prefix,
            health=health_,
            on_activation=registry.apply_remote,
            backoff_max=settings.redis_backoff_max,
        )
        registry.publisher = state.bus.publish
    state.items_opener = _configure_items(state)

    app = FastAPI(
        title="tonearm",
        version=getattr(tonearm, "__version__", "0.1.0"),
        description=DESCRIPTION,
        lifespan=_lifespan,
        docs_url=None,  # served from local assets by install_api_docs (no CDN)
        redoc_url=None,
    )
    app.state.tonearm = state
    app.add_middleware(LatencyMiddleware, metrics=metrics)
    install_error_handlers(app)
    install_api_docs(app)
    install_language_enums(app, registry.active_languages, registry.active_filter_fields)
    for module in (search, diagnostics, health, audio, demo):
        app.include_router(module.router)
    if settings.admin_on:
        if settings.admin_token is None:
            log.warning("admin routes are enabled WITHOUT a token (development only)")
        app.include_router(bundles.router)
    if settings.items_on:  # the admin token, or an items token alone (docs/service.md, "Tokens")
        app.include_router(items.router)
    return app


def _initial_bundle(state: AppState) -> Path | None:
    """The bundle to serve first: the id other replicas recorded in Redis, else the setting."""
    registry, settings = state.registry, state.settings
    if state.bus is not None:
        current = state.bus.current()
        if current is not None:
            try:
                return registry.find(current)
            except ServiceError:
                log.warning("active bundle %s recorded in redis is not in %s", current, registry.bundles_dir)
    if settings.bundle is None:
        log.warning("no bundle configured (TONEARM_BUNDLE); not ready until one is activated")
        return None
    return resolve_bundle(settings.bundle, registry.bundles_dir)


def _startup(state: AppState) -> None:
    """Background thread: load the first bundle, then follow activations."""
    try:
        path = _initial_bundle(state)
        if path is not None:
            state.registry.start(path)
    except (ServiceError, BundleError) as err:
        log.error("initial bundle not loaded: %s", err)
    finally:
        state.started.set()
    if state.bus is not None:
        state.bus.start()


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: AppState = app.state.tonearm
    loader = threading.Thread(target=_startup, args=(state,), name="tonearm-startup", daemon=True)
    loader.start()
    state.batchers = Batchers.start(state.settings, state.batch_metrics)
    items_stop = threading.Event()
    if state.items is not None:
        state.metrics.items_ready.set(1)
        state.items.start(state.registry.active_searcher, on_stale=functools.partial(_items_stale, state))
    elif state.items_error is not None and state.items_opener is not None:
        threading.Thread(target=_retry_items, args=(state, state.items_opener, items_stop), name="tonearm-items-retry",
                         daemon=True).start()
    trimmer = PeriodicTrim.start(state.settings.malloc_trim_interval_s)
    gc_pauses = GcPauses(state.metrics)
    gc_pauses.install()
    try:
        yield
    finally:
        gc_pauses.remove()
        if trimmer is not None:
            trimmer.stop()
        state.batchers.close()
        items_stop.set()
        if state.items is not None:
            state.items.stop()
        loader.join(timeout=60)
        if state.bus is not None:
            state.bus.stop()
        state.registry.close()


def app_from_env() -> FastAPI:
    """uvicorn factory (``service.app:app_from_env``): settings from ``TONEARM_*`` variables; the
    process's malloc arenas are capped first, before any of its threads allocates."""
    settings = Settings()
    limit_arenas(settings.malloc_arenas)
    return create_app(settings)
