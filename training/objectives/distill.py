"""Estimated audio–caption correspondences: distillation from frozen stage-1 teachers.

The M teachers' similarity matrices on the same batch are averaged,
``Ĉ = 1/M Σ_m C^m`` with ``C^m_ij = teacher_left^m_i · teacher_right^m_j``; the targets are
``p̂_a = softmax_i(Ĉ/τ)`` (audios given a caption, column-wise) and
``p̂_c = softmax_j(Ĉ/τ)`` (captions given an audio, row-wise); the student's ``q_a``,
``q_c`` are the same softmaxes of its own ``S/τ``, and

    L_dist = ½ [H(p̂_a, q_a) + H(p̂_c, q_c)],     L = λ L_sup + (1 − λ) L_dist.

The ½ puts ``L_dist`` on the scale of this repo's InfoNCE (mean of its two directions):
with one-hot targets ``p̂ = I``, ``L_dist`` equals InfoNCE at the same τ. ``L_sup`` is the
configured base loss, only computed when λ > 0. M = 1 is self-distillation.

Args (the ``objective.distill`` section):
    teachers: stage-1 checkpoint directories (frozen, eval mode; loaded by
        :func:`training.teachers.build_teachers`, not here).
    tau: temperature τ of targets and student (logit scale = 1/τ), default 0.05 (fixed).
    mix_lambda: λ, default 0 (pure distillation).
    cache: ``auto`` | ``on`` | ``off`` — caching of teacher embeddings, see
        :mod:`training.teachers`.

Shapes: pair.left (B, d), pair.right (B, d); pair.teacher_left / teacher_right (M, B, d_t)
→ scalars.

References: Primus et al., "Estimated Audio–Caption Correspondences Improve Language-Based
Audio Retrieval", §2 (``q_a``, ``q_c``, ``L_sup``), §3 (``Ĉ``, ``p̂_a``, ``p̂_c``, ``L_dist``;
the paper's equations are unnumbered), §4.3 (τ = 0.05, stage-2 init from stage 1),
§5.3 (λ mix); SPEC §4.4.

Relations: wraps any base loss (the registry calls :func:`wrap_with_distillation` when
``objective.distill`` is set); replaces InfoNCE's one-hot targets by soft ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, ValidationError
from torch import Tensor

from training.config import ConfigError
from training.objectives.base import AlignedPair, BuildEnv, PairTerm, TermConfig, TrainingContext


class DistillConfig(TermConfig):
    teachers: list[Path] = Field(min_length=1)
    tau: float = Field(0.05, gt=0)
    mix_lambda: float = Field(0.0, ge=0, le=1)
    cache: Literal["auto", "on", "off"] = "auto"
    cache_max_mib: float = Field(2048.0, gt=0)
    """Host memory budget of each teacher cache (audio per clip, text per caption) on each rank;
    past it the least recently used entries are dropped (and re-embedded when met again)."""


def parse_distill_config(spec: Mapping[str, Any]) -> DistillConfig:
    """Validate the ``objective.distill`` section; raises :class:`ConfigError` naming the key."""
    try:
        return DistillConfig.model_validate(dict(spec))
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '<root>'}: {'unknown key' if e['type'] == 'extra_forbidden' else e['msg']}"
            for e in err.errors()
        )
        raise ConfigError(f"objective.distill: {problems}") from None


def ensemble_similarity(teacher_left: Tensor, teacher_right: Tensor) -> Tensor:
    """``Ĉ = 1/M Σ_m left^m right^mᵀ``: (M, B, d), (M, B, d) → (B, B)."""
    return torch.einsum("mid,mjd->ij", teacher_left, teacher_right) / teacher_left.shape[0]


def soft_targets(similarity: Tensor, tau: float) -> tuple[Tensor, Tensor]:
    """(p̂_a column-wise softmax over rows, p̂_c row-wise softmax over columns) of ``similarity/τ``."""
    logits = similarity / tau
    return logits.softmax(dim=0), logits.softmax(dim=1)


def distillation_loss(student_logits: Tensor, target_a: Tensor, target_c: Tensor) -> Tensor:
    """``½ [H(p̂_a, q_a) + H(p̂_c, q_c)]`` with ``q`` the column / row softmaxes of ``student_logits``.

    ``H(p, q)`` is averaged over the conditioning items (captions for ``a``, audios for ``c``).
    """
    h_a = -(target_a * student_logits.log_softmax(dim=0)).sum(dim=0).mean()
    h_c = -(target_c * student_logits.log_softmax(dim=1)).sum(dim=1).mean()
    return 0.5 * (h_a + h_c)


class Distillation(PairTerm):
    name = "distill"
    Config = DistillConfig

    def __init__(self, config: DistillConfig, base: PairTerm) -> None:
        super().__init__()
        self.config = config
        self.base = base
        self.kinds = base.kinds  # type: ignore[misc]

    def forward(self, pair: AlignedPair) -> dict[str, Tensor]:
        if pair.teacher_left is None or pair.teacher_right is None:
            raise RuntimeError(
                "distillation needs teacher embeddings in the batch: the loop must fill "
                "EmbeddingBatch.teacher_audio / teacher_text from training.teachers.Teachers.embed"
            )
        lam = self.config.mix_lambda
        out: dict[str, Tensor] = {}
        if lam > 0:
            for key, value in self.base(pair).items():
                out[key] = lam * value if key.endswith("_loss") else value
        with torch.no_grad():
            target_a, target_c = soft_targets(
                ensemble_similarity(pair.teacher_left, pair.teacher_right), self.config.tau
            )
        student_logits = pair.left @ pair.right.t() / self.config.tau
        out["distill_loss"] = (1.0 - lam) * distillation_loss(student_logits, target_a, target_c)
        return out

    def on_epoch_start(self, context: TrainingContext) -> None:
        self.base.on_epoch_start(context)

    def on_step_start(self, context: TrainingContext) -> None:
        self.base.on_step_start(context)

    def epoch_summary(self) -> dict[str, float]:
        return self.base.epoch_summary()


def wrap_with_distillation(spec: Mapping[str, Any], base: PairTerm, env: BuildEnv) -> Distillation:
    """The registry's hook: the base loss wrapped into ``λ L_sup + (1 − λ) L_dist``."""
    return Distillation(parse_distill_config(spec), base)
