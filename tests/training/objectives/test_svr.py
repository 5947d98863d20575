"""SupCLAP SVR (SPEC §4.2): Jacobian property, R = 0 reduction, constraint, dynamic radius."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from training.config import ConfigError, ObjectiveConfig
from training.objectives.base import AlignedPair, BuildEnv
from training.objectives.registry import build_objective
from training.objectives.svr import SupportVectorRegularizer, SVRConfig, similarity_features

ENV = BuildEnv(languages=("eng",), embed_dim=8)


def unit(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1)


def pair(audio: torch.Tensor, text: torch.Tensor) -> AlignedPair:
    return AlignedPair(
        left=audio, right=text, clip_index=torch.arange(audio.shape[0]), kind="audio-text", weight=1.0, name="t"
    )


def svr(**params: object) -> SupportVectorRegularizer:
    return SupportVectorRegularizer(SVRConfig(**params), ENV).double()


def test_gradient_wrt_text_is_jacobian_transpose_times_support_gradient() -> None:
    """Eq. 13–16: ∇_v L_svr = Jᵀ ∇_{v_sup} L_svr with J = I − (R/‖u−v‖)(I − ûûᵀ)."""
    batch, dim, radius, tau, alpha = 6, 8, 0.3, 0.07, 1.0
    audio = unit(batch, dim, seed=0)
    text = unit(batch, dim, seed=1).requires_grad_(True)
    term = svr(radius="static", direction="uni", init_radius=radius, tau=tau, alpha=alpha)
    term(pair(audio, text))["svr_loss"].backward()

    with torch.no_grad():
        v = text.detach()
        diff = audio - v
        dist = diff.norm(dim=1, keepdim=True)
        u_hat = diff / dist
        support = v + radius * u_hat
        probs = (support @ audio.t() / tau).softmax(dim=1)
        # ∂/∂v_sup of alpha * ½ * mean_i CE: (α/2B)(1/τ)(Σ_j P_ij u_j − u_i)
        grad_support = alpha * 0.5 / batch / tau * (probs @ audio - audio)
        expected = torch.empty_like(v)
        for i in range(batch):
            eye = torch.eye(dim, dtype=torch.float64)
            jac = eye - radius / dist[i] * (eye - torch.outer(u_hat[i], u_hat[i]))
            expected[i] = jac.t() @ grad_support[i]
            # the force decomposition of Eq. 16: parallel part kept, perpendicular part scaled
            negative = audio[(i + 1) % batch]
            parallel = (negative @ u_hat[i]) * u_hat[i]
            perpendicular = negative - parallel
            assert torch.allclose(jac @ negative, parallel + (1 - radius / dist[i]) * perpendicular)
    assert torch.allclose(text.grad, expected, atol=1e-10)


def test_zero_radius_reduces_to_the_infonce_text_to_audio_term() -> None:
    audio, text = unit(5, 8, seed=2), unit(5, 8, seed=3)
    tau, alpha = 0.07, 0.7
    out = svr(radius="static", direction="uni", init_radius=0.0, tau=tau, alpha=alpha)(pair(audio, text))
    logits = audio @ text.t() / tau
    text_to_audio = F.cross_entropy(logits.t(), torch.arange(5))
    # InfoNCE = ½ a2t + ½ t2a; SVR keeps the per-direction weight ½.
    assert torch.allclose(out["svr_loss"], alpha * 0.5 * text_to_audio)


def test_bidirectional_zero_radius_is_alpha_times_infonce() -> None:
    audio, text = unit(5, 8, seed=4), unit(5, 8, seed=5)
    out = svr(radius="static", direction="bi", init_radius=0.0, tau=0.07)(pair(audio, text))
    logits = audio @ text.t() / 0.07
    target = torch.arange(5)
    expected = 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target))
    assert torch.allclose(out["svr_loss"], expected)


@pytest.mark.parametrize(
    ("radius", "expected"),
    [
        (0.0, lambda d: torch.zeros((), dtype=torch.float64)),  # R = 0: inside [0, ‖u−v‖]
        (0.05, lambda d: torch.zeros((), dtype=torch.float64)),  # every ‖u−v‖ > 0.05 here (checked below)
        (-0.2, lambda d: torch.tensor(0.2, dtype=torch.float64)),  # ReLU(−R)
        (3.0, lambda d: (3.0 - d).mean()),  # ReLU(R − ‖u−v‖), R above any distance (≤ 2)
    ],
)
def test_constraint_zero_inside_and_positive_outside(radius: float, expected) -> None:
    audio, text = unit(6, 8, seed=6), unit(6, 8, seed=7)
    dist = (audio - text).norm(dim=1)
    assert dist.min() > 0.05
    beta = 0.5
    # a fresh predictor outputs exactly init_radius (zero-initialized last layer)
    out = svr(radius="dynamic", direction="uni", init_radius=radius, beta=beta)(pair(audio, text))
    assert torch.allclose(out["svr_radius"], torch.tensor(radius, dtype=torch.float64))
    assert torch.allclose(out["svr_cons_loss"], beta * expected(dist))


def test_constraint_is_absent_without_beta_and_for_static_radius() -> None:
    audio, text = unit(4, 8, seed=8), unit(4, 8, seed=9)
    assert "svr_cons_loss" not in svr(radius="dynamic", beta=0.0)(pair(audio, text))
    assert "svr_cons_loss" not in svr(radius="static")(pair(audio, text))


def test_similarity_features_sort_negatives_and_pad_or_cut() -> None:
    sim = torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.8, -0.3], [0.4, 0.6, 0.7]])
    assert torch.equal(
        similarity_features(sim, 5),
        torch.tensor([[0.9, 0.5, 0.1, -1.0, -1.0], [0.8, 0.2, -0.3, -1.0, -1.0], [0.7, 0.6, 0.4, -1.0, -1.0]]),
    )
    assert torch.equal(similarity_features(sim, 2), torch.tensor([[0.9, 0.5], [0.8, 0.2], [0.7, 0.6]]))


def test_dynamic_radius_handles_batches_smaller_and_larger_than_its_width() -> None:
    term = svr(radius="dynamic", width=8)
    for size in (2, 3, 8, 13):
        out = term(pair(unit(size, 8, seed=size), unit(size, 8, seed=size + 100)))
        assert torch.isfinite(out["svr_loss"])


def test_dynamic_radius_gets_gradients_but_does_not_push_encoders_through_the_predictor() -> None:
    audio = unit(6, 8, seed=10)
    text = unit(6, 8, seed=11).requires_grad_(True)
    term = svr(radius="dynamic", beta=1.0, init_radius=5.0)  # constraint active
    out = term(pair(audio, text))
    out["svr_cons_loss"].backward()
    assert text.grad is None or torch.count_nonzero(text.grad) == 0  # distance and features detached
    assert term.predictor.mlp[-1].bias.grad is not None and term.predictor.mlp[-1].bias.grad.abs() > 0


def test_epoch_summary_reports_the_mean_radius_then_resets() -> None:
    term = svr(radius="static", init_radius=0.25)
    audio, text = unit(4, 8, seed=12), unit(4, 8, seed=13)
    term(pair(audio, text))
    term(pair(audio, text))
    assert term.epoch_summary() == pytest.approx({"svr_mean_radius": 0.25})
    assert term.epoch_summary() == {}


@pytest.mark.parametrize("base", ["infonce", "siglip"])
def test_composes_with_both_base_losses(base: str) -> None:
    objective = build_objective(
        ObjectiveConfig(base={"name": base}, regularizers=[{"name": "svr", "radius": "dynamic"}]), ENV
    )
    from training.objectives.base import EmbeddingBatch

    batch = EmbeddingBatch(
        audio=unit(4, 8, seed=14).float(),
        text=unit(1, 4, 8, seed=15).float(),
        text_mask=torch.ones(1, 4, dtype=torch.bool),
        clip_index=torch.arange(4),
    )
    out = objective(batch)
    assert f"{base}_loss" in out and "svr_loss" in out and "svr_cons_loss" in out


def test_unknown_key_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="radius_kind"):
        build_objective(ObjectiveConfig(regularizers=[{"name": "svr", "radius_kind": "static"}]), ENV)
