"""Hugging Face ``transformers`` towers (SPEC §3), loaded with ``from_pretrained``.

Each tower maps the dual encoder's inputs to pooled features; the dual encoder
adds the projection head to ``embed_dim`` and the L2 norm.

* text ``hf_auto``: any ``AutoModel`` text encoder (BERT, XLM-R, LaBSE, …), mean
  or CLS pooling of ``last_hidden_state`` over the attention mask;
* text ``hf_clap``: ``ClapModel.text_model`` + its ``text_projection``;
* audio ``hf_ast``: ``ASTModel`` on ``ASTFeatureExtractor``'s own features (Kaldi fbank,
  :mod:`training.models.ast_frontend`; ``frontend.n_mels`` must equal ``num_mel_bins`` and
  ``frontend.sample_rate`` the extractor's rate); pooled output = mean of the CLS and
  distillation tokens;
* audio ``hf_clap``: ``ClapModel.audio_model`` (HTS-AT, unfused) + its
  ``audio_projection`` on ``ClapFeatureExtractor``'s own features (Slaney mel bank, repeat-pad,
  HTS-AT's bicubic frame fit; :mod:`training.models.clap_frontend`, the module
  ``export --pretrained`` runs too);
* audio ``hf_auto``: an ``AutoModel`` backbone (the encoder of an
  encoder–decoder) that takes ``input_features`` (B, n_mels, frames) —
  Whisper-style, frames fixed to ``2 · max_source_positions`` when the config
  has it — or raw ``input_values`` waveforms (wav2vec 2.0 / HuBERT / WavLM,
  standardised per clip); mean pooling over time.

Features: ``hf_clap`` and ``hf_ast`` reproduce the model's own feature extractor (read from the
folder's ``preprocessor_config.json``, else the extractor's defaults at the ``frontend`` settings),
so step 0 of a fine-tune is the pretrained model (tests/training/test_finetune_step0.py). For
``hf_auto`` set the ``frontend`` section to the model's parameters (sample rate, n_fft, hop, mels,
f_min/f_max); fine-tuning absorbs the rest.

``transformers`` is imported lazily so the built-in towers do not pay for it.
"""

from __future__ import annotations

import inspect
import math
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from training.config import ConfigError, FrontendConfig
from training.models.frontend import LOG_EPS, LogMelFrontend
from training.models.text_transformer import masked_mean

SILENCE = math.log(LOG_EPS)
"""Log-mel value of digital silence (frame padding)."""


def hf_config_from_dict(data: dict[str, Any]) -> Any:
    """Rebuild a ``PretrainedConfig`` from ``config.to_dict()`` output (checkpoint loading)."""
    from transformers import AutoConfig

    data = dict(data)
    model_type = data.pop("model_type")
    return AutoConfig.for_model(model_type, **data)


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
"""What ``from_pretrained`` reads the weights of a PyTorch model from (one of them)."""
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""``org/name``: a Hugging Face hub id (also a relative path; a folder of that name wins)."""


def check_model_folder(path: str, *, key: str, weights: bool = True) -> None:
    """One-line errors for a local model folder that cannot be loaded: it does not exist, has no
    config.json, or (with `weights`) no weights file. Hub ids that are not local folders pass."""
    folder = Path(path).expanduser()
    if not folder.exists():
        if HUB_ID.match(path):
            return  # from_pretrained tries the hub; its failure is reported by the caller
        raise ConfigError(f"{key}: model folder {folder.absolute()} does not exist")
    if not folder.is_dir():
        raise ConfigError(f"{key}: {folder} is a file; give the model folder (with config.json) instead")
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"{key}: no config.json in {folder} — not a Hugging Face model folder "
            "(it needs config.json, the weights and, for text, tokenizer.json)"
        )
    if weights and not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise ConfigError(f"{key}: no weights in {folder} (expected one of {', '.join(WEIGHT_FILES)})")


def hub_note(path: str) -> str:
    """Says that `path` was tried as a hub id because no such local folder exists."""
    return "" if Path(path).expanduser().exists() else " (no such local folder, so tried as a hub id)"


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (transformers' messages run over many lines)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def load_model_and_tokenizer(folder: Path, model_class: Any, *, key: str) -> tuple[Any, Any]:
    """A pretrained folder's model (in eval mode) and its transformers tokenizer, for the
    ``--pretrained`` families; a failure is one line naming the folder."""
    import transformers

    try:
        model = model_class.from_pretrained(folder).eval()
    except Exception as err:  # safetensors, torch and transformers raise unrelated types for bad weights
        raise ConfigError(f"{key}: cannot load {folder} as {model_class.__name__}: {first_line(err)}") from None
    try:
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    except Exception as err:  # tokenizers raises a bare Exception for a broken tokenizer.json
        raise ConfigError(f"{key}: the tokenizer in {folder} cannot be loaded: {first_line(err)}") from None
    return model, hf_tokenizer


def load_hf_model(
    class_name: str, *, path: str | None, config: dict[str, Any] | None, key: str
) -> Any:
    """``transformers.<class_name>`` from ``path`` (from_pretrained) or from a saved config dict.

    ``key`` names the config key (e.g. ``model.audio.path``) in error messages.
    """
    import transformers

    cls = getattr(transformers, class_name)
    if config is not None:
        hf_config = hf_config_from_dict(config)
        return cls.from_config(hf_config) if class_name == "AutoModel" else cls(hf_config)
    if path is None:
        raise ConfigError(f"{key} is required for this tower kind (local directory or hub id)")
    check_model_folder(path, key=key)
    try:
        return cls.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{key} {path!r}{hub_note(path)}: cannot load it as {class_name}: {first_line(err)}"
        ) from None


def fit_frames(x: Tensor, frames: int, fill: float) -> Tensor:
    """Right-pad (with ``fill``) or crop the last axis of ``x`` to exactly ``frames``."""
    return nn.functional.pad(x, (0, frames), value=fill)[..., :frames]


def _check_mels(frontend_cfg: FrontendConfig, n_mels: int, what: str) -> None:
    if frontend_cfg.n_mels != n_mels:
        raise ConfigError(
            f"frontend.n_mels={frontend_cfg.n_mels} but the {what} expects {n_mels} mel bins; "
            f"set frontend.n_mels={n_mels}"
        )


class HFTextTower(nn.Module):
    """``AutoModel`` text encoder with mean or CLS pooling."""

    def __init__(self, model: nn.Module, *, pooling: str) -> None:
        super().__init__()
        self.model = model
        self.pooling = pooling
        self.out_dim = int(model.config.hidden_size)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        if self.pooling == "cls":
            return hidden[:, 0]
        return masked_mean(hidden, attention_mask)


class ClapTextTower(nn.Module):
    """CLAP's text encoder and text projection (the pretrained CLAP text embedding)."""

    def __init__(self, clap: nn.Module) -> None:
        super().__init__()
        self.text_model = clap.text_model
        self.text_projection = clap.text_projection
        self.out_dim = int(clap.config.projection_dim)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        out = self.text_model(input_ids=input_ids, attention_mask=attention_mask)
        return self.text_projection(out.pooler_output)


class ASTAudioTower(nn.Module):
    """Audio Spectrogram Transformer on its own features
    (:class:`training.models.ast_frontend.ASTWaveFrontend`: ``ASTFeatureExtractor``'s Kaldi fbank)."""

    def __init__(self, model: nn.Module, frontend_cfg: FrontendConfig, path: str | None = None) -> None:
        super().__init__()
        from training.models.ast_frontend import ASTWaveFrontend, ast_extractor

        _check_mels(frontend_cfg, int(model.config.num_mel_bins), "AST model")
        extractor = ast_extractor(
            path, sample_rate=frontend_cfg.sample_rate, num_mel_bins=int(model.config.num_mel_bins),
            max_length=int(model.config.max_length),
        )
        if int(extractor.sampling_rate) != frontend_cfg.sample_rate:
            raise ConfigError(
                f"frontend.sample_rate={frontend_cfg.sample_rate} but the AST feature extractor in "
                f"{path} runs at {extractor.sampling_rate} Hz; set frontend.sample_rate={extractor.sampling_rate}"
            )
        self.frontend = ASTWaveFrontend(extractor)
        self.model = model
        self.out_dim = int(model.config.hidden_size)

    def forward(self, waveform: Tensor) -> Tensor:
        return self.model(input_values=self.frontend(waveform)).pooler_output


class ClapAudioTower(nn.Module):
    """CLAP's audio encoder (unfused HTS-AT) and audio projection on CLAP's own features
    (:class:`training.models.clap_frontend.ClapWaveFrontend`: the extractor's Slaney mel bank,
    padding and window policy — the module ``export --pretrained`` runs too)."""

    def __init__(self, clap: nn.Module, frontend_cfg: FrontendConfig, path: str | None = None) -> None:
        super().__init__()
        from training.models.clap_frontend import (
            ClapWaveFrontend,
            check_clap_settings,
            clap_extractor,
        )

        audio_cfg = clap.config.audio_config
        check_clap_settings(None, audio_cfg, folder=path or "the checkpoint's CLAP", key="model.audio.path")
        _check_mels(frontend_cfg, int(audio_cfg.num_mel_bins), "CLAP audio model")
        extractor = clap_extractor(
            path, sample_rate=frontend_cfg.sample_rate, n_fft=frontend_cfg.n_fft,
            hop_length=frontend_cfg.hop_length, n_mels=frontend_cfg.n_mels,
            f_min=frontend_cfg.f_min, f_max=frontend_cfg.f_max,
            max_frames=int(audio_cfg.spec_size * (audio_cfg.spec_size // audio_cfg.num_mel_bins)),
        )
        check_clap_settings(extractor, audio_cfg, folder=path, key="model.audio.path")  # as export --pretrained
        if int(extractor.sampling_rate) != frontend_cfg.sample_rate:
            raise ConfigError(
                f"frontend.sample_rate={frontend_cfg.sample_rate} but the CLAP feature extractor in "
                f"{path} runs at {extractor.sampling_rate} Hz; set frontend.sample_rate={extractor.sampling_rate}"
            )
        self.frontend = ClapWaveFrontend(extractor)
        self.audio_model = clap.audio_model
        self.audio_projection = clap.audio_projection
        self.out_dim = int(clap.config.projection_dim)

    def forward(self, waveform: Tensor) -> Tensor:
        out = self.audio_model(input_features=self.frontend(waveform.float()))
        return self.audio_projection(out.pooler_output)


class HFAutoAudioTower(nn.Module):
    """Generic ``AutoModel`` audio backbone on log-mel ``input_features`` or raw ``input_values``."""

    def __init__(self, model: nn.Module, frontend_cfg: FrontendConfig) -> None:
        super().__init__()
        if getattr(model.config, "is_encoder_decoder", False):
            model = model.get_encoder()
        params = inspect.signature(model.forward).parameters
        self.model = model
        self.out_dim = int(
            model.config.hidden_size
            if hasattr(model.config, "hidden_size")
            else model.config.d_model
        )
        self.frames: int | None = None
        if "input_features" in params:
            self.input_name = "input_features"
            _check_mels(frontend_cfg, int(model.config.num_mel_bins), "audio model")
            self.frontend: LogMelFrontend | None = LogMelFrontend(frontend_cfg)
            positions = getattr(model.config, "max_source_positions", None)
            self.frames = 2 * int(positions) if positions else None
        elif "input_values" in params:
            if getattr(model.config, "num_mel_bins", None) is not None:  # spectrogram models (AST)
                raise ConfigError(
                    f"model.audio.path: {type(model).__name__} takes spectrogram input_values; "
                    "use model.audio.kind=hf_ast"
                )
            self.input_name = "input_values"
            self.frontend = None
        else:
            raise ConfigError(
                f"model.audio.path: {type(model).__name__} takes neither input_features nor "
                "input_values; use kind hf_ast / hf_clap or another backbone"
            )

    def forward(self, waveform: Tensor) -> Tensor:
        if self.frontend is None:
            mean = waveform.mean(dim=-1, keepdim=True)
            std = torch.sqrt(waveform.var(dim=-1, keepdim=True, unbiased=False) + 1e-7)
            inputs = (waveform - mean) / std
        else:
            inputs = self.frontend(waveform)
            if self.frames is not None:
                inputs = fit_frames(inputs, self.frames, SILENCE)
        hidden = self.model(**{self.input_name: inputs}).last_hidden_state
        return hidden.mean(dim=1)


def load_clap_model(path: str | None, config: dict[str, Any] | None) -> Any:
    """``ClapModel`` for the ``hf_clap`` towers; a local folder's ``config.json`` and
    ``preprocessor_config.json`` are checked first (fused checkpoint, ``truncation``: the refusals of
    ``export --pretrained``, :func:`training.models.clap_frontend.check_clap_settings`), so such a
    folder is refused in one line before its weights load."""
    if config is None and path is not None and (Path(path).expanduser() / "config.json").is_file():
        import transformers

        from training.models.clap_frontend import check_clap_settings

        folder = Path(path).expanduser()
        try:
            hf_config = transformers.AutoConfig.from_pretrained(folder)
            extractor = (transformers.ClapFeatureExtractor.from_pretrained(folder)
                         if (folder / "preprocessor_config.json").is_file() else None)
        except (OSError, ValueError, TypeError) as err:
            raise ConfigError(f"model.audio.path: {folder} cannot be read as a CLAP folder: {first_line(err)}") from None
        if getattr(hf_config, "audio_config", None) is not None:
            check_clap_settings(extractor, hf_config.audio_config, folder=folder, key="model.audio.path")
    return load_hf_model("ClapModel", path=path, config=config, key="model.audio.path")


def build_hf_text_tower(
    kind: str, *, path: str | None, pooling: str, config: dict[str, Any] | None
) -> tuple[nn.Module, dict[str, Any]]:
    """Text tower for ``kind`` and the full HF config dict it was built from."""
    if kind == "hf_clap":
        clap = load_hf_model("ClapModel", path=path, config=config, key="model.text.path")
        return ClapTextTower(clap), clap.config.to_dict()
    model = load_hf_model("AutoModel", path=path, config=config, key="model.text.path")
    return HFTextTower(model, pooling=pooling), model.config.to_dict()


def build_hf_audio_tower(
    kind: str, *, path: str | None, frontend_cfg: FrontendConfig, config: dict[str, Any] | None
) -> tuple[nn.Module, dict[str, Any]]:
    """Audio tower for ``kind`` and the full HF config dict it was built from."""
    if kind == "hf_clap":
        clap = load_clap_model(path, config)
        return ClapAudioTower(clap, frontend_cfg, path), clap.config.to_dict()
    if kind == "hf_ast":
        model = load_hf_model("ASTModel", path=path, config=config, key="model.audio.path")
        return ASTAudioTower(model, frontend_cfg, path), model.config.to_dict()
    model = load_hf_model("AutoModel", path=path, config=config, key="model.audio.path")
    return HFAutoAudioTower(model, frontend_cfg), model.config.to_dict()


def build_hf_clap_pair(
    *, path: str | None, frontend_cfg: FrontendConfig, config: dict[str, Any] | None
) -> tuple[nn.Module, nn.Module, dict[str, Any]]:
    """Audio and text towers of one ``ClapModel`` (loaded once), and its config dict."""
    clap = load_clap_model(path, config)
    return ClapAudioTower(clap, frontend_cfg, path), ClapTextTower(clap), clap.config.to_dict()
