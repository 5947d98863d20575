"""Encoders of SPEC §3: log-mel frontend, built-in towers, Hugging Face towers, dual encoder.

Plug-in point: a new tower kind = one module here + one branch in
``dual_encoder._build_towers`` (and its ``kind`` literal in ``training/config.py``).
"""

from __future__ import annotations

from training.models.dual_encoder import DualEncoder, build_dual_encoder
from training.models.frontend import LogMelFrontend
from training.models.tokenizer import build_tokenizer, train_bpe_tokenizer

__all__ = [
    "DualEncoder",
    "LogMelFrontend",
    "build_dual_encoder",
    "build_tokenizer",
    "train_bpe_tokenizer",
]
