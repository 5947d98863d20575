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
  extractor's ``_reflect_pad`` — and embedded at that length (the model has no maximum length);
  in a call with clips of other lengths it is zero-padded further behind a ``padding_mask`` that
  masks the codec as well as the transformer (:func:`masked_pooled`, the loader's length buckets:
  the embedding is the clip's own — transformers' batch ``padding_mask`` masks the transformer only);
* the window (``clip_samples``, a hop multiple): as the extractor (no padding);
* longer: the extractor has no policy: the model attends over the whole clip (25 tokens/s; 1,500 at
  60 s, where the attention is still cheaper than the codec). Bundles do the same
  (``audio_frontend.long_clips = "whole"``): the window-mean of 10-s windows was measured against
  the whole-clip forward and agrees on the raw cosine (0.9998 at 60 s) but not on what tells clips
  apart (centred cosine 0.5–0.74 at 20–60 s; docs/models.md "PE-Audio: long clips").

Fine-tuning (``model.audio.kind: hf_pe_audio``, configs/real/pe_audio.yaml) runs the same modules
(:class:`PeAudioAudioTower`, :class:`PeAudioTextTower`); folders of the layouts in :data:`LAYOUTS`
(``pe_audio``; ``pe_audio_video``, whose audio branch is a whole ``PeAudioModel``) are accepted by both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from index.bundle.tokenizer import TextTokenizer
from training.config import ConfigError
from training.models.hf import check_model_folder, first_line
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
    """The extractor's own policy for long clips: none (the whole clip)."""
    long_clips: Literal["chunk", "whole"] = "whole"
    """The bundle's rule for clips longer than the window: ``whole``, the model's own forward over the
    whole clip (the window-mean was measured against it and differs on what tells clips apart,
    docs/models.md "PE-Audio: long clips")."""

    @property
    def pad_multiple(self) -> int:
        return self.hop_length


def masked_pooled(encoder: Any, waveform: Tensor, padding_mask: Tensor, *, codec: bool = True,
                  transformer: bool = True) -> Tensor:
    """``PeAudioEncoder``'s ``pooler_output`` (B, hidden) of clips zero-padded to one length, each
    equal to that of the clip alone (its first ``padding_mask.sum()`` samples, a hop multiple).

    transformers' own ``padding_mask`` masks only the transformer (attention, the patch embedder's
    group norms); its codec convolutions still see the padding, so the last ~6 frames (the codec's
    ~22,000-sample receptive field) of a padded clip differ from the clip alone. Here every convolution
    whose kernel reaches past the clip's end reads zeros there — what it reads for the clip alone
    (``padding`` of its own ``Conv1d``): the input is zeroed past the end and so is each activation
    the next kernel reads, at every stride (``padding_mask[:, ::stride]``: a clip of a hop multiple has
    a whole number of frames at each). ``Snake1d`` maps 0 to 0, so zeros stay zeros through it. The
    rest is ``PeAudioEncoder.forward`` with the frame mask (:mod:`transformers.models.pe_audio`), whose
    rotary positions start at each clip's start. Equal to the clip's own forward up to float rounding
    (tests/training/test_pe_audio_buckets.py); the loader pads clips into length buckets with it
    (:func:`index.audio.frontend.bucket_length`).

    ``codec`` / ``transformer`` False leave that half of the mask out (the codec then reads the padding; the
    transformer attends to it): the ablations the tests and ``bench/pe_audio_buckets.py`` measure, never the
    bundles' graph."""
    from transformers.masking_utils import create_bidirectional_mask

    embedder = encoder.embedder
    dac = embedder.dac_encoder
    mask = padding_mask.to(waveform.dtype)
    kept = mask if codec else torch.ones_like(mask)  # what the codec's activations are multiplied by
    frames = kept[:, None, :]
    hidden = dac.conv1(waveform[:, None, :] * frames) * frames
    stride = 1
    for block, step in zip(dac.block, encoder.config.dac_config.downsampling_ratios, strict=True):
        for unit in (block.res_unit1, block.res_unit2, block.res_unit3):
            hidden = unit(hidden) * frames
        stride *= int(step)
        frames = kept[:, None, ::stride]
        hidden = block.conv1(block.snake1(hidden)) * frames
    hidden = embedder.bottleneck(dac.conv2(dac.snake1(hidden)))
    embeds = embedder.data_proj(hidden.transpose(1, 2))
    hop_mask = mask[:, ::stride] if transformer else torch.ones_like(mask[:, ::stride])
    hidden, frame_mask = encoder.patch_embedder(embeds, padding_mask=hop_mask)
    attention = create_bidirectional_mask(config=encoder.config, inputs_embeds=hidden, attention_mask=frame_mask.bool())
    positions = encoder.rotary_emb(hidden, torch.arange(hidden.shape[1], device=hidden.device)[None, :])
    for layer in encoder.layers[: encoder.config.num_hidden_layers]:
        hidden = layer(hidden, attention_mask=attention, position_embeddings=positions)
    return encoder.output(encoder.norm(hidden))[:, 0]


class PeAudioAudioEmbedder(nn.Module):
    """waveform (B, N) at ``sample_rate`` [, padding_mask (B, N) int64, 1 = audio] →
    ``audio_head(audio_encoder(...).pooler_output)``, L2-normalised.

    Without ``padding_mask`` (bundles exported before length buckets, and the export's trace of the
    one-input graph) every row is a whole clip: the loader then runs one clip length per call. With it
    (the graph bundles export now: ``audio_encoder.inputs = [waveform, padding_mask]``), rows are clips
    zero-padded to a common length (:func:`masked_pooled`)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.audio_encoder = model.audio_encoder
        self.audio_head = model.audio_head

    def forward(self, waveform: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        if padding_mask is None:  # the extractor's mask of an unbatched clip is all ones
            pooled = self.audio_encoder(input_values=waveform[:, None, :]).pooler_output
        else:
            pooled = masked_pooled(self.audio_encoder, waveform, padding_mask)
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
    extractor = load_pe_audio_extractor(folder, key=KEY)
    model = load_pe_audio_model(folder, key=KEY)  # pe_audio, or the audio branch of pe_audio_video
    config = model.config
    settings = _settings(extractor, config, folder)
    try:
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    except Exception as err:  # tokenizers raises a bare Exception for a broken tokenizer.json
        raise ConfigError(f"{KEY}: the tokenizer in {folder} cannot be loaded: {first_line(err)}") from None
    declared = int(min(getattr(hf_tokenizer, "model_max_length", TEXT_MAX_LENGTH), 10**6))
    max_length = max(4, min(declared, TEXT_MAX_LENGTH, int(config.text_config.max_position_embeddings)))
    tokenizer = load_hf_tokenizer(str(folder), max_length=max_length)
    return PretrainedPeAudio(
        folder=folder, model=model, extractor=extractor, hf_tokenizer=hf_tokenizer, tokenizer=tokenizer,
        settings=settings, audio=PeAudioAudioEmbedder(model).eval(), text=PeAudioTextEmbedder(model).eval(),
    )


# ----------------------------------------------------------------------------- checkpoint layouts

LAYOUTS: dict[str, str] = {
    "pe_audio": "PeAudioModel (facebook/pe-a-frame-*, or any PeAudioModel.save_pretrained)",
    "pe_audio_video": "PeAudioVideoModel (facebook/pe-av-*): its audio branch audio_model.* and text_model.*",
}
"""``config.json`` ``model_type`` values that hold a whole PE audio–text pair (transformers 5.x
``models/pe_audio``, ``models/pe_audio_video``). ``pe_audio_encoder`` / ``pe_audio_video_encoder``
(encoders without text tower or heads) and ``pe_video`` hold no audio–text space and are refused."""


def _read_state(folder: Path, key: str) -> dict[str, Tensor]:
    """Every tensor of a folder's safetensors weights (single file or sharded index)."""
    import json

    from safetensors.torch import load_file

    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        files = sorted({folder / f for f in json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()})
    else:
        raise ConfigError(f"{key}: {folder} holds a pe_audio_video model without model.safetensors weights")
    state: dict[str, Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except Exception as err:  # safetensors raises its own types for a damaged file
            raise ConfigError(f"{key}: cannot read {file}: {first_line(err)}") from None
    return state


def _audio_branch_of_pe_av(folder: Path, key: str) -> Any:
    """The ``PeAudioModel`` inside a ``PeAudioVideoModel`` folder, without building its video tower:
    ``audio_model.*`` weights, the tied text model from ``text_model.*`` where the audio branch's copy
    was not saved (transformers saves tied weights once)."""
    import transformers

    try:
        av_config = transformers.PeAudioVideoConfig.from_pretrained(folder)
        config = av_config.audio_config  # a PeAudioConfig: text_config + the audio encoder's config
    except Exception as err:  # transformers' config errors are of many types
        raise ConfigError(f"{key}: {folder / 'config.json'} is not a readable pe_audio_video config: "
                          f"{first_line(err)}") from None
    model = transformers.PeAudioModel(config)
    state = _read_state(folder, key)
    wanted = model.state_dict()
    loaded: dict[str, Tensor] = {}
    for name in wanted:
        for source in (f"audio_model.{name}", name if name.startswith("text_model.") else None):
            if source is not None and source in state:
                loaded[name] = state[source]
                break
    missing = [n for n in wanted if n not in loaded]
    if missing:
        raise ConfigError(f"{key}: {folder} lacks {len(missing)} weights of its audio branch, e.g. "
                          f"audio_model.{missing[0]}")
    try:
        model.load_state_dict(loaded, strict=True)
    except RuntimeError as err:
        raise ConfigError(f"{key}: {folder}: the audio branch's weights do not fit its config: "
                          f"{first_line(err)}") from None
    return model.eval()


def load_pe_audio_model(folder: Path | str, *, key: str) -> Any:
    """A ``PeAudioModel`` (eval mode) from a folder of any layout in :data:`LAYOUTS`; a folder of another
    model type is refused in one line."""
    import json

    import transformers

    folder = Path(folder).expanduser()
    check_model_folder(str(folder), key=key)
    try:
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(f"{key}: {folder / 'config.json'} cannot be read: {first_line(err)}") from None
    if model_type == "pe_audio_video":
        return _audio_branch_of_pe_av(folder, key)
    if model_type != "pe_audio":
        accepted = "; ".join(f"{k!r} = {v}" for k, v in LAYOUTS.items())
        raise ConfigError(f"{key}: {folder} holds a {model_type or 'unknown'!r} model, not a PE audio–text model "
                          f"(config.json model_type; accepted: {accepted})")
    try:
        return transformers.PeAudioModel.from_pretrained(folder).eval()
    except Exception as err:  # safetensors, torch and transformers raise unrelated types for bad weights
        raise ConfigError(f"{key}: cannot load {folder} as PeAudioModel: {first_line(err)}") from None


def load_pe_audio_extractor(folder: Path | str, *, key: str) -> Any:
    """The folder's ``PeAudioFeatureExtractor`` (its defaults when the folder has no settings)."""
    import transformers

    folder = Path(folder).expanduser()
    for name in (PREPROCESSOR, "processor_config.json"):
        path = folder / name
        if path.is_file():
            try:
                return transformers.PeAudioFeatureExtractor.from_pretrained(folder)
            except (OSError, ValueError, TypeError) as err:
                raise ConfigError(f"{key}: {path} cannot be loaded: {first_line(err)}") from None
    return transformers.PeAudioFeatureExtractor()


# ----------------------------------------------------------------------------- training towers


class PeAudioAudioTower(nn.Module):
    """Training tower ``hf_pe_audio``: waveform (B, N) at 48 kHz → ``audio_head(pooler_output)``
    (B, d), **not** normalised (the dual encoder adds its head and the L2 norm).

    What it sees equals what ``PeAudioFeatureExtractor`` gives the model (docs/models.md):

    * a batch without NaN runs as is (a window of the data path: 10 s, a hop multiple, or any length
      the bundle's loader prepared — the ONNX graph is this path), reflect-padded to the hop first
      when eager and its width is not a multiple of it (a long clip that evaluation keeps whole,
      alone in its batch; before, only a batch holding a short clip padded it);
    * a row with a NaN tail (the training/evaluation data path's marker of a clip shorter than the
      window, ``frontend.short_clip_padding: reflect``, :mod:`index.audio.frontend`) runs at the
      clip's own length, reflect-padded to a multiple of the hop as ``_reflect_pad`` does; such rows
      run one length at a time (eager only: the exported graph never receives NaN).

    The codec encoder (``dac_encoder`` + ``bottleneck``) runs under ``torch.no_grad`` inside
    transformers' ``PeAudioEncoderEmbedder``: it stays frozen whatever ``optim.audio`` says; the
    transformer, ``data_proj`` and the head train."""

    def __init__(self, model: Any, hop_length: int) -> None:
        super().__init__()
        self.audio_encoder = model.audio_encoder
        self.audio_head = model.audio_head
        self.hop_length = int(hop_length)
        self.out_dim = int(model.config.text_config.hidden_size)

    def _embed(self, waveform: Tensor) -> Tensor:
        return self.audio_head(self.audio_encoder(input_values=waveform[:, None, :]).pooler_output)

    def forward(self, waveform: Tensor) -> Tensor:
        waveform = waveform.float()
        if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
            return self._embed(waveform)
        missing = torch.isnan(waveform)
        if not bool(missing.any()):
            pad = (-waveform.shape[1]) % self.hop_length
            if pad:  # a long clip kept whole (evaluation) off the hop, with no short row in its batch
                waveform = nn.functional.pad(waveform[:, None, :], (0, pad), mode="reflect")[:, 0]
            return self._embed(waveform)
        lengths = (~missing).sum(dim=1)
        out: list[Tensor | None] = [None] * waveform.shape[0]
        for length in torch.unique(lengths).tolist():
            rows = torch.nonzero(lengths == length).flatten()
            clips = waveform[rows, : max(int(length), 1)].nan_to_num(0.0)
            pad = (-clips.shape[1]) % self.hop_length
            if pad:
                clips = nn.functional.pad(clips[:, None, :], (0, pad), mode="reflect")[:, 0]
            for row, emb in zip(rows.tolist(), self._embed(clips), strict=True):
                out[row] = emb
        return torch.stack(out)  # type: ignore[arg-type]


class PeAudioTextTower(nn.Module):
    """Training tower ``hf_pe_audio`` (text): ``text_audio_head`` of ModernBERT's last hidden state at
    position 0, as ``PeAudioModel.forward`` computes ``text_audio_embeds``; not normalised."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.text_model = model.text_model
        self.text_audio_head = model.text_audio_head
        self.out_dim = int(model.config.text_config.hidden_size)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        out = self.text_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return self.text_audio_head(out.hidden_states[-1][:, 0])


def build_pe_audio_pair(
    *, path: str | None, sample_rate: int, config: dict[str, Any] | None
) -> tuple[nn.Module, nn.Module, dict[str, Any]]:
    """The ``hf_pe_audio`` audio and text towers of one ``PeAudioModel`` (loaded once) and its config
    dict (a checkpoint rebuilds the architecture from it, random weights, then loads its own)."""
    import transformers

    key = "model.audio.path"
    if config is not None:
        from training.models.hf import hf_config_from_dict

        model = transformers.PeAudioModel(hf_config_from_dict(config))
        audio_config: Any = model.config.audio_config
        hop = int(np.prod(audio_config.dac_config.downsampling_ratios))
        rate = sample_rate
    else:
        if path is None:
            raise ConfigError(f"{key} is required for model.audio.kind=hf_pe_audio (a PeAudioModel or "
                              "PeAudioVideoModel folder)")
        model = load_pe_audio_model(path, key=key)
        extractor = load_pe_audio_extractor(path, key=key)
        settings = _settings(extractor, model.config, Path(path))
        hop, rate = settings.hop_length, settings.sample_rate
    if sample_rate != rate:
        raise ConfigError(f"frontend.sample_rate={sample_rate} but the PE-Audio feature extractor in {path} runs at "
                          f"{rate} Hz; set frontend.sample_rate={rate}")
    model.train()
    return PeAudioAudioTower(model, hop), PeAudioTextTower(model), model.config.to_dict()
