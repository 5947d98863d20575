"""Quality gate of an activation: candidate vs active bundle on the same held-out queries.

Like with like (decided here, docs/service.md "Quality gate"):

- **One set, both bundles.** The gate set is the **active** bundle's held-out set (the set
  the serving model was validated on), or the bundle directory named by ``TONEARM_GATE_SET``.
  Its waveforms and captions are encoded by *each* bundle's own encoders (ONNX; resampled
  when a bundle's rate differs) and scored against the set's clips only, so both bundles
  answer exactly the same queries over the same gallery. Only languages both bundles serve
  and the set holds are compared. (The candidate's own held-out set is *not* used: a
  small one makes every model look perfect — 8 clips give any model t2a R@10 = 1.)
- **Big enough to mean something.** A set with fewer than ``gate_min_clips`` clips (default
  100: chance t2a R@10 is then ≤ 10 %) is refused without ``--force``.
- **A margin that accounts for the sample.** The per-query differences of the gate metric
  (``gate_metric``, default ``t2a_R@10_mean``) give a seeded paired bootstrap interval over
  clips (:mod:`index.metrics.paired`); the candidate passes when the interval's lower end is at
  least ``−gate_max_recall_drop`` — it must be shown *not worse than allowed*, a
  non-inferiority test, so a noisy set cannot wave a bad model through.
- text→audio MRV must not rise above ``active × gate_max_mrv_ratio + gate_mrv_slack``
  (point values on the same set).
- An index-only candidate (no held-out set: `tonearm index`) is refused without ``--force``.

The verdict names the set, its size, each metric for both bundles and the interval; it is
returned to the caller whether the bundle was activated or not.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from index.metrics.paired import PairedInterval, QueryTable, paired_bootstrap, query_table
from index.metrics.retrieval import retrieval_report

MRV_KEY = "mrv_t2a"
SHOWN = ("t2a_R@1_mean", "t2a_R@10_mean", "a2t_R@10_mean", "t2a_mAP@10_mean", MRV_KEY)
FORCE_HINT = "activate it anyway with --force (HTTP: \"force\": true)"


@dataclass(frozen=True)
class EvalData:
    """A held-out set: raw waveforms (at ``sample_rate``) and captions with their clip row, language, group."""

    waveforms: list[np.ndarray]
    captions: list[str]
    clip: np.ndarray
    lang: np.ndarray
    group: np.ndarray
    sample_rate: int = 0


@dataclass(frozen=True)
class GateSet:
    """The queries both bundles are judged on, and where they came from."""

    data: EvalData
    source: str  # "active-held-out" | "configured"
    name: str

    def describe(self, languages: Sequence[str]) -> dict[str, Any]:
        keep = np.isin(self.data.lang, list(languages))
        return {"source": self.source, "name": self.name, "n_clips": len(self.data.waveforms),
                "n_queries": int(keep.sum()), "languages": list(languages)}


@dataclass(frozen=True)
class GateThresholds:
    metric: str
    max_recall_drop: float
    max_mrv_ratio: float
    mrv_slack: float
    min_clips: int = 100
    confidence: float = 0.95
    bootstrap_samples: int = 2000
    seed: int = 0
    gate_set: Path | None = None


@dataclass
class GateVerdict:
    passed: bool
    forced: bool = False
    reasons: list[str] = field(default_factory=list)
    languages: list[str] = field(default_factory=list)
    candidate: dict[str, float] = field(default_factory=dict)
    active: dict[str, float] = field(default_factory=dict)
    compared_to: str | None = None
    set: dict[str, Any] | None = None
    interval: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed, "forced": self.forced, "reasons": list(self.reasons),
            "languages": list(self.languages), "candidate": dict(self.candidate), "active": dict(self.active),
            "compared_to": self.compared_to, "set": self.set, "interval": self.interval,
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
        sample_rate=int(getattr(bundle, "sample_rate", 0)),
    )


def configured_set(path: Path) -> GateSet:
    """``TONEARM_GATE_SET``: a bundle directory whose held-out set (``eval/``) is the gate set."""
    from index.bundle.evalset import read_eval_set
    from index.bundle.format import EVAL_DIR, read_manifest

    manifest = read_manifest(path)
    if manifest.eval_set is None:
        from index.errors import BundleError

        raise BundleError(f"TONEARM_GATE_SET={path}: an index-only bundle, it has no held-out set")
    raw = read_eval_set(path / EVAL_DIR)
    data = EvalData(raw.waveforms, list(raw.captions), raw.clip, raw.lang.astype(str), raw.group,
                    sample_rate=manifest.sample_rate)
    return GateSet(data=data, source="configured", name=str(path))


def _waveforms_for(bundle: Any, data: EvalData) -> list[np.ndarray]:
    rate = int(getattr(bundle, "sample_rate", 0))
    if not data.sample_rate or not rate or rate == data.sample_rate:
        return data.waveforms
    import soxr

    return [soxr.resample(w, data.sample_rate, rate, quality="HQ").astype(np.float32) for w in data.waveforms]


def _embed(bundle: Any, data: EvalData, languages: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(clip embeddings, caption embeddings of ``languages``, the kept-caption mask) by ``bundle``'s encoders."""
    keep = np.isin(data.lang, list(languages))
    captions = [c for c, k in zip(data.captions, keep, strict=True) if k]
    audio = np.asarray(bundle.encode_audio(_waveforms_for(bundle, data)), dtype=np.float32)
    text = np.asarray(bundle.encode_text(captions), dtype=np.float32)
    return audio, text, keep


def _report(audio: np.ndarray, text: np.ndarray, keep: np.ndarray, data: EvalData,
            languages: Sequence[str]) -> dict[str, float]:
    return retrieval_report(
        audio_emb=audio, text_emb=text, caption_clip=data.clip[keep], caption_lang=data.lang[keep],
        caption_group=data.group[keep], languages=list(languages),
    )


def evaluate(bundle: Any, data: EvalData, languages: Sequence[str]) -> dict[str, float]:
    """The metrics report (docs/metrics.md) of ``bundle``'s encoders on ``data`` restricted to ``languages``."""
    return _report(*_embed(bundle, data, languages), data, languages)


_MEMO: OrderedDict[tuple[Any, ...], tuple[dict[str, float], QueryTable]] = OrderedDict()
_MEMO_SIZE = 4
_MEMO_LOCK = threading.Lock()


def evaluate_with_table(
    bundle: Any, data: EvalData, languages: Sequence[str], metric: str, *, set_name: str | None = None
) -> tuple[dict[str, float], QueryTable]:
    """:func:`evaluate` plus the per-query table of ``metric`` for the paired comparison.

    With ``set_name`` the result is remembered per (bundle id, set, languages, metric) — bundles
    are immutable once published — so a retried activation does not re-encode the active bundle."""
    key = (bundle.bundle_id, set_name, tuple(languages), metric) if set_name else None
    with _MEMO_LOCK:
        if key is not None and key in _MEMO:
            _MEMO.move_to_end(key)
            return _MEMO[key]
    audio, text, keep = _embed(bundle, data, languages)
    table = query_table(metric, audio_emb=audio, text_emb=text, caption_clip=data.clip[keep],
                        caption_lang=data.lang[keep], languages=languages)
    result = _report(audio, text, keep, data, languages), table
    if key is not None:
        with _MEMO_LOCK:
            _MEMO[key] = result
            while len(_MEMO) > _MEMO_SIZE:
                _MEMO.popitem(last=False)
    return result


def judge(
    candidate: dict[str, float], active: dict[str, float], thresholds: GateThresholds,
    interval: PairedInterval | None = None,
) -> list[str]:
    """Reasons to reject (empty list = pass). With an ``interval`` the recall rule uses its lower end."""
    reasons = []
    metric = thresholds.metric
    if metric in candidate and metric in active:
        allowed = thresholds.max_recall_drop
        if interval is not None and interval.low < -allowed:
            reasons.append(
                f"{metric}: candidate {candidate[metric]:.4f} vs active {active[metric]:.4f}, difference "
                f"{interval.delta:+.4f} with {100 * interval.confidence:g} % interval "
                f"[{interval.low:+.4f}, {interval.high:+.4f}]; its lower end is below the allowed "
                f"−{allowed:.4f}, so the candidate is not shown to be at most {allowed:.4f} worse"
            )
        elif interval is None and active[metric] - candidate[metric] > allowed:
            reasons.append(
                f"{metric} drops from {active[metric]:.4f} to {candidate[metric]:.4f} "
                f"(−{active[metric] - candidate[metric]:.4f} > allowed {allowed:.4f})"
            )
    if MRV_KEY in candidate and MRV_KEY in active:
        limit = active[MRV_KEY] * thresholds.max_mrv_ratio + thresholds.mrv_slack
        if candidate[MRV_KEY] > limit:
            reasons.append(
                f"{MRV_KEY} rises from {active[MRV_KEY]:.3f} to {candidate[MRV_KEY]:.3f} "
                f"(limit {limit:.3f} = active × {thresholds.max_mrv_ratio:g} + {thresholds.mrv_slack:g})"
            )
    return reasons


def _gate_set(active: Any, thresholds: GateThresholds) -> GateSet | str:
    """The gate set, or the reason there is none."""
    if thresholds.gate_set is not None:
        return configured_set(thresholds.gate_set)
    if getattr(getattr(active, "manifest", None), "eval_set", True) is None:
        return (f"the active bundle {active.bundle_id} has no held-out set (an index-only bundle) and no "
                f"gate set is configured (TONEARM_GATE_SET=BUNDLE_DIR), so the gate cannot compare; {FORCE_HINT}")
    return GateSet(data=eval_data(active), source="active-held-out",
                   name=f"held-out set of the active bundle {active.bundle_id}")


def run_gate(candidate: Any, active: Any | None, thresholds: GateThresholds, *, force: bool) -> GateVerdict:
    """Evaluate both bundles on the gate set (docstring above) and decide."""
    if active is None:
        return GateVerdict(passed=True, forced=force, reasons=["no active bundle to compare with"])

    def refuse(reason: str, **extra: Any) -> GateVerdict:
        return GateVerdict(passed=force, forced=force, reasons=[reason], compared_to=active.bundle_id, **extra)

    if getattr(getattr(candidate, "manifest", None), "eval_set", True) is None:
        return refuse("the candidate has no held-out set (an index-only bundle from `tonearm index`), so the "
                      f"gate does not vouch for it; {FORCE_HINT}")
    found = _gate_set(active, thresholds)
    if isinstance(found, str):
        return refuse(found)
    data = found.data
    languages = [lang for lang in candidate.languages if lang in active.languages and np.any(data.lang == lang)]
    if not languages:
        return refuse(f"the gate set ({found.name}) has no caption in a language both bundles serve",
                      set=found.describe([]))
    cand_report, cand_table = evaluate_with_table(candidate, data, languages, thresholds.metric)
    act_report, act_table = evaluate_with_table(active, data, languages, thresholds.metric, set_name=found.name)
    interval = paired_bootstrap(cand_table, act_table, samples=thresholds.bootstrap_samples,
                                confidence=thresholds.confidence, seed=thresholds.seed)
    reasons = []
    if len(data.waveforms) < thresholds.min_clips:
        reasons.append(
            f"the gate set ({found.name}) has {len(data.waveforms)} clips, fewer than the minimum "
            f"{thresholds.min_clips} (TONEARM_GATE_MIN_CLIPS) for a meaningful comparison; configure a larger "
            f"set (TONEARM_GATE_SET) or {FORCE_HINT}"
        )
    reasons += judge(cand_report, act_report, thresholds, interval)
    keys = (thresholds.metric, *SHOWN)
    return GateVerdict(
        passed=not reasons or force,
        forced=force,
        reasons=reasons,
        languages=languages,
        candidate={k: cand_report[k] for k in keys if k in cand_report},
        active={k: act_report[k] for k in keys if k in act_report},
        compared_to=active.bundle_id,
        set=found.describe(languages),
        interval={"metric": thresholds.metric, **asdict(interval)},
    )
