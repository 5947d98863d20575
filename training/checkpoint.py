"""Checkpoints: a directory of safetensors + JSON, never pickle (SPEC §6).

Layout::

    model.safetensors   the DualEncoder's state dict
    config.json         the resolved TrainConfig
    tokenizer.json      the text tokenizer (padding/truncation included)
    state.json          JSON-able training state (epoch, step, best metric, …)
    hf_configs.json     only for Hugging Face towers: their full model configs,
                        so loading needs neither the network nor the original
                        model directory

Writes are atomic: everything goes to a temporary sibling directory which is
renamed over the target (a previous checkpoint at that path is replaced).
The optimizer state is the training loop's business (saved beside, not here).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from index.bundle.format import fsync_path
from index.bundle.tokenizer import TextTokenizer
from index.errors import TonearmError
from training.config import TrainConfig
from training.models.dual_encoder import DualEncoder, build_dual_encoder

WEIGHTS, CONFIG, TOKENIZER, STATE, HF_CONFIGS = (
    "model.safetensors",
    "config.json",
    "tokenizer.json",
    "state.json",
    "hf_configs.json",
)
REQUIRED_FILES = (WEIGHTS, CONFIG, TOKENIZER, STATE)


@dataclass
class Checkpoint:
    """A loaded checkpoint: the model (eval mode), its config, tokenizer and training state."""

    model: DualEncoder
    config: TrainConfig
    tokenizer: TextTokenizer
    state: dict[str, Any] = field(default_factory=dict)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")



def _state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies of the state dict (safetensors refuses shared/strided storage)."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}


def replace_dir(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` to ``target``, replacing an existing directory."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    os.replace(tmp, target)
    fsync_path(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    directory: Path | str,
    *,
    model: DualEncoder,
    config: TrainConfig,
    tokenizer: TextTokenizer,
    state: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint directory atomically; returns its path."""
    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        save_file(_state_tensors(model), str(tmp / WEIGHTS), metadata={"format": "pt"})
        _write_json(tmp / CONFIG, config.model_dump(mode="json"))
        tokenizer.save(tmp / TOKENIZER)
        _write_json(tmp / STATE, state or {})
        if model.hf_configs:
            _write_json(tmp / HF_CONFIGS, model.hf_configs)
        for item in tmp.iterdir():
            with item.open("rb") as handle:
                os.fsync(handle.fileno())
        replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise TonearmError(f"checkpoint file {path} is unreadable ({err})") from None


def _check_complete(directory: Path) -> None:
    if not directory.is_dir():
        raise TonearmError(f"checkpoint directory not found: {directory}")
    missing = [name for name in REQUIRED_FILES if not (directory / name).is_file()]
    if missing:
        raise TonearmError(f"checkpoint {directory} is incomplete: missing {', '.join(missing)}")


def _load_weights(model: DualEncoder, path: Path) -> None:
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise TonearmError(f"checkpoint weights {path} are unreadable ({err})") from None
    result = model.load_state_dict(tensors, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise TonearmError(
            f"checkpoint weights {path} do not match config.json's model: "
            f"missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}"
        )


def load_checkpoint(directory: Path | str, *, device: str | torch.device = "cpu") -> Checkpoint:
    """Rebuild the model from ``config.json`` + tokenizer vocab and load its weights (eval mode)."""
    directory = Path(directory)
    _check_complete(directory)
    try:
        config = TrainConfig.model_validate(_read_json(directory / CONFIG))
    except ValidationError as err:
        raise TonearmError(f"checkpoint config {directory / CONFIG} is invalid:\n{err}") from None
    tokenizer = TextTokenizer.from_file(directory / TOKENIZER)
    hf_path = directory / HF_CONFIGS
    hf_configs = _read_json(hf_path) if hf_path.is_file() else None
    model = build_dual_encoder(
        config.model, config.frontend, vocab_size=tokenizer.vocab_size, hf_configs=hf_configs
    )
    _load_weights(model, directory / WEIGHTS)
    model.to(device).eval()
    return Checkpoint(
        model=model, config=config, tokenizer=tokenizer, state=_read_json(directory / STATE)
    )
