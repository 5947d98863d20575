"""SigLIP's batch-dependent initialisation (docs/objectives.md, "SigLIP initialisation")."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from training.objectives.base import AlignedPair, BuildEnv
from training.objectives.siglip import SigLIP, SigLIPConfig

ENV = BuildEnv(languages=("eng",), embed_dim=8)


def _pair(batch: int, seed: int = 0) -> AlignedPair:
    gen = torch.Generator().manual_seed(seed)
    left = F.normalize(torch.randn(batch, 8, generator=gen), dim=-1)
    right = F.normalize(torch.randn(batch, 8, generator=gen), dim=-1)
    return AlignedPair(left=left, right=right, clip_index=torch.arange(batch), kind="audio-text", weight=1.0, name="t")


@pytest.mark.parametrize("batch", [2, 8, 64, 512])
def test_default_init_is_one_over_tau0_and_minus_log_batch(batch: int) -> None:
    term = SigLIP(SigLIPConfig(), ENV)
    out = term(_pair(batch))
    assert float(out["siglip_scale"]) == pytest.approx(1 / 0.07, rel=1e-6)
    assert float(out["siglip_bias"]) == pytest.approx(-math.log(batch), rel=1e-6)
    # σ(b) = 1/(1 + B): at S = 0 the model predicts about the prior of a positive, 1 in B
    assert float(torch.sigmoid(out["siglip_bias"])) == pytest.approx(1 / (1 + batch), rel=1e-5)


@pytest.mark.parametrize("batch", [8, 64])
def test_init_loss_is_balanced_at_zero_similarity(batch: int) -> None:
    """With S = 0 the default init's loss per row is B·(−log σ(∓b)) ≈ log B + 1, far from the paper
    init's ≈ 10 (the positive term alone) at a small batch."""
    zero = AlignedPair(left=torch.zeros(batch, 8), right=torch.zeros(batch, 8), clip_index=torch.arange(batch),
                       kind="audio-text", weight=1.0, name="t")
    ours = float(SigLIP(SigLIPConfig(), ENV)(zero)["siglip_loss"].detach())
    paper = float(SigLIP(SigLIPConfig(init_scale=10.0, init_bias=-10.0), ENV)(zero)["siglip_loss"].detach())
    expected = -math.log(1 / (1 + batch)) + (batch - 1) * -math.log(batch / (1 + batch))
    assert ours == pytest.approx(expected, rel=1e-5)
    assert paper > 10.0 > ours


def test_paper_values_stay_selectable_and_do_not_depend_on_the_batch() -> None:
    term = SigLIP(SigLIPConfig(init_scale=10.0, init_bias=-10.0), ENV)
    for batch in (4, 64):
        out = term(_pair(batch))
        assert float(out["siglip_scale"]) == pytest.approx(10.0)
        assert float(out["siglip_bias"]) == pytest.approx(-10.0)


def test_the_bias_offset_gets_the_gradient_of_a_plain_bias() -> None:
    pair = _pair(16, seed=3)
    ours = SigLIP(SigLIPConfig(), ENV)
    plain = SigLIP(SigLIPConfig(init_scale=1 / 0.07, init_bias=-math.log(16)), ENV)
    ours(pair)["siglip_loss"].backward()
    plain(pair)["siglip_loss"].backward()
    assert ours.bias.grad is not None and plain.bias.grad is not None
    torch.testing.assert_close(ours.bias.grad, plain.bias.grad)
    torch.testing.assert_close(ours.log_scale.grad, plain.log_scale.grad)
