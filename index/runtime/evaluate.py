"""The metrics (docs/metrics.md) of a bundle from its ONNX encoders only (no torch).

The held-out set stored in the bundle is embedded with the bundle's encoders
(chunk-and-average audio, tokenizer + text encoder) and scored with
:func:`index.metrics.retrieval.retrieval_report`. Export computes the manifest's
``evaluation.report`` with this same function, so `tonearm bundle eval`
reproduces it; both agree with `tonearm evaluate` on the source checkpoint
(same clips, same policy) to within ONNX-vs-PyTorch rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from index.bundle.evalset import EvalSet
from index.metrics.retrieval import retrieval_report

if TYPE_CHECKING:
    from index.runtime.loader import LoadedBundle

Encoder = Callable[[Sequence], np.ndarray]
RETRIEVAL_PREFIXES = ("t2a_", "a2t_")


def evaluate_eval_set(
    eval_set: EvalSet, *, encode_audio: Encoder, encode_text: Encoder, languages: Sequence[str]
) -> dict[str, float]:
    """Retrieval report of the given encoders on ``eval_set`` (captions outside ``languages`` ignored)."""
    keep = np.isin(eval_set.lang, list(languages))
    texts = [t for t, k in zip(eval_set.captions, keep, strict=True) if k]
    report = retrieval_report(
        audio_emb=encode_audio(eval_set.waveforms),
        text_emb=encode_text(texts),
        caption_clip=eval_set.clip[keep],
        caption_lang=eval_set.lang[keep],
        caption_group=eval_set.group[keep],
        languages=list(languages),
    )
    return {key: float(value) for key, value in report.items()}


def evaluate_bundle(bundle: LoadedBundle) -> dict[str, float]:
    """The bundle's held-out report (what ``manifest.evaluation.report`` records)."""
    return evaluate_eval_set(
        bundle.eval_set(),
        encode_audio=bundle.encode_audio,
        encode_text=bundle.encode_text,
        languages=bundle.languages,
    )


def retrieval_delta(new: dict[str, float], old: dict[str, float]) -> dict[str, float]:
    """``new - old`` for every recall / mAP key present in both."""
    return {
        key: new[key] - old[key]
        for key in new
        if key.startswith(RETRIEVAL_PREFIXES) and key in old
    }


def max_report_difference(a: dict[str, float], b: dict[str, float]) -> float:
    """Largest absolute difference over the recall / mAP keys (fractions, not points)."""
    delta = retrieval_delta(a, b)
    return max((abs(v) for v in delta.values() if np.isfinite(v)), default=0.0)
