"""The dual encoder (SPEC §3): an audio and a text tower mapped to one L2-normalised space.

``build_dual_encoder`` picks the towers from :class:`ModelConfig`; each tower is
followed by a projection head (dropout + linear) to ``embed_dim`` and an L2
norm. ``audio_module()`` / ``text_module()`` are the exportable modules with the
ONNX signatures of the bundle (``waveform`` → ``embedding``;
``input_ids, attention_mask`` → ``embedding``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from training.config import ConfigError, FrontendConfig, ModelConfig
from training.models.audio_cnn import AudioCNN
from training.models.text_transformer import TextTransformer

PAIRED_KINDS = ("hf_clap", "hf_pe_audio")
"""Tower kinds that are one pretrained joint space (CLAP, PE-Audio): heads start as the identity."""


class ProjectionHead(nn.Module):
    """Dropout + linear map to ``embed_dim``.

    ``identity_init`` (square heads only) starts as the identity, so a pretrained
    joint space (CLAP) is kept at initialisation.
    """

    def __init__(
        self, in_dim: int, out_dim: int, *, dropout: float, identity_init: bool = False
    ) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.linear = nn.Linear(in_dim, out_dim)
        if identity_init and in_dim == out_dim:
            with torch.no_grad():
                self.linear.weight.copy_(torch.eye(out_dim))
                self.linear.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(self.drop(x))


class AudioEncoder(nn.Module):
    """waveform (B, T) float32 → L2-normalised embedding (B, d); frontend inside the tower."""

    def __init__(self, tower: nn.Module, head: ProjectionHead) -> None:
        super().__init__()
        self.tower = tower
        self.head = head

    def forward(self, waveform: Tensor) -> Tensor:
        return nn.functional.normalize(self.head(self.tower(waveform)), dim=-1)


class TextEncoder(nn.Module):
    """(input_ids (B, L), attention_mask (B, L)) int64 → L2-normalised embedding (B, d)."""

    def __init__(self, tower: nn.Module, head: ProjectionHead) -> None:
        super().__init__()
        self.tower = tower
        self.head = head

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return nn.functional.normalize(self.head(self.tower(input_ids, attention_mask)), dim=-1)


def trim_right_padding(input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Drop trailing columns that are padding in every row (no effect on the embeddings).

    Captions are padded to ``max_length``; most are much shorter, so training
    skips the all-padding tail. Left-padded or ragged masks are returned as-is.
    """
    length = max(int(attention_mask.sum(dim=1).max()), 1)
    if length >= attention_mask.shape[1] or bool(attention_mask[:, length:].any()):
        return input_ids, attention_mask
    return input_ids[:, :length], attention_mask[:, :length]


class DualEncoder(nn.Module):
    """Audio and text encoders sharing an ``embed_dim``-dimensional L2-normalised space.

    ``hf_configs`` holds the full Hugging Face config dict of each HF tower
    (``{"audio": {...}, "text": {...}}``) so a checkpoint can rebuild the
    architecture without the original model directory.
    """

    def __init__(
        self,
        audio: AudioEncoder,
        text: TextEncoder,
        *,
        embed_dim: int,
        hf_configs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        super().__init__()
        self.audio = audio
        self.text = text
        self.embed_dim = embed_dim
        self.hf_configs = dict(hf_configs or {})

    def encode_audio(self, waveform: Tensor) -> Tensor:
        """waveform (B, T) float32 → (B, d), L2-normalised."""
        return self.audio(waveform)

    def encode_text(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """input_ids, attention_mask (B, L) int64 → (B, d), L2-normalised."""
        return self.text(*trim_right_padding(input_ids, attention_mask))

    def forward(
        self, waveform: Tensor, input_ids: Tensor, attention_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Both encoders in one call (what DistributedDataParallel wraps): ((B, d), (N, d))."""
        return self.encode_audio(waveform), self.encode_text(input_ids, attention_mask)

    def audio_module(self) -> nn.Module:
        """Exportable ``forward(waveform) -> embedding`` module (shares parameters)."""
        return self.audio

    def text_module(self) -> nn.Module:
        """Exportable ``forward(input_ids, attention_mask) -> embedding`` module (shares parameters)."""
        return self.text


def _build_towers(
    model_cfg: ModelConfig,
    frontend_cfg: FrontendConfig,
    *,
    vocab_size: int,
    hf_configs: dict[str, dict[str, Any]],
) -> tuple[nn.Module, nn.Module, dict[str, dict[str, Any]]]:
    """Audio tower, text tower and the HF configs used (empty for built-in towers)."""
    from training.models import hf  # transformers is imported only for hf_* kinds

    audio_cfg, text_cfg = model_cfg.audio, model_cfg.text
    used: dict[str, dict[str, Any]] = {}
    if (
        audio_cfg.kind == "hf_clap"
        and text_cfg.kind == "hf_clap"
        and text_cfg.path in (None, audio_cfg.path)
    ):
        audio, text, config = hf.build_hf_clap_pair(
            path=audio_cfg.path, frontend_cfg=frontend_cfg, config=hf_configs.get("audio")
        )
        return audio, text, {"audio": config, "text": config}
    if audio_cfg.kind == "hf_pe_audio" or text_cfg.kind == "hf_pe_audio":
        from training.models.pretrained_pe_audio import build_pe_audio_pair

        if not (audio_cfg.kind == text_cfg.kind == "hf_pe_audio" and text_cfg.path in (None, audio_cfg.path)):
            raise ConfigError("model.audio.kind and model.text.kind are both hf_pe_audio, from one folder "
                              "(model.audio.path; model.text.path unset): PE-Audio's joint space is the pair")
        audio, text, config = build_pe_audio_pair(
            path=audio_cfg.path, sample_rate=frontend_cfg.sample_rate, config=hf_configs.get("audio")
        )
        return audio, text, {"audio": config, "text": config}
    if audio_cfg.kind == "cnn":
        audio = AudioCNN(audio_cfg, frontend_cfg)
    else:
        audio, used["audio"] = hf.build_hf_audio_tower(
            audio_cfg.kind,
            path=audio_cfg.path,
            frontend_cfg=frontend_cfg,
            config=hf_configs.get("audio"),
        )
    if text_cfg.kind == "builtin":
        text = TextTransformer(text_cfg, vocab_size=vocab_size)
    else:
        text, used["text"] = hf.build_hf_text_tower(
            text_cfg.kind,
            path=text_cfg.path,
            pooling=text_cfg.pooling,
            config=hf_configs.get("text"),
        )
    return audio, text, used


def build_dual_encoder(
    model_cfg: ModelConfig,
    frontend_cfg: FrontendConfig,
    *,
    vocab_size: int,
    hf_configs: dict[str, dict[str, Any]] | None = None,
) -> DualEncoder:
    """Build the dual encoder of ``model_cfg``.

    ``vocab_size`` is the tokenizer's (built-in text tower only). ``hf_configs``
    (from a checkpoint) rebuilds HF towers from their saved configs with random
    weights instead of ``from_pretrained`` — the checkpoint's weights follow.
    """
    audio, text, used = _build_towers(
        model_cfg, frontend_cfg, vocab_size=vocab_size, hf_configs=hf_configs or {}
    )
    d = model_cfg.embed_dim
    audio_head = ProjectionHead(
        audio.out_dim,
        d,
        dropout=model_cfg.audio.dropout,
        identity_init=model_cfg.audio.kind in PAIRED_KINDS,
    )
    text_head = ProjectionHead(
        text.out_dim,
        d,
        dropout=model_cfg.text.dropout,
        identity_init=model_cfg.text.kind in PAIRED_KINDS,
    )
    return DualEncoder(
        AudioEncoder(audio, audio_head), TextEncoder(text, text_head), embed_dim=d, hf_configs=used
    )
