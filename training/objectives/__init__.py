"""Training objectives of SPEC §4: one file per objective, built by :mod:`.registry`."""

from training.objectives.base import AlignedPair, EmbeddingBatch, Objective, total_loss
from training.objectives.registry import build_objective

__all__ = ["AlignedPair", "EmbeddingBatch", "Objective", "build_objective", "total_loss"]
