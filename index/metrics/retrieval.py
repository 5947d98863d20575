"""Retrieval and cross-language consistency metrics (docs/metrics.md), pure numpy.

Scores are dot products of the embeddings as given (cosine for L2-normalized
embeddings). Conventions, stated once (see also docs/metrics.md and
``index.metrics.report.METRIC_CONVENTION``):

- Ranks are 1-based. **Ties are pessimistic**: every *non-relevant* item scoring
  at least as high as a relevant one ranks above it, so collapsed embeddings
  (all scores equal) get the worst rank, not a perfect one. Relevant items that
  tie with each other are ordered by caption index.
- text→audio (t2a): each caption is a query, its clip is the one relevant item,
  the gallery is every clip. audio→text (a2t): each clip is a query, its captions
  are relevant; R@k is a hit when any of them is in the top k.
- mAP@10 (t2a) = ``1/rank`` if rank ≤ 10 else 0. mAP@10 (a2t) =
  ``Σ_{j: r_j ≤ 10} j / r_j / min(n_captions, 10)`` over the sorted ranks ``r_j``.
- Per language: t2a uses that language's captions as queries against all clips;
  a2t searches only that language's captions, and a clip without a caption in
  that language is not a query for it. ``*_mean`` is the unweighted mean over
  the requested languages.
- MRV (ATRI Eq. 16, from CCRK) is the mean over query groups of the population
  variance across languages of the target's rank; the mean rank standard
  deviation is the mean of the per-group population standard deviations. A group
  uses the languages it has; groups with fewer than two are skipped.

Everything is computed in blocks of at most ``max_block_elements`` scores, so a
large gallery never materializes a full query × gallery matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

from index.errors import DataError
from index.languages import ENGLISH, validate_language_codes

DEFAULT_BLOCK_ELEMENTS = 1 << 22
"""Scores per block (4 Mi: 16 MB of float32 per temporary)."""

RECALL_KS: tuple[int, ...] = (1, 5, 10)
MAP_CUTOFF = 10
DIRECTIONS: tuple[str, ...] = ("t2a", "a2t")
RETRIEVAL_METRICS: tuple[str, ...] = ("R@1", "R@5", "R@10", "mAP@10")


# ---------------------------------------------------------------- validation


def _as_index_array(values: np.ndarray | Sequence[int], *, name: str, length: int) -> np.ndarray:
    """Return ``values`` as a 1-D int64 array of ``length`` items, or raise ValueError."""
    array = np.asarray(values)
    if array.ndim != 1 or array.shape[0] != length:
        raise ValueError(f"{name} must have shape ({length},), got {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


def _check_clip_ids(caption_clip: np.ndarray, n_clips: int) -> None:
    if caption_clip.size and (caption_clip.min() < 0 or caption_clip.max() >= n_clips):
        raise ValueError(f"caption_clip values must lie in [0, {n_clips}), the gallery's clip rows")


def _check_matrix(array: np.ndarray, *, name: str) -> np.ndarray:
    """Require a finite 2-D float array (NaN scores would silently rank as misses)."""
    array = np.asarray(array)
    if array.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.floating):
        array = array.astype(np.float64)
    if not np.isfinite(array).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    return array


def _row_blocks(n_rows: int, width: int, max_block_elements: int) -> Iterator[tuple[int, int]]:
    """Yield ``(start, stop)`` row ranges of at most ``max_block_elements`` cells."""
    rows = max(1, max_block_elements // max(width, 1))
    for start in range(0, n_rows, rows):
        yield start, min(start + rows, n_rows)


# ---------------------------------------------------------------- text→audio ranks


def _t2a_block_ranks(block: np.ndarray, clips: np.ndarray) -> np.ndarray:
    """Pessimistic ranks: count of clips scoring ≥ the target (the target counts itself)."""
    target = block[np.arange(block.shape[0]), clips]
    return np.count_nonzero(block >= target[:, None], axis=1).astype(np.int64)


def t2a_ranks(
    scores: np.ndarray,
    caption_clip: np.ndarray | Sequence[int],
    *,
    max_block_elements: int = DEFAULT_BLOCK_ELEMENTS,
) -> np.ndarray:
    """1-based rank of each caption's clip among all clips.

    Shapes: ``scores`` (Q, N) caption × clip, ``caption_clip`` (Q,) clip row of
    each caption → (Q,) int64. Ties are pessimistic: ``rank = 1 + #{other clips
    with score ≥ target}``.
    """
    scores = np.asarray(scores)
    if scores.ndim != 2:
        raise ValueError(f"scores must be 2-D (captions × clips), got shape {scores.shape}")
    n_captions, n_clips = scores.shape
    clips = _as_index_array(caption_clip, name="caption_clip", length=n_captions)
    _check_clip_ids(clips, n_clips)
    ranks = np.empty(n_captions, dtype=np.int64)
    for start, stop in _row_blocks(n_captions, n_clips, max_block_elements):
        block = _check_matrix(scores[start:stop], name="scores")
        ranks[start:stop] = _t2a_block_ranks(block, clips[start:stop])
    return ranks


def t2a_ranks_from_embeddings(
    text_emb: np.ndarray,
    audio_emb: np.ndarray,
    caption_clip: np.ndarray | Sequence[int],
    *,
    max_block_elements: int = DEFAULT_BLOCK_ELEMENTS,
) -> np.ndarray:
    """Same as :func:`t2a_ranks` with ``scores = text_emb @ audio_emb.T``, block by block.

    Shapes: ``text_emb`` (Q, d), ``audio_emb`` (N, d), ``caption_clip`` (Q,) → (Q,).
    """
    text_emb = _check_matrix(text_emb, name="text_emb")
    audio_emb = _check_matrix(audio_emb, name="audio_emb")
    clips = _as_index_array(caption_clip, name="caption_clip", length=text_emb.shape[0])
    _check_clip_ids(clips, audio_emb.shape[0])
    ranks = np.empty(text_emb.shape[0], dtype=np.int64)
    for start, stop in _row_blocks(text_emb.shape[0], audio_emb.shape[0], max_block_elements):
        block = text_emb[start:stop] @ audio_emb.T
        ranks[start:stop] = _t2a_block_ranks(block, clips[start:stop])
    return ranks


# ---------------------------------------------------------------- audio→text ranks


def _clip_blocks(
    counts: np.ndarray, width: int, max_block_elements: int
) -> Iterator[tuple[int, int]]:
    """Clip ranges whose captions × gallery width stay within the budget (≥ 1 clip each)."""
    budget = max(1, max_block_elements // max(width, 1))
    ends = np.cumsum(counts)
    start = 0
    while start < counts.shape[0]:
        before = ends[start - 1] if start else 0
        stop = int(np.searchsorted(ends, before + budget, side="right"))
        stop = min(max(stop, start + 1), start + budget, counts.shape[0])
        yield start, stop
        start = stop


def _irrelevant_at_least(
    rows: np.ndarray, captions: np.ndarray, caption_clip: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """For each caption (one row of its clip's scores): its score and #other clips' captions scoring ≥ it."""
    target = rows[np.arange(rows.shape[0]), captions]
    other_clip = caption_clip[None, :] != caption_clip[captions][:, None]
    count = np.count_nonzero((rows >= target[:, None]) & other_clip, axis=1)
    return target, count


def _group_sorted_ranks(
    target: np.ndarray, irrelevant: np.ndarray, caption_clip: np.ndarray, counts: np.ndarray
) -> list[np.ndarray]:
    """Order each clip's captions by score (ties by index): rank_j = j + #irrelevant ≥ score."""
    order = np.lexsort((np.arange(target.shape[0]), -target, caption_clip))
    group_start = np.repeat(np.cumsum(counts) - counts, counts)
    position = np.arange(order.shape[0]) - group_start + 1
    ranks = (position + irrelevant[order]).astype(np.int64)
    return np.split(ranks, np.cumsum(counts)[:-1])


def _a2t_ranks(
    clip_rows: Callable[[int, int], np.ndarray],
    n_clips: int,
    n_captions: int,
    caption_clip: np.ndarray,
    max_block_elements: int,
) -> list[np.ndarray]:
    """Shared a2t loop; ``clip_rows(start, stop)`` returns the (stop-start, Q) score block."""
    _check_clip_ids(caption_clip, n_clips)
    counts = np.bincount(caption_clip, minlength=n_clips)
    by_clip = np.argsort(caption_clip, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(counts)])
    target = np.empty(n_captions, dtype=np.float64)
    irrelevant = np.empty(n_captions, dtype=np.int64)
    for start, stop in _clip_blocks(counts, n_captions, max_block_elements):
        captions = by_clip[bounds[start] : bounds[stop]]
        if captions.size == 0:
            continue
        block = clip_rows(start, stop)
        rows = block[caption_clip[captions] - start]
        target[captions], irrelevant[captions] = _irrelevant_at_least(rows, captions, caption_clip)
    return _group_sorted_ranks(target, irrelevant, caption_clip, counts)


def a2t_ranks(
    scores: np.ndarray,
    caption_clip: np.ndarray | Sequence[int],
    *,
    max_block_elements: int = DEFAULT_BLOCK_ELEMENTS,
) -> list[np.ndarray]:
    """Sorted 1-based ranks of each clip's captions among all captions.

    Shapes: ``scores`` (N, Q) clip × caption, ``caption_clip`` (Q,) → a list of N
    int64 arrays (empty for a clip with no caption in the gallery). Ties are
    pessimistic against other clips' captions: the j-th best caption of a clip
    has ``rank = j + #{other clips' captions with score ≥ its score}``.
    """
    scores = np.asarray(scores)
    if scores.ndim != 2:
        raise ValueError(f"scores must be 2-D (clips × captions), got shape {scores.shape}")
    n_clips, n_captions = scores.shape
    clips = _as_index_array(caption_clip, name="caption_clip", length=n_captions)

    def clip_rows(start: int, stop: int) -> np.ndarray:
        return _check_matrix(scores[start:stop], name="scores")

    return _a2t_ranks(clip_rows, n_clips, n_captions, clips, max_block_elements)


def a2t_ranks_from_embeddings(
    audio_emb: np.ndarray,
    text_emb: np.ndarray,
    caption_clip: np.ndarray | Sequence[int],
    *,
    max_block_elements: int = DEFAULT_BLOCK_ELEMENTS,
) -> list[np.ndarray]:
    """Same as :func:`a2t_ranks` with ``scores = audio_emb @ text_emb.T``, block by block.

    Shapes: ``audio_emb`` (N, d), ``text_emb`` (Q, d), ``caption_clip`` (Q,).
    """
    audio_emb = _check_matrix(audio_emb, name="audio_emb")
    text_emb = _check_matrix(text_emb, name="text_emb")
    clips = _as_index_array(caption_clip, name="caption_clip", length=text_emb.shape[0])

    def clip_rows(start: int, stop: int) -> np.ndarray:
        return audio_emb[start:stop] @ text_emb.T

    return _a2t_ranks(clip_rows, audio_emb.shape[0], text_emb.shape[0], clips, max_block_elements)


# ---------------------------------------------------------------- recall and mAP@10


def _t2a_rank_array(ranks: np.ndarray | Sequence[int]) -> np.ndarray:
    array = np.asarray(ranks, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"ranks must be a non-empty 1-D array, got shape {array.shape}")
    if array.min() < 1:
        raise ValueError("ranks are 1-based; got a value below 1")
    return array


def _a2t_queries(ranks: Sequence[np.ndarray | Sequence[int]]) -> list[np.ndarray]:
    """The clips that are queries (at least one caption), each as sorted float ranks."""
    queries = [np.sort(np.asarray(r, dtype=np.float64)) for r in ranks if len(r)]
    if not queries:
        raise ValueError("no clip has a caption in the gallery: audio→text has no query")
    if min(float(q[0]) for q in queries) < 1:
        raise ValueError("ranks are 1-based; got a value below 1")
    return queries


def recall_at_k_t2a(ranks: np.ndarray | Sequence[int], k: int) -> float:
    """Fraction of caption queries whose clip ranks in the top ``k``."""
    return float(np.mean(_t2a_rank_array(ranks) <= k))


def recall_at_k_a2t(ranks: Sequence[np.ndarray | Sequence[int]], k: int) -> float:
    """Fraction of clip queries with at least one of their captions in the top ``k``."""
    return float(np.mean([q[0] <= k for q in _a2t_queries(ranks)]))


def map_at_10_t2a(ranks: np.ndarray | Sequence[int]) -> float:
    """Mean over caption queries of ``1/rank`` when rank ≤ 10, else 0 (one relevant clip)."""
    array = _t2a_rank_array(ranks)
    return float(np.mean(np.where(array <= MAP_CUTOFF, 1.0 / array, 0.0)))


def _average_precision_at_10(sorted_ranks: np.ndarray) -> float:
    """``Σ_{j: r_j ≤ 10} j / r_j`` over the sorted ranks, divided by ``min(n, 10)``."""
    position = np.arange(1, sorted_ranks.shape[0] + 1)
    hit = sorted_ranks <= MAP_CUTOFF
    return float(np.sum(position[hit] / sorted_ranks[hit]) / min(sorted_ranks.shape[0], MAP_CUTOFF))


def map_at_10_a2t(ranks: Sequence[np.ndarray | Sequence[int]]) -> float:
    """Mean over clip queries of AP@10 (the WavCaps / ML-CLAP convention, docs/metrics.md)."""
    return float(np.mean([_average_precision_at_10(q) for q in _a2t_queries(ranks)]))


# ---------------------------------------------------------------- consistency


def _eligible_rank_rows(ranks: np.ndarray) -> np.ndarray:
    """Rows of a (G, K) rank table (NaN = language missing) with ≥ 2 languages."""
    table = np.asarray(ranks, dtype=np.float64)
    if table.ndim != 2:
        raise ValueError(f"ranks must be a (groups, languages) table, got shape {table.shape}")
    rows = table[np.count_nonzero(np.isfinite(table), axis=1) >= 2]
    if rows.shape[0] == 0:
        raise ValueError("no query group has ranks in two or more languages")
    return rows


def mean_rank_variance(ranks: np.ndarray) -> float:
    """MRV (ATRI Eq. 16): mean over groups of the population variance across languages.

    ``ranks`` is a (G, K) table; NaN marks a language the group lacks. Each group
    uses the languages it has; groups with fewer than two are skipped.
    """
    return float(np.mean(np.nanvar(_eligible_rank_rows(ranks), axis=1)))


def mean_rank_std(ranks: np.ndarray) -> float:
    """Mean over groups of the population standard deviation across languages (CCRK)."""
    return float(np.mean(np.nanstd(_eligible_rank_rows(ranks), axis=1)))


def _paired(eng: np.ndarray, other: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    eng = _check_matrix(eng, name="eng")
    other = _check_matrix(other, name="other")
    if eng.shape != other.shape or eng.shape[0] == 0:
        raise ValueError(
            f"eng and other must be equal non-empty (n, d), got {eng.shape} and {other.shape}"
        )
    return eng, other


def gap(eng: np.ndarray, other: np.ndarray) -> float:
    """Embedding-space gap (ATRI Eq. 14): ``‖mean_i eng_i − mean_i other_i‖``; rows are translations."""
    eng, other = _paired(eng, other)
    return float(np.linalg.norm(eng.mean(axis=0) - other.mean(axis=0)))


def dis(eng: np.ndarray, other: np.ndarray) -> float:
    """Average embedding distance (ATRI Eq. 15): ``mean_i ‖eng_i − other_i‖``."""
    eng, other = _paired(eng, other)
    return float(np.mean(np.linalg.norm(eng - other, axis=1)))


# ---------------------------------------------------------------- the report


class _EvalSet(NamedTuple):
    audio: np.ndarray  # (N, d)
    text: np.ndarray  # (Q, d), captions of the requested languages only
    clip: np.ndarray  # (Q,)
    lang: np.ndarray  # (Q,) index into languages
    groups: np.ndarray  # (G, K) caption row of each group and language, -1 if missing


def _group_table(
    group: np.ndarray, lang: np.ndarray, clip: np.ndarray, n_languages: int
) -> np.ndarray:
    """(G, K) caption rows per query group and language; a group is one clip's translations."""
    _, group_index = np.unique(group, return_inverse=True)
    n_groups = int(group_index.max()) + 1
    table = np.full((n_groups, n_languages), -1, dtype=np.int64)
    cells = group_index * n_languages + lang
    if np.unique(cells).shape[0] != cells.shape[0]:
        raise DataError(
            "a query group has two captions in the same language; caption_group must "
            "pair each caption only with its translations"
        )
    if np.unique(np.stack([group_index, clip]), axis=1).shape[1] != n_groups:
        raise DataError("a query group spans several clips; translations must belong to one clip")
    table[group_index, lang] = np.arange(group.shape[0])
    return table


def _validated_eval_set(
    audio_emb: np.ndarray,
    text_emb: np.ndarray,
    caption_clip: np.ndarray | Sequence[int],
    caption_lang: np.ndarray | Sequence[str],
    caption_group: np.ndarray | Sequence[int],
    languages: Sequence[str],
) -> _EvalSet:
    """Check shapes and languages; keep the captions of the requested languages."""
    validate_language_codes(list(languages))
    audio = _check_matrix(audio_emb, name="audio_emb")
    text = _check_matrix(text_emb, name="text_emb")
    if audio.shape[1] != text.shape[1]:
        raise ValueError(
            f"audio_emb and text_emb dimensions differ: {audio.shape[1]} vs {text.shape[1]}"
        )
    n_captions = text.shape[0]
    clip = _as_index_array(caption_clip, name="caption_clip", length=n_captions)
    group = _as_index_array(caption_group, name="caption_group", length=n_captions)
    lang_codes = np.asarray(caption_lang).astype(str)
    if lang_codes.shape != (n_captions,):
        raise ValueError(f"caption_lang must have shape ({n_captions},), got {lang_codes.shape}")
    _check_clip_ids(clip, audio.shape[0])
    for code in languages:
        if not np.any(lang_codes == code):
            raise DataError(f"the evaluation set has no caption in language {code!r}")
    lookup = {code: k for k, code in enumerate(languages)}
    lang = np.array([lookup.get(code, -1) for code in lang_codes], dtype=np.int64)
    keep = lang >= 0
    table = _group_table(group[keep], lang[keep], clip[keep], len(languages))
    return _EvalSet(audio, text[keep], clip[keep], lang[keep], table)


def _t2a_metrics(lang: str, ranks: np.ndarray) -> dict[str, float]:
    """t2a R@1/5/10 and mAP@10 of one language, under the report's key names."""
    values = {f"t2a_R@{k}_{lang}": recall_at_k_t2a(ranks, k) for k in RECALL_KS}
    values[f"t2a_mAP@10_{lang}"] = map_at_10_t2a(ranks)
    return values


def _a2t_metrics(lang: str, ranks: list[np.ndarray]) -> dict[str, float]:
    """a2t R@1/5/10 and mAP@10 of one language, under the report's key names."""
    values = {f"a2t_R@{k}_{lang}": recall_at_k_a2t(ranks, k) for k in RECALL_KS}
    values[f"a2t_mAP@10_{lang}"] = map_at_10_a2t(ranks)
    return values


def _language_means(report: dict[str, float], languages: Sequence[str]) -> dict[str, float]:
    return {
        f"{direction}_{metric}_mean": float(
            np.mean([report[f"{direction}_{metric}_{lang}"] for lang in languages])
        )
        for direction in DIRECTIONS
        for metric in RETRIEVAL_METRICS
    }


def _rank_consistency(direction: str, table: np.ndarray) -> dict[str, float]:
    """MRV and mean rank std of a (groups, languages) table; empty when no group has 2 languages."""
    if not np.any(np.count_nonzero(np.isfinite(table), axis=1) >= 2):
        return {}
    return {
        f"mrv_{direction}": mean_rank_variance(table),
        f"mean_rank_std_{direction}": mean_rank_std(table),
    }


def _t2a_group_ranks(groups: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """(G, K) rank of the group's clip for each language's caption; NaN where missing."""
    return np.where(groups >= 0, ranks[np.maximum(groups, 0)], np.nan)


def _embedding_consistency(data: _EvalSet, languages: Sequence[str]) -> dict[str, float]:
    """Gap and Dis of every non-English language against English over shared groups."""
    if ENGLISH not in languages:
        return {}
    eng_rows = data.groups[:, list(languages).index(ENGLISH)]
    values: dict[str, float] = {}
    for k, lang in enumerate(languages):
        both = (eng_rows >= 0) & (data.groups[:, k] >= 0)
        if lang == ENGLISH or not both.any():
            continue
        eng, other = data.text[eng_rows[both]], data.text[data.groups[both, k]]
        values[f"gap_{lang}"], values[f"dis_{lang}"] = gap(eng, other), dis(eng, other)
    return values


def retrieval_report(
    *,
    audio_emb: np.ndarray,
    text_emb: np.ndarray,
    caption_clip: np.ndarray | Sequence[int],
    caption_lang: np.ndarray | Sequence[str],
    caption_group: np.ndarray | Sequence[int],
    languages: Sequence[str],
    max_block_elements: int = DEFAULT_BLOCK_ELEMENTS,
) -> dict[str, float]:
    """Every metric (docs/metrics.md) of one evaluation set as a flat dict of floats.

    Keys: ``{t2a|a2t}_{R@1|R@5|R@10|mAP@10}_{lang|mean}`` (fractions in [0, 1]),
    ``mrv_t2a``, ``mrv_a2t``, ``mean_rank_std_t2a``, ``mean_rank_std_a2t``,
    ``gap_{lang}``, ``dis_{lang}`` (non-English languages), ``n_clips``,
    ``n_captions``. Consistency keys are omitted when undefined: MRV/std when no
    query group has two languages (e.g. a monolingual set), Gap/Dis when English
    is not evaluated or shares no query group with that language.

    Shapes: ``audio_emb`` (N, d) (row = clip id), ``text_emb`` (Q, d),
    ``caption_clip`` / ``caption_lang`` / ``caption_group`` (Q,). Captions in
    languages outside ``languages`` are ignored. Raises ``DataError`` when a
    requested language has no caption or groups are inconsistent, ValueError
    for malformed arrays.
    """
    data = _validated_eval_set(
        audio_emb, text_emb, caption_clip, caption_lang, caption_group, languages
    )
    t2a = t2a_ranks_from_embeddings(
        data.text, data.audio, data.clip, max_block_elements=max_block_elements
    )
    report: dict[str, float] = {}
    a2t_best = np.full((data.audio.shape[0], len(languages)), np.nan)
    for k, lang in enumerate(languages):
        mine = data.lang == k
        report.update(_t2a_metrics(lang, t2a[mine]))
        a2t = a2t_ranks_from_embeddings(
            data.audio, data.text[mine], data.clip[mine], max_block_elements=max_block_elements
        )
        report.update(_a2t_metrics(lang, a2t))
        a2t_best[:, k] = [float(r[0]) if r.size else np.nan for r in a2t]
    report.update(_language_means(report, languages))
    report.update(_rank_consistency("t2a", _t2a_group_ranks(data.groups, t2a)))
    report.update(_rank_consistency("a2t", a2t_best))
    report.update(_embedding_consistency(data, languages))
    report["n_clips"] = float(data.audio.shape[0])
    report["n_captions"] = float(data.text.shape[0])
    return report
