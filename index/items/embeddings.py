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

    def _path(self, audio: str) -> Path:
        name = _SAFE.sub("_", audio)
        return self.root / name[:2] / f"{name}.f32"

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
            target = self._path(audio)
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
                try:
                    with os.fdopen(fd, "wb") as out:
                        out.write(int(audio_size).to_bytes(8, "little") + vector.tobytes())
                    os.replace(tmp, target)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
            except OSError:
                continue
            written += 1
        return written


def prune(items_root: Path, live_audio: Iterable[str]) -> int:
    """Remove every bundle's entries of audio not in ``live_audio`` (after a compaction removed that
    audio); the number of files removed. Bundles' directories left empty go too."""
    keep = {_SAFE.sub("_", name) for name in live_audio}
    base = Path(items_root) / EMBEDDINGS_DIR
    removed = 0
    if not base.is_dir():
        return 0
    for bundle_dir in base.iterdir():
        for entry in bundle_dir.glob("*/*.f32"):
            if entry.stem not in keep:
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
