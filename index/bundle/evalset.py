"""The held-out multilingual evaluation set stored in a bundle (``eval/``; docs/bundle.md).

Files (no pickle; ``np.load(allow_pickle=False)``):

* ``eval/waveforms.npy`` — int16 (N, T_max): each clip's decoded waveform at the
  bundle's sample rate, prepared by the training config's evaluation policy
  (:func:`prepare_waveform`: whole clip for ``chunk``, center crop for
  ``center``), zero-padded on the right (16-bit PCM sources are stored
  losslessly: ``round(x * 32768)``). ``LoadedBundle.encode_audio`` on these
  waveforms reproduces the manifest's evaluation;
* ``eval/clips.jsonl`` — one line per clip: ``{"id", "num_samples"}``;
* ``eval/captions.jsonl`` — one line per caption query:
  ``{"text", "clip" (row in clips), "lang", "group"}``; captions of one
  ``group`` are translations of each other (a query group for MRV, docs/metrics.md).

The service's consistency diagnostics and quality gate, and `tonearm bundle
eval`, read it through :func:`read_eval_set`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from index.audio.decode import decode_audio, decode_window, fit_length
from index.audio.frontend import Padding
from index.errors import BundleError

WAVEFORMS = "waveforms.npy"
CLIPS = "clips.jsonl"
CAPTIONS = "captions.jsonl"
MAX_EVAL_CLIPS = 300
"""At most this many clips (the first ones of the held-out split) are stored."""
_SCALE = 32768.0


@dataclass(frozen=True)
class EvalSet:
    """Held-out clips and their multilingual caption queries.

    Shapes: ``waveforms`` N float32 arrays (each clip's full length);
    ``captions`` Q strings with ``clip`` (Q,) int64 rows into ``clip_ids``,
    ``lang`` (Q,) str, ``group`` (Q,) int64.
    """

    clip_ids: list[str]
    waveforms: list[np.ndarray]
    captions: list[str]
    clip: np.ndarray
    lang: np.ndarray
    group: np.ndarray

    def __post_init__(self) -> None:
        n, q = len(self.clip_ids), len(self.captions)
        if len(self.waveforms) != n:
            raise ValueError(f"{len(self.waveforms)} waveforms for {n} clip ids")
        for name in ("clip", "lang", "group"):
            if len(getattr(self, name)) != q:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {q} captions")
        if q and (self.clip.min() < 0 or self.clip.max() >= n):
            raise ValueError("caption clip rows out of range")


def prepare_waveform(
    wave: np.ndarray, *, clip_samples: int, policy: Literal["center", "chunk"], padding: Padding = "pad"
) -> np.ndarray:
    """The waveform the bundle embeds for a clip under the evaluation policy (docs/corpus.md).

    ``chunk``: the whole clip (``encode_audio`` chunks and averages it);
    ``center``: the center crop, or the clip padded to ``clip_samples`` with ``padding``
    (the bundle's ``audio_frontend`` policy; zeros by default).
    """
    if policy == "center":
        return fit_length(wave, clip_samples, mode="center", padding=padding)
    return np.asarray(wave, dtype=np.float32)


def load_eval_waveform(
    source: Path | str, *, sample_rate: int, clip_samples: int, policy: Literal["center", "chunk"],
    padding: Padding = "pad", min_sample_rate: int | None = None, max_samples: int | None = None,
    max_bytes: int | None = None,
) -> np.ndarray:
    """``prepare_waveform(decode_audio(source))``, decoding only the center window for ``center``; the
    decode limits as :func:`index.audio.decode.decode_audio`'s (a catalogue pass's
    :class:`index.audio.decode.DecodeLimits`)."""
    if policy == "center":
        return decode_window(source, sample_rate=sample_rate, n=clip_samples, mode="center", padding=padding,
                             min_sample_rate=min_sample_rate, max_samples=max_samples, max_bytes=max_bytes)
    return decode_audio(source, sample_rate=sample_rate, min_sample_rate=min_sample_rate, max_samples=max_samples,
                        max_bytes=max_bytes)


def to_int16(wave: np.ndarray) -> np.ndarray:
    """float32 in [-1, 1] → int16 (lossless for 16-bit PCM sources)."""
    return np.clip(np.round(np.asarray(wave, dtype=np.float64) * _SCALE), -32768, 32767).astype(np.int16)


def _save_waveforms(path: Path, waveforms: Sequence[np.ndarray]) -> list[int]:
    """Save ``waveforms`` as one zero-padded int16 matrix (a row each) at ``path``; their lengths."""
    lengths = [len(w) for w in waveforms]
    matrix = np.zeros((len(lengths), max(lengths, default=0)), dtype=np.int16)
    for row, wave in enumerate(waveforms):
        matrix[row, : len(wave)] = to_int16(wave)
    np.save(path, matrix, allow_pickle=False)
    return lengths


def write_eval_set(directory: Path, eval_set: EvalSet) -> None:
    """Write ``eval_set`` into ``directory`` (created)."""
    directory.mkdir(parents=True, exist_ok=True)
    lengths = _save_waveforms(directory / WAVEFORMS, eval_set.waveforms)
    _write_jsonl(
        directory / CLIPS,
        ({"id": cid, "num_samples": n} for cid, n in zip(eval_set.clip_ids, lengths, strict=True)),
    )
    _write_jsonl(
        directory / CAPTIONS,
        (
            {"text": text, "clip": int(c), "lang": str(lang), "group": int(g)}
            for text, c, lang, g in zip(
                eval_set.captions, eval_set.clip, eval_set.lang, eval_set.group, strict=True
            )
        ),
    )


def _write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_jsonl(path: Path, *, required: Sequence[str]) -> list[dict]:
    """Parse a JSONL file of objects that must carry the ``required`` keys; errors name the line."""
    rows: list[dict] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise BundleError(f"{path}: cannot read ({err})") from None
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise BundleError(f"{path}:{number}: invalid JSON ({err.msg})") from None
        if not isinstance(row, dict) or any(key not in row for key in required):
            raise BundleError(f"{path}:{number}: expected an object with keys {list(required)}")
        rows.append(row)
    return rows


def read_eval_set(directory: Path) -> EvalSet:
    """Load and check the held-out set written by :func:`write_eval_set`."""
    path = directory / WAVEFORMS
    try:
        matrix = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise BundleError(f"{path}: cannot read ({err})") from None
    clips = read_jsonl(directory / CLIPS, required=("id", "num_samples"))
    captions = read_jsonl(directory / CAPTIONS, required=("text", "clip", "lang", "group"))
    if matrix.dtype != np.int16 or matrix.ndim != 2 or len(matrix) != len(clips):
        raise BundleError(f"{path}: expected int16 ({len(clips)}, T), got {matrix.dtype} {matrix.shape}")
    if any(not 0 < int(c["num_samples"]) <= matrix.shape[1] for c in clips):
        raise BundleError(f"{directory / CLIPS}: num_samples out of range for {path}")
    # One float32 matrix, scaled in place, and a view per clip: two large allocations (memory-mapped
    # by malloc and returned whole when the set is dropped) instead of two per clip, which the
    # service's gate made at every activation and left as holes in the heap (docs/service.md, "Memory").
    scaled = matrix.astype(np.float32)
    scaled /= _SCALE
    waveforms = [scaled[row, : int(c["num_samples"])] for row, c in enumerate(clips)]
    try:
        return EvalSet(
            clip_ids=[str(c["id"]) for c in clips],
            waveforms=waveforms,
            captions=[str(c["text"]) for c in captions],
            clip=np.array([int(c["clip"]) for c in captions], dtype=np.int64),
            lang=np.array([str(c["lang"]) for c in captions], dtype=str),
            group=np.array([int(c["group"]) for c in captions], dtype=np.int64),
        )
    except ValueError as err:
        raise BundleError(f"{directory / CAPTIONS}: inconsistent eval set ({err})") from None


# ----------------------------------------------------------------------------- the held-out moment set

MOMENT_WAVEFORMS = "moment_waveforms.npy"
MOMENT_RECORDINGS = "moment_recordings.jsonl"
MOMENT_QUERIES = "moment_queries.jsonl"
MOMENT_SET_FILES = (MOMENT_WAVEFORMS, MOMENT_RECORDINGS, MOMENT_QUERIES)
"""Optional files of ``eval/``: the long recordings whose moment report is the manifest's ``moments.heldout``
(and ``moment_head.heldout``), kept so that the quality gate can ask any bundle the same moment queries."""


@dataclass(frozen=True)
class MomentQuerySpec:
    """One held-out moment query: a caption asked of one recording, and its ground-truth spans (seconds)."""

    recording: int
    lang: str
    text: str
    spans: list[tuple[float, float]]


@dataclass(frozen=True)
class MomentSet:
    """Held-out long recordings (float32 at ``sample_rate``) and the moment queries asked of them."""

    recording_ids: list[str]
    waveforms: list[np.ndarray]
    queries: list[MomentQuerySpec]
    sample_rate: int

    def __post_init__(self) -> None:
        if len(self.waveforms) != len(self.recording_ids):
            raise ValueError(f"{len(self.waveforms)} waveforms for {len(self.recording_ids)} recording ids")
        if any(not 0 <= q.recording < len(self.recording_ids) for q in self.queries):
            raise ValueError("moment query recording rows out of range")

    def languages(self) -> list[str]:
        return sorted({q.lang for q in self.queries})


def write_moment_set(directory: Path, moment_set: MomentSet) -> None:
    """Write ``moment_set`` into ``directory`` (created) as int16 waveforms and two JSONL files."""
    directory.mkdir(parents=True, exist_ok=True)
    lengths = _save_waveforms(directory / MOMENT_WAVEFORMS, moment_set.waveforms)
    _write_jsonl(directory / MOMENT_RECORDINGS,
                 ({"id": rid, "num_samples": n, "sample_rate": moment_set.sample_rate}
                  for rid, n in zip(moment_set.recording_ids, lengths, strict=True)))
    _write_jsonl(directory / MOMENT_QUERIES,
                 ({"recording": q.recording, "lang": q.lang, "text": q.text, "spans": [list(s) for s in q.spans]}
                  for q in moment_set.queries))


def read_moment_set(directory: Path) -> MomentSet | None:
    """The moment set written by :func:`write_moment_set`; None when ``directory`` has none."""
    if not (directory / MOMENT_QUERIES).is_file():
        return None
    path = directory / MOMENT_WAVEFORMS
    try:
        matrix = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise BundleError(f"{path}: cannot read ({err})") from None
    recordings = read_jsonl(directory / MOMENT_RECORDINGS, required=("id", "num_samples", "sample_rate"))
    queries = read_jsonl(directory / MOMENT_QUERIES, required=("recording", "lang", "text", "spans"))
    if matrix.dtype != np.int16 or matrix.ndim != 2 or len(matrix) != len(recordings):
        raise BundleError(f"{path}: expected int16 ({len(recordings)}, T), got {matrix.dtype} {matrix.shape}")
    if any(not 0 < int(r["num_samples"]) <= matrix.shape[1] for r in recordings):
        raise BundleError(f"{directory / MOMENT_RECORDINGS}: num_samples out of range for {path}")
    rates = {int(r["sample_rate"]) for r in recordings}
    if len(rates) > 1:
        raise BundleError(f"{directory / MOMENT_RECORDINGS}: recordings at several sample rates {sorted(rates)}")
    try:
        return MomentSet(
            recording_ids=[str(r["id"]) for r in recordings],
            waveforms=[matrix[row, : int(r["num_samples"])].astype(np.float32) / _SCALE
                       for row, r in enumerate(recordings)],
            queries=[MomentQuerySpec(int(q["recording"]), str(q["lang"]), str(q["text"]),
                                     [(float(s), float(e)) for s, e in q["spans"]]) for q in queries],
            sample_rate=rates.pop() if rates else 0,
        )
    except (TypeError, ValueError) as err:
        raise BundleError(f"{directory / MOMENT_QUERIES}: inconsistent moment set ({err})") from None
