"""Which published model family a `tonearm export --pretrained` folder holds (SPEC §11).

The family is read from the folder's ``config.json`` (``model_type``), before any weights
are loaded, so a folder of another family is refused in one line that names the families
tonearm can serve.

* ``clap`` — Hugging Face ``ClapModel`` (the LAION CLAP checkpoints): exported
  (:mod:`training.bundle.pretrained`).
* ``pe_audio`` — Meta's Perception Encoder Audio (``PeAudioModel``): exported
  (:mod:`training.models.pretrained_pe_audio`);
* ``pe_audio_video`` — ``PeAudioVideoModel`` (the ``facebook/pe-av-*`` checkpoints): its audio branch is
  a whole ``PeAudioModel`` (``audio_model.*`` + the tied ``text_model.*``), exported as ``pe_audio``.
"""

from __future__ import annotations

import json
from pathlib import Path

from training.config import ConfigError

KEY = "--pretrained"

SUPPORTED: dict[str, str] = {
    "clap": "ClapModel (LAION CLAP)",
    "pe_audio": "PeAudioModel (Meta Perception Encoder Audio, facebook/pe-a-frame-*)",
    "pe_audio_video": "PeAudioVideoModel (facebook/pe-av-*; its audio–text branch)",
}
"""``model_type`` → what it is, for the families ``export --pretrained`` serves."""

RECOGNISED: dict[str, str] = {}
"""Families tonearm knows but cannot export yet (refused with a line that says so)."""

NO_TEXT_SPACE: dict[str, str] = {
    "pe_audio_encoder": "PeAudioEncoder: the audio encoder alone, without text tower or heads",
    "pe_audio_video_encoder": "PeAudioVideoEncoder: the audio-video fusion encoder alone",
    "pe_video": "PeVideoModel: video and text, no audio tower",
    "pe_video_encoder": "PeVideoEncoder: the video encoder alone",
}
"""Perception Encoder folders transformers declares that hold no audio–text space (refused in one line)."""


def supported_line() -> str:
    return ", ".join(f"{k!r} = {v}" for k, v in SUPPORTED.items())


def detect_family(folder: Path | str) -> str | None:
    """The folder's ``model_type`` when it is a supported family; ``None`` when the folder or its
    ``config.json`` is missing (the family loader then says what is missing, in one line).

    Raises ``ConfigError`` (one line) for an unreadable ``config.json`` or a family tonearm does
    not serve."""
    config = Path(folder).expanduser() / "config.json"
    if not config.is_file():
        return None
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(f"{KEY}: {config} cannot be read: {str(err).splitlines()[0] if str(err) else err!r}") from None
    if model_type in SUPPORTED:
        return str(model_type)
    if model_type in NO_TEXT_SPACE:
        raise ConfigError(
            f"{KEY}: {Path(folder)} holds a {model_type!r} model ({NO_TEXT_SPACE[model_type]}), which has no "
            f"audio–text space to serve; use the pe_audio or pe_audio_video folder it came from "
            f"(supported: {supported_line()})"
        )
    if model_type in RECOGNISED:
        raise ConfigError(
            f"{KEY}: {Path(folder)} holds a {model_type!r} model ({RECOGNISED[model_type]}); its export is not "
            f"implemented yet — supported model_type: {supported_line()}"
        )
    raise ConfigError(
        f"{KEY}: {Path(folder)} holds a {model_type or 'unknown'!r} model, not a model of a supported "
        f"family (config.json model_type; supported: {supported_line()})"
    )
