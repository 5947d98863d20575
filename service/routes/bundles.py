"""Admin routes: list, activate (quality-gated hot swap), roll back (docs/service.md)."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter

from service.bundles import ActivationResult
from service.deps import AdminDep, PoolDep, RegistryDep
from service.routes import ShallowJsonRoute
from service.schemas import (
    ActivateRequest,
    ActivationResponse,
    BundleListResponse,
    BundleOut,
    GateVerdictOut,
    problem_responses,
)

router = APIRouter(prefix="/v1/bundles", tags=["bundles (admin)"], route_class=ShallowJsonRoute)


def _activation_out(result: ActivationResult) -> ActivationResponse:
    verdict = GateVerdictOut(**result.verdict.as_dict()) if result.verdict is not None else None
    return ActivationResponse(
        bundle_id=result.bundle_id, previous=result.previous_id, changed=result.changed, verdict=verdict
    )


@router.get("", responses=problem_responses(401))
async def list_bundles(_: AdminDep, registry: RegistryDep, pool: PoolDep) -> BundleListResponse:
    """Bundles in the bundles directory, with the active and previous one marked."""
    summaries = await pool.run(registry.list_bundles)
    return BundleListResponse(
        active=registry.active_id,
        previous=registry.previous_id,
        bundles=[BundleOut(**asdict(s)) for s in summaries],
    )


@router.post("/activate", responses=problem_responses(400, 401, 404, 409, 415, 422))
async def activate(body: ActivateRequest, _: AdminDep, registry: RegistryDep, pool: PoolDep) -> ActivationResponse:
    """Load beside the active bundle, verify, warm up, run the quality gate, swap atomically.

    A rejection is a 409 problem whose ``verdict`` member holds the gate's numbers."""
    result = await pool.run(lambda: registry.activate(body.bundle_id, force=body.force))
    return _activation_out(result)


@router.post("/rollback", responses=problem_responses(401, 409))
async def rollback(_: AdminDep, registry: RegistryDep, pool: PoolDep) -> ActivationResponse:
    """Return to the previous bundle (kept loaded, so this is instant)."""
    return _activation_out(await pool.run(registry.rollback))
