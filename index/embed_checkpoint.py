"""Chunked checkpoints of a long embedding pass, so an interrupted pass resumes (issue 41).

One logic for every in-process catalogue pass — `tonearm index` (:mod:`index.own_audio`), `tonearm
export` and `export --pretrained` (:mod:`training.export`, :mod:`training.pretrained`): the pass over
``N`` items embeds them in chunks of ``chunk_files`` items (:func:`embed_in_chunks`); each chunk's
clip ids, vectors and skipped files are written to ``<out>.partial/chunk-NNNNNN.npz`` (atomically:
a temporary file renamed) as soon as it is done. ``plan.json`` there holds a digest of what the
pass embeds (:func:`plan_digest`: the encoder's checksum and whatever else decides the vectors —
every input file's name, size and mtime, the frontend, the chunk size), and a rerun of the same
command with the same plan loads the finished chunks instead of embedding them again; any other
plan (a file added, changed or removed, another encoder) starts over. The caller removes the folder
once its bundle is published. A chunk is the unit of loss: an interruption costs at most the
chunk in progress. :class:`PassRate` is the progress the passes show: this run's clips/s (loaded
chunks left out) and the time left at that rate.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

CHUNK_FILES = 1024
"""Files (clips) per checkpointed chunk (~1,024 × 4 KB of vectors at d = 1024: small next to the decoding)."""
PLAN = "plan.json"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Chunk:
    clip_ids: list[str]
    embeddings: np.ndarray
    skipped: list[tuple[str, str]]


def plan_digest(*, files: Sequence[tuple[str, Path]], chunk_files: int, **decides: Any) -> str:
    """sha256 of everything that decides a pass's vectors and its chunk boundaries: each input file's
    name (as ``files`` gives it), size and mtime, the chunk size, and ``decides`` (JSON values: the
    encoder's checksum, the frontend, the clip ids, ...)."""
    listing = []
    for name, path in files:
        stat = path.stat()
        listing.append([name, stat.st_size, stat.st_mtime_ns])
    body = json.dumps({**decides, "files": listing, "chunk_files": chunk_files}, sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


class EmbedCheckpoint:
    """``<out>.partial/``: the plan digest and the finished chunks of one pass (another plan's chunks
    found there are deleted)."""

    def __init__(self, out: Path, digest: str) -> None:
        self.folder = partial_folder(out)
        self.digest = digest
        plan = self.folder / PLAN
        if plan.is_file() and json.loads(plan.read_text(encoding="utf-8")).get("digest") != digest:
            shutil.rmtree(self.folder)  # another pass's chunks: start over
        self.folder.mkdir(parents=True, exist_ok=True)
        if not plan.is_file():
            plan.write_text(json.dumps({"digest": digest}) + "\n", encoding="utf-8")

    def _path(self, number: int) -> Path:
        return self.folder / f"chunk-{number:06d}.npz"

    def load(self, number: int) -> Chunk | None:
        """A finished chunk, or None."""
        path = self._path(number)
        if not path.is_file():
            return None
        with np.load(path, allow_pickle=False) as data:
            skipped = [(str(rel), str(reason)) for rel, reason in zip(data["skipped_rel"], data["skipped_reason"],
                                                                      strict=True)]
            return Chunk([str(c) for c in data["clip_ids"]], np.asarray(data["embeddings"], np.float32), skipped)

    def save(self, number: int, chunk: Chunk) -> None:
        tmp = self.folder / f".chunk-{number:06d}.tmp.npz"
        np.savez(tmp, clip_ids=np.asarray(chunk.clip_ids, dtype=str), embeddings=chunk.embeddings,
                 skipped_rel=np.asarray([s[0] for s in chunk.skipped], dtype=str),
                 skipped_reason=np.asarray([s[1] for s in chunk.skipped], dtype=str))
        with tmp.open("rb") as handle:
            os.fsync(handle.fileno())
        tmp.replace(self._path(number))

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


class Advance(Protocol):
    """Progress of a pass: ``n`` more items done; ``resumed``: loaded from a checkpoint, not embedded."""

    def __call__(self, n: int, /, *, resumed: bool = False) -> None: ...


EmbedChunk = Callable[[int, int, Callable[[int], None]], Chunk]
"""``embed(start, stop, advance)``: the chunk of items ``[start, stop)``, calling ``advance(n)`` as it goes."""


def embed_in_chunks(total: int, embed: EmbedChunk, *, dim: int, checkpoint: EmbedCheckpoint | None,
                    chunk_files: int = CHUNK_FILES, advance: Advance) -> Chunk:
    """The pass over ``total`` items in chunks of ``chunk_files``: a chunk found in ``checkpoint`` is
    loaded, any other embedded by ``embed`` and saved there; all chunks concatenated in item order."""
    if chunk_files < 1:
        raise ValueError(f"chunk_files must be >= 1, got {chunk_files}")
    clip_ids: list[str] = []
    parts: list[np.ndarray] = []
    skipped: list[tuple[str, str]] = []
    for number, start in enumerate(range(0, total, chunk_files)):
        stop = min(start + chunk_files, total)
        chunk = checkpoint.load(number) if checkpoint is not None else None
        if chunk is not None:
            log.info("resumed: chunk %d (%d items) from %s", number, stop - start, checkpoint.folder)  # type: ignore[union-attr]
            advance(stop - start, resumed=True)
        else:
            chunk = embed(start, stop, advance)
            if checkpoint is not None:
                checkpoint.save(number, chunk)
        clip_ids += chunk.clip_ids
        parts.append(chunk.embeddings)
        skipped += chunk.skipped
    embeddings = np.concatenate(parts) if parts else np.zeros((0, dim), np.float32)
    return Chunk(clip_ids, embeddings, skipped)


class PassRate:
    """A pass's progress text: this run's clips/s (items loaded from a checkpoint left out) and the
    time left at that rate, e.g. ``12.3 clips/s, 4.5 min left``."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.embedded = total, 0, 0
        self.began = time.monotonic()

    def add(self, n: int, *, resumed: bool = False) -> None:
        self.done += n
        if not resumed:
            self.embedded += n

    @property
    def rate(self) -> float:
        return self.embedded / max(time.monotonic() - self.began, 1e-9)

    def describe(self) -> str:
        rate = self.rate
        left = f"{(self.total - self.done) / rate / 60:.1f} min left" if rate > 0 else "? left"
        return f"{rate:.1f} clips/s, {left}"


@contextmanager
def resumable(out: Path) -> Iterator[None]:
    """Around a pass that publishes ``out``: its chunks stay for a rerun when the pass is interrupted
    (Ctrl-C, a killed job) or crashes, and go when it ends — published, or refused by one of its
    checks (a :class:`~index.errors.TonearmError`: a parity or quantization limit, bad input), so that
    a refused export leaves its output folder as it found it."""
    from index.errors import TonearmError

    try:
        yield
    except TonearmError:
        discard(out)
        raise
    discard(out)


def discard(out: Path) -> None:
    """Remove ``<out>.partial/`` (the pass's bundle is published)."""
    shutil.rmtree(partial_folder(out), ignore_errors=True)


def partial_folder(out: Path) -> Path:
    """``<out>.partial``: where the pass publishing ``out`` keeps its chunks."""
    return out.parent / f"{out.name}.partial"
