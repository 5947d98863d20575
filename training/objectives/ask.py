"""ASK: adaptive self-improving knowledge — knowledge injection, reliability and OT realignment.

For each granularity g ∈ {fine, coarse} (knowledge bases of :mod:`training.knowledge`):

* **Injection** (Eq. 8 / Appendix A): ``ū_i`` = mean of the top-K audio-side neighbours
  of ``u_i``; ``u'_i = (1 − ρ) u_i + ρ ū_i`` (``injection: appendix_a``, default: ρ is
  the share of knowledge) or ``u'_i = ρ u_i + (1 − ρ) ū_i`` (``injection: eq8``, Eq. 8
  as printed); same for text. Not re-normalised. The fine KB excludes the clip's own
  entries (all its captions) when the source is the training set.
* **Reliability** (Eq. 10–12): T→A: the text-side neighbours of ``v_i`` give pairs
  ``(u'_j, v_j)``, the audio-side neighbours of ``u_i`` the set ``U_r``;
  ``s̄_j = mean_l u'_j·u_l``, ``w = softmax(s̄)``, ``Ψ_i = Σ_j w_j exp(u_i·u'_j)``;
  A→T symmetric (text partners of the audio-side neighbours against the text-side
  neighbours, query ``v_i``); ``F = mean_i −log Ψ_i`` (Eq. 16).
* **OT realignment** (Eq. 14, Appendix C): per direction, rows = queries
  (``S^{T→A} = V' U'ᵀ``), ``Q* = B · sinkhorn(−S, uniform, ε)`` detached,
  ``S* = ((1 − β) I + β Q*) S``; the A→T direction uses ``S^{A→T} = (S^{T→A})ᵀ`` and
  ``Q*ᵀ`` (the plan of the transposed problem).
* **Loss** (Eq. 15–18): ``L_{T→A}`` = mean over enabled granularities of the row
  cross-entropy of ``S*/τ`` (the paper sums fine + coarse; the mean keeps the loss on
  InfoNCE's scale whatever the ablation), ``L*_{T→A} = (1 + λ_f F_f + λ_c F_c) L_{T→A}``,
  ``L_ASK = ½ (L*_{T→A} + L*_{A→T})``. With ρ = β = λ = 0 this is InfoNCE exactly.
  ``reliability_scope`` chooses how Eq. 17–18 are read: ``batch`` (F the batch mean of
  −log Ψ_i, one factor per batch and direction, as written above) or ``sample`` (each query's
  cross-entropy weighted by its own ``1 + λ_f F_{f,i} + λ_c F_{c,i}`` with ``F_i = −log Ψ_i``,
  then averaged). They are equal when Ψ is the same for every query; the default is the one the
  benchmark supports (docs/objectives.md, "ASK reliability scope").

τ is the wrapped InfoNCE base's temperature (fixed or learnable). Text–text pairs
(CACL's anchor–other pair) and evaluation mode use the plain base loss: the knowledge
bases hold audio–text pairs, and ASK is training-only (retrieval uses plain encoder
embeddings). Both KBs are built at the first ``on_epoch_start`` / ``on_step_start``
and rebuilt every ``refresh_epochs`` epochs or ``refresh_steps`` steps (neither =
static KB); just before each rebuild the representation drift (RDM, Eq. 3–4) between
the new and the stale audio embeddings of a fixed sample of KB clips is logged and
reported by ``epoch_summary()`` as ``ask_rdm`` (history in ``drift_log``).

Args (the ``objective.knowledge`` section): see :class:`ASKConfig`.

Shapes: pair.left (B, d) audio, pair.right (B, d) text, pair.clip_index (B,) → scalar
``ask_loss`` and logged ``ask_f_fine``, ``ask_f_coarse``, ``ask_plan_diag`` (mean B·Q*_ii).

References: ASK (Guo et al. 2025) Eq. 3–4 (RDM), 6–7 (KBs), 8 and Appendix A (injection),
10–12 (reliability), 14 and Appendix C (OT), 15–18 (loss), §5.1 (K = 10, N_c = 512,
ρ = 0.2, β = 0.2, λ_f = 0.2, λ_c = 0.3, T = 15); SPEC §4.6.

Relations: wraps the :mod:`.infonce` base (the registry calls
:func:`wrap_with_knowledge` when ``objective.knowledge`` is set); composes with every
multilingual strategy (random, KCL: one ASK term per language pair; CACL: ASK on the two
audio–text pairs, InfoNCE on the text–text pair) and with regularizers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, ValidationError, model_validator
from torch import Tensor

from training import distributed
from training.config import ConfigError
from training.knowledge import (
    KnowledgeBase,
    Neighbours,
    build_coarse_kb,
    build_fine_kb,
    group_identical_rows,
    representation_drift,
    unique_audio,
)
from training.objectives.base import AlignedPair, BuildEnv, PairTerm, TermConfig, TrainingContext
from training.objectives.infonce import InfoNCE
from training.ot import sinkhorn_log

log = logging.getLogger(__name__)
TRAIN_SOURCE = "train"


class ASKConfig(TermConfig):
    sources: list[str] = Field(default_factory=lambda: [TRAIN_SOURCE], min_length=1)
    """``train`` (the training set, with self-exclusion) and/or paths of extra JSONL manifests."""
    fine: bool = True
    """Use the fine KB (ablation: false)."""
    coarse: bool = True
    """Use the coarse KB (ablation: false)."""
    n_clusters: int = Field(512, ge=1)
    kmeans_iters: int = Field(20, ge=1)
    top_k: int = Field(10, ge=1)
    inject: bool = True
    """Knowledge injection (ablation: false = plain embeddings in the similarities)."""
    rho: float = Field(0.2, ge=0, le=1)
    injection: Literal["appendix_a", "eq8"] = "appendix_a"
    reliability: Literal["adaptive", "uniform", "off"] = "adaptive"
    """``adaptive`` = Eq. 11 weights; ``uniform`` = w_j = 1/K (ablation); ``off`` = no modulation."""
    lambda_fine: float = Field(0.2, ge=0)
    lambda_coarse: float = Field(0.3, ge=0)
    reliability_scope: Literal["batch", "sample"] = "batch"
    """Eq. 17–18 per batch (one ``1 + λF`` per direction) or per sample (each query weighted by its
    own ``1 + λF_i``); equal when Ψ is constant (docs/objectives.md, "ASK reliability scope")."""
    potential_gradient: bool = False
    """Back-propagate through the potentials F = −log Ψ (Eq. 16–17 read literally, as the
    paper's Appendix B does). Off by default: with the gradient, ``(1 + λF)·L`` has a collapsed
    optimum — all embeddings equal gives Ψ → e, F → −1 and a loss of ½·log B — that a model
    trained from scratch falls into (seen on the small corpus: chance-level recall). Detached,
    F is the per-batch reliability weight the paper describes it as."""
    beta: float = Field(0.2, ge=0, le=1)
    ot_eps: float = Field(0.05, gt=0)
    ot_iters: int = Field(50, ge=1)
    refresh_epochs: int | None = Field(15, ge=1)
    refresh_steps: int | None = Field(None, ge=1)
    drift_sample: int = Field(256, ge=2)
    drift_tau: float = Field(0.1, gt=0)
    seed: int = 0
    partition: Literal["auto", "none"] = "auto"
    """``auto``: under torchrun (world size > 1) each rank holds the knowledge-base rows it
    embedded (about 1/R of them) and searches are merged over ranks, exactly; ``none``: every
    rank holds the whole KBs (docs/objectives.md, "ASK at scale")."""

    @model_validator(mode="after")
    def _check(self) -> ASKConfig:
        if not (self.fine or self.coarse):
            raise ValueError("at least one of fine / coarse must be enabled")
        if self.refresh_epochs is not None and self.refresh_steps is not None:
            raise ValueError("set refresh_epochs or refresh_steps, not both (null both for a static KB)")
        return self


def parse_knowledge_config(spec: Mapping[str, Any]) -> ASKConfig:
    """Validate the ``objective.knowledge`` section; raises :class:`ConfigError` naming the key."""
    try:
        return ASKConfig.model_validate(dict(spec))
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '<root>'}: {'unknown key' if e['type'] == 'extra_forbidden' else e['msg']}"
            for e in err.errors()
        )
        raise ConfigError(f"objective.knowledge: {problems}") from None


def inject(x: Tensor, knowledge: Tensor, *, rho: float, form: str) -> Tensor:
    """Interpolate embeddings x (B, d) with knowledge vectors (B, d) (Eq. 8 / Appendix A)."""
    share = rho if form == "appendix_a" else 1.0 - rho
    return (1.0 - share) * x + share * knowledge


def reliability_weights(candidates: Tensor, reference: Tensor) -> Tensor:
    """``w = softmax_j(s̄_j)``, ``s̄_j = mean_l candidates_j · reference_l`` (Eq. 10–11): (B, K, d), (B, K', d) → (B, K)."""
    return torch.einsum("bkd,bd->bk", candidates, reference.mean(dim=1)).softmax(dim=-1)


def knowledge_potential(query: Tensor, candidates: Tensor, reference: Tensor, *, adaptive: bool) -> Tensor:
    """``Ψ_i = Σ_j w_j exp(query_i · candidates_ij)`` (Eq. 12): (B, d), (B, K, d), (B, K', d) → (B,).

    ``adaptive=False`` replaces the reliability weights by ``w_j = 1/K``.
    """
    if adaptive:
        weights = reliability_weights(candidates, reference)
    else:
        weights = torch.full(candidates.shape[:2], 1.0 / candidates.shape[1], dtype=query.dtype, device=query.device)
    return (weights * torch.einsum("bkd,bd->bk", candidates, query).exp()).sum(dim=-1)


def realignment_plan(similarity: Tensor, *, eps: float, iters: int) -> Tensor:
    """``Q* = B · argmax_{Q ∈ U(1/B, 1/B)} ⟨Q, S⟩ + ε H(Q)`` (Appendix C), detached: (B, B) → (B, B)."""
    with torch.no_grad():
        return similarity.shape[0] * sinkhorn_log(-similarity.detach(), eps=eps, iters=iters, tol=1e-5)


def realigned_cross_entropy(similarity: Tensor, plan: Tensor, *, beta: float, scale: Tensor) -> Tensor:
    """Per-row cross-entropy (B,) with diagonal targets of ``scale · ((1 − β) I + β Q*) S`` (Eq. 14–15)."""
    realigned = (1.0 - beta) * similarity + beta * plan @ similarity
    targets = torch.arange(similarity.shape[0], device=similarity.device)
    return F.cross_entropy(scale * realigned, targets, reduction="none")


def modulated_loss(row_losses: Tensor, potentials: list[tuple[float, Tensor]], *, scope: str) -> Tensor:
    """``(1 + Σ_g λ_g F_g) · L`` of Eq. 17 for one direction.

    ``row_losses`` (B,): each query's loss; ``potentials``: (λ_g, F_g (B,) = −log Ψ_{g,i}) per
    granularity. ``batch``: ``(1 + Σ_g λ_g mean_i F_{g,i}) · mean_i L_i``; ``sample``:
    ``mean_i (1 + Σ_g λ_g F_{g,i}) L_i``. Identical when every F_g is constant over the batch.
    """
    if scope == "batch":
        factor = 1.0 + sum((lam * f.mean() for lam, f in potentials), torch.zeros((), device=row_losses.device))
        return factor * row_losses.mean()
    weights = 1.0 + sum((lam * f for lam, f in potentials), torch.zeros_like(row_losses))
    return (weights * row_losses).mean()


class ASK(PairTerm):
    """The ASK loss around an InfoNCE base; owns the knowledge bases and their refresh schedule."""

    name = "ask"
    Config = ASKConfig

    def __init__(self, config: ASKConfig, base: InfoNCE) -> None:
        super().__init__()
        self.config = config
        self.base = base
        self.fine_kb: KnowledgeBase | None = None
        self.coarse_kb: KnowledgeBase | None = None
        self.builds = 0
        self.built_epoch = 0
        self.built_step = 0
        self.drift_log: list[dict[str, float]] = []
        self._drift_rows: Tensor | None = None
        self._drift_stale: Tensor | None = None
        self._drift_clips = 0
        self._epoch_drift: float | None = None

    # -- loss ---------------------------------------------------------------------------
    def forward(self, pair: AlignedPair) -> dict[str, Tensor]:
        if pair.kind != "audio-text" or not self.training:
            return self.base(pair)
        if self.fine_kb is None and self.coarse_kb is None:
            raise RuntimeError(
                "ASK knowledge bases are not built: the training loop must call "
                "Objective.on_epoch_start(context) (or on_step_start) before the first step"
            )
        cfg = self.config
        scale = self.base.temperature.scale()
        out: dict[str, Tensor] = {}
        t2a, a2t, diag = [], [], []
        f_rows_t2a: list[tuple[float, Tensor]] = []
        f_rows_a2t: list[tuple[float, Tensor]] = []
        for name, kb, lam, exclude in (
            ("fine", self.fine_kb, cfg.lambda_fine, pair.clip_index),
            ("coarse", self.coarse_kb, cfg.lambda_coarse, None),
        ):
            if kb is None:
                continue
            k = kb.effective_k(cfg.top_k, exclude=exclude is not None)
            hood = kb.retrieve(pair.left, pair.right, k=k, exclude_clip=exclude)
            losses, plan = self._directional_losses(pair.left, pair.right, hood, scale)
            t2a.append(losses[0])
            a2t.append(losses[1])
            diag.append(plan.diagonal().mean())
            if cfg.reliability != "off":
                f_t2a, f_a2t = self._reliability_terms(pair.left, pair.right, hood)
                if not cfg.potential_gradient:
                    f_t2a, f_a2t = f_t2a.detach(), f_a2t.detach()
                f_rows_t2a.append((lam, f_t2a))
                f_rows_a2t.append((lam, f_a2t))
                out[f"ask_f_{name}"] = (0.5 * (f_t2a.mean() + f_a2t.mean())).detach()
                out[f"ask_f_{name}_std"] = (0.5 * (f_t2a.std(correction=0) + f_a2t.std(correction=0))).detach()
        loss_t2a = modulated_loss(torch.stack(t2a).mean(dim=0), f_rows_t2a, scope=cfg.reliability_scope)
        loss_a2t = modulated_loss(torch.stack(a2t).mean(dim=0), f_rows_a2t, scope=cfg.reliability_scope)
        out["ask_loss"] = 0.5 * (loss_t2a + loss_a2t)
        out["ask_plan_diag"] = torch.stack(diag).mean()
        out["tau"] = self.base.temperature.tau().detach()
        return out

    def _directional_losses(
        self, u: Tensor, v: Tensor, hood: Neighbours, scale: Tensor
    ) -> tuple[tuple[Tensor, Tensor], Tensor]:
        """((L_{T→A}, L_{A→T}) on the enhanced, realigned similarities, Q*^{T→A})."""
        cfg = self.config
        if cfg.inject:
            u = inject(u, hood.audio.mean(dim=1), rho=cfg.rho, form=cfg.injection)
            v = inject(v, hood.text.mean(dim=1), rho=cfg.rho, form=cfg.injection)
        sim_t2a = v @ u.t()
        plan = realignment_plan(sim_t2a, eps=cfg.ot_eps, iters=cfg.ot_iters)
        loss_t2a = realigned_cross_entropy(sim_t2a, plan, beta=cfg.beta, scale=scale)
        loss_a2t = realigned_cross_entropy(sim_t2a.t(), plan.t(), beta=cfg.beta, scale=scale)
        return (loss_t2a, loss_a2t), plan

    def _reliability_terms(self, u: Tensor, v: Tensor, hood: Neighbours) -> tuple[Tensor, Tensor]:
        """Per-query potentials (−log Ψ^{T→A}_i, −log Ψ^{A→T}_i), each (B,); their means are F (Eq. 16)."""
        adaptive = self.config.reliability == "adaptive"
        psi_t2a = knowledge_potential(u, hood.text_partner, hood.audio, adaptive=adaptive)
        psi_a2t = knowledge_potential(v, hood.audio_partner, hood.text, adaptive=adaptive)
        return -psi_t2a.log(), -psi_a2t.log()

    # -- knowledge bases ----------------------------------------------------------------
    def on_epoch_start(self, context: TrainingContext) -> None:
        self.base.on_epoch_start(context)
        every = self.config.refresh_epochs
        if self.builds == 0 or (every is not None and context.epoch - self.built_epoch >= every):
            self.rebuild(context)

    def on_step_start(self, context: TrainingContext) -> None:
        self.base.on_step_start(context)
        every = self.config.refresh_steps
        if self.builds == 0 or (every is not None and context.step - self.built_step >= every):
            self.rebuild(context)

    @property
    def partitioned(self) -> bool:
        """Whether the KBs are split over the ranks (``partition: auto`` under a group of > 1)."""
        return self.config.partition == "auto" and distributed.world_size() > 1

    def rebuild(self, context: TrainingContext) -> None:
        """Embed the sources with the current encoders, log the drift, replace both KBs."""
        cfg = self.config
        split = self.partitioned
        self.fine_kb = self.coarse_kb = None  # the old KBs go before the new ones are built
        with torch.no_grad():
            if split:
                audio, text, clip, rows = self._embed_sources_local(context)
            else:
                (audio, text, clip), rows = self._embed_sources(context), None
            self._track_drift(audio, text, clip, context)
            self.fine_kb = build_fine_kb(audio, text, clip, partitioned=split) if cfg.fine else None
            self.coarse_kb = (
                build_coarse_kb(audio, text, n_clusters=cfg.n_clusters, seed=cfg.seed + self.builds,
                                iters=cfg.kmeans_iters, rows=rows, partitioned=split)
                if cfg.coarse else None
            )
        self.builds += 1
        self.built_epoch, self.built_step = context.epoch, context.step
        held = f"; this rank holds {audio.shape[0]} of them (partitioned)" if split else ""
        log.info(
            "ASK knowledge bases built (#%d, epoch %d, step %d): %s pairs, fine %s, coarse %s%s",
            self.builds, context.epoch, context.step,
            self.fine_kb.text.total if self.fine_kb else audio.shape[0],
            f"{self.fine_kb.audio.total} clips / {self.fine_kb.text.total} texts" if self.fine_kb else "off",
            f"{len(self.coarse_kb.audio)} prototypes" if self.coarse_kb else "off", held,
        )

    def _embed_sources(self, context: TrainingContext) -> tuple[Tensor, Tensor, Tensor]:
        audios, texts, clips = [], [], []
        offset = 0
        for source in self.config.sources:
            if source == TRAIN_SOURCE:
                audio, text, clip = context.embed_training_pairs()
            else:
                audio, text = context.embed_manifest_pairs(Path(source))
                clip = group_identical_rows(audio, offset=offset)
                offset = int(-clip.min()) if clip.numel() else offset
            audios.append(audio.detach().float())
            texts.append(text.detach().float().to(audio.device))
            clips.append(clip.long().to(audio.device))
        return torch.cat(audios), torch.cat(texts), torch.cat(clips)

    def _embed_sources_local(self, context: TrainingContext) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """This rank's pairs of every source: (audio, text, clip id, global row), each (N_local, ...).

        The global row is the pair's row in what :meth:`_embed_sources` returns on one process
        (sources in order; a source's pairs by clip — training row or record — then caption),
        computed from the gathered clip ids (8 B per pair). Extra manifests' ids are
        ``−1 − offset − record`` (a record is a clip), not :func:`group_identical_rows`.
        """
        audios, texts, clips, rows = [], [], [], []
        row_offset = id_offset = 0
        for source in self.config.sources:
            if source == TRAIN_SOURCE:
                audio, text, key = context.embed_training_pairs_local()
                key = key.long().to(audio.device)
                clip = key
            else:
                audio, text, key = context.embed_manifest_pairs_local(Path(source))
                key = key.long().to(audio.device)
                clip = -1 - id_offset - key
                top = key.max() if key.numel() else torch.tensor(-1, device=audio.device)
                id_offset += int(distributed.all_reduce_max(top.reshape(1)).item()) + 1
            everyone = torch.sort(distributed.all_gather_rows(key)).values
            first_local = torch.searchsorted(key, key)  # a clip's pairs are contiguous, ascending
            ordinal = torch.arange(key.numel(), device=key.device) - first_local
            rows.append(row_offset + torch.searchsorted(everyone, key) + ordinal)
            row_offset += int(everyone.numel())
            audios.append(audio.detach().float())
            texts.append(text.detach().float().to(audio.device))
            clips.append(clip)
        return torch.cat(audios), torch.cat(texts), torch.cat(clips), torch.cat(rows)

    def _drift_sample(self, clip_audio: Tensor, ids: Tensor) -> tuple[Tensor, int]:
        """(audio of the drift sample's clips (n, d) in id order, clips in the sources): this
        rank's unique clips ``clip_audio`` (C, d) with ascending ``ids``; partitioned, the sample
        is drawn over every rank's clips and gathered (C ids and n·d floats)."""
        everyone = torch.sort(distributed.all_gather_rows(ids)).values if self.partitioned else ids
        if self._drift_rows is None:
            rng = np.random.default_rng(self.config.seed)
            count = min(self.config.drift_sample, everyone.shape[0])
            self._drift_rows = torch.from_numpy(np.sort(rng.choice(everyone.shape[0], count, replace=False)))
        if self._drift_rows.numel() and int(self._drift_rows.max()) >= everyone.shape[0]:
            return clip_audio[:0], int(everyone.shape[0])
        if not self.partitioned:
            return clip_audio[self._drift_rows.to(clip_audio.device)], int(everyone.shape[0])
        wanted = everyone[self._drift_rows.to(everyone.device)]
        mine = torch.isin(ids, wanted)
        got_ids = distributed.all_gather_rows(ids[mine])
        got = distributed.all_gather_rows(clip_audio[mine])
        return got[torch.argsort(got_ids)], int(everyone.shape[0])

    def _track_drift(self, audio: Tensor, text: Tensor, clip: Tensor, context: TrainingContext) -> None:
        """RDM between the new and the stale embeddings of a fixed sample of source clips (Eq. 3–4)."""
        clip_audio, _, ids, _ = unique_audio(audio, text, clip)
        first = self._drift_rows is None or self._drift_stale is None
        sample, clips = self._drift_sample(clip_audio, ids)
        if first:
            self._drift_clips = clips
        elif clips == self._drift_clips and self._drift_stale is not None:
            rdm = representation_drift(sample, self._drift_stale, tau=self.config.drift_tau)
            self._epoch_drift = rdm
            self.drift_log.append({"epoch": float(context.epoch), "step": float(context.step), "rdm": rdm})
            log.info("ASK representation drift before rebuild at epoch %d, step %d: RDM = %.6f",
                     context.epoch, context.step, rdm)
        else:
            log.warning("ASK: the knowledge sources changed size; drift not measured, sample reset")
            self._drift_rows = self._drift_stale = None
            self._track_drift(audio, text, clip, context)
            return
        self._drift_stale = sample.clone()

    def epoch_summary(self) -> dict[str, float]:
        summary = dict(self.base.epoch_summary())
        summary["ask_kb_builds"] = float(self.builds)
        if self._epoch_drift is not None:
            summary["ask_rdm"] = self._epoch_drift
            self._epoch_drift = None
        return summary


def wrap_with_knowledge(spec: Mapping[str, Any], base: PairTerm, env: BuildEnv) -> ASK:
    """Wrap the base loss with ASK (called by the registry when ``objective.knowledge`` is set)."""
    config = parse_knowledge_config(spec)
    if not isinstance(base, InfoNCE):
        raise ConfigError(
            "objective.knowledge (ASK) modulates an NT-Xent loss and needs objective.base.name = infonce "
            f"without distillation; got {type(base).__name__}"
        )
    return ASK(config, base)
