"""ATRI CACL (SPEC §4.3): three pairs, identical-text reduction, masking, views, config errors."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from training.config import ConfigError, ObjectiveConfig
from training.objectives.base import BuildEnv, EmbeddingBatch
from training.objectives.registry import build_objective

LANGS = ("eng", "fra", "deu")
TAU = 0.07


def unit(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(*shape, generator=g), dim=-1)


def infonce(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    logits = left @ right.t() / TAU
    target = torch.arange(left.shape[0])
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target))


def cacl(languages: tuple[str, ...] = LANGS, **strategy: object):
    return build_objective(
        ObjectiveConfig(base={"name": "infonce", "tau": TAU, "learnable_tau": False}, strategy={"name": "cacl", **strategy}),
        BuildEnv(languages=languages, embed_dim=8),
    )


def make_batch(audio: torch.Tensor, eng: torch.Tensor, other: torch.Tensor, mask: torch.Tensor | None = None) -> EmbeddingBatch:
    size = audio.shape[0]
    return EmbeddingBatch(
        audio=audio,
        text=torch.stack([eng, other]),
        text_mask=torch.ones(2, size, dtype=torch.bool) if mask is None else mask,
        clip_index=torch.arange(size),
    )


def test_mean_of_three_symmetric_infonce_terms() -> None:
    audio, eng, other = unit(6, 8, seed=0), unit(6, 8, seed=1), unit(6, 8, seed=2)
    out = cacl()(make_batch(audio, eng, other))
    expected = (infonce(audio, eng) + infonce(audio, other) + infonce(eng, other)) / 3
    assert torch.allclose(out["infonce_loss"], expected)


def test_identical_english_and_other_texts() -> None:
    """other = eng: L = ⅔ L(audio, eng) + ⅓ CE(E Eᵀ/τ, I) — the text–text term is a self-contrast.

    E Eᵀ is symmetric, so both of its directions are the same cross-entropy, and its
    diagonal is 1/τ, the largest logit of each row.
    """
    audio, eng = unit(6, 8, seed=3), unit(6, 8, seed=4)
    out = cacl()(make_batch(audio, eng, eng.clone()))
    self_contrast = F.cross_entropy(eng @ eng.t() / TAU, torch.arange(6))
    assert torch.allclose(out["infonce_loss"], (2 * infonce(audio, eng) + self_contrast) / 3)


def test_third_pair_is_text_text_and_svr_skips_it() -> None:
    objective = build_objective(
        ObjectiveConfig(strategy={"name": "cacl"}, regularizers=[{"name": "svr", "init_radius": 0.0, "direction": "bi"}]),
        BuildEnv(languages=LANGS, embed_dim=8),
    )
    audio, eng, other = unit(5, 8, seed=5), unit(5, 8, seed=6), unit(5, 8, seed=7)
    pairs = objective.strategy.pairs(make_batch(audio, eng, other))
    assert [p.kind for p in pairs] == ["audio-text", "audio-text", "text-text"]
    out = objective(make_batch(audio, eng, other))
    # R = 0, bi: SVR = InfoNCE per audio-text pair (τ = 0.07), each pair weighted ⅓; none on eng–other.
    assert torch.allclose(out["svr_loss"], (infonce(audio, eng) + infonce(audio, other)) / 3)


def test_clips_without_another_language_are_masked_from_two_pairs() -> None:
    audio, eng, other = unit(5, 8, seed=8), unit(5, 8, seed=9), unit(5, 8, seed=10)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 0] = False
    pairs = cacl().strategy.pairs(make_batch(audio, eng, other, mask))
    assert [p.left.shape[0] for p in pairs] == [5, 4, 4]


def test_views_are_english_and_the_same_caption_in_one_other_language() -> None:
    strategy = cacl().strategy
    captions = {"eng": ["dog", "rain"], "fra": ["chien", "pluie"], "deu": ["Hund", "Regen"]}
    translations = {"dog": {"chien", "Hund"}, "rain": {"pluie", "Regen"}}
    others = set()
    for seed in range(30):
        eng, other = strategy.views(captions, random.Random(seed))
        assert other in translations[eng]
        others.add(other)
    assert others == {"chien", "Hund", "pluie", "Regen"}
    assert strategy.views({"eng": ["dog"]}, random.Random(0)) == ["dog", None]


def test_anchor_must_be_a_configured_language_with_another_one() -> None:
    with pytest.raises(ConfigError, match="anchor"):
        cacl(("fra", "deu"))
    with pytest.raises(ConfigError, match="besides the anchor"):
        cacl(("eng",))
    assert cacl(("fra", "deu"), anchor="fra").strategy.num_views == 2
