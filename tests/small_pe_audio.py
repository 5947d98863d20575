"""Small random-weight PE-Audio folders (CPU-cheap), in the layouts transformers declares.

* ``pe_audio``: ``PeAudioModel(small PeAudioConfig).save_pretrained`` + ``PeAudioFeatureExtractor`` +
  a byte-level BPE (``[CLS]``-first ids, :func:`tests.real_size_models.bpe_tokenizer`). The codec keeps
  PE-Audio's hop (downsampling 2·8·10·12 = 1920 samples at 48 kHz) so every length rule is the real
  one; only widths and depths are small (~0.5 M parameters).
* ``pe_audio_video``: the layout of the ``facebook/pe-av-*`` checkpoints (``PeAudioVideoModel``): the
  audio branch is a whole ``PeAudioModel`` under ``audio_model.`` and the text model (tied into
  ``audio_model.text_model``) is saved once, at ``text_model.``. ``PeAudioVideoModel`` itself cannot
  be built here (its video tower needs ``timm``), so the weights are the small ``PeAudioModel``'s under
  those names plus the audio-video heads a real folder has; ``config.json`` is
  ``PeAudioVideoConfig(...).save_pretrained`` (transformers' own).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "vocab_size": 600, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1,
        "sep_token_id": 2, "max_position_embeddings": 1024, "global_attn_every_n_layers": 2, "local_attention": 16}
AUDIO = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
         "head_dim": 16, "dac_config": {"encoder_hidden_size": 4, "codebook_dim": 8, "hidden_size": 64,
                                        "downsampling_ratios": [2, 8, 10, 12]}}


REAL_CODEC = {**AUDIO, "dac_config": {"downsampling_ratios": [2, 8, 10, 12]}}
"""PE-Audio's full-size codec (transformers' defaults: 64 channels at 48 kHz, 1,024 at the hop, ~22 M
parameters) under the small transformer: what dominates PE-Audio's audio cost, and the codec whose
receptive field a padding reaches (bench/pe_audio_buckets.py)."""


def small_pe_audio_config(audio: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
    from transformers import PeAudioConfig

    return PeAudioConfig(text_config=dict(TEXT, model_type="modernbert"), audio_config=dict(audio or AUDIO))


def save_small_pe_audio(directory: Path, *, seed: int = 0, max_length: int = 512,
                        audio: dict[str, Any] | None = None) -> Path:
    """``audio``: the audio encoder's config (default :data:`AUDIO`; :data:`REAL_CODEC`)."""
    import torch
    from transformers import PeAudioFeatureExtractor, PeAudioModel

    from tests.real_size_models import bpe_tokenizer

    torch.manual_seed(seed)
    directory.mkdir(parents=True, exist_ok=True)
    PeAudioModel(small_pe_audio_config(audio)).save_pretrained(directory)
    bpe_tokenizer(directory, roberta_ids=False, max_length=max_length)
    PeAudioFeatureExtractor().save_pretrained(directory)
    return directory


def save_small_pe_audio_video(directory: Path, pe_audio_dir: Path) -> Path:
    """The ``pe_audio_video`` layout around the weights of the small ``pe_audio`` folder."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import PeAudioVideoConfig

    directory.mkdir(parents=True, exist_ok=True)
    config = PeAudioVideoConfig(
        text_config=dict(TEXT, model_type="modernbert"),
        audio_video_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                            "num_attention_heads": 2, "head_dim": 16, "audio_config": dict(AUDIO)},
    )
    config.save_pretrained(directory)
    state = load_file(str(pe_audio_dir / "model.safetensors"))
    out = {}
    for key, value in state.items():
        if key.startswith("text_model."):
            out[key] = value  # tied: saved once, at the top level
        else:
            out[f"audio_model.{key}"] = value
    out["audio_video_head.proj.weight"] = torch.zeros(32, 32)  # a key of the audio-video branch (ignored)
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "preprocessor_config.json"):
        if (pe_audio_dir / name).is_file():
            shutil.copyfile(pe_audio_dir / name, directory / name)
    return directory


class RecordedEncoder:
    """A real :class:`index.runtime.loader.OnnxEncoder` that records the ``waveform`` shape of each call (and
    whether a ``padding_mask`` came with it): how many calls a pass makes, and of which shapes."""

    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder
        self.calls: list[tuple[int, int]] = []
        self.masked: list[bool] = []

    @property
    def takes_padding_mask(self) -> bool:
        return bool(self.encoder.takes_padding_mask)

    def run(self, feeds: dict[str, Any]) -> Any:
        self.calls.append(tuple(feeds["waveform"].shape))  # type: ignore[arg-type]
        self.masked.append("padding_mask" in feeds)
        return self.encoder.run(feeds)
