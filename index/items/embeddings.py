"""Added items' embeddings kept on disk per bundle, so that a replica starts without re-embedding.

A replica replays the item log when it starts and when a bundle goes live; before this store it
decoded and encoded every added item's audio each time (500 items: 4.5 s against 2.2 s empty with
the test encoder; minutes with a real one at 100 k items, past a startup probe). Every embedding is
a pure function of (the bundle's encoder, the stored audio's bytes); the audio is content-addressed
(its file name is its sha256), so the pair ``(bundle key, audio name)`` names it for good.

Layout, beside the log (``<items dir>/embeddings/<bundle key>/<audio name[:2]>/<audio name>.f32``):
one file per embedding — the stored audio's size in bytes (8 bytes, little-endian) then the vector,
raw little-endian float32 of the bundle's dimension — written to a temporary file and renamed — replicas sharing the volume may write the same entry at once and a reader sees a
whole file or none. A file of the wrong size is ignored (re-embedded and rewritten), never trusted. The audio's size
lets the caller see an audio file truncated or rewritten since (it then decodes it, and quarantines
it if it fails, as without this store).
Entries of audio that a compaction removed are pruned by :meth:`EmbeddingStore.prune`.

Beside each ``.f32``, a ``.win`` holds the audio's moment windows (:mod:`index.moments.windows`: computed when
the item is embedded, never at query time): the audio's size (8 bytes), the number of windows ``m`` (8 bytes),
then ``m × 2`` float64 spans (seconds) and ``m × d`` float32 vectors, little-endian — ``m = 0`` for a recording no
longer than two windows (it has none, and the entry says so). Same rules: written whole and renamed, a file of
the wrong size ignored, pruned with its ``.f32``. A clip vector without its windows entry (a store written before
windows were kept) is completed by the item sync (service.items: an empty entry when the audio's header says it is
short, else the item embedded again, off the request path).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

EMBEDDINGS_DIR = "embeddings"
VECTOR_SUFFIX = ".f32"
WINDOWS_SUFFIX = ".win"
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def bundle_key(bundle_id: str, dim: int, encoder_sha256: str | None = None) -> str:
    """The directory of one bundle's embeddings: its id, its audio encoder's checksum when known (an id
    reused for another model after a bundle was deleted must not read the old vectors) and the dimension."""
    digest = f"-{encoder_sha256[:16]}" if encoder_sha256 else ""
    return f"{_SAFE.sub('_', bundle_id)}{digest}-{int(dim)}"


class EmbeddingStore:
    """The embeddings of one bundle's encoder over the log's stored audio."""

    def __init__(self, items_root: Path, bundle_id: str, dim: int, encoder_sha256: str | None = None) -> None:
        self.dim = int(dim)
        self.root = Path(items_root) / EMBEDDINGS_DIR / bundle_key(bundle_id, dim, encoder_sha256)

    def _path(self, audio: str, suffix: str = VECTOR_SUFFIX) -> Path:
        name = _SAFE.sub("_", audio)
        return self.root / name[:2] / f"{name}{suffix}"

    def get(self, audios: Sequence[str | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(found, vectors, audio_sizes)``: a mask of the audio names held, their vectors (NaN rows
        elsewhere) and the size of the audio each was embedded from (-1 elsewhere)."""
        found = np.zeros(len(audios), dtype=bool)
        vectors = np.full((len(audios), self.dim), np.nan, np.float32)
        sizes = np.full(len(audios), -1, np.int64)
        expected = 8 + 4 * self.dim
        for row, audio in enumerate(audios):
            if not audio:
                continue
            try:
                data = self._path(audio).read_bytes()
            except OSError:
                continue
            if len(data) != expected:  # another dimension, or not one of ours
                continue
            vector = np.frombuffer(data, dtype="<f4", offset=8)
            if np.isfinite(vector).all():
                vectors[row] = vector
                sizes[row] = int.from_bytes(data[:8], "little")
                found[row] = True
        return found, vectors, sizes

    def put(self, audios: Sequence[str | None], vectors: np.ndarray, audio_sizes: Sequence[int]) -> int:
        """Store the finite rows of ``vectors`` under their audio names; the number written. A write
        that fails (a full or read-only volume) costs only a re-embedding later: it is not an error."""
        written = 0
        for audio, vector, audio_size in zip(audios, np.asarray(vectors, dtype="<f4"), audio_sizes, strict=True):
            if not audio or vector.shape != (self.dim,) or not np.isfinite(vector).all():
                continue
            written += _write_whole(self._path(audio), int(audio_size).to_bytes(8, "little") + vector.tobytes())
        return written

    def get_windows(self, audios: Sequence[str | None]) -> list[tuple[int, np.ndarray, np.ndarray] | None]:
        """Per audio name, ``(audio size, spans (m, 2) seconds, vectors (m, d))`` of its moment windows (m = 0: a
        recording that has none), or None when the store holds no whole entry for it."""
        out: list[tuple[int, np.ndarray, np.ndarray] | None] = []
        for audio in audios:
            out.append(self._read_windows(audio) if audio else None)
        return out

    def _read_windows(self, audio: str) -> tuple[int, np.ndarray, np.ndarray] | None:
        try:
            data = self._path(audio, WINDOWS_SUFFIX).read_bytes()
        except OSError:
            return None
        if len(data) < 16:
            return None
        m = int.from_bytes(data[8:16], "little")
        if len(data) != 16 + m * (16 + 4 * self.dim):  # another dimension, torn, or not one of ours
            return None
        spans = np.frombuffer(data, dtype="<f8", count=2 * m, offset=16).reshape(m, 2)
        vectors = np.frombuffer(data, dtype="<f4", count=m * self.dim, offset=16 + 16 * m).reshape(m, self.dim)
        if not (np.isfinite(spans).all() and np.isfinite(vectors).all()):
            return None
        return int.from_bytes(data[:8], "little"), spans.astype(np.float64), vectors.astype(np.float32)

    def put_windows(self, audio: str, spans: np.ndarray, vectors: np.ndarray, audio_size: int) -> bool:
        """Store one audio's moment windows (none: an empty entry, which says it has none); whether it was
        written (a failed write costs an embedding at the next sync, as :meth:`put`'s)."""
        spans = np.asarray(spans, dtype="<f8").reshape(-1, 2)
        vectors = np.asarray(vectors, dtype="<f4").reshape(len(spans), -1) if len(spans) else np.zeros((0, self.dim), "<f4")
        if not audio or vectors.shape[1] != self.dim or not np.isfinite(vectors).all():
            return False
        header = int(audio_size).to_bytes(8, "little") + len(spans).to_bytes(8, "little")
        return bool(_write_whole(self._path(audio, WINDOWS_SUFFIX), header + spans.tobytes() + vectors.tobytes()))


def _write_whole(target: Path, payload: bytes) -> int:
    """Write ``payload`` to a temporary file beside ``target`` and rename it there (a reader sees the whole file
    or none); 1 when written, 0 when the volume refused (full, read-only)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(payload)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError:
        return 0
    return 1


def prune(items_root: Path, live_audio: Iterable[str]) -> int:
    """Remove every bundle's entries (vectors and windows) of audio not in ``live_audio`` (after a compaction
    removed that audio); the number of files removed. Bundles' directories left empty go too."""
    keep = {_SAFE.sub("_", name) for name in live_audio}
    base = Path(items_root) / EMBEDDINGS_DIR
    removed = 0
    if not base.is_dir():
        return 0
    for bundle_dir in base.iterdir():
        for entry in bundle_dir.glob("*/*"):
            if entry.suffix in (VECTOR_SUFFIX, WINDOWS_SUFFIX) and entry.stem not in keep:
                with contextlib.suppress(OSError):
                    entry.unlink()
                    removed += 1
        for shard in bundle_dir.glob("*"):
            with contextlib.suppress(OSError):
                shard.rmdir()  # only when empty
        with contextlib.suppress(OSError):
            bundle_dir.rmdir()
    return removed


def drop_bundle(items_root: Path, bundle_id: str, dim: int, encoder_sha256: str | None = None) -> None:
    """Forget one bundle's embeddings (a bundle deleted from the volume)."""
    shutil.rmtree(Path(items_root) / EMBEDDINGS_DIR / bundle_key(bundle_id, dim, encoder_sha256), ignore_errors=True)
