"""Chunked checkpoints of a long embedding pass, so an interrupted `tonearm index` resumes (issue 41).

The in-process pass over ``N`` files embeds them in chunks of :data:`CHUNK_FILES` files; each chunk's
clip ids, vectors and skipped files are written to ``<out>.partial/chunk-NNNNNN.npz`` (atomically:
a temporary file renamed) as soon as it is done. ``plan.json`` there holds a digest of what the
pass embeds — the source bundle's id and encoder checksum, the audio root, every file's relative
path, size and mtime, the chunk size — and a rerun of the same command with the same plan loads the
finished chunks instead of embedding them again; any other plan (a file added, changed or
removed, another bundle) starts over. The folder is removed once the bundle is published. A
chunk is the unit of loss: an interruption costs at most the chunk in progress.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHUNK_FILES = 1024
"""Files per checkpointed chunk (~1,024 × 4 KB of vectors at d = 1024: small next to the decoding)."""
PLAN = "plan.json"


@dataclass(frozen=True)
class Chunk:
    clip_ids: list[str]
    embeddings: np.ndarray
    skipped: list[tuple[str, str]]


def plan_digest(*, bundle_id: str, encoder_sha256: str, audio_dir: Path, files: Sequence[Path], chunk_files: int,
                precision: str = "fp32") -> str:
    """sha256 of everything that decides the pass's vectors and its chunk boundaries (``precision``:
    `--precision`; an fp32 plan's digest is what it was before the option existed)."""
    listing = []
    for path in files:
        stat = path.stat()
        listing.append([path.relative_to(audio_dir).as_posix(), stat.st_size, stat.st_mtime_ns])
    body = json.dumps({"bundle": bundle_id, "encoder": encoder_sha256, "root": str(audio_dir), "files": listing,
                       "chunk_files": chunk_files, **({"precision": precision} if precision != "fp32" else {})},
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


class EmbedCheckpoint:
    """``<out>.partial/``: the plan digest and the finished chunks of one pass."""

    def __init__(self, out: Path, digest: str) -> None:
        self.folder = out.parent / f"{out.name}.partial"
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
