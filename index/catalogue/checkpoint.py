"""Chunked, content-keyed checkpoints of a long embedding pass: a pass resumes after an interruption,
a bad clip and a changed catalogue without losing work (issues 41 and 49).

One logic for every catalogue pass — `tonearm index` (:mod:`index.catalogue.own_audio`), `tonearm export` and
`export --pretrained` (:mod:`training.bundle.parts`), in process or on Ray, clips and captions alike.

* **Keys.** Every item has a content key (:func:`content_key`: a file's size and a hash of its first
  and last 64 KiB; :func:`text_key`: a caption's sha256) and the pass has a digest of what else decides
  a vector (:func:`pass_digest`: the encoder's checksum, the front end, the providers, the precision).
  A file's name, path and mtime are *not* part of either: a touched or renamed file keeps its vector.
* **Chunks.** The items still to embed are embedded in chunks of ``chunk_files``; each chunk's keys,
  clip ids, vectors and skipped items (a clip that cannot be decoded: its reason) are written to
  ``<out>.partial/chunk-NNNNNN.npz`` (atomically) as soon as it is done.
* **Resume.** A rerun reads every chunk saved under the same pass digest and reuses each vector (and each
  skip) whose key is still in the catalogue, whatever chunk it was saved in; only the rest is embedded,
  and :func:`embed_in_chunks` logs how many were reused and why the rest were not (new or changed
  content; another pass: which of its settings changed). Chunks of another pass are deleted.
* **Windows.** A clips pass that windows its long recordings (:mod:`index.catalogue.pass_windows`) saves
  each long file's moment windows in the chunk of its clip vector, under the same key: a resumed pass
  neither decodes a finished file again nor loses its windows. Chunks saved by a pass that did not window
  are another pass (the window settings are part of the pass digest).
* **Loss.** An interruption costs at most the chunk in progress; a clip that cannot be decoded is
  skipped and listed (the caller records it in the bundle), never a reason to drop chunks; a pass refused
  by a check (:func:`resumable`) keeps its chunks for the rerun. The folder goes once the bundle is published.

:class:`PassRate` is the progress the passes show: this run's clips/s (reused items left out), the
time left at that rate, and with a :class:`~index.catalogue.embed_pass.PassClock` the decode wait and the
encoder's busy fraction.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

CHUNK_FILES = 1024
"""Files (clips) per checkpointed chunk (~1,024 × 4 KB of vectors at d = 1024: small next to the decoding)."""
CHUNK_TEXTS = 16384
"""Captions per checkpointed chunk of the caption pass."""
PLAN = "pass.json"
EDGE_BYTES = 1 << 16
"""Bytes read at each end of a file for its content key."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Item:
    """One item of a pass: its id in the bundle and its content key."""

    clip_id: str
    key: str


Windows = tuple[np.ndarray, np.ndarray]
"""A long recording's moment windows: ``(spans (n, 2) seconds, vectors (n, d))``
(:func:`index.moments.windows.embed_windows`)."""


@dataclass(frozen=True)
class Chunk:
    """Vectors of the embedded items (``clip_ids``/``keys`` row by row) and the skipped ones
    (``(clip id, reason)``, with their keys in ``skipped_keys``); ``windows``: the moment windows of the
    long recordings among the embedded items, by clip id (:mod:`index.catalogue.pass_windows`)."""

    clip_ids: list[str]
    embeddings: np.ndarray
    skipped: list[tuple[str, str]]
    keys: list[str] = field(default_factory=list)
    skipped_keys: list[str] = field(default_factory=list)
    windows: dict[str, Windows] = field(default_factory=dict)


def content_key(path: Path) -> str:
    """``<size>-<blake2b of the first and last 64 KiB>``: what a file holds, cheap to read for a
    million files (not its name or mtime). Two files of equal size and equal ends are taken as equal."""
    size = path.stat().st_size
    digest = hashlib.blake2b(digest_size=16)
    with path.open("rb") as handle:
        digest.update(handle.read(EDGE_BYTES))
        if size > 2 * EDGE_BYTES:
            handle.seek(size - EDGE_BYTES)
        digest.update(handle.read(EDGE_BYTES))
    return f"{size}-{digest.hexdigest()}"


def text_key(text: str) -> str:
    """A caption's content key."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def file_items(ids: Sequence[str], paths: Sequence[Path]) -> list[Item]:
    """Items of files; a file that cannot be read gets a key of its own that no chunk holds (its
    decoding fails and lists it)."""
    items = []
    for clip_id, path in zip(ids, paths, strict=True):
        try:
            key = content_key(Path(path))
        except OSError as err:
            key = f"unreadable-{err.__class__.__name__}-{clip_id}"
        items.append(Item(clip_id, key))
    return items


def pass_digest(**decides: Any) -> str:
    """sha256 of what besides an item's content decides its vector (JSON values: the encoder's
    checksum, the front end, the providers, the precision, ...)."""
    body = json.dumps(decides, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(body.encode()).hexdigest()


class EmbedCheckpoint:
    """A folder of one pass's chunks: ``<out>.partial/`` (or ``<out>.partial/<name>/``), its pass digest
    in ``pass.json``. Chunks of another pass found there are deleted (and the settings that differ logged).

    ``skips_under``: what decides whether a file is *skipped* but not its vector — the pass's decode limits
    (:class:`index.audio.decode.DecodeLimits`). Saved with the plan; when it differs, the saved vectors are
    reused as before but every saved skip is tried again (``retry_skips``): a file refused under lower
    limits may pass the new ones, and one that cannot be decoded fails again at once."""

    def __init__(self, out: Path, digest: str, *, name: str = "", describe: dict[str, Any] | None = None,
                 skips_under: dict[str, Any] | None = None) -> None:
        self.folder = partial_folder(out) / name if name else partial_folder(out)
        self.digest = digest
        self.changed: list[str] = []
        self.retry_skips = False
        plan = self.folder / PLAN
        skips_key = json.dumps(skips_under or {}, sort_keys=True, default=str)
        old = self.folder / "plan.json"  # issue 41's plan (keyed by names and mtimes): not reusable
        if old.is_file():
            self._clear("an older checkpoint format")
            old.unlink()
        if plan.is_file():
            found = json.loads(plan.read_text(encoding="utf-8"))
            if found.get("digest") != digest:
                before, now = found.get("describe") or {}, describe or {}
                self.changed = sorted(k for k in {*before, *now} if before.get(k) != now.get(k)) or ["the pass"]
                self._clear("another pass (" + ", ".join(self.changed) + " changed)")
                plan.unlink()
            elif json.dumps(found.get("skips_under") or {}, sort_keys=True, default=str) != skips_key:
                self.retry_skips = bool(self.chunk_paths())
                plan.unlink()
        self.folder.mkdir(parents=True, exist_ok=True)
        if not plan.is_file():
            body = {"digest": digest, "describe": describe or {}, "skips_under": skips_under or {}}
            plan.write_text(json.dumps(body, sort_keys=True, default=str) + "\n", encoding="utf-8")

    def _clear(self, why: str) -> None:
        chunks = self.chunk_paths()
        if chunks:
            log.info("resume: %d saved chunks in %s not reused: %s", len(chunks), self.folder, why)
        for path in chunks:
            path.unlink()

    def chunk_paths(self) -> list[Path]:
        return sorted(self.folder.glob("chunk-*.npz")) if self.folder.is_dir() else []

    def _path(self, number: int) -> Path:
        return self.folder / f"chunk-{number:06d}.npz"

    def load_all(self) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, Windows]]:
        """Every saved vector, skip reason and long recording's windows by content key (no skip when
        ``retry_skips``: the decode limits changed; a later chunk's skip or vector of a key replaces an
        earlier one's)."""
        vectors: dict[str, np.ndarray] = {}
        skips: dict[str, str] = {}
        windows: dict[str, Windows] = {}
        for path in self.chunk_paths():
            try:
                with np.load(path, allow_pickle=False) as data:
                    found = dict(zip(data["keys"].tolist(), np.asarray(data["embeddings"], np.float32), strict=True))
                    reasons = dict(zip(data["skipped_keys"].tolist(), data["skipped_reason"].tolist(), strict=True))
                    long = _saved_windows(data) if "window_keys" in data.files else {}
            except (OSError, ValueError, KeyError) as err:  # written atomically, so only a foreign file
                log.warning("resume: %s unreadable (%s); its items are embedded again", path, err)
                continue
            for key, vector in found.items():
                vectors[str(key)] = vector
                windows.pop(str(key), None)  # this chunk's own windows of the key (or none) replace older ones
            skips.update((str(k), str(r)) for k, r in reasons.items())
            windows.update(long)
        if self.retry_skips and skips:
            log.info("resume: %d saved skips tried again: the decode limits changed", len(skips))
            skips = {}
        return vectors, skips, windows

    def next_number(self) -> int:
        numbers = [int(p.stem.split("-")[1]) for p in self.chunk_paths()]
        return max(numbers, default=-1) + 1

    def save(self, number: int, chunk: Chunk) -> None:
        tmp = self.folder / f".chunk-{number:06d}.tmp.npz"
        key_of = dict(zip(chunk.clip_ids, chunk.keys, strict=True))
        long = [(key_of[c], w) for c, w in chunk.windows.items()]
        dim = chunk.embeddings.shape[1] if chunk.embeddings.ndim == 2 else 0
        np.savez(tmp, keys=np.asarray(chunk.keys, dtype=str), clip_ids=np.asarray(chunk.clip_ids, dtype=str),
                 embeddings=chunk.embeddings,
                 skipped_keys=np.asarray(chunk.skipped_keys, dtype=str),
                 skipped_rel=np.asarray([s[0] for s in chunk.skipped], dtype=str),
                 skipped_reason=np.asarray([s[1] for s in chunk.skipped], dtype=str),
                 window_keys=np.asarray([k for k, _ in long], dtype=str),
                 window_counts=np.asarray([len(w[0]) for _, w in long], dtype=np.int64),
                 window_spans=np.concatenate([w[0] for _, w in long]) if long else np.zeros((0, 2)),
                 window_vectors=(np.concatenate([w[1] for _, w in long]).astype(np.float32) if long
                                 else np.zeros((0, dim), np.float32)))
        with tmp.open("rb") as handle:
            os.fsync(handle.fileno())
        tmp.replace(self._path(number))

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _saved_windows(data: Any) -> dict[str, Windows]:
    """The windows a chunk file holds, by content key."""
    ends = np.cumsum(data["window_counts"])
    spans, vectors = np.asarray(data["window_spans"], np.float64), np.asarray(data["window_vectors"], np.float32)
    return {str(key): (spans[end - n : end], vectors[end - n : end])
            for key, n, end in zip(data["window_keys"].tolist(), data["window_counts"].tolist(), ends.tolist(),
                                   strict=True)}


class Advance(Protocol):
    """Progress of a pass: ``n`` more items done; ``resumed``: loaded from a checkpoint, not embedded."""

    def __call__(self, n: int, /, *, resumed: bool = False) -> None: ...


EmbedChunk = Callable[[Sequence[int], Callable[[int], None]], Chunk]
"""``embed(indices, advance)``: the chunk of the pass's items at ``indices`` (ids and skips in that order,
keys left empty: the driver fills them), calling ``advance(n)`` as it goes."""


@dataclass(frozen=True)
class PassResult:
    """A whole pass: the embedded items in item order, the skipped ones, what resume reused, and the
    moment windows of the long recordings among the embedded items, by clip id (a pass that windows)."""

    clip_ids: list[str]
    embeddings: np.ndarray
    skipped: list[tuple[str, str]]
    reused: int = 0
    embedded: int = 0
    windows: dict[str, Windows] = field(default_factory=dict)


def embed_in_chunks(items: Sequence[Item] | int, embed: EmbedChunk, *, dim: int, checkpoint: EmbedCheckpoint | None,
                    chunk_files: int = CHUNK_FILES, advance: Advance, what: str = "clips") -> PassResult:
    """The pass over ``items``: each item whose key a chunk in ``checkpoint`` holds is reused, the others
    embedded by ``embed`` in chunks of ``chunk_files`` (each saved there as soon as it is done); the
    result in item order. ``items`` an int ``n``: items ``0..n-1`` with their index as key (no reuse
    across catalogues)."""
    if chunk_files < 1:
        raise ValueError(f"chunk_files must be >= 1, got {chunk_files}")
    if isinstance(items, int):
        items = [Item(str(i), f"#{i}") for i in range(items)]
    vectors, skips, windows = checkpoint.load_all() if checkpoint is not None else ({}, {}, {})
    todo = [i for i, item in enumerate(items) if item.key not in vectors and item.key not in skips]
    reused = len(items) - len(todo)
    if checkpoint is not None:
        if reused or checkpoint.changed or checkpoint.chunk_paths():
            why = (f"another pass ({', '.join(checkpoint.changed)} changed)" if checkpoint.changed
                   else "new or changed content (no saved chunk holds its key)")
            log.info("resume: %d of %d %s reused from %s; %d to embed: %s", reused, len(items), what,
                     checkpoint.folder, len(todo), why if todo else "none")
        if reused:
            advance(reused, resumed=True)
    number = checkpoint.next_number() if checkpoint is not None else 0
    for start in range(0, len(todo), chunk_files):
        chosen = todo[start : start + chunk_files]
        chunk = embed(chosen, advance)
        by_id = {items[i].clip_id: items[i].key for i in chosen}
        chunk = Chunk(chunk.clip_ids, chunk.embeddings, chunk.skipped, keys=[by_id[c] for c in chunk.clip_ids],
                      skipped_keys=[by_id[s[0]] for s in chunk.skipped], windows=chunk.windows)
        if checkpoint is not None:
            checkpoint.save(number, chunk)
            number += 1
        for key, vector in zip(chunk.keys, chunk.embeddings, strict=True):
            vectors[key] = vector
        windows.update((by_id[c], w) for c, w in chunk.windows.items())
        skips.update(zip(chunk.skipped_keys, (s[1] for s in chunk.skipped), strict=True))
    clip_ids: list[str] = []
    rows: list[np.ndarray] = []
    skipped: list[tuple[str, str]] = []
    kept_windows: dict[str, Windows] = {}
    for item in items:
        if item.key in vectors:
            clip_ids.append(item.clip_id)
            rows.append(vectors[item.key])
            if item.key in windows:
                kept_windows[item.clip_id] = windows[item.key]
        else:
            skipped.append((item.clip_id, skips[item.key]))
    embeddings = np.stack(rows).astype(np.float32) if rows else np.zeros((0, dim), np.float32)
    return PassResult(clip_ids, embeddings, skipped, reused=reused, embedded=len(todo), windows=kept_windows)


class PassRate:
    """A pass's progress text: this run's clips/s (items loaded from a checkpoint left out), the time
    left at that rate, and — given a clock (:class:`index.catalogue.embed_pass.PassClock`) — the time spent
    waiting for decoded clips, the encoder's busy fraction and the moment windows of the long files embedded,
    e.g. ``12.3 clips/s, 4.5 min left, decode wait 3 %, encoder busy 95 %, 840 moment windows of 7 long files``."""

    def __init__(self, total: int, clock: Any = None) -> None:
        self.total, self.done, self.embedded = total, 0, 0
        self.began = time.monotonic()
        self.clock = clock

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
        text = f"{rate:.1f} clips/s, {left}"
        described = self.clock.describe() if self.clock is not None and self.clock.elapsed() > 0 else ""
        return f"{text}, {described}" if described else text


@contextmanager
def resumable(out: Path) -> Iterator[None]:
    """Around a pass that publishes ``out``: its chunks stay for a rerun when the pass is interrupted
    (Ctrl-C, a killed job), crashes or is refused by one of its checks (a
    :class:`~index.errors.TonearmError`: the rerun after a fix reuses every vector its key still
    matches), and go when the bundle is published. A folder with no chunk in it is removed either way,
    so a refused export before its pass leaves its output folder as it found it."""
    try:
        yield
    except BaseException:
        folder = partial_folder(out)
        if folder.is_dir() and not any(folder.rglob("chunk-*.npz")):
            shutil.rmtree(folder, ignore_errors=True)
        elif folder.is_dir():
            log.info("resume: the saved chunks stay in %s for a rerun of the same command", folder)
        raise
    discard(out)


def discard(out: Path) -> None:
    """Remove ``<out>.partial/`` (the pass's bundle is published)."""
    shutil.rmtree(partial_folder(out), ignore_errors=True)


def partial_folder(out: Path) -> Path:
    """``<out>.partial``: where the pass publishing ``out`` keeps its chunks."""
    return out.parent / f"{out.name}.partial"
