"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response

from service.deps import StateDep
from service.errors import ServiceError
from service.routes import ShallowJsonRoute
from service.schemas import HealthResponse, problem_responses

router = APIRouter(tags=["operations"], route_class=ShallowJsonRoute)


@router.get("/healthz")
async def healthz() -> HealthResponse:
    """Liveness: the process answers (no bundle needed)."""
    return HealthResponse(status="ok")


@router.get("/readyz", responses=problem_responses(503))
async def readyz(state: StateDep) -> HealthResponse:
    """Readiness: a bundle is loaded, verified and warm, and — where items are configured — the item
    log is open and writable (a replica without it would serve without the takedowns)."""
    if state.items_error is not None:
        raise ServiceError("items-unavailable", state.items_error)
    bundle_id = state.registry.active_id
    if bundle_id is None:
        raise ServiceError("not-ready", "no bundle is loaded yet")
    return HealthResponse(status="ready", bundle_id=bundle_id)


@router.get("/metrics", response_class=Response)
async def metrics(state: StateDep) -> Response:
    """Prometheus text format: latency per route, cache hits/misses, Redis errors, active bundle."""
    return Response(state.metrics.render(), media_type=state.metrics.content_type)
