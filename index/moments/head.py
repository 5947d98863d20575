"""Torch-free inference of the trained temporal moment head (``moment_head.onnx``, docs/objectives.md "Moments").

The head (training/models/moment_head.py) reads a recording's window embeddings and a query's
text embedding and gives every window a relevance score and a proposed span ``[c − l, c + r]``
around its centre; the proposals are ranked by score, clipped to the recording and thinned by the
same non-maximum suppression as the sliding-window baseline (:func:`index.moments.postprocess.non_maximum_suppression`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from index.bundle.format import MOMENT_HEAD as HEAD_ONNX
from index.bundle.format import MOMENT_HEAD_INFO as HEAD_INFO
from index.errors import BundleError
from index.moments.postprocess import Moment, moments_from_scores, non_maximum_suppression

__all__ = ["HEAD_INFO", "HEAD_ONNX", "LONGER_THAN", "MomentHeadModel"]

LONGER_THAN = 1.5
"""A stretch of high relevance replaces the head's spans inside it when it is this many times longer than the
longest moment the head was trained on (:meth:`MomentHeadModel._longer_runs`)."""


@dataclass
class MomentHeadModel:
    session: ort.InferenceSession
    info: dict

    @classmethod
    def load(cls, folder: Path) -> MomentHeadModel:
        folder = Path(folder)
        if not (folder / HEAD_ONNX).is_file() or not (folder / HEAD_INFO).is_file():
            raise BundleError(f"{folder}: no moment head ({HEAD_ONNX} and {HEAD_INFO}); train one with "
                              "`tonearm train-moments`")
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(str(folder / HEAD_ONNX), options, providers=["CPUExecutionProvider"])
        return cls(session, json.loads((folder / HEAD_INFO).read_text(encoding="utf-8")))

    def outputs(self, windows: np.ndarray, text: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(logits (T,), distances (T, 2) seconds) for one recording and one query."""
        feeds = {"windows": np.asarray(windows, np.float32)[None], "text": np.asarray(text, np.float32)[None]}
        logits, distances = self.session.run(["logits", "distances"], feeds)
        return np.asarray(logits[0]), np.asarray(distances[0])

    def moments(self, spans: np.ndarray, windows: np.ndarray, text: np.ndarray, *, nms_iou: float = 0.5,
                limit: int = 10) -> list[Moment]:
        """Ranked moments of one recording (``spans`` (T, 2) seconds of its windows, in time order)."""
        spans = np.asarray(spans, np.float64).reshape(-1, 2)
        if len(spans) == 0:
            return []
        logits, distances = self.outputs(windows, text)
        centres = spans.mean(axis=1)
        lo, hi = float(spans[0, 0]), float(spans[-1, 1])
        starts = np.clip(centres - distances[:, 0], lo, hi)
        ends = np.clip(centres + distances[:, 1], lo, hi)
        scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
        proposals = [Moment(float(s), float(e), float(p)) for s, e, p in zip(starts, ends, scores, strict=True)
                     if e > s]
        return non_maximum_suppression([*self._longer_runs(spans, scores), *proposals], nms_iou, limit)

    def _longer_runs(self, spans: np.ndarray, scores: np.ndarray) -> list[Moment]:
        """Stretches of the head's relevance curve longer than any moment it was trained on, as moments.

        The head places a moment around each window with spans it learned from its training moments; an
        event far longer (a sound covering most of a recording, when it was trained on events of seconds)
        gets spans of the trained lengths inside it, and none of them is the event. Its relevance stays high
        over the whole event, though: the sliding windows' merge and refinement
        (:func:`index.moments.postprocess.moments_from_scores`) over the curve of probabilities give that
        stretch, which ranks before the spans inside it (same best window, a hair more). Only stretches
        longer than ``LONGER_THAN`` × the longest trained moment (``longest_moment_seconds`` in
        ``moment_head.json``; a head without it keeps its own spans only)."""
        longest = float(self.info.get("longest_moment_seconds") or 0.0)
        if longest <= 0.0 or len(spans) < 3:
            return []
        runs = moments_from_scores(spans, scores)
        return [Moment(m.start, m.end, min(1.0, m.score + 1e-6)) for m in runs
                if m.end - m.start > LONGER_THAN * longest]
