"""A Meta PE-Audio (``PeAudioModel``) folder as the two encoders of a bundle, no training (SPEC §11).

Perception Encoder Audio (Meta, "Perception Encoder: audio-visual", 2025; transformers 5.x
``models/pe_audio``) embeds raw 48 kHz mono waveforms: a DAC-style convolutional codec encoder
(hop 1920 samples = 25 frames/s), a 1×1 bottleneck, a transformer with rotary positions and a
class token, and ``audio_head`` (LayerNorm + linear). Text is ModernBERT; the joint-space text
embedding is ``text_audio_head`` of the **last hidden state at position 0**, as
``PeAudioModel.forward`` computes ``text_audio_embeds`` (its ``get_text_audio_embeds`` fails on a
default config in transformers 5.x: it does not ask the text model for hidden states).

The folder holds ``config.json`` (``model_type = "pe_audio"``), the weights, the ModernBERT
tokenizer and ``preprocessor_config.json`` (``PeAudioFeatureExtractor``; its defaults are used
when absent). :func:`load_pretrained_pe_audio` returns

* :class:`PeAudioAudioEmbedder` — waveform (B, N) → ``get_audio_embeds`` (B, d), L2-normalised;
  the extractor computes no features, so the whole model is in the graph;
* :class:`PeAudioTextEmbedder` — token ids → ``text_audio_embeds`` (B, d), L2-normalised;
* :class:`PeAudioSettings` — what the bundle records and the service applies.

What the encoders see per clip (docs/models.md, "Bring your own model"):

* shorter than the window: reflect-padded to a multiple of ``hop_length`` — exactly the
  extractor's ``_reflect_pad`` — and embedded at that length (the model has no maximum length;
  the extractor's batch zero-padding + ``padding_mask`` only matter in mixed-length batches, and
  the loader never mixes lengths in one call);
* the window (``clip_samples``, a hop multiple): as the extractor (no padding);
* longer: the extractor has no policy (the model would attend over the whole clip, at a cost
  quadratic in length); bundles chunk and average windows as every tonearm bundle does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from index.tokenizer import TextTokenizer
from training.config import ConfigError
from training.models.hf import check_model_folder, first_line, load_model_and_tokenizer
from training.models.tokenizer import load_hf_tokenizer

PREPROCESSOR = "preprocessor_config.json"
KEY = "--pretrained"
WINDOW_SECONDS = 10.0
"""The window a bundle embeds at once (clips longer are chunked and averaged): 10 s, the length of
AudioSet / AudioCaps / most Clotho clips, rounded down to a multiple of ``hop_length``."""
TEXT_MAX_LENGTH = 512
"""Tokens per caption at most (ModernBERT allows 8192; captions and queries are far shorter, and the
export's probe runs at this length)."""


@dataclass(frozen=True)
class PeAudioSettings:
    """The extractor's settings that decide what the audio encoder sees (bundle manifest fields)."""

    sample_rate: int
    hop_length: int
    max_length_s: float
    clip_samples: int
    extractor: dict[str, Any]
    """``PeAudioFeatureExtractor.to_dict()`` + the window: the bundle manifest's ``frontend``."""
    padding: str = "reflect"
    truncation: str = "none"
    """The extractor's own policy for long clips: none (whole clip); bundles chunk instead."""

    @property
    def pad_multiple(self) -> int:
        return self.hop_length


class PeAudioAudioEmbedder(nn.Module):
    """waveform (B, N) at ``sample_rate`` → ``audio_head(audio_encoder(...).pooler_output)``, L2-normalised."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.audio_encoder = model.audio_encoder
        self.audio_head = model.audio_head

    def forward(self, waveform: Tensor) -> Tensor:
        # One clip length per call (the loader groups windows by length), so no padding_mask:
        # the extractor's mask of an unbatched clip is all ones.
        pooled = self.audio_encoder(input_values=waveform[:, None, :]).pooler_output
        return nn.functional.normalize(self.audio_head(pooled), dim=-1)


class PeAudioTextEmbedder(nn.Module):
    """(input_ids, attention_mask) (B, L) int64 → ``text_audio_embeds`` (B, d), L2-normalised."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.text_model = model.text_model
        self.text_audio_head = model.text_audio_head

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        out = self.text_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return nn.functional.normalize(self.text_audio_head(out.hidden_states[-1][:, 0]), dim=-1)


@dataclass
class PretrainedPeAudio:
    """What `tonearm export --pretrained` needs from a PE-Audio folder."""

    folder: Path
    model: Any
    """The ``PeAudioModel`` (eval mode): the reference the bundle's encoders are checked against."""
    extractor: Any
    hf_tokenizer: Any
    tokenizer: TextTokenizer
    settings: PeAudioSettings
    audio: PeAudioAudioEmbedder
    text: PeAudioTextEmbedder
    family: str = "pe_audio"

    @property
    def embed_dim(self) -> int:
        return int(self.model.config.text_config.hidden_size)

    @torch.no_grad()
    def reference_audio(self, window: np.ndarray) -> Tensor:
        """The model's own ``get_audio_embeds`` of one window, through its own extractor."""
        inputs = self.extractor(window, sampling_rate=self.settings.sample_rate, return_tensors="pt")
        return self.model.get_audio_embeds(inputs["input_values"], padding_mask=inputs["padding_mask"])[0]

    @torch.no_grad()
    def reference_text(self, texts: list[str]) -> Tensor:
        """``text_audio_embeds`` as ``PeAudioModel.forward`` computes them, with its own tokenizer."""
        batch = self.hf_tokenizer(texts, padding=True, truncation=True, max_length=self.tokenizer.max_length,
                                  return_tensors="pt")
        out = self.model.text_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                    output_hidden_states=True)
        return self.model.text_audio_head(out.hidden_states[-1][:, 0])


def _settings(extractor: Any, config: Any, path: Path) -> PeAudioSettings:
    hop = int(extractor.hop_length)
    dac_hop = int(np.prod(config.audio_config.dac_config.downsampling_ratios))
    if hop != dac_hop:
        raise ConfigError(f"{KEY}: {path / PREPROCESSOR} has hop_length={hop} but the codec encoder downsamples "
                          f"by {dac_hop}")
    if int(extractor.feature_size) != 1:
        raise ConfigError(f"{KEY}: {path / PREPROCESSOR} has feature_size={extractor.feature_size}; only mono (1) "
                          "is supported by PeAudioFeatureExtractor")
    rate = int(extractor.sampling_rate)
    clip_samples = int(WINDOW_SECONDS * rate) // hop * hop
    info = {**extractor.to_dict(), "window_samples": clip_samples}
    return PeAudioSettings(sample_rate=rate, hop_length=hop, max_length_s=clip_samples / rate,
                           clip_samples=clip_samples, extractor=info)


def load_pretrained_pe_audio(path: Path | str) -> PretrainedPeAudio:
    """Load and check a ``PeAudioModel`` folder; errors are one line naming the folder or file."""
    import transformers

    folder = Path(path).expanduser()
    check_model_folder(str(folder), key=KEY)
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{KEY}: {folder / 'config.json'} cannot be read: {first_line(err)}") from None
    try:
        extractor = (transformers.PeAudioFeatureExtractor.from_pretrained(folder) if (folder / PREPROCESSOR).is_file()
                     else transformers.PeAudioFeatureExtractor())
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"{KEY}: {folder / PREPROCESSOR} cannot be loaded: {first_line(err)}") from None
    settings = _settings(extractor, config, folder)
    model, hf_tokenizer = load_model_and_tokenizer(folder, transformers.PeAudioModel, key=KEY)
    declared = int(min(getattr(hf_tokenizer, "model_max_length", TEXT_MAX_LENGTH), 10**6))
    max_length = max(4, min(declared, TEXT_MAX_LENGTH, int(config.text_config.max_position_embeddings)))
    tokenizer = load_hf_tokenizer(str(folder), max_length=max_length)
    return PretrainedPeAudio(
        folder=folder, model=model, extractor=extractor, hf_tokenizer=hf_tokenizer, tokenizer=tokenizer,
        settings=settings, audio=PeAudioAudioEmbedder(model).eval(), text=PeAudioTextEmbedder(model).eval(),
    )
