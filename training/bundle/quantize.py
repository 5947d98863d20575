"""Quantized bundle encoders, measured against fp32 (SPEC §11; `tonearm export --quantize`).

Dynamic int8 (ONNX Runtime ``quantize_dynamic``): the weights of every ``MatMul``
are stored as int8 with one scale per tensor; activations are quantized per call
from their observed range (``DynamicQuantizeLinear``) and the products run as
``MatMulInteger``. Convolutions stay fp32 — the audio towers' frontend computes its
STFT as a convolution whose precision the mel features need — so the gain comes
from the transformer layers, where real-size towers (RoBERTa/XLM-R, AST, HTS-AT)
spend their time. fp16 (:func:`index.catalogue.half_precision.half_precision_copy`: float inputs and
outputs, normalisations, reductions, Softmax and the mel front end kept fp32) is for GPU
providers; it is not measured on a GPU here.

Quantization is never assumed harmless; on the bundle's own held-out set the export measures

* per-item agreement: cosine between the quantized and the fp32 encoder's embedding of
  every held-out caption (text) and clip (audio) — min and mean;
* retrieval: the held-out report (docs/metrics.md) with the quantized encoders minus the
  report with the fp32 ones; ``drop`` = fp32 − quantized in points for t2a/a2t R@1 and R@10.

Past ``max_r10_drop`` points (either direction's mean R@10) the export refuses (one-line
error, exit status 2) or, with ``on_loss: warn``, logs a warning and keeps the bundle;
either way the manifest records the measurement (``manifest.quantization``).

Reference: Jacob et al., "Quantization and Training of Neural Networks for Efficient
Integer-Arithmetic-Only Inference", CVPR 2018, Eq. 1–7 (affine int8 scheme).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from index.bundle.evalset import EvalSet
from index.errors import TonearmError
from index.runtime.evaluate import evaluate_eval_set, retrieval_delta

log = logging.getLogger(__name__)

Modality = Literal["text", "audio"]
Precision = Literal["int8", "fp16"]
CHOICES = ("none", "text", "audio", "both")
RECALL_KEYS = ("t2a_R@1_mean", "t2a_R@10_mean", "a2t_R@1_mean", "a2t_R@10_mean")
R10_KEYS = ("t2a_R@10_mean", "a2t_R@10_mean")
QUANTIZED_OPS = ["MatMul"]
"""Op types int8 quantization touches (see the module docstring for why not Conv)."""
EXTERNAL_DATA_BYTES = 2 * 1024**3
"""ONNX protobufs are capped at 2 GB: larger models keep their weights in an external file."""

Encode = Callable[[Sequence], np.ndarray]


class QuantizationLossError(TonearmError):
    """The quantized encoders lose more held-out recall than the configured limit."""


class QuantizeConfig(BaseModel):
    """What to quantize at export and how much held-out recall it may cost."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    encoders: tuple[Modality, ...] = ()
    """Encoders to quantize (empty: none)."""
    precision: Precision = "int8"
    max_r10_drop: float = Field(default=1.0, ge=-100, le=100)
    """Largest allowed held-out R@10 drop against fp32, in points (mean over languages, t2a and a2t);
    a negative limit demands a gain, so every export refuses (how the tests force the refusal)."""
    on_loss: Literal["refuse", "warn"] = "refuse"
    """Past the limit: refuse the export (exit status 2) or only warn."""

    @classmethod
    def from_choice(cls, choice: str | None, *, quantize_text: bool = False, **kwargs: object) -> QuantizeConfig:
        """``--quantize text|audio|both|none`` (``--quantize-text`` is the old spelling of ``text``)."""
        choice = choice or ("text" if quantize_text else "none")
        if choice not in CHOICES:
            raise TonearmError(f"--quantize {choice!r}: choose one of {', '.join(CHOICES)}")
        if quantize_text and choice not in ("text", "both"):
            raise TonearmError(f"--quantize-text contradicts --quantize {choice}")
        encoders: tuple[Modality, ...] = {"none": (), "text": ("text",), "audio": ("audio",),
                                          "both": ("text", "audio")}[choice]
        return cls(encoders=encoders, **kwargs)  # type: ignore[arg-type]

    def applies(self, modality: Modality) -> bool:
        return modality in self.encoders

    @property
    def label(self) -> str:
        """The manifest's ``quantization`` value of a quantized encoder."""
        return "dynamic-int8" if self.precision == "int8" else "fp16"


# ----------------------------------------------------------------------------- conversion


def quantize_model(src: Path | str, dst: Path | str, *, precision: Precision = "int8") -> Path:
    """Write the quantized copy of the ONNX model ``src`` to ``dst``."""
    src, dst = Path(src), Path(dst)
    external = src.stat().st_size >= EXTERNAL_DATA_BYTES or any(src.parent.glob(f"{src.name}.data"))
    if precision == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(src, dst, weight_type=QuantType.QInt8, op_types_to_quantize=QUANTIZED_OPS,
                         use_external_data_format=external)
    else:  # the same fp16 copy as the fp16 catalogue pass: fragile ops and the mel front end stay fp32
        from index.catalogue.half_precision import half_precision_copy

        half_precision_copy(src, dst)
    log.info("%s: %s copy written to %s (%.1f MB -> %.1f MB)", src.name, precision, dst,
             src.stat().st_size / 1e6, dst.stat().st_size / 1e6)
    return dst


# ----------------------------------------------------------------------------- measurement


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-row cosine of two (n, d) embedding matrices."""
    a = a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=-1, keepdims=True), 1e-12)
    return np.asarray((a * b).sum(axis=-1), dtype=np.float64)


class _Recorded:
    """An encode function that remembers its last output (the report encodes each side once)."""

    def __init__(self, encode: Encode) -> None:
        self.encode = encode
        self.last: np.ndarray | None = None

    def __call__(self, items: Sequence) -> np.ndarray:
        self.last = self.encode(items)
        return self.last


@dataclass(frozen=True)
class EncoderPair:
    """One modality's served encoder and its fp32 original (the same function when not quantized)."""

    served: Encode
    fp32: Encode
    quantized: bool


@dataclass(frozen=True)
class Measurement:
    report: dict[str, float]
    fp32_report: dict[str, float]
    delta: dict[str, float]
    """served − fp32 (fractions), every recall / mAP key."""
    cosine: dict[str, np.ndarray]
    """Per-item cosine served vs fp32, for the quantized modalities."""

    def drop_points(self) -> dict[str, float]:
        """fp32 − served in points, for :data:`RECALL_KEYS` present in the report."""
        return {key: round(-100.0 * self.delta[key], 4) for key in RECALL_KEYS if key in self.delta}


def measure(eval_set: EvalSet, languages: Sequence[str], *, audio: EncoderPair, text: EncoderPair) -> Measurement:
    """Held-out reports of the served and the fp32 encoders, and per-item cosines between them."""
    served_audio, served_text = _Recorded(audio.served), _Recorded(text.served)
    report = evaluate_eval_set(eval_set, encode_audio=served_audio, encode_text=served_text, languages=languages)
    fp32_audio = _Recorded(audio.fp32) if audio.quantized else (lambda _items: served_audio.last)
    fp32_text = _Recorded(text.fp32) if text.quantized else (lambda _items: served_text.last)
    fp32_report = evaluate_eval_set(eval_set, encode_audio=fp32_audio, encode_text=fp32_text,  # type: ignore[arg-type]
                                    languages=languages)
    cosine: dict[str, np.ndarray] = {}
    for name, served, fp32 in (("audio", served_audio, fp32_audio), ("text", served_text, fp32_text)):
        if isinstance(fp32, _Recorded) and served.last is not None and fp32.last is not None:
            cosine[name] = cosines(served.last, fp32.last)
    return Measurement(report, fp32_report, retrieval_delta(report, fp32_report), cosine)


def check_loss(measurement: Measurement, config: QuantizeConfig) -> bool:
    """True when within the limit; past it raise :class:`QuantizationLossError` (refuse) or warn."""
    drops = measurement.drop_points()
    worst_key = max((k for k in R10_KEYS if k in drops), key=lambda k: drops[k], default=None)
    if worst_key is None or drops[worst_key] <= config.max_r10_drop:
        return True
    agreement = ", ".join(f"{m} min cosine {c.min():.4f}" for m, c in sorted(measurement.cosine.items()))
    message = (
        f"{config.precision} {'+'.join(config.encoders)} encoder(s) lose {drops[worst_key]:.2f} points of held-out "
        f"{worst_key} against fp32 (limit {config.max_r10_drop:g}; {agreement}): export without --quantize, "
        f"or raise --quantize-max-drop, or --quantize-on-loss warn"
    )
    if config.on_loss == "refuse":
        raise QuantizationLossError(message)
    log.warning("%s", message)
    return False
