"""Hand-computed checks of index.metrics.retrieval (SPEC §5)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from index.metrics.retrieval import (
    a2t_ranks,
    a2t_ranks_from_embeddings,
    dis,
    gap,
    map_at_10_a2t,
    map_at_10_t2a,
    mean_rank_std,
    mean_rank_variance,
    recall_at_k_a2t,
    recall_at_k_t2a,
    retrieval_report,
    t2a_ranks,
    t2a_ranks_from_embeddings,
)
from tonearm.errors import DataError

# ---------------------------------------------------------------- the worked example
#
# 3 clips, 6 captions; caption q belongs to clip q // 2; even captions are English,
# odd ones their French translations (query group = q // 2).
# SCORES[q, c] = similarity of caption q and clip c.
SCORES = np.array(
    [
        [0.90, 0.10, 0.25],  # q0 eng, clip 0
        [0.30, 0.75, 0.40],  # q1 fra, clip 0
        [0.60, 0.70, 0.10],  # q2 eng, clip 1
        [0.80, 0.20, 0.15],  # q3 fra, clip 1
        [0.35, 0.30, 0.20],  # q4 eng, clip 2
        [0.00, 0.05, 0.95],  # q5 fra, clip 2
    ]
)
CLIP = np.array([0, 0, 1, 1, 2, 2])
LANG = np.array(["eng", "fra", "eng", "fra", "eng", "fra"])
GROUP = np.array([0, 0, 1, 1, 2, 2])

# text→audio, rank = 1 + #clips scoring higher than the caption's clip:
#   q0: 0.90 beats 0.10, 0.25          -> 1
#   q1: 0.30 < 0.75, 0.40              -> 3
#   q2: 0.70 beats 0.60, 0.10          -> 1
#   q3: 0.20 < 0.80 (> 0.15)           -> 2
#   q4: 0.20 < 0.35, 0.30              -> 3
#   q5: 0.95 beats both                -> 1
T2A_RANKS = [1, 3, 1, 2, 3, 1]
# R@1 = 3/6; R@5 = R@10 = 1 (only 3 clips).
# mAP@10 = mean(1, 1/3, 1, 1/2, 1/3, 1) = (3 + 2/3 + 1/2) / 6 = 25/36.
#
# audio→text over all 6 captions (a column of SCORES is a clip's row):
#   clip 0: q0 .90, q3 .80, q2 .60, q4 .35, q1 .30, q5 .00 -> own q0, q1 at [1, 5]
#   clip 1: q1 .75, q2 .70, q4 .30, q3 .20, q0 .10, q5 .05 -> own q2, q3 at [2, 4]
#   clip 2: q5 .95, q1 .40, q0 .25, q4 .20, q3 .15, q2 .10 -> own q4, q5 at [1, 4]
A2T_RANKS = [[1, 5], [2, 4], [1, 4]]
# R@1 = best ranks (1, 2, 1) -> 2/3; R@5 = 1.
# AP@10: clip 0 (1/1 + 2/5)/2 = 0.7; clip 1 (1/2 + 2/4)/2 = 0.5; clip 2 (1/1 + 2/4)/2 = 0.75
# mAP@10 = (0.7 + 0.5 + 0.75)/3 = 0.65.


def test_worked_example_text_to_audio() -> None:
    ranks = t2a_ranks(SCORES, CLIP)
    assert ranks.tolist() == T2A_RANKS
    assert recall_at_k_t2a(ranks, 1) == pytest.approx(0.5)
    assert recall_at_k_t2a(ranks, 2) == pytest.approx(4 / 6)
    assert recall_at_k_t2a(ranks, 5) == pytest.approx(1.0)
    assert recall_at_k_t2a(ranks, 10) == pytest.approx(1.0)
    assert map_at_10_t2a(ranks) == pytest.approx(25 / 36)


def test_worked_example_audio_to_text_multi_caption() -> None:
    ranks = a2t_ranks(SCORES.T, CLIP)
    assert [r.tolist() for r in ranks] == A2T_RANKS
    assert recall_at_k_a2t(ranks, 1) == pytest.approx(2 / 3)
    assert recall_at_k_a2t(ranks, 2) == pytest.approx(1.0)
    assert recall_at_k_a2t(ranks, 5) == pytest.approx(1.0)
    assert map_at_10_a2t(ranks) == pytest.approx(0.65)


def test_worked_example_report_per_language() -> None:
    # audio_emb = identity, text_emb = SCORES  =>  text_emb @ audio_emb.T == SCORES.
    report = retrieval_report(
        audio_emb=np.eye(3),
        text_emb=SCORES,
        caption_clip=CLIP,
        caption_lang=LANG,
        caption_group=GROUP,
        languages=["eng", "fra"],
    )
    # t2a eng: q0, q2, q4 -> ranks 1, 1, 3: R@1 2/3, mAP (1 + 1 + 1/3)/3 = 7/9.
    # t2a fra: q1, q3, q5 -> ranks 3, 2, 1: R@1 1/3, mAP (1/3 + 1/2 + 1)/3 = 11/18.
    assert report["t2a_R@1_eng"] == pytest.approx(2 / 3)
    assert report["t2a_mAP@10_eng"] == pytest.approx(7 / 9)
    assert report["t2a_R@1_fra"] == pytest.approx(1 / 3)
    assert report["t2a_mAP@10_fra"] == pytest.approx(11 / 18)
    # a2t eng searches only q0, q2, q4:
    #   clip 0: q0 .90 q2 .60 q4 .35 -> 1;  clip 1: q2 .70 q4 .30 q0 .10 -> 1;
    #   clip 2: q4 .20 after q0 .25 -> 2.   R@1 2/3, mAP (1 + 1 + 1/2)/3 = 5/6.
    # a2t fra searches only q1, q3, q5:
    #   clip 0: q3 .80 > q1 .30 -> 2;  clip 1: q1 .75 > q3 .20 -> 2;  clip 2: q5 .95 -> 1.
    #   R@1 1/3, mAP (1/2 + 1/2 + 1)/3 = 2/3.  (In the full gallery clip 0's q1 was 5th.)
    assert report["a2t_R@1_eng"] == pytest.approx(2 / 3)
    assert report["a2t_R@5_eng"] == pytest.approx(1.0)
    assert report["a2t_mAP@10_eng"] == pytest.approx(5 / 6)
    assert report["a2t_R@1_fra"] == pytest.approx(1 / 3)
    assert report["a2t_mAP@10_fra"] == pytest.approx(2 / 3)
    # means over the two languages
    assert report["t2a_R@1_mean"] == pytest.approx(0.5)
    assert report["t2a_mAP@10_mean"] == pytest.approx((7 / 9 + 11 / 18) / 2)
    assert report["a2t_R@1_mean"] == pytest.approx(0.5)
    assert report["a2t_mAP@10_mean"] == pytest.approx((5 / 6 + 2 / 3) / 2)
    # MRV t2a: groups (eng, fra) ranks (1, 3) var 1, (1, 2) var 1/4, (3, 1) var 1.
    assert report["mrv_t2a"] == pytest.approx((1 + 0.25 + 1) / 3)
    assert report["mean_rank_std_t2a"] == pytest.approx((1 + 0.5 + 1) / 3)
    # MRV a2t: clips' per-language best ranks (1, 2), (1, 2), (2, 1): variance 1/4 each.
    assert report["mrv_a2t"] == pytest.approx(0.25)
    assert report["mean_rank_std_a2t"] == pytest.approx(0.5)
    # Gap/Dis pair each English caption with its French translation.
    assert report["gap_fra"] == pytest.approx(gap(SCORES[0::2], SCORES[1::2]))
    assert report["dis_fra"] == pytest.approx(dis(SCORES[0::2], SCORES[1::2]))
    assert "gap_eng" not in report and "dis_eng" not in report
    assert report["n_clips"] == 3.0 and report["n_captions"] == 6.0


def test_report_has_exactly_the_shared_api_keys() -> None:
    report = retrieval_report(
        audio_emb=np.eye(3),
        text_emb=SCORES,
        caption_clip=CLIP,
        caption_lang=LANG,
        caption_group=GROUP,
        languages=["eng", "fra"],
    )
    expected = {
        f"{d}_{m}_{lang}"
        for d in ("t2a", "a2t")
        for m in ("R@1", "R@5", "R@10", "mAP@10")
        for lang in ("eng", "fra", "mean")
    }
    expected |= {"mrv_t2a", "mrv_a2t", "mean_rank_std_t2a", "mean_rank_std_a2t"}
    expected |= {"gap_fra", "dis_fra", "n_clips", "n_captions"}
    assert set(report) == expected
    assert all(isinstance(v, float) for v in report.values())


# ---------------------------------------------------------------- mAP@10 cut-off and cap


def test_a_caption_ranked_11th_contributes_zero_to_map() -> None:
    # One clip with two captions among 12: its captions sit at positions 3 and 11.
    row = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.0, -0.1])
    caption_clip = np.array([1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1])  # clip 0 owns q2 and q10
    scores = np.stack([row, np.zeros(12)])  # clip 1's row does not matter here
    ranks = a2t_ranks(scores, caption_clip)
    assert ranks[0].tolist() == [3, 11]
    # AP@10 = (1/3 + [11 > 10: 0]) / min(2, 10) = 1/6
    assert map_at_10_a2t([ranks[0]]) == pytest.approx(1 / 6)
    assert recall_at_k_a2t([ranks[0]], 1) == 0.0
    assert recall_at_k_a2t([ranks[0]], 5) == 1.0
    # Same cut-off for text→audio: rank 11 scores 0, rank 10 scores 1/10.
    assert map_at_10_t2a([10, 11]) == pytest.approx((0.1 + 0.0) / 2)


def test_map_a2t_divides_by_caption_count_capped_at_10() -> None:
    # 12 captions at ranks 1..12: Σ_{j ≤ 10} j/j = 10, divided by min(12, 10) -> 1.0
    assert map_at_10_a2t([np.arange(1, 13)]) == pytest.approx(1.0)
    # 5 captions (Clotho) at ranks 1, 2, 4, 8, 20: (1 + 1 + 3/4 + 4/8 + 0)/5 = 0.65
    assert map_at_10_a2t([[20, 1, 8, 2, 4]]) == pytest.approx(0.65)


# ---------------------------------------------------------------- ties


def test_ties_are_pessimistic_for_text_to_audio() -> None:
    scores = np.array([[0.5, 0.5, 0.2], [0.5, 0.5, 0.2], [0.3, 0.3, 0.3]])
    # q0 -> clip 0 ties with clip 1: rank 2 (not 1); q1 -> clip 1: 2; q2 -> clip 2: 3.
    assert t2a_ranks(scores, [0, 1, 2]).tolist() == [2, 2, 3]


def test_ties_for_audio_to_text() -> None:
    # Clip 0 owns q0 and q1 (both 0.7); q2 (other clip) also 0.7, q3 (other clip) 0.9.
    # Sorted own captions: q0 (j=1), q1 (j=2, tie broken by index).
    # rank_j = j + #other-clip captions scoring >= 0.7 (q2, q3) = j + 2 -> [3, 4].
    scores = np.array([[0.7, 0.7, 0.7, 0.9], [0.0, 0.0, 1.0, 1.0]])
    ranks = a2t_ranks(scores, [0, 0, 1, 1])
    assert ranks[0].tolist() == [3, 4]
    # Clip 1: q2 and q3 both 1.0, nothing else >= 1.0 -> [1, 2].
    assert ranks[1].tolist() == [1, 2]


def test_collapsed_embeddings_get_the_worst_rank() -> None:
    audio = np.ones((4, 2))
    text = np.ones((4, 2))
    ranks = t2a_ranks_from_embeddings(text, audio, [0, 1, 2, 3])
    assert ranks.tolist() == [4, 4, 4, 4]
    assert recall_at_k_t2a(ranks, 1) == 0.0


# ---------------------------------------------------------------- rank consistency


def test_mean_rank_variance_by_hand() -> None:
    assert mean_rank_variance(np.array([[1, 3]])) == pytest.approx(1.0)
    assert mean_rank_variance(np.array([[2, 2, 2]])) == 0.0
    # mean of 1.0 and 0.0
    assert mean_rank_variance(np.array([[1, 3], [2, 2]])) == pytest.approx(0.5)
    # (1, 2, 3): mean 2, deviations -1, 0, 1 -> population variance 2/3 (not 1)
    assert mean_rank_variance(np.array([[1, 2, 3]])) == pytest.approx(2 / 3)


def test_mean_rank_std_by_hand() -> None:
    assert mean_rank_std(np.array([[1, 3]])) == pytest.approx(1.0)
    # stds 1 and 2 -> 1.5 (while MRV is (1 + 4)/2 = 2.5)
    assert mean_rank_std(np.array([[1, 3], [1, 5]])) == pytest.approx(1.5)
    assert mean_rank_variance(np.array([[1, 3], [1, 5]])) == pytest.approx(2.5)


def test_rank_consistency_uses_present_languages_and_skips_single_language_groups() -> None:
    nan = np.nan
    table = np.array([[1, 3, nan], [5, nan, nan], [2, 2, 2]])
    # row 0 uses (1, 3) -> 1; row 1 has one language -> skipped; row 2 -> 0
    assert mean_rank_variance(table) == pytest.approx(0.5)
    assert mean_rank_std(table) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="two or more languages"):
        mean_rank_variance(np.array([[1.0, nan], [nan, 4.0]]))


def test_report_handles_groups_lacking_a_language() -> None:
    # The worked example plus a German caption q6 for group 0 only (clip 0).
    text = np.vstack([SCORES, [0.5, 0.6, 0.1]])
    report = retrieval_report(
        audio_emb=np.eye(3),
        text_emb=text,
        caption_clip=np.append(CLIP, 0),
        caption_lang=np.append(LANG, "deu"),
        caption_group=np.append(GROUP, 0),
        languages=["eng", "fra", "deu"],
    )
    # t2a: q6 ranks clip 0 (0.5) below clip 1 (0.6) -> 2.
    # Group 0 ranks (1, 3, 2): variance 2/3, std sqrt(2/3); groups 1, 2 as before.
    assert report["mrv_t2a"] == pytest.approx((2 / 3 + 0.25 + 1) / 3)
    assert report["mean_rank_std_t2a"] == pytest.approx((math.sqrt(2 / 3) + 0.5 + 1) / 3)
    # a2t deu: the gallery is q6 alone; only clip 0 has a German caption -> one query, rank 1.
    assert report["a2t_R@1_deu"] == 1.0
    assert report["t2a_R@1_deu"] == 0.0
    # a2t best ranks per clip: clip 0 (eng 1, fra 2, deu 1): mean 4/3, variance 2/9;
    # clips 1 and 2 have only eng/fra: 1/4 each.
    assert report["mrv_a2t"] == pytest.approx((2 / 9 + 0.25 + 0.25) / 3)
    # Gap/Dis deu: only group 0 has both English and German.
    assert report["gap_deu"] == pytest.approx(np.linalg.norm(SCORES[0] - text[6]))
    assert report["dis_deu"] == pytest.approx(report["gap_deu"])
    assert report["t2a_R@1_mean"] == pytest.approx((2 / 3 + 1 / 3 + 0) / 3)


def test_monolingual_report_omits_rank_consistency() -> None:
    report = retrieval_report(
        audio_emb=np.eye(3),
        text_emb=SCORES,
        caption_clip=CLIP,
        caption_lang=LANG,
        caption_group=GROUP,
        languages=["eng"],
    )
    assert report["n_captions"] == 3.0  # French captions are ignored
    assert report["t2a_R@1_mean"] == pytest.approx(report["t2a_R@1_eng"])
    assert not any(key.startswith(("mrv", "mean_rank_std", "gap", "dis")) for key in report)


# ---------------------------------------------------------------- Gap / Dis


def test_gap_and_dis_by_hand() -> None:
    eng = np.array([[3.0, 0.0], [0.0, 4.0]])
    other = np.zeros((2, 2))
    # mean eng = (1.5, 2) -> ‖(1.5, 2)‖ = 2.5; distances 3 and 4 -> 3.5
    assert gap(eng, other) == pytest.approx(2.5)
    assert dis(eng, other) == pytest.approx(3.5)
    # A shift by a constant vector: gap == dis == ‖shift‖.
    shifted = eng + np.array([0.0, 1.0])
    assert gap(eng, shifted) == pytest.approx(1.0)
    assert dis(eng, shifted) == pytest.approx(1.0)
    # Swapping the pairing changes Dis but not Gap.
    other = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert gap(eng, other) == pytest.approx(gap(eng, other[::-1]))
    assert dis(eng, other) == pytest.approx(2.5)  # ‖(2, 0)‖ = 2 and ‖(0, 3)‖ = 3
    # ‖(3, -1)‖ = √10 and ‖(-1, 4)‖ = √17
    assert dis(eng, other[::-1]) == pytest.approx((math.sqrt(10) + math.sqrt(17)) / 2)


# ---------------------------------------------------------------- perfect and random


def _multilingual_set(n_clips: int, per_clip: int, languages: list[str]):
    """Caption arrays with ``per_clip`` groups per clip, each group in every language."""
    n_groups = n_clips * per_clip
    clip = np.repeat(np.arange(n_clips), per_clip * len(languages))
    group = np.repeat(np.arange(n_groups), len(languages))
    lang = np.tile(np.array(languages), n_groups)
    return clip, lang, group


def test_perfect_embeddings() -> None:
    languages = ["eng", "fra", "deu"]
    clip, lang, group = _multilingual_set(20, 2, languages)
    audio = np.eye(20)
    report = retrieval_report(
        audio_emb=audio,
        text_emb=audio[clip],
        caption_clip=clip,
        caption_lang=lang,
        caption_group=group,
        languages=languages,
    )
    for direction in ("t2a", "a2t"):
        for lang_key in [*languages, "mean"]:
            assert report[f"{direction}_R@1_{lang_key}"] == 1.0
            assert report[f"{direction}_mAP@10_{lang_key}"] == pytest.approx(1.0)
        assert report[f"mrv_{direction}"] == 0.0
        assert report[f"mean_rank_std_{direction}"] == 0.0
    assert report["gap_fra"] == 0.0 and report["dis_deu"] == 0.0


def test_random_embeddings_have_chance_recall() -> None:
    rng = np.random.default_rng(7)
    n_clips, per_clip, dim = 200, 5, 32
    clip = np.repeat(np.arange(n_clips), per_clip)
    n_captions = clip.shape[0]
    audio = rng.standard_normal((n_clips, dim))
    text = rng.standard_normal((n_captions, dim))
    t2a = t2a_ranks_from_embeddings(text, audio, clip)
    # Each caption's clip is uniformly ranked among 200: R@10 = 10/200 = 0.05 (sd ≈ 0.003).
    assert recall_at_k_t2a(t2a, 10) == pytest.approx(10 / n_clips, abs=0.015)
    assert recall_at_k_t2a(t2a, 1) == pytest.approx(1 / n_clips, abs=0.005)
    # a2t: P(some of 5 captions in the top 10 of 1000) = 1 - Π_{i<10} (995 - i)/(1000 - i).
    miss = np.prod([(n_captions - per_clip - i) / (n_captions - i) for i in range(10)])
    a2t = a2t_ranks_from_embeddings(audio, text, clip)
    assert recall_at_k_a2t(a2t, 10) == pytest.approx(1 - miss, abs=0.04)
    # Mean rank is (N + 1)/2 for t2a under chance.
    assert float(np.mean(t2a)) == pytest.approx((n_clips + 1) / 2, rel=0.05)


# ---------------------------------------------------------------- chunked == unchunked


def _argsort_t2a(scores: np.ndarray, clip: np.ndarray) -> np.ndarray:
    """Reference: position of the clip in the full descending argsort (no ties here)."""
    order = np.argsort(-scores, axis=1)
    return np.array([int(np.nonzero(order[q] == clip[q])[0][0]) + 1 for q in range(len(clip))])


def _argsort_a2t(scores: np.ndarray, clip: np.ndarray) -> list[list[int]]:
    order = np.argsort(-scores, axis=1)
    return [
        sorted(int(p) + 1 for p in np.nonzero(clip[order[c]] == c)[0]) for c in range(len(scores))
    ]


def test_chunked_equals_unchunked_and_argsort_reference() -> None:
    rng = np.random.default_rng(3)
    n_clips, dim = 37, 8
    clip = rng.integers(0, n_clips - 2, size=150)  # the last two clips have no caption
    audio = rng.standard_normal((n_clips, dim))
    text = rng.standard_normal((150, dim))
    scores = text @ audio.T
    reference_t2a = _argsort_t2a(scores, clip)
    reference_a2t = _argsort_a2t(scores.T, clip)
    for budget in (1, 7, 100, 1 << 22):
        assert t2a_ranks(scores, clip, max_block_elements=budget).tolist() == reference_t2a.tolist()
        assert t2a_ranks_from_embeddings(text, audio, clip, max_block_elements=budget).tolist() == (
            reference_t2a.tolist()
        )
        for ranks in (
            a2t_ranks(scores.T, clip, max_block_elements=budget),
            a2t_ranks_from_embeddings(audio, text, clip, max_block_elements=budget),
        ):
            assert [r.tolist() for r in ranks] == reference_a2t
    assert reference_a2t[-1] == [] and reference_a2t[-2] == []


def test_report_is_independent_of_block_size() -> None:
    rng = np.random.default_rng(5)
    languages = ["eng", "fra", "jpn"]
    clip, lang, group = _multilingual_set(30, 3, languages)
    audio = rng.standard_normal((30, 16))
    text = audio[clip] + 1.5 * rng.standard_normal((clip.shape[0], 16))
    kwargs = {
        "audio_emb": audio,
        "text_emb": text,
        "caption_clip": clip,
        "caption_lang": lang,
        "caption_group": group,
        "languages": languages,
    }
    small = retrieval_report(**kwargs, max_block_elements=50)
    large = retrieval_report(**kwargs)
    assert small.keys() == large.keys()
    for key in large:
        assert small[key] == pytest.approx(large[key], rel=1e-12), key


# ---------------------------------------------------------------- bad input


def test_bad_input_is_rejected_with_a_clear_message() -> None:
    base = {
        "audio_emb": np.eye(3),
        "text_emb": SCORES,
        "caption_clip": CLIP,
        "caption_lang": LANG,
        "caption_group": GROUP,
        "languages": ["eng", "fra"],
    }
    with pytest.raises(DataError, match="no caption in language 'deu'"):
        retrieval_report(**{**base, "languages": ["eng", "deu"]})
    with pytest.raises(DataError, match="same language"):
        retrieval_report(**{**base, "caption_group": [0, 0, 0, 1, 2, 2]})
    with pytest.raises(DataError, match="spans several clips"):
        retrieval_report(**{**base, "caption_group": [0, 1, 1, 2, 3, 3]})
    with pytest.raises(ValueError, match="caption_clip"):
        retrieval_report(**{**base, "caption_clip": [0, 0, 1, 1, 2, 3]})
    with pytest.raises(ValueError, match="caption_clip must have shape"):
        retrieval_report(**{**base, "caption_clip": [0, 0, 1]})
    with pytest.raises(ValueError, match="NaN"):
        retrieval_report(**{**base, "text_emb": np.where(SCORES > 0.9, np.nan, SCORES)})
    with pytest.raises(ValueError, match="ISO 639-3"):
        retrieval_report(**{**base, "languages": ["en", "fra"]})
    with pytest.raises(ValueError, match="1-based"):
        recall_at_k_t2a([0, 1], 1)
