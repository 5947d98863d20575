"""Paired comparison of two models on one evaluation set: per-query values and a bootstrap interval.

A retrieval metric of docs/metrics.md (``{t2a|a2t}_{R@k|mAP@10}_mean``) is the unweighted
mean over languages of a per-language mean over queries. Both models answer the **same**
queries, so the difference of their metrics is estimated from the paired per-query
differences, and its sampling uncertainty from a *paired cluster bootstrap* (Efron &
Tibshirani 1993, ch. 6 and 13; the paired form for retrieval evaluation is Sakai 2006,
"Evaluating evaluation metrics based on the bootstrap"):

- the resampled unit is the **clip** — a clip's captions, their translations and its own
  audio→text query are correlated, so they are drawn together;
- for a draw of clip counts ``w`` (multinomial, n clips with replacement) the metric of a
  model is ``mean_l  Σ_c w_c S[c, l] / Σ_c w_c N[c, l]`` where ``S[c, l]`` is the sum of the
  per-query values of clip ``c``'s queries in language ``l`` and ``N[c, l]`` their count —
  with ``w = 1`` this is exactly the metric of :func:`index.metrics.retrieval.retrieval_report`;
- the interval is the percentile interval of ``metric(candidate) − metric(reference)`` over
  the draws. The generator is seeded, so an interval (and a gate verdict) is reproducible.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from index.metrics.retrieval import (
    MAP_CUTOFF,
    _average_precision_at_10,
    a2t_ranks_from_embeddings,
    t2a_ranks_from_embeddings,
)

METRIC = re.compile(r"^(?P<direction>t2a|a2t)_(?P<name>R@(?P<k>\d+)|mAP@10)_mean$")


@dataclass(frozen=True)
class QueryTable:
    """Per-clip, per-language sums ``S`` and counts ``N`` (both (clips, languages)) of one metric."""

    sums: np.ndarray
    counts: np.ndarray

    def metric(self) -> float:
        return float(np.mean(self.sums.sum(axis=0) / self.counts.sum(axis=0)))


@dataclass(frozen=True)
class PairedInterval:
    """``delta`` = candidate − reference on the full set; [low, high] its bootstrap interval."""

    delta: float
    low: float
    high: float
    confidence: float
    samples: int
    seed: int
    unit: str = "clip"


def supported(metric: str) -> bool:
    return METRIC.match(metric) is not None


def query_table(
    metric: str,
    *,
    audio_emb: np.ndarray,
    text_emb: np.ndarray,
    caption_clip: np.ndarray,
    caption_lang: np.ndarray,
    languages: Sequence[str],
) -> QueryTable:
    """The per-query values of ``metric`` (e.g. ``t2a_R@10_mean``) gathered per clip and language.

    Captions outside ``languages`` must already be removed (the rows of ``text_emb``)."""
    match = METRIC.match(metric)
    if match is None:
        raise ValueError(f"{metric!r}: not a per-query retrieval metric ({{t2a|a2t}}_{{R@k|mAP@10}}_mean)")
    k = int(match["k"]) if match["k"] else None
    n = audio_emb.shape[0]
    clip = np.asarray(caption_clip, dtype=np.int64)
    lang = np.asarray(caption_lang).astype(str)
    sums = np.zeros((n, len(languages)))
    counts = np.zeros((n, len(languages)))
    if match["direction"] == "t2a":
        ranks = t2a_ranks_from_embeddings(text_emb, audio_emb, clip).astype(np.float64)
        values = ranks <= k if k is not None else np.where(ranks <= MAP_CUTOFF, 1.0 / ranks, 0.0)
        for j, code in enumerate(languages):
            mine = lang == code
            np.add.at(sums[:, j], clip[mine], values[mine])
            np.add.at(counts[:, j], clip[mine], 1.0)
        return QueryTable(sums, counts)
    for j, code in enumerate(languages):
        mine = lang == code
        for c, ranks_c in enumerate(a2t_ranks_from_embeddings(audio_emb, text_emb[mine], clip[mine])):
            if len(ranks_c):
                r = np.sort(np.asarray(ranks_c, dtype=np.float64))
                sums[c, j] = float(r[0] <= k) if k is not None else _average_precision_at_10(r)
                counts[c, j] = 1.0
    return QueryTable(sums, counts)


def paired_bootstrap(
    candidate: QueryTable, reference: QueryTable, *, samples: int, confidence: float, seed: int
) -> PairedInterval:
    """Percentile interval of ``metric(candidate) − metric(reference)``, resampling clips."""
    if candidate.counts.shape != reference.counts.shape or not np.array_equal(candidate.counts, reference.counts):
        raise ValueError("the two tables must count the same queries (a paired comparison)")
    n = candidate.counts.shape[0]
    rng = np.random.default_rng(seed)
    weights = rng.multinomial(n, np.full(n, 1.0 / n), size=samples).astype(np.float64)  # (B, n)
    counts = weights @ candidate.counts  # (B, L)
    diff = candidate.sums - reference.sums
    with np.errstate(invalid="ignore", divide="ignore"):
        per_language = (weights @ diff) / counts
    # a draw that misses every query of a language has no value for it: average the others
    deltas = np.nanmean(per_language, axis=1)
    deltas = deltas[np.isfinite(deltas)]
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(deltas, [alpha, 1.0 - alpha])
    return PairedInterval(
        delta=candidate.metric() - reference.metric(), low=float(low), high=float(high),
        confidence=confidence, samples=samples, seed=seed,
    )
