"""ATRI KCL (SPEC §4.3): views are query groups; one language = InfoNCE; masking is per language."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from training.config import ObjectiveConfig
from training.objectives.base import BuildEnv, EmbeddingBatch
from training.objectives.kcl import query_group
from training.objectives.registry import build_objective


def unit(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(*shape, generator=g), dim=-1)


def infonce(left: torch.Tensor, right: torch.Tensor, tau: float = 0.07) -> torch.Tensor:
    logits = left @ right.t() / tau
    target = torch.arange(left.shape[0])
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target))


def kcl(languages: tuple[str, ...]):
    return build_objective(
        ObjectiveConfig(base={"name": "infonce", "learnable_tau": False}, strategy={"name": "kcl"}),
        BuildEnv(languages=languages, embed_dim=8),
    )


def batch(views: int, size: int, *, seed: int, mask: torch.Tensor | None = None) -> EmbeddingBatch:
    return EmbeddingBatch(
        audio=unit(size, 8, seed=seed),
        text=unit(views, size, 8, seed=seed + 1),
        text_mask=torch.ones(views, size, dtype=torch.bool) if mask is None else mask,
        clip_index=torch.arange(size),
    )


def test_one_language_is_infonce() -> None:
    b = batch(1, 6, seed=0)
    out = kcl(("eng",))(b)
    assert torch.allclose(out["infonce_loss"], infonce(b.audio, b.text[0]))


def test_k_languages_average_the_per_language_symmetric_losses() -> None:
    b = batch(3, 6, seed=1)
    out = kcl(("eng", "fra", "deu"))(b)
    expected = sum(infonce(b.audio, b.text[k]) for k in range(3)) / 3
    assert torch.allclose(out["infonce_loss"], expected)


def test_masking_a_language_changes_only_its_terms() -> None:
    objective = kcl(("eng", "fra", "deu"))
    full = batch(3, 6, seed=2)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, 2] = False  # clip 2 lacks French
    masked = batch(3, 6, seed=2, mask=mask)

    before, after = objective.strategy.pairs(full), objective.strategy.pairs(masked)
    for k in (0, 2):
        assert torch.equal(before[k].left, after[k].left) and torch.equal(before[k].right, after[k].right)
    assert after[1].left.shape[0] == 5 and 2 not in after[1].clip_index.tolist()

    keep = torch.tensor([0, 1, 3, 4, 5])
    delta = objective(masked)["infonce_loss"] - objective(full)["infonce_loss"]
    expected = (infonce(full.audio[keep], full.text[1][keep]) - infonce(full.audio, full.text[1])) / 3
    assert torch.allclose(delta, expected, atol=1e-6)


def test_a_language_with_fewer_than_two_rows_drops_out() -> None:
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1, 1:] = False
    b = batch(2, 4, seed=3, mask=mask)
    out = kcl(("eng", "fra"))(b)
    assert torch.allclose(out["infonce_loss"], infonce(b.audio, b.text[0]))


def test_views_are_translations_of_one_caption() -> None:
    captions = {"eng": ["a dog barks", "rain falls"], "fra": ["un chien aboie", "la pluie tombe"], "deu": []}
    seen = set()
    for seed in range(20):
        group = query_group(captions, ("eng", "fra", "deu"), random.Random(seed))
        assert group[2] is None
        assert (group[0], group[1]) in {("a dog barks", "un chien aboie"), ("rain falls", "la pluie tombe")}
        seen.add(group[0])
    assert len(seen) == 2


def test_a_language_with_fewer_captions_falls_back_to_one_of_its_own() -> None:
    captions = {"eng": ["a", "b", "c"], "fra": ["x"]}
    for seed in range(10):
        assert query_group(captions, ("eng", "fra"), random.Random(seed))[1] == "x"
    assert query_group({}, ("eng", "fra"), random.Random(0)) == [None, None]


def test_num_views_is_the_number_of_languages() -> None:
    assert kcl(("eng", "fra", "deu", "jpn")).strategy.num_views == 4
