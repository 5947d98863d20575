"""The papers' missing table rows: SupCLAP's simple reweighting (Table 7), DART's L2-norm and
variance marginals (Table 8) and the triplet base loss (DART Tables 2, 4, 11)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from training.objectives.base import AlignedPair, BuildEnv
from training.objectives.infonce import InfoNCE, InfoNCEConfig
from training.objectives.reweight import ReweightConfig, SimpleReweight
from training.objectives.triplet import Triplet, TripletConfig
from training.objectives.uwd import UWD, UWDConfig, side_marginals

ENV = BuildEnv(languages=("eng",), embed_dim=12)


def _pair(left: torch.Tensor, right: torch.Tensor) -> AlignedPair:
    return AlignedPair(left=left, right=right, clip_index=torch.arange(left.shape[0]), kind="audio-text",
                       weight=1.0, name="test")


def _unit(seed: int, batch: int = 6, dim: int = 12) -> torch.Tensor:
    return F.normalize(torch.randn(batch, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64),
                       dim=-1)


# --- simple reweighting ------------------------------------------------------------------------

def test_reweighting_with_gamma_one_is_infonce() -> None:
    u, v = _unit(0), _unit(1)
    plain = InfoNCE(InfoNCEConfig(learnable_tau=False), ENV).double()(_pair(u, v))["infonce_loss"]
    reweighted = SimpleReweight(ReweightConfig(learnable_tau=False), ENV).double()(_pair(u, v))["reweight_loss"]
    torch.testing.assert_close(reweighted, plain)


def test_reweighting_scales_the_positive_probability_and_keeps_the_negatives_directions() -> None:
    """SupCLAP Eq. 2–4 with P⁺ scaled by γ: the text gradient is 1/τ[(P̃⁺ − 1) a⁺ + Σ P̃⁻_j a⁻_j],
    so each negative pushes along its own audio and the negatives keep their relative weights."""
    tau, gamma = 0.07, 3.0
    audio, text = _unit(2), _unit(3).requires_grad_(True)
    term = SimpleReweight(ReweightConfig(tau=tau, learnable_tau=False, init_gamma=gamma, learnable_gamma=False),
                          ENV).double()
    # one direction (text → audio, the right→left cross-entropy) isolates Eq. 4
    logits = (text @ audio.t()) / tau + math.log(gamma) * torch.eye(6, dtype=torch.float64)
    loss = F.cross_entropy(logits, torch.arange(6))
    (grad,) = torch.autograd.grad(loss, text)
    with torch.no_grad():
        plain = torch.softmax((text @ audio.t()) / tau, dim=1)
        scaled = plain * torch.where(torch.eye(6, dtype=torch.bool), gamma, 1.0)
        scaled = scaled / scaled.sum(dim=1, keepdim=True)
        expected = ((scaled - torch.eye(6, dtype=torch.float64)) @ audio) / (tau * 6)
    torch.testing.assert_close(grad, expected)
    negatives = ~torch.eye(6, dtype=torch.bool)
    ratio = scaled[negatives].view(6, 5) / plain[negatives].view(6, 5)
    torch.testing.assert_close(ratio, ratio[:, :1].expand_as(ratio))  # same factor for every negative of a row
    # and the module computes exactly this loss in that direction
    both = term(_pair(audio, text.detach()))["reweight_loss"]
    other = F.cross_entropy(logits.t().detach(), torch.arange(6))
    torch.testing.assert_close(both, 0.5 * (loss.detach() + other))


def test_reweighting_gamma_is_clamped() -> None:
    term = SimpleReweight(ReweightConfig(init_gamma=50.0, max_gamma=10.0), ENV)
    assert term(_pair(_unit(4).float(), _unit(5).float()))["gamma"].item() == pytest.approx(10.0)


# --- triplet ---------------------------------------------------------------------------------

@pytest.mark.parametrize("negatives", ["hardest", "sum"])
def test_triplet_is_zero_once_every_positive_beats_its_negatives_by_the_margin(negatives: str) -> None:
    eye = torch.eye(4, 8, dtype=torch.float64)
    term = Triplet(TripletConfig(margin=0.2, negatives=negatives), ENV)
    assert term(_pair(eye, eye))["triplet_loss"].item() == 0.0  # S = I: positives 1, negatives 0
    close = F.normalize(eye + 0.95 * torch.roll(eye, 1, dims=0), dim=-1)  # a negative within the margin
    assert term(_pair(eye, close))["triplet_loss"].item() > 0.0


def test_hardest_negative_triplet_only_pushes_the_hardest_negative() -> None:
    """VSE++ (Faghri et al. 2018): with the max over negatives, one negative per anchor gets a gradient."""
    audio = _unit(6).requires_grad_(True)
    text = _unit(7)
    loss = Triplet(TripletConfig(margin=2.0), ENV)(_pair(audio, text))["triplet_loss"]  # every hinge active
    similarity = audio.detach() @ text.t()
    masked = similarity.masked_fill(torch.eye(6, dtype=torch.bool), -math.inf)
    hardest_text = masked.argmax(dim=1)
    hardest_audio = masked.argmax(dim=0)
    (grad,) = torch.autograd.grad(loss, audio)
    expected = torch.zeros_like(grad)
    for i in range(6):
        expected[i] += (text[hardest_text[i]] - text[i]) / 6  # row i: anchor audio i
    for j in range(6):
        expected[hardest_audio[j]] += text[j] / 6  # column j: anchor text j, its hardest audio is pushed
        expected[j] -= text[j] / 6
    torch.testing.assert_close(grad, expected)


# --- DART Table 8 marginals ----------------------------------------------------------------

def test_l2norm_and_variance_marginals_follow_each_sides_channels() -> None:
    gen = torch.Generator().manual_seed(8)
    u = torch.randn(32, 12, generator=gen, dtype=torch.float64)
    v = torch.randn(32, 12, generator=gen, dtype=torch.float64)
    u[:, 0] *= 5.0  # a loud, high-variance audio channel
    v[:, 3] = 0.0  # a dead text channel
    for kind in ("l2norm", "variance"):
        a, b = side_marginals(u, v, kind)  # type: ignore[arg-type]
        assert a.sum().item() == pytest.approx(1.0) and b.sum().item() == pytest.approx(1.0)
        assert int(a.argmax()) == 0 and int(b.argmin()) == 3
        assert not torch.allclose(a, b)  # one marginal per side, unlike RAM's shared one
    a, _ = side_marginals(u, v, "l2norm")
    torch.testing.assert_close(a, u.norm(dim=0) / u.norm(dim=0).sum(), atol=1e-9, rtol=1e-9)


def test_uwd_with_variance_marginals_moves_mass_to_high_variance_channels() -> None:
    gen = torch.Generator().manual_seed(9)
    u = F.normalize(torch.randn(16, 12, generator=gen), dim=-1)
    v = F.normalize(u + 0.1 * torch.randn(16, 12, generator=gen), dim=-1)
    u[:, 5] *= 0.01  # audio channel 5 almost constant
    plans = {}
    for kind in ("uniform", "variance"):
        term = UWD(UWDConfig(marginals=kind), BuildEnv(languages=("eng",), embed_dim=12))
        out = term(_pair(u, v))
        assert math.isfinite(out["uwd_loss"].item())
        from training.ot import pairwise_euclidean, sinkhorn_unbalanced_log

        a, b = term.marginals(u, v)
        plans[kind] = sinkhorn_unbalanced_log(pairwise_euclidean(u.t(), v.t()), a, b, eps=0.03, reg_m=0.05, iters=50)
    assert plans["variance"][5].sum() < plans["uniform"][5].sum()
