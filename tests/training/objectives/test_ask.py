"""ASK (SPEC §4.6): injection, reliability, OT realignment, refresh schedule, composition, end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import ROOT, TINY_CONFIG
from tonearm.cli import main
from training.config import ConfigError, ObjectiveConfig, load_train_config
from training.knowledge import build_fine_kb
from training.objectives.ask import (
    ASK,
    ASKConfig,
    inject,
    knowledge_potential,
    reliability_weights,
    wrap_with_knowledge,
)
from training.objectives.base import AlignedPair, BuildEnv, EmbeddingBatch, total_loss
from training.objectives.infonce import InfoNCE, InfoNCEConfig
from training.objectives.registry import build_objective

ENV = BuildEnv(languages=("eng", "fra"), embed_dim=8)


class FakeContext:
    """A TrainingContext over fixed tensors: `caps` captions per clip; `drift()` moves the encoders."""

    def __init__(self, *, clips: int = 40, caps: int = 3, dim: int = 8, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.audio = F.normalize(torch.randn(clips, dim, generator=self.gen), dim=-1)
        self.clip = torch.arange(clips).repeat_interleave(caps)
        self.text = F.normalize(self.audio[self.clip] + 0.4 * torch.randn(clips * caps, dim, generator=self.gen), dim=-1)
        self.epoch = 0
        self.step = 0
        self.device = torch.device("cpu")
        self.calls = 0
        self.extra: dict[Path, tuple[torch.Tensor, torch.Tensor]] = {}

    def embed_training_pairs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.calls += 1
        return self.audio[self.clip], self.text, self.clip

    def embed_manifest_pairs(self, manifest: Path) -> tuple[torch.Tensor, torch.Tensor]:
        return self.extra[manifest]

    def embed_clips(self, clip_index: torch.Tensor) -> torch.Tensor:
        return self.audio[clip_index]

    def drift(self) -> None:
        self.audio = F.normalize(self.audio + 0.1 * torch.randn(self.audio.shape, generator=self.gen), dim=-1)


def _ask(**overrides: object) -> ASK:
    base = InfoNCE(InfoNCEConfig(tau=0.07, learnable_tau=False), ENV)
    return wrap_with_knowledge({"n_clusters": 8, **overrides}, base, ENV)


def _pair(u: torch.Tensor, v: torch.Tensor, clip: torch.Tensor, kind: str = "audio-text") -> AlignedPair:
    return AlignedPair(left=u, right=v, clip_index=clip, kind=kind, weight=1.0, name="test")  # type: ignore[arg-type]


# --- hand-made knowledge base --------------------------------------------------------------

def _tiny_kb_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Four clips with one caption each in 2-D; the batch is clips 0 and 3 (their KB entries must be skipped)."""
    audio = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.6, 0.8], [0.0, 1.0]])
    text = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0], [-0.6, 0.8]])
    return audio, text, torch.arange(4), torch.tensor([0, 3])


def test_neighbours_injection_weights_and_potential_by_hand() -> None:
    audio, text, clip, batch = _tiny_kb_batch()
    kb = build_fine_kb(audio, text, clip)
    hood = kb.retrieve(audio[batch], text[batch], k=2, exclude_clip=batch)
    # Clip 0: u=(1,0) scores clips 1, 2, 3 at .8, .6, 0; v=(1,0) scores texts 1, 2, 3 at .6, 0, -.6.
    # Clip 3: u=(0,1) scores clips 2, 1, 0 at .8, .6, 0; v=(-.6,.8) scores texts 2, 1, 0 at .8, .28, -.6.
    torch.testing.assert_close(hood.audio, torch.stack([audio[[1, 2]], audio[[2, 1]]]))
    torch.testing.assert_close(hood.audio_partner, torch.stack([text[[1, 2]], text[[2, 1]]]))
    torch.testing.assert_close(hood.text, torch.stack([text[[1, 2]], text[[2, 1]]]))
    torch.testing.assert_close(hood.text_partner, torch.stack([audio[[1, 2]], audio[[2, 1]]]))

    # Injection (Appendix A reading, rho = 0.2): u' = 0.8 u + 0.2 mean(neighbours).
    injected = inject(audio[batch], hood.audio.mean(1), rho=0.2, form="appendix_a")
    torch.testing.assert_close(injected, torch.tensor([[0.94, 0.14], [0.14, 0.94]]))
    eq8 = inject(text[batch], hood.text.mean(1), rho=0.2, form="eq8")  # Eq. 8 as printed: 0.2 v + 0.8 mean
    torch.testing.assert_close(eq8, torch.tensor([[0.2 + 0.8 * 0.3, 0.8 * 0.9], [-0.12 + 0.8 * 0.3, 0.16 + 0.8 * 0.9]]))

    # T->A reliability of clip 0: candidates = audio partners of its text neighbours = audio 1, 2;
    # reference U_r = audio 1, 2 (mean (.7,.7)): s = [.98, .98] -> w = [.5, .5].
    # Clip 3: candidates audio 2, 1; U_r = audio 2, 1: s = [.98, .98] as well.
    w = reliability_weights(hood.text_partner, hood.audio)
    torch.testing.assert_close(w, torch.full((2, 2), 0.5))
    psi = knowledge_potential(audio[batch], hood.text_partner, hood.audio, adaptive=True)
    torch.testing.assert_close(psi, torch.tensor([0.5 * (math.exp(0.8) + math.exp(0.6))] * 2))
    # A->T of clip 0: candidates = text partners of audio neighbours = text 1, 2; reference = text
    # neighbours 1, 2 (mean (.3,.9)): s = [.18+.72, .9] = [.9, .9]; Psi = .5 (e^.6 + e^0).
    psi_a2t = knowledge_potential(text[batch], hood.audio_partner, hood.text, adaptive=True)
    assert psi_a2t[0].item() == pytest.approx(0.5 * (math.exp(0.6) + 1.0), rel=1e-6)


def test_reliability_weights_and_potential_unequal_by_hand() -> None:
    candidates = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    reference = torch.tensor([[[1.0, 0.0], [0.6, 0.8]]])  # mean (.8, .4): s = [.8, .4]
    query = torch.tensor([[0.6, 0.8]])
    w0 = math.exp(0.8) / (math.exp(0.8) + math.exp(0.4))
    torch.testing.assert_close(reliability_weights(candidates, reference), torch.tensor([[w0, 1 - w0]]))
    expected = w0 * math.exp(0.6) + (1 - w0) * math.exp(0.8)
    assert knowledge_potential(query, candidates, reference, adaptive=True).item() == pytest.approx(expected, rel=1e-6)
    uniform = 0.5 * (math.exp(0.6) + math.exp(0.8))
    assert knowledge_potential(query, candidates, reference, adaptive=False).item() == pytest.approx(uniform, rel=1e-6)


# --- reductions and properties -----------------------------------------------------------------

def _batch_from(ctx: FakeContext, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    caption = rows * 3  # first caption of each clip
    return ctx.audio[rows].clone(), ctx.text[caption].clone(), rows


def test_zero_rho_beta_lambda_reduces_to_infonce() -> None:
    ctx = FakeContext()
    term = _ask(rho=0.0, beta=0.0, lambda_fine=0.0, lambda_coarse=0.0)
    term.on_epoch_start(ctx)
    u, v, clip = _batch_from(ctx, torch.arange(0, 24, 2))
    ask = term(_pair(u, v, clip))["ask_loss"]
    infonce = term.base(_pair(u, v, clip))["infonce_loss"]
    torch.testing.assert_close(ask, infonce, atol=1e-6, rtol=1e-6)
    # ...and every ingredient changes it.
    for change in ({"rho": 0.2}, {"beta": 0.2}, {"lambda_fine": 0.2}):
        other = _ask(**{"rho": 0.0, "beta": 0.0, "lambda_fine": 0.0, "lambda_coarse": 0.0, **change})
        other.on_epoch_start(ctx)
        assert abs(other(_pair(u, v, clip))["ask_loss"].item() - infonce.item()) > 1e-5, change


def test_text_text_pairs_and_eval_mode_use_the_base_loss() -> None:
    ctx = FakeContext()
    term = _ask()
    term.on_epoch_start(ctx)
    u, v, clip = _batch_from(ctx, torch.arange(8))
    assert set(term(_pair(v, v.flip(0), clip, kind="text-text"))) == {"infonce_loss", "tau"}
    term.eval()
    assert "ask_loss" not in term(_pair(u, v, clip))


def test_ask_is_invariant_to_jointly_permuting_the_batch() -> None:
    ctx = FakeContext()
    term = _ask()
    term.on_epoch_start(ctx)
    u, v, clip = _batch_from(ctx, torch.arange(0, 30, 2))
    perm = torch.randperm(15, generator=torch.Generator().manual_seed(0))
    first = term(_pair(u, v, clip))
    permuted = term(_pair(u[perm], v[perm], clip[perm]))
    for key in ("ask_loss", "ask_f_fine", "ask_f_coarse"):
        torch.testing.assert_close(first[key], permuted[key], atol=1e-5, rtol=1e-5)


def test_a_few_steps_lower_the_ask_loss() -> None:
    ctx = FakeContext()
    term = _ask()
    term.on_epoch_start(ctx)
    u, _, clip = _batch_from(ctx, torch.arange(12))
    gen = torch.Generator().manual_seed(5)
    audio = torch.nn.Parameter(u)
    text = torch.nn.Parameter(F.normalize(torch.randn(12, 8, generator=gen), dim=-1))
    optimizer = torch.optim.Adam([audio, text], lr=0.05)

    def loss() -> torch.Tensor:
        return term(_pair(F.normalize(audio, dim=-1), F.normalize(text, dim=-1), clip))["ask_loss"]

    first = loss().item()
    for _ in range(20):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
    assert loss().item() < first


def test_forward_before_the_knowledge_bases_exist_is_a_clear_error() -> None:
    ctx = FakeContext()
    u, v, clip = _batch_from(ctx, torch.arange(4))
    with pytest.raises(RuntimeError, match="on_epoch_start"):
        _ask()(_pair(u, v, clip))


# --- refresh schedule and drift ------------------------------------------------------------------

@pytest.mark.parametrize(
    ("overrides", "epochs", "steps_per_epoch", "expected_builds"),
    [
        ({"refresh_epochs": 15}, 40, 2, 3),  # epochs 0, 15, 30
        ({"refresh_epochs": 1}, 4, 2, 4),
        ({"refresh_epochs": None, "refresh_steps": 7}, 5, 6, 5),  # steps 0, 7, 14, 21, 28
        ({"refresh_epochs": None}, 10, 2, 1),  # static knowledge base: the "no refresh" ablation
    ],
)
def test_knowledge_bases_refresh_exactly_when_scheduled(
    overrides: dict, epochs: int, steps_per_epoch: int, expected_builds: int
) -> None:
    ctx = FakeContext(clips=12)
    term = _ask(**overrides)
    summaries = []
    for epoch in range(epochs):
        ctx.epoch = epoch
        term.on_epoch_start(ctx)
        for _ in range(steps_per_epoch):
            term.on_step_start(ctx)
            ctx.step += 1
            ctx.drift()
        summaries.append(term.epoch_summary())
    assert term.builds == expected_builds == ctx.calls
    assert len(term.drift_log) == expected_builds - 1
    assert sum("ask_rdm" in s for s in summaries) == len({int(e["epoch"]) for e in term.drift_log})
    assert all(entry["rdm"] > 0 for entry in term.drift_log)
    json.dumps(term.drift_log)  # JSON-able


def test_extra_manifest_source_is_never_self_excluded() -> None:
    ctx = FakeContext(clips=10)
    extra = Path("extra.jsonl")
    ctx.extra[extra] = (ctx.audio[ctx.clip], ctx.text)  # the same pairs, but without clip ids
    term = _ask(sources=["train", str(extra)], coarse=False)
    term.on_epoch_start(ctx)
    kb = term.fine_kb
    assert kb is not None and len(kb.audio) == 20 and len(kb.text) == 60
    assert int((kb.audio.clip < 0).sum()) == 10 and int((kb.text.clip < 0).sum()) == 30
    u, v, clip = _batch_from(ctx, torch.arange(4))
    hood = kb.retrieve(u, v, k=1, exclude_clip=clip)
    torch.testing.assert_close(hood.audio[:, 0], u)  # its copy from the extra manifest is the top hit


# --- configuration and composition -------------------------------------------------------------------

def test_config_errors_name_the_key() -> None:
    base = InfoNCE(InfoNCEConfig(), ENV)
    with pytest.raises(ConfigError, match="objective.knowledge: top_kk: unknown key"):
        wrap_with_knowledge({"top_kk": 3}, base, ENV)
    with pytest.raises(ConfigError, match="at least one of fine / coarse"):
        wrap_with_knowledge({"fine": False, "coarse": False}, base, ENV)
    with pytest.raises(ConfigError, match="needs objective.base.name = infonce"):
        build_objective(ObjectiveConfig(base={"name": "siglip"}, knowledge={}), ENV)


def test_ask_composes_with_cacl() -> None:
    objective = build_objective(ObjectiveConfig(strategy={"name": "cacl"}, knowledge={"n_clusters": 8}), ENV)
    ctx = FakeContext()
    objective.on_epoch_start(ctx)
    u, v, clip = _batch_from(ctx, torch.arange(10))
    other = F.normalize(v + 0.1, dim=-1)
    batch = EmbeddingBatch(audio=u, text=torch.stack([v, other]), text_mask=torch.ones(2, 10, dtype=torch.bool),
                           clip_index=clip)
    terms = objective(batch)
    assert {"ask_loss", "infonce_loss"} <= set(terms)  # ASK on the audio-text pairs, InfoNCE on eng-other
    assert torch.isfinite(total_loss(terms))


def test_ablation_switches() -> None:
    ctx = FakeContext()
    u, v, clip = _batch_from(ctx, torch.arange(10))
    losses = {}
    for name, overrides in {
        "full": {}, "no_fine": {"fine": False}, "no_coarse": {"coarse": False}, "no_injection": {"inject": False},
        "uniform_reliability": {"reliability": "uniform"}, "no_reliability": {"reliability": "off"},
    }.items():
        term = _ask(**overrides)
        term.on_epoch_start(ctx)
        out = term(_pair(u, v, clip))
        losses[name] = out["ask_loss"].item()
        assert ("ask_f_fine" in out) == (name not in {"no_fine", "no_reliability"}), name
        assert ("ask_f_coarse" in out) == (name not in {"no_coarse", "no_reliability"}), name
    assert len({round(x, 6) for x in losses.values()}) == len(losses)


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "ask").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_ask_configs_build(path: Path) -> None:
    cfg = load_train_config(path)
    objective = build_objective(cfg.objective, BuildEnv(languages=tuple(cfg.data.languages), embed_dim=cfg.model.embed_dim))
    assert isinstance(objective.base, ASK)
    ASKConfig.model_validate(cfg.objective.knowledge)


def test_ask_trains_end_to_end(tiny_corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    code = main([
        "train", str(TINY_CONFIG), f"data.manifest={tiny_corpus}", f"out_dir={out}", "optim.epochs=2",
        "optim.batch_size=4", "data.max_clips=12", "objective.knowledge={n_clusters: 16, refresh_epochs: 1}",
    ])
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in records if r["kind"] == "step")
    assert math.isfinite(step["ask_loss"])
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [r["ask_kb_builds"] for r in epochs] == [1.0, 2.0]
    assert "ask_rdm" not in epochs[0] and epochs[1]["ask_rdm"] >= 0


def _spread_after_training(potential_gradient: bool) -> float:
    """Mean off-diagonal cosine of the batch's audio embeddings after Adam steps on them."""
    ctx = FakeContext()
    term = _ask(potential_gradient=potential_gradient, lambda_fine=1.0, lambda_coarse=1.0)
    term.on_epoch_start(ctx)
    u0, v0, clip = _batch_from(ctx, torch.arange(0, 24, 2))
    u, v = u0.clone().requires_grad_(True), v0.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([u, v], lr=0.05)
    for _ in range(60):
        optimizer.zero_grad()
        term(_pair(F.normalize(u, dim=-1), F.normalize(v, dim=-1), clip))["ask_loss"].backward()
        optimizer.step()
    un = F.normalize(u.detach(), dim=-1)
    cosine = un @ un.t()
    return float((cosine.sum() - cosine.diagonal().sum()) / (cosine.numel() - len(cosine)))


def test_detached_potentials_do_not_reward_collapse() -> None:
    """With gradients through F = −log Ψ the embeddings are pulled together (the collapsed
    optimum); the default treats F as a reliability weight and keeps them apart."""
    collapsing, default = _spread_after_training(True), _spread_after_training(False)
    assert collapsing > default + 0.1, (collapsing, default)


# --- reliability scope (docs/objectives.md, "ASK reliability scope") --------------------------------

def test_per_sample_modulation_equals_per_batch_when_psi_is_constant() -> None:
    from training.objectives.ask import modulated_loss

    gen = torch.Generator().manual_seed(0)
    rows = torch.rand(12, generator=gen) * 3
    constant = [(0.2, torch.full((12,), 0.7)), (0.3, torch.full((12,), -0.4))]
    batch = modulated_loss(rows, constant, scope="batch")
    sample = modulated_loss(rows, constant, scope="sample")
    torch.testing.assert_close(sample, batch)
    torch.testing.assert_close(batch, (1 + 0.2 * 0.7 - 0.3 * 0.4) * rows.mean())
    # varying Ψ: the two readings differ, and per sample weights each row by its own factor
    varying = [(0.2, torch.linspace(-1, 1, 12)), (0.3, torch.linspace(1, 0, 12))]
    by_hand = ((1 + 0.2 * torch.linspace(-1, 1, 12) + 0.3 * torch.linspace(1, 0, 12)) * rows).mean()
    torch.testing.assert_close(modulated_loss(rows, varying, scope="sample"), by_hand)
    assert not torch.allclose(modulated_loss(rows, varying, scope="batch"), by_hand)
    torch.testing.assert_close(modulated_loss(rows, [], scope="sample"), rows.mean())


def test_per_sample_scope_trains_and_logs_the_spread_of_f() -> None:
    ctx = FakeContext()
    batch_term, sample_term = _ask(), _ask(reliability_scope="sample")
    batch_term.on_epoch_start(ctx)
    sample_term.on_epoch_start(ctx)
    u, v, clip = _batch_from(ctx, torch.arange(0, 30, 2))
    by_batch, by_sample = batch_term(_pair(u, v, clip)), sample_term(_pair(u, v, clip))
    torch.testing.assert_close(by_sample["ask_f_fine"], by_batch["ask_f_fine"])
    assert float(by_sample["ask_f_fine_std"]) > 0
    assert torch.isfinite(by_sample["ask_loss"])
    assert not torch.allclose(by_sample["ask_loss"], by_batch["ask_loss"])
