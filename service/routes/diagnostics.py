"""Cross-language consistency diagnostics (docs/service.md, metrics of docs/metrics.md)."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter

from index.metrics.retrieval import RETRIEVAL_METRICS
from service.deps import PoolDep, SearcherDep
from service.routes import ShallowJsonRoute
from service.schemas import (
    AudioHitOut,
    ConsistencyRequest,
    ConsistencyResponse,
    HeldoutReportResponse,
    LanguageDiagnosisOut,
    LanguageMetrics,
    problem_responses,
)
from service.searcher import Searcher

router = APIRouter(prefix="/v1/diagnostics", tags=["diagnostics"], route_class=ShallowJsonRoute)


@router.post("/consistency", responses=problem_responses(400, 404, 415, 422, 503, 504))
async def diagnose(body: ConsistencyRequest, searcher: SearcherDep, pool: PoolDep) -> ConsistencyResponse:
    """Hits and target rank per language for one query group; MRV and Gap/Dis of its embeddings."""
    result = await pool.run(lambda: searcher.consistency(body.captions, target_id=body.target_id, k=body.k))
    return ConsistencyResponse(
        bundle_id=searcher.bundle_id,
        target_id=result.target_id,
        languages={
            lang: LanguageDiagnosisOut(
                hits=[AudioHitOut(**asdict(h)) for h in d.hits], target_rank=d.target_rank
            )
            for lang, d in result.per_language.items()
        },
        mrv=result.mrv,
        mean_rank_std=result.mean_rank_std,
        gap=result.gap,
        dis=result.dis,
    )


def _per_language(report: dict[str, float], languages: list[str]) -> dict[str, LanguageMetrics]:
    out = {}
    for lang in [*languages, "mean"]:
        if f"t2a_R@1_{lang}" not in report:
            continue
        out[lang] = LanguageMetrics(
            t2a={m: report[f"t2a_{m}_{lang}"] for m in RETRIEVAL_METRICS if f"t2a_{m}_{lang}" in report},
            a2t={m: report[f"a2t_{m}_{lang}"] for m in RETRIEVAL_METRICS if f"a2t_{m}_{lang}" in report},
        )
    return out


def _heldout(searcher: Searcher) -> HeldoutReportResponse:
    held = searcher.heldout_report()
    return HeldoutReportResponse(
        bundle_id=searcher.bundle_id,
        source=held.source,  # type: ignore[arg-type]
        convention=held.convention,
        per_language=_per_language(held.report, searcher.languages),
        mrv_t2a=held.report.get("mrv_t2a"),
        mrv_a2t=held.report.get("mrv_a2t"),
        report=held.report,
    )


@router.get("/consistency", responses=problem_responses(409, 503))
async def heldout_report(searcher: SearcherDep, pool: PoolDep) -> HeldoutReportResponse:
    """The active bundle's own held-out report: per-language R@k, mAP@10, MRV."""
    return await pool.run(_heldout, searcher)
