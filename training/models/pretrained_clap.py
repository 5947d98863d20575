"""A Hugging Face ``ClapModel`` folder as the two encoders of a bundle, no training (SPEC §11).

The folder has the layout of the published LAION CLAP checkpoints (``save_pretrained`` of
``ClapModel`` and ``ClapProcessor``): ``config.json``, ``model.safetensors`` or
``pytorch_model.bin``, ``preprocessor_config.json`` (``ClapFeatureExtractor``) and the
RoBERTa tokenizer files. :func:`load_pretrained_clap` checks it and returns

* :class:`ClapAudioEmbedder` — waveform at the extractor's rate → ``get_audio_features``,
  the extractor's log-mel inside (:class:`training.models.clap_frontend.ClapWaveFrontend`, shared
  with the training tower ``hf_clap``);
* :class:`ClapTextEmbedder` — token ids → ``get_text_features``;
* :class:`ClapSettings` — the extractor's settings the bundle records and the service applies.

What the encoders see per clip (docs/models.md, "A pretrained CLAP as a bundle"):

* shorter than ``max_length_s``: the extractor's ``padding`` (``repeatpad``: tiled
  ``⌊N / len⌋`` times, then zero-padded to N samples; ``repeat``; ``pad``), applied to the
  waveform before the encoder by the loader (``index.audio.frontend``) — identical to the
  extractor;
* exactly ``max_length_s``: as the extractor;
* longer: the extractor's ``rand_trunc`` keeps one *random* window, which no bundle can
  reproduce. Bundles use the deterministic chunk-and-average policy of every tonearm
  bundle instead: non-overlapping ``max_length_s`` windows (the last one right-aligned),
  each embedded exactly as the model embeds a ``max_length_s`` clip, and the L2-normalised
  mean of the window embeddings. ``rand_trunc`` is the expectation over windows' features;
  chunk-and-average covers the whole clip every time.

Fused checkpoints (``enable_fusion=true``, ``truncation="fusion"``) are refused: their
features depend on random crops *and* on which other clips share the batch (the extractor
marks a random clip "longer" when none is), so no deterministic encoder reproduces them.
An unfused model with ``truncation="fusion"`` is refused too: ``get_audio_features`` itself
fails on the four-channel input that setting produces.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from index.bundle.tokenizer import TextTokenizer
from training.config import ConfigError
from training.models.clap_frontend import ClapWaveFrontend, check_clap_settings
from training.models.hf import check_model_folder, first_line, load_model_and_tokenizer
from training.models.tokenizer import load_hf_tokenizer

PREPROCESSOR = "preprocessor_config.json"
PADDINGS = ("repeatpad", "repeat", "pad")
KEY = "--pretrained"


@dataclass(frozen=True)
class ClapSettings:
    """The feature extractor's settings that decide what the audio encoder sees."""

    sample_rate: int
    max_length_s: float
    clip_samples: int
    truncation: str
    padding: str
    n_fft: int
    hop_length: int
    n_mels: int
    f_min: float
    f_max: float
    extractor: dict[str, Any]
    """``ClapFeatureExtractor.to_dict()``: recorded as the bundle manifest's ``frontend``."""

    @property
    def frames(self) -> int:
        return 1 + self.clip_samples // self.hop_length


class ClapAudioEmbedder(nn.Module):
    """waveform (B, N) at ``sample_rate`` → ``get_audio_features`` (B, d), L2-normalised."""

    def __init__(self, clap: nn.Module, frontend: ClapWaveFrontend) -> None:
        super().__init__()
        self.frontend = frontend
        self.audio_model = clap.audio_model
        self.audio_projection = clap.audio_projection

    def forward(self, waveform: Tensor) -> Tensor:
        features = self.frontend(waveform)
        pooled = self.audio_model(input_features=features).pooler_output
        return nn.functional.normalize(self.audio_projection(pooled), dim=-1)


class ClapTextEmbedder(nn.Module):
    """(input_ids, attention_mask) (B, L) int64 → ``get_text_features`` (B, d), L2-normalised."""

    def __init__(self, clap: nn.Module) -> None:
        super().__init__()
        self.text_model = clap.text_model
        self.text_projection = clap.text_projection

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        pooled = self.text_model(input_ids=input_ids, attention_mask=attention_mask).pooler_output
        return nn.functional.normalize(self.text_projection(pooled), dim=-1)


@dataclass
class PretrainedClap:
    """What `tonearm export --pretrained` needs from a CLAP folder."""

    folder: Path
    model: Any
    """The ``ClapModel`` (eval mode): the reference the bundle's encoders are checked against."""
    extractor: Any
    """Its ``ClapFeatureExtractor``."""
    hf_tokenizer: Any
    """Its fast tokenizer as ``AutoTokenizer`` loads it (the parity reference)."""
    tokenizer: TextTokenizer
    settings: ClapSettings
    audio: ClapAudioEmbedder
    text: ClapTextEmbedder


def check_clap_folder(path: Path) -> None:
    """One-line errors for a folder that is not a saved ``ClapModel`` + ``ClapProcessor``."""
    check_model_folder(str(path), key=KEY)
    if not Path(path).is_dir():
        raise ConfigError(f"{KEY}: model folder {Path(path).absolute()} does not exist")
    if not (path / PREPROCESSOR).is_file():
        raise ConfigError(
            f"{KEY}: no {PREPROCESSOR} in {path} — the CLAP feature extractor's settings are needed "
            "(save the model's ClapProcessor or ClapFeatureExtractor into the folder)"
        )


def _settings(extractor: Any, audio_config: Any, path: Path) -> ClapSettings:
    fe = extractor
    check_clap_settings(fe, audio_config, folder=path, key=KEY)  # the same refusals as training's hf_clap
    if fe.padding not in PADDINGS:
        raise ConfigError(f"{KEY}: {path / PREPROCESSOR} has padding={fe.padding!r}; expected one of {PADDINGS}")
    if int(fe.feature_size) != int(audio_config.num_mel_bins):
        raise ConfigError(
            f"{KEY}: {path / PREPROCESSOR} has feature_size={fe.feature_size} but the audio model expects "
            f"num_mel_bins={audio_config.num_mel_bins}"
        )
    extractor_dict = fe.to_dict()
    return ClapSettings(
        sample_rate=int(fe.sampling_rate), max_length_s=float(fe.max_length_s),
        clip_samples=int(fe.nb_max_samples), truncation=str(fe.truncation), padding=str(fe.padding),
        n_fft=int(fe.fft_window_size), hop_length=int(fe.hop_length), n_mels=int(fe.feature_size),
        f_min=float(fe.frequency_min), f_max=float(fe.frequency_max), extractor=extractor_dict,
    )


def text_max_length(hf_tokenizer: Any, text_config: Any) -> int:
    """Tokens per caption: the tokenizer's ``model_max_length``, at most the model's positions
    (RoBERTa reserves ``pad_token_id + 1`` of them: 514 positions → 512 tokens)."""
    positions = int(text_config.max_position_embeddings) - int(text_config.pad_token_id or 0) - 1
    declared = int(min(getattr(hf_tokenizer, "model_max_length", positions), 10**6))
    return max(4, min(declared, positions))


def load_pretrained_clap(path: Path | str) -> PretrainedClap:
    """Load and check a ``ClapModel`` folder; errors are one line naming the folder or file."""
    import transformers

    folder = Path(path).expanduser()
    check_clap_folder(folder)
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{KEY}: {folder / 'config.json'} cannot be read: {first_line(err)}") from None
    if getattr(config, "model_type", None) != "clap":
        raise ConfigError(
            f"{KEY}: {folder} holds a {getattr(config, 'model_type', 'unknown')!r} model, not a CLAP model "
            "(config.json model_type must be 'clap')"
        )
    try:
        extractor = transformers.ClapFeatureExtractor.from_pretrained(folder)
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"{KEY}: {folder / PREPROCESSOR} cannot be loaded: {first_line(err)}") from None
    settings = _settings(extractor, config.audio_config, folder)
    model, hf_tokenizer = load_model_and_tokenizer(folder, transformers.ClapModel, key=KEY)
    max_length = text_max_length(hf_tokenizer, config.text_config)
    tokenizer = load_hf_tokenizer(str(folder), max_length=max_length)
    frontend = ClapWaveFrontend(extractor)  # the module the training tower runs too
    return PretrainedClap(
        folder=folder, model=model, extractor=extractor, hf_tokenizer=hf_tokenizer, tokenizer=tokenizer,
        settings=settings, audio=ClapAudioEmbedder(model, frontend).eval(), text=ClapTextEmbedder(model).eval(),
    )


@torch.no_grad()
def reference_audio_features(clap: PretrainedClap, window: Any) -> Tensor:
    """The model's own ``get_audio_features`` of one waveform of at most ``max_length_s``
    (the extractor pads it; no random crop happens at that length)."""
    inputs = clap.extractor(window, sampling_rate=clap.settings.sample_rate, return_tensors="pt")
    return clap.model.get_audio_features(input_features=inputs["input_features"]).pooler_output[0]


@torch.no_grad()
def reference_text_features(clap: PretrainedClap, texts: list[str]) -> Tensor:
    """The model's own ``get_text_features`` with its own tokenizer (truncated to our max_length)."""
    batch = clap.hf_tokenizer(texts, padding=True, truncation=True, max_length=clap.tokenizer.max_length,
                              return_tensors="pt")
    return clap.model.get_text_features(input_ids=batch["input_ids"],
                                        attention_mask=batch["attention_mask"]).pooler_output
