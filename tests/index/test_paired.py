"""Per-query tables reproduce the report's metrics; the paired bootstrap is seeded and paired."""

from __future__ import annotations

import numpy as np
import pytest

from index.metrics.paired import paired_bootstrap, query_table, supported
from index.metrics.retrieval import retrieval_report

LANGS = ["eng", "fra", "jpn"]


def _set(rng: np.random.Generator, n: int = 40, captions: int = 2, noise: float = 1.0):
    d = 16
    audio = rng.normal(size=(n, d)).astype(np.float32)
    clip = np.repeat(np.arange(n), captions * len(LANGS))
    lang = np.tile(np.repeat(LANGS, captions), n)
    group = clip * captions + np.tile(np.arange(captions), n * len(LANGS))  # translations share a group
    text = audio[clip] + noise * rng.normal(size=(len(clip), d)).astype(np.float32)
    return audio, text, clip, lang, group


@pytest.mark.parametrize("metric", ["t2a_R@1_mean", "t2a_R@10_mean", "t2a_mAP@10_mean",
                                    "a2t_R@1_mean", "a2t_R@5_mean", "a2t_mAP@10_mean"])
def test_table_metric_equals_the_reports(metric):
    audio, text, clip, lang, group = _set(np.random.default_rng(0))
    report = retrieval_report(audio_emb=audio, text_emb=text, caption_clip=clip, caption_lang=lang,
                              caption_group=group, languages=LANGS)
    table = query_table(metric, audio_emb=audio, text_emb=text, caption_clip=clip, caption_lang=lang,
                        languages=LANGS)
    assert table.metric() == pytest.approx(report[metric], abs=1e-12)
    assert supported(metric) and not supported("mrv_t2a")


def test_identical_models_have_a_zero_interval_and_a_worse_one_a_negative_one():
    rng = np.random.default_rng(1)
    audio, text, clip, lang, _ = _set(rng, n=60, noise=0.8)
    good = query_table("t2a_R@5_mean", audio_emb=audio, text_emb=text, caption_clip=clip, caption_lang=lang,
                       languages=LANGS)
    same = paired_bootstrap(good, good, samples=500, confidence=0.95, seed=0)
    assert (same.delta, same.low, same.high) == (0.0, 0.0, 0.0)
    noisy = text + 3.0 * rng.normal(size=text.shape).astype(np.float32)
    worse = query_table("t2a_R@5_mean", audio_emb=audio, text_emb=noisy, caption_clip=clip, caption_lang=lang,
                        languages=LANGS)
    interval = paired_bootstrap(worse, good, samples=500, confidence=0.95, seed=0)
    assert interval.delta == pytest.approx(worse.metric() - good.metric())
    assert interval.low <= interval.delta <= interval.high < 0
    again = paired_bootstrap(worse, good, samples=500, confidence=0.95, seed=0)
    assert again == interval  # seeded: the same verdict every time
    other = paired_bootstrap(worse, good, samples=500, confidence=0.95, seed=1)
    assert other.low != interval.low
    wider = paired_bootstrap(worse, good, samples=500, confidence=0.99, seed=0)
    assert wider.low <= interval.low and wider.high >= interval.high


def test_tables_of_different_query_sets_are_not_paired():
    audio, text, clip, lang, _ = _set(np.random.default_rng(2))
    full = query_table("t2a_R@1_mean", audio_emb=audio, text_emb=text, caption_clip=clip, caption_lang=lang,
                       languages=LANGS)
    keep = lang != "jpn"
    part = query_table("t2a_R@1_mean", audio_emb=audio, text_emb=text[keep], caption_clip=clip[keep],
                       caption_lang=lang[keep], languages=LANGS)
    with pytest.raises(ValueError, match="same queries"):
        paired_bootstrap(full, part, samples=100, confidence=0.9, seed=0)
