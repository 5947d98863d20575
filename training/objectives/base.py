"""The objective interface shared by every loss of SPEC §4.

An objective works on embeddings, never on the model:

* the data loader asks the *strategy* which caption(s) of each clip to embed
  (``Strategy.views``), so a batch holds ``V`` text views per clip;
* the loop embeds them and hands an :class:`EmbeddingBatch` to the
  :class:`Objective`;
* the strategy turns the batch into weighted :class:`AlignedPair` s (audio–text,
  or text–text for co-anchor learning); the base loss and every regularizer that
  accepts the pair's kind return a dict of named terms; names ending in
  ``_loss`` are summed by the loop, every other entry is only logged.

Adding an objective = one file with one :class:`PairTerm` (or :class:`Strategy`)
subclass + one line in :mod:`training.objectives.registry`.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor, nn

PairKind = Literal["audio-text", "text-text"]


class TermConfig(BaseModel):
    """Base of every objective's own config (``extra="forbid"``: unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class BuildEnv:
    """What an objective may need to know about the run when it is built."""

    languages: tuple[str, ...]
    embed_dim: int


@dataclass
class EmbeddingBatch:
    """Embeddings of one training batch.

    Shapes: ``audio`` (B, d); ``text`` (V, B, d) with ``text_mask`` (V, B) telling
    which views exist (a clip may lack a language); ``clip_index`` (B,) indices
    of the clips in the training set. Teacher embeddings (distillation) are
    ``teacher_audio`` (M, B, d) and ``teacher_text`` (M, V, B, d). All
    embeddings are L2-normalized.
    """

    audio: Tensor
    text: Tensor
    text_mask: Tensor
    clip_index: Tensor
    teacher_audio: Tensor | None = None
    teacher_text: Tensor | None = None
    local_rows: Tensor | None = None
    """(B,) bool: the rows this process scores in local-loss mode (None = every row)."""
    replicas: int = 1
    """Processes that share the rows in local-loss mode (1 otherwise); see :func:`row_mean`."""

    @property
    def batch_size(self) -> int:
        return int(self.audio.shape[0])


@dataclass
class AlignedPair:
    """Two row-aligned embedding sets (row i of ``left`` matches row i of ``right``).

    ``left`` is audio for ``audio-text`` pairs, the anchor text for ``text-text``.
    ``weight`` is this pair's share of the batch loss (a strategy's weights sum to 1).
    """

    left: Tensor
    right: Tensor
    clip_index: Tensor
    kind: PairKind
    weight: float
    name: str
    teacher_left: Tensor | None = None
    teacher_right: Tensor | None = None
    local_rows: Tensor | None = None
    """Row indices this process scores (local-loss mode, training.distributed); None = all."""
    replicas: int = 1

    def query_rows(self) -> Tensor:
        """Indices of the rows whose loss this process computes."""
        if self.local_rows is None:
            return torch.arange(self.left.shape[0], device=self.left.device)
        return self.local_rows


def row_mean(row_losses: Tensor, pair: AlignedPair) -> Tensor:
    """Mean over *all* rows of the pair of a per-row loss computed for ``pair.query_rows()``.

    In local-loss mode this process holds only its rows: their sum × replicas / rows, whose
    mean over the processes is the mean over every row (training.distributed).
    """
    if pair.local_rows is None:
        return row_losses.mean()
    return row_losses.sum() * pair.replicas / pair.left.shape[0]


class TrainingContext(Protocol):
    """What the loop offers to objectives with state across steps (ASK's knowledge bases)."""

    epoch: int
    step: int
    device: torch.device

    def embed_training_pairs(self) -> tuple[Tensor, Tensor, Tensor]:
        """(audio (N, d), text (N, d), clip_index (N,)) for every (clip, caption) pair of the training set."""
        ...

    def embed_manifest_pairs(self, manifest: Path) -> tuple[Tensor, Tensor]:
        """(audio (N, d), text (N, d)) for every (clip, caption) pair of another manifest."""
        ...

    def embed_training_pairs_local(self) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's share of :meth:`embed_training_pairs` (no gather; a clip's pairs on one rank,
        ascending by clip index)."""
        ...

    def embed_manifest_pairs_local(self, manifest: Path) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's share of another manifest's pairs: (audio, text, record row), ascending by row."""
        ...

    def embed_clips(self, clip_index: Tensor) -> Tensor:
        """Audio embeddings of the given training clips with the current encoders (no grad)."""
        ...


class PairTerm(nn.Module, ABC):
    """A loss term on an :class:`AlignedPair` (base loss or regularizer)."""

    name: ClassVar[str]
    Config: ClassVar[type[TermConfig]] = TermConfig
    kinds: ClassVar[frozenset[str]] = frozenset({"audio-text", "text-text"})
    supports_local_loss: ClassVar[bool] = False
    """True when the loss is a sum over rows that reads ``pair.query_rows()`` (local-loss mode)."""

    @abstractmethod
    def forward(self, pair: AlignedPair) -> dict[str, Tensor]:
        """Named terms of this pair; keys ending in ``_loss`` are summed by the loop."""

    # Hooks for stateful terms; no-ops by default.
    def on_epoch_start(self, context: TrainingContext) -> None:
        return None

    def on_step_start(self, context: TrainingContext) -> None:
        return None

    def epoch_summary(self) -> dict[str, float]:
        """Numbers to log once per epoch (e.g. SupCLAP's mean radius), then reset."""
        return {}


class Strategy(ABC):
    """Multilingual batching: which captions a clip contributes, and how they pair up."""

    name: ClassVar[str]
    Config: ClassVar[type[TermConfig]] = TermConfig

    def __init__(self, config: TermConfig, env: BuildEnv) -> None:
        self.config = config
        self.languages = env.languages

    @property
    @abstractmethod
    def num_views(self) -> int:
        """How many text views each clip contributes to a batch."""

    @abstractmethod
    def views(self, captions: Mapping[str, Sequence[str]], rng: random.Random) -> list[str | None]:
        """The ``num_views`` caption texts of one clip for this epoch (None = missing)."""

    @abstractmethod
    def pairs(self, batch: EmbeddingBatch) -> list[AlignedPair]:
        """The weighted row-aligned pairs this batch is scored on (empty rows removed)."""


def select_rows(
    batch: EmbeddingBatch, view: int, *, name: str, weight: float, left: Tensor | None = None,
    left_view: int | None = None,
) -> AlignedPair | None:
    """Pair audio (or text view `left_view`) with text view `view`, keeping rows where both exist.

    Returns None when fewer than two rows remain (no negatives to contrast with).
    """
    mask = batch.text_mask[view]
    kind: PairKind = "audio-text"
    teacher_left = batch.teacher_audio
    if left_view is not None:
        mask = mask & batch.text_mask[left_view]
        left = batch.text[left_view]
        kind = "text-text"
        teacher_left = batch.teacher_text[:, left_view] if batch.teacher_text is not None else None
    elif left is None:
        left = batch.audio
    if int(mask.sum()) < 2:
        return None
    local_rows = None
    if batch.local_rows is not None:  # positions of this process's rows among the kept ones
        local_rows = batch.local_rows[mask].nonzero().squeeze(1)
    teacher_right = batch.teacher_text[:, view] if batch.teacher_text is not None else None
    return AlignedPair(
        left=left[mask],
        right=batch.text[view][mask],
        clip_index=batch.clip_index[mask],
        kind=kind,
        weight=weight,
        name=name,
        teacher_left=teacher_left[:, mask] if teacher_left is not None else None,
        teacher_right=teacher_right[:, mask] if teacher_right is not None else None,
        local_rows=local_rows,
        replicas=batch.replicas,
    )


class Objective(nn.Module):
    """Base loss + strategy + regularizers, as built by the registry from config."""

    def __init__(self, *, base: PairTerm, strategy: Strategy, regularizers: Sequence[PairTerm] = ()) -> None:
        nn.Module.__init__(self)
        self.base = base
        self.strategy = strategy
        self.regularizers = nn.ModuleList(regularizers)

    @property
    def terms(self) -> list[PairTerm]:
        return [self.base, *self.regularizers]  # type: ignore[list-item]

    def forward(self, batch: EmbeddingBatch) -> dict[str, Tensor]:
        pairs = self.strategy.pairs(batch)
        if not pairs:
            raise ValueError("the batch yields no pair with at least two rows; increase the batch size")
        total_weight = sum(pair.weight for pair in pairs)
        out: dict[str, Tensor] = {}
        logged_share: dict[str, float] = {}
        for pair in pairs:
            share = pair.weight / total_weight
            for term in self.terms:
                if pair.kind not in term.kinds:
                    continue
                for key, value in term(pair).items():
                    out[key] = out.get(key, 0.0) + share * value
                    logged_share[key] = logged_share.get(key, 0.0) + share
        # A loss keeps its share of the batch (a term that skips a pair kind contributes
        # nothing there); a logged value is the mean over the pairs that produced it.
        return {
            key: value if key.endswith("_loss") else value / logged_share[key]
            for key, value in out.items()
        }

    def on_epoch_start(self, context: TrainingContext) -> None:
        for term in self.terms:
            term.on_epoch_start(context)

    def on_step_start(self, context: TrainingContext) -> None:
        for term in self.terms:
            term.on_step_start(context)

    def epoch_summary(self) -> dict[str, float]:
        summary: dict[str, float] = {}
        for term in self.terms:
            summary.update(term.epoch_summary())
        return summary


def total_loss(terms: Mapping[str, Tensor]) -> Tensor:
    """Sum of the entries whose name ends in ``_loss``."""
    losses = [value for key, value in terms.items() if key.endswith("_loss")]
    if not losses:
        raise ValueError(f"objective returned no '_loss' term (got {sorted(terms)})")
    return torch.stack([torch.as_tensor(v) for v in losses]).sum()

