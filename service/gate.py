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
- **Moments, like recall.** When the gate set's bundle keeps held-out moment queries (``eval/moment_*``:
  long recordings with captioned spans, written by `tonearm train-moments` and the demo build) and both
  bundles answer moments (windows or a trained head), each bundle answers them with the scorer it serves
  (its head if it has one, else the sliding windows) and the candidate is refused when its
  ``gate_moment_metric`` (default ``moment_R1@0.7_mean``) is below the active's by more than
  ``gate_max_moment_drop`` (point values: the moment set is a few recordings, too few queries per
  recording for a bootstrap over recordings). A candidate that answers no moments while the active
  does is refused without ``--force`` (its moment route would answer 409 after the swap).

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

from index.bundle.evalset import MomentSet, read_moment_set
from index.bundle.format import EVAL_DIR
from index.metrics.paired import PairedInterval, QueryTable, paired_bootstrap, query_table
from index.metrics.retrieval import retrieval_report
from index.moments.evaluate import evaluate_moment_set

MRV_KEY = "mrv_t2a"
SHOWN = ("t2a_R@1_mean", "t2a_R@10_mean", "a2t_R@10_mean", "t2a_mAP@10_mean", MRV_KEY)
FORCE_HINT = "activate it anyway with --force (HTTP: \"force\": true)"
MOMENT_SHOWN = ("moment_R1@0.5_mean", "moment_R1@0.7_mean", "moment_mAP_mean")


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
    moments: MomentSet | None = None
    """The long recordings and moment queries kept beside the held-out clips, if any."""

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
    moment_metric: str = "moment_R1@0.7_mean"
    max_moment_drop: float = 0.05


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
    moments: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed, "forced": self.forced, "reasons": list(self.reasons),
            "languages": list(self.languages), "candidate": dict(self.candidate), "active": dict(self.active),
            "compared_to": self.compared_to, "set": self.set, "interval": self.interval, "moments": self.moments,
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
    return GateSet(data=data, source="configured", name=str(path), moments=read_moment_set(path / EVAL_DIR))


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
_MOMENT_MEMO: OrderedDict[tuple[Any, ...], dict[str, float]] = OrderedDict()


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
    root = getattr(active, "path", None)
    moments = read_moment_set(Path(root) / EVAL_DIR) if root is not None else None
    return GateSet(data=eval_data(active), source="active-held-out",
                   name=f"held-out set of the active bundle {active.bundle_id}", moments=moments)


def answers_moments(bundle: Any) -> bool:
    """Whether ``bundle`` answers `/v1/search/moments` by itself: it holds windows or a trained moment head."""
    manifest = getattr(bundle, "manifest", None)
    return manifest is not None and (getattr(manifest, "moments", None) is not None
                                     or getattr(manifest, "moment_head", None) is not None)


def scorer_of(bundle: Any) -> str:
    return "head" if getattr(bundle, "moment_head", None) is not None else "windows"


def evaluate_moments(bundle: Any, moment_set: MomentSet, languages: Sequence[str], *,
                     set_name: str | None = None) -> dict[str, float]:
    """The moment report of ``bundle`` on ``moment_set`` with the scorer it serves (remembered per bundle and
    set with ``set_name``, as :func:`evaluate_with_table`)."""
    key = (bundle.bundle_id, set_name, tuple(languages), "moments") if set_name else None
    with _MEMO_LOCK:
        if key is not None and key in _MOMENT_MEMO:
            return _MOMENT_MEMO[key]
    head = getattr(bundle, "moment_head", None)
    reports = evaluate_moment_set(bundle, moment_set, languages=languages, head=head)
    report = reports["head" if head is not None else "windows"]
    if key is not None:
        with _MEMO_LOCK:
            _MOMENT_MEMO[key] = report
            while len(_MOMENT_MEMO) > _MEMO_SIZE:
                _MOMENT_MEMO.popitem(last=False)
    return report


def judge_moments(candidate: dict[str, float], active: dict[str, float], thresholds: GateThresholds) -> list[str]:
    """The moment rule: reasons to reject (empty = pass)."""
    metric = thresholds.moment_metric
    if metric not in candidate or metric not in active:
        return []
    drop = active[metric] - candidate[metric]
    if drop <= thresholds.max_moment_drop + 1e-12:
        return []
    return [f"{metric} drops from {active[metric]:.4f} to {candidate[metric]:.4f} on the gate set's moment queries "
            f"(−{drop:.4f} > allowed {thresholds.max_moment_drop:.4f}, TONEARM_GATE_MAX_MOMENT_DROP)"]


def _compare_moments(candidate: Any, active: Any, found: GateSet, languages: Sequence[str],
                     thresholds: GateThresholds) -> tuple[list[str], dict[str, Any] | None]:
    """Reasons and the verdict's ``moments`` part: refused when the active answers moments and the candidate
    does not; both answers compared when both do and the gate set has moment queries in ``languages``."""
    if answers_moments(active) and not answers_moments(candidate):
        return [f"the active bundle {active.bundle_id} answers moment queries (/v1/search/moments) and the "
                "candidate has neither moment windows nor a moment head: after the swap the route would answer "
                f"409 no-moment-index; {FORCE_HINT}"], None
    moment_set = found.moments
    if moment_set is None or not answers_moments(candidate) or not answers_moments(active):
        return [], None
    asked = [lang for lang in languages if lang in moment_set.languages()]
    if not asked:
        return [], None
    cand = evaluate_moments(candidate, moment_set, asked)
    act = evaluate_moments(active, moment_set, asked, set_name=found.name)
    keys = (thresholds.moment_metric, *MOMENT_SHOWN)
    shown = {
        "metric": thresholds.moment_metric, "max_drop": thresholds.max_moment_drop,
        "candidate": {k: cand[k] for k in keys if k in cand}, "active": {k: act[k] for k in keys if k in act},
        "candidate_scorer": scorer_of(candidate), "active_scorer": scorer_of(active),
        "n_recordings": len(moment_set.recording_ids),
        "n_queries": sum(1 for q in moment_set.queries if q.lang in asked),
    }
    return judge_moments(cand, act, thresholds), shown


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
    moment_reasons, moments = _compare_moments(candidate, active, found, languages, thresholds)
    reasons += moment_reasons
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
        moments=moments,
    )
