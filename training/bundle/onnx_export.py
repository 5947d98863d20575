"""Export the dual encoder's towers to ONNX (SPEC §6), verified against PyTorch.

Signatures (dynamic batch and length):

* audio: ``waveform`` float32 (batch, samples) → ``embedding`` float32 (batch, d),
  log-mel frontend inside (its DFT-as-conv1d path, see
  ``training.models.frontend``); PE-Audio's takes ``padding_mask`` int64 (batch, samples) as well
  (1 = audio, 0 = the zeros a clip is padded with to its call's length; ``mask_multiple``);
* text: ``input_ids``, ``attention_mask`` int64 (batch, tokens) → ``embedding``.

Uses the TorchScript-based exporter (``dynamo=False``): it handles the dynamic
axes of these models reliably and quickly. Every export is checked with
``onnx.checker`` and by running onnxruntime against the module on a probe
batch (cosine ≥ :data:`MIN_COSINE` per item) — a failed check raises
:class:`ExportError`.

A model whose weights exceed :data:`EXTERNAL_DATA_THRESHOLD` (protobuf's 2 GiB limit on one
file, less a margin) is written as ``NAME.onnx`` + one ``NAME.onnx.data`` beside it (ONNX
external data); onnxruntime and ``onnx.checker`` read the pair from the ``.onnx`` path, and
a bundle's checksums cover both files.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from index.errors import TonearmError

log = logging.getLogger(__name__)

MIN_COSINE = 0.999
"""ONNX vs torch agreement required per item (SPEC §6)."""
EXTERNAL_DATA_THRESHOLD = 2 * 1024**3 - 64 * 1024**2
"""Bytes of an exported model above which its weights go to an external data file."""


class ExportError(TonearmError):
    """An ONNX export that failed or does not reproduce the PyTorch module."""


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the exporter's warnings and stdout chatter (tracer, deprecation notes)."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        loggers = [
            logging.getLogger(name) for name in ("torch.onnx", "torch.export", "torch._dynamo")
        ]
        levels = [logger.level for logger in loggers]
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


def external_data_file(path: Path) -> Path:
    """The weights file of ``path`` when it is stored with external data (may not exist)."""
    return path.with_name(path.name + ".data")


def _save_external(model: onnx.ModelProto, path: Path) -> None:
    external_data_file(path).unlink(missing_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=external_data_file(path).name, size_threshold=1024, convert_attribute=True)
    log.info("%s: weights stored as external data in %s", path, external_data_file(path).name)


def place_model(exported: Path, path: Path, *, threshold: int | None = None) -> None:
    """Move an export (``exported`` and any tensor files the exporter wrote beside it) to
    ``path``: one file, or ``path`` + :func:`external_data_file` when larger than ``threshold``
    (default :data:`EXTERNAL_DATA_THRESHOLD`)."""
    threshold = EXTERNAL_DATA_THRESHOLD if threshold is None else threshold
    files = list(exported.parent.iterdir())
    if files == [exported] and exported.stat().st_size <= threshold:
        os.replace(exported, path)
        return
    _save_external(onnx.load(str(exported), load_external_data=True), path)


def copy_model(source: Path, destination: Path) -> None:
    """Copy an ONNX model, with its external data file renamed to match ``destination`` if it has one."""
    if not external_data_file(source).exists():
        shutil.copyfile(source, destination)
        return
    _save_external(onnx.load(str(source), load_external_data=True), destination)


def _export(
    module: nn.Module,
    args: tuple[torch.Tensor, ...],
    path: Path,
    *,
    input_names: list[str],
    opset: int,
    external_threshold: int | None = None,
) -> None:
    dynamic_axes = {
        name: {0: "batch", 1: "samples" if name in ("waveform", "padding_mask") else "tokens"} for name in input_names
    }
    dynamic_axes["embedding"] = {0: "batch"}
    path.parent.mkdir(parents=True, exist_ok=True)
    was_training = module.training
    module.eval()
    scratch = tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.")
    exported = Path(scratch.name) / path.name
    try:
        with _quiet(), torch.no_grad():
            torch.onnx.export(
                module,
                args,
                str(exported),
                input_names=input_names,
                output_names=["embedding"],
                dynamic_axes=dynamic_axes,
                opset_version=opset,
                dynamo=False,
                do_constant_folding=True,
            )
        place_model(exported, path, threshold=external_threshold)
    except Exception as err:  # the exporter raises many unrelated types
        raise ExportError(f"ONNX export to {path} failed: {err}") from err
    finally:
        module.train(was_training)
        scratch.cleanup()
    onnx.checker.check_model(str(path))


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=-1, keepdims=True), 1e-12)
    return (a * b).sum(axis=-1)


def onnx_session(path: Path | str, *, threads: int = 1) -> ort.InferenceSession:
    """A CPU onnxruntime session (used by the export checks and tests)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def verify_export(module: nn.Module, path: Path | str, inputs: dict[str, torch.Tensor]) -> float:
    """Run torch and onnxruntime on ``inputs``; return the minimum per-item cosine.

    Raises :class:`ExportError` when it is below :data:`MIN_COSINE`.
    """
    was_training = module.training
    module.eval()
    with torch.no_grad():
        expected = module(*inputs.values()).cpu().numpy()
    module.train(was_training)
    feeds = {name: tensor.cpu().numpy() for name, tensor in inputs.items()}
    got = onnx_session(path).run(["embedding"], feeds)[0]
    worst = float(_cosines(expected, got).min())
    if not worst >= MIN_COSINE:
        raise ExportError(
            f"{path}: ONNX and PyTorch disagree (min cosine {worst:.5f} < {MIN_COSINE})"
        )
    return worst


def export_audio_encoder(
    module: nn.Module, path: Path | str, *, sample_rate: int, opset: int = 18,
    external_threshold: int | None = None, verify: bool = True, mask_multiple: int | None = None,
) -> Path:
    """Export ``module(waveform) -> embedding`` to ``path`` and verify it; returns ``path``.

    ``verify=False`` leaves out the probe run (a batch of three 1.33-s noise clips through torch and
    onnxruntime) for a caller that checks the file against the module itself right after, on a batch
    of three as well (:func:`training.bundle.export.check_audio_parity`): for AST-base the probe alone is
    three 10-s windows on each side, ~12 s of two CPU cores. ``onnx.checker`` runs either way.

    ``mask_multiple`` (PE-Audio, its hop): the graph is ``module(waveform, padding_mask)``, and the probe
    is three clips of 2 s, 1.2 s and 0.4 s (multiples of it) zero-padded to 2 s in one call."""
    path = Path(path)
    generator = torch.Generator().manual_seed(0)
    trace = 0.1 * torch.randn(2, sample_rate, generator=generator)
    if mask_multiple is None:
        args: tuple[torch.Tensor, ...] = (trace,)
        names = ["waveform"]
    else:
        args, names = (trace, torch.ones(trace.shape, dtype=torch.int64)), ["waveform", "padding_mask"]
    _export(module, args, path, input_names=names, opset=opset, external_threshold=external_threshold)
    if not verify:
        log.info("exported audio encoder to %s (parity checked by the caller)", path)
        return path
    if mask_multiple is None:
        probes = {"waveform": 0.1 * torch.randn(3, sample_rate + sample_rate // 3, generator=generator)}
    else:
        width = 2 * sample_rate // mask_multiple * mask_multiple
        valid = torch.tensor([width, width * 3 // 5 // mask_multiple * mask_multiple,
                              width // 5 // mask_multiple * mask_multiple])
        mask = (torch.arange(width)[None, :] < valid[:, None]).long()
        probes = {"waveform": 0.1 * torch.randn(3, width, generator=generator) * mask, "padding_mask": mask}
    worst = verify_export(module, path, probes)
    log.info("exported audio encoder to %s (min cosine vs torch %.6f)", path, worst)
    return path


def _text_probe(max_length: int, vocab_size: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids with right padding of varied lengths (one full row)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, max(vocab_size, 2), (batch, max_length), generator=generator)
    lengths = torch.linspace(max_length, 2, batch).round().long()
    mask = (torch.arange(max_length)[None, :] < lengths[:, None]).long()
    return ids * mask, mask


def _vocab_size(module: nn.Module) -> int:
    """Rows of the first embedding table (the token embedding in our and HF towers)."""
    first = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    return first.num_embeddings if first is not None else 2


def export_text_encoder(
    module: nn.Module, path: Path | str, *, max_length: int, opset: int = 18,
    external_threshold: int | None = None,
) -> Path:
    """Export ``module(input_ids, attention_mask) -> embedding`` to ``path`` and verify it."""
    path = Path(path)
    vocab = _vocab_size(module)
    ids, mask = _text_probe(max_length, vocab, batch=2)
    _export(module, (ids, mask), path, input_names=["input_ids", "attention_mask"], opset=opset,
            external_threshold=external_threshold)
    ids, mask = _text_probe(max_length, vocab, batch=3)
    worst = verify_export(module, path, {"input_ids": ids, "attention_mask": mask})
    log.info("exported text encoder to %s (min cosine vs torch %.6f)", path, worst)
    return path
