"""Quality gate of an activation: candidate vs active bundle on the same held-out data.

Fair comparison (decided here): both bundles are
evaluated on the **candidate's** held-out set — the set the new bundle ships —
each with its own encoders, the gallery being the held-out clips only (not each
bundle's full index, whose sizes may differ). Only languages both bundles
serve are compared. The candidate is rejected when

- recall (``Settings.gate_metric``, default ``t2a_R@10_mean``) drops by more
  than ``gate_max_recall_drop`` (absolute), or
- text→audio MRV rises above ``active × gate_max_mrv_ratio + gate_mrv_slack``

unless the activation is forced. The verdict (numbers and reasons) is returned
to the caller either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from index.metrics import retrieval_report

MRV_KEY = "mrv_t2a"


@dataclass(frozen=True)
class EvalData:
    """A held-out set: raw waveforms and captions with their clip row, language and query group."""

    waveforms: list[np.ndarray]
    captions: list[str]
    clip: np.ndarray
    lang: np.ndarray
    group: np.ndarray


@dataclass(frozen=True)
class GateThresholds:
    metric: str
    max_recall_drop: float
    max_mrv_ratio: float
    mrv_slack: float


@dataclass
class GateVerdict:
    passed: bool
    forced: bool = False
    reasons: list[str] = field(default_factory=list)
    languages: list[str] = field(default_factory=list)
    candidate: dict[str, float] = field(default_factory=dict)
    active: dict[str, float] = field(default_factory=dict)
    compared_to: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "forced": self.forced,
            "reasons": list(self.reasons),
            "languages": list(self.languages),
            "candidate": dict(self.candidate),
            "active": dict(self.active),
            "compared_to": self.compared_to,
        }


def eval_data(bundle: Any) -> EvalData:
    """The bundle's held-out set as :class:`EvalData` (accepts a named tuple or a 5-tuple)."""
    raw = bundle.eval_set()
    if hasattr(raw, "waveforms"):
        parts = (raw.waveforms, raw.captions, raw.clip, raw.lang, raw.group)
    else:
        parts = tuple(raw)
    waveforms, captions, clip, lang, group = parts
    return EvalData(
        waveforms=list(waveforms),
        captions=[str(c) for c in captions],
        clip=np.asarray(clip, dtype=np.int64),
        lang=np.asarray(lang).astype(str),
        group=np.asarray(group, dtype=np.int64),
    )


def evaluate(bundle: Any, data: EvalData, languages: Sequence[str]) -> dict[str, float]:
    """The metrics report (docs/metrics.md) of ``bundle``'s encoders on ``data`` restricted to ``languages``."""
    keep = np.isin(data.lang, list(languages))
    captions = [c for c, k in zip(data.captions, keep, strict=True) if k]
    audio = np.asarray(bundle.encode_audio(data.waveforms), dtype=np.float32)
    text = np.asarray(bundle.encode_text(captions), dtype=np.float32)
    return retrieval_report(
        audio_emb=audio,
        text_emb=text,
        caption_clip=data.clip[keep],
        caption_lang=data.lang[keep],
        caption_group=data.group[keep],
        languages=list(languages),
    )


def judge(
    candidate: dict[str, float], active: dict[str, float], thresholds: GateThresholds
) -> list[str]:
    """Reasons to reject (empty list = pass)."""
    reasons = []
    metric = thresholds.metric
    if metric in candidate and metric in active:
        drop = active[metric] - candidate[metric]
        if drop > thresholds.max_recall_drop:
            reasons.append(
                f"{metric} drops from {active[metric]:.4f} to {candidate[metric]:.4f} "
                f"(−{drop:.4f} > allowed {thresholds.max_recall_drop:.4f})"
            )
    if MRV_KEY in candidate and MRV_KEY in active:
        limit = active[MRV_KEY] * thresholds.max_mrv_ratio + thresholds.mrv_slack
        if candidate[MRV_KEY] > limit:
            reasons.append(
                f"{MRV_KEY} rises from {active[MRV_KEY]:.3f} to {candidate[MRV_KEY]:.3f} "
                f"(limit {limit:.3f} = active × {thresholds.max_mrv_ratio:g} + {thresholds.mrv_slack:g})"
            )
    return reasons


def run_gate(
    candidate: Any, active: Any | None, thresholds: GateThresholds, *, force: bool
) -> GateVerdict:
    """Evaluate both bundles on the candidate's held-out set and decide."""
    if active is None:
        return GateVerdict(passed=True, forced=force, reasons=["no active bundle to compare with"])
    if getattr(getattr(candidate, "manifest", None), "eval_set", True) is None:
        reason = (
            "the candidate has no held-out set (an index-only bundle from `tonearm index`), so the gate "
            "cannot compare it; activate it with force=true"
        )
        return GateVerdict(passed=force, forced=force, reasons=[reason], compared_to=active.bundle_id)
    data = eval_data(candidate)
    languages = [
        lang for lang in candidate.languages if lang in active.languages and np.any(data.lang == lang)
    ]
    if not languages:
        reason = "the candidate's held-out set has no caption in a language both bundles serve"
        return GateVerdict(passed=force, forced=force, reasons=[reason], compared_to=active.bundle_id)
    cand_report = evaluate(candidate, data, languages)
    act_report = evaluate(active, data, languages)
    reasons = judge(cand_report, act_report, thresholds)
    keys = (thresholds.metric, MRV_KEY, "t2a_R@1_mean", "a2t_R@10_mean")
    return GateVerdict(
        passed=not reasons or force,
        forced=force,
        reasons=reasons,
        languages=languages,
        candidate={k: cand_report[k] for k in keys if k in cand_report},
        active={k: act_report[k] for k in keys if k in act_report},
        compared_to=active.bundle_id,
    )
