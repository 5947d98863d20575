"""Items added through the API, for the service: the shared write-ahead log and each bundle's overlay.

Storage is :mod:`index.items.log` (a JSONL log + content-addressed audio on the bundles volume,
``<bundles_dir>/.items`` unless ``TONEARM_ITEMS_DIR`` says otherwise) and search is
:mod:`index.items.overlay`; this module embeds (decodes the stored audio and runs the bundle's own
encoders) and keeps every loaded bundle's overlay in step with the log:

* a ``POST``/``DELETE`` appends to the log (fsync'd) and then brings the active bundle's overlay
  up to date *before* it answers, so the item is searchable on this replica at the 201;
* a follower thread polls the log (a ``stat`` every ``TONEARM_ITEMS_POLL_S``, 0.2 s) and applies
  records that other replicas appended; the log on the shared volume is the one source of truth,
  so a replica that missed a notification (or runs without Redis) can never diverge;
* before a bundle goes live (startup, activation, a replica following an activation, rollback)
  its overlay is synced: a bundle of another model re-embeds the added items from their stored
  audio then, after its quality gate judged the bundle alone;
* the follower also compacts the log when most of it is records of replaced or deleted items
  (``TONEARM_ITEMS_COMPACT_MIN``, :meth:`index.items.log.ItemLog.compact`), off the request path;
* a record whose stored audio cannot be embedded (missing, over a limit lowered since, undecodable)
  is *quarantined*: its row is dead (no search returns it; it still replaces the id's earlier item
  or clip), it is counted on ``/metrics`` and listed by ``GET /v1/items?status=quarantined`` — one
  record never keeps a replica from starting or a bundle from going live (docs/service.md).

Opening the store checks that this process can write the log (create its files, take the
``flock``, write a file in ``audio/``): a replica that cannot is not ready (``/readyz``), never one
that serves without the takedowns the other replicas apply.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import io
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

from index.items.embeddings import EmbeddingStore
from index.items.embeddings import prune as prune_embeddings
from index.items.log import AUDIO_DIR, ItemLog, ItemRecord
from index.items.overlay import ItemOverlay, build_overlay
from index.moments.windows import HOP_FRACTION, LONG_RECORDING_WINDOWS, embed_windows
from service.audio_input import check_upload_header, decode_upload, embed_upload, item_limits_of
from service.errors import ServiceError
from service.settings import Settings

log = logging.getLogger(__name__)

ITEMS_DIR_NAME = ".items"
"""Under the bundles directory (a dot name: never listed as a bundle)."""
EMBED_BATCH = 16
SHORT_BY_HEADER = 0.9
"""A stored vector without its windows entry (a store from before windows were kept) needs no decode when its
header's length is below this share of two windows (an estimated header length, an MP3's, has room)."""
SYNC_TRIES = 3
"""A sync that finds a record's stored audio gone (a compaction replaced the log meanwhile) reads
the log again and retries: the new file no longer holds that record."""


def items_dir_of(settings: Settings, bundles_dir: Path | None) -> Path | None:
    """Where the item log lives: ``TONEARM_ITEMS_DIR``, else ``<bundles_dir>/.items``; None when
    items are off (``TONEARM_ITEMS_ENABLED=false``) or there is no directory to put them in."""
    if settings.items_enabled is False:
        return None
    if settings.items_dir is not None:
        return settings.items_dir
    return bundles_dir / ITEMS_DIR_NAME if bundles_dir is not None else None


def embedding_store(items_root: Path, bundle: object) -> EmbeddingStore:
    """Where ``bundle``'s embeddings of the log's audio are kept (keyed by its id, its audio encoder's
    checksum when the bundle has a manifest, and its dimension): a replica that starts, or a bundle
    that goes live, reads them instead of decoding and encoding every added item again."""
    manifest = getattr(bundle, "manifest", None)
    sha = None
    with contextlib.suppress(AttributeError, KeyError, TypeError):
        sha = manifest.files[manifest.audio_encoder.file].sha256  # type: ignore[union-attr]
    return EmbeddingStore(items_root, str(getattr(bundle, "bundle_id", "bundle")), int(bundle.embed_dim),  # type: ignore[attr-defined]
                          encoder_sha256=sha)


def check_writable(log_: ItemLog) -> None:
    """What every write needs, tried once: the log opened for appending, the ``flock`` of its lock
    file (some NFS setups refuse it: ENOLCK), and a file created, fsynced and removed in ``audio/``.
    OSError names what failed."""
    with open(log_.path, "ab"):
        pass
    with open(log_.lock_path, "rb") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    fd, probe = tempfile.mkstemp(dir=log_.root / AUDIO_DIR, prefix=".tmp-probe-")
    try:
        os.write(fd, b"probe")
        os.fsync(fd)
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(probe)


@dataclass(frozen=True)
class Quarantined:
    """Why a stored audio file could not be embedded (the records that name it are not searchable)."""

    reason: str
    """missing-audio | over-limit | undecodable | unreadable | embedding-failed"""
    detail: str


class ItemStore:
    """The log of one deployment and the code that keeps searchers' overlays in step with it."""

    def __init__(self, root: Path, settings: Settings, *, metrics: Any = None) -> None:
        self.log = ItemLog(root)
        check_writable(self.log)
        self.settings = settings
        self.metrics = metrics
        """service.metrics.ServiceMetrics (quarantine and corrupt-line counts); None in tools."""
        self.limits = item_limits_of(settings)  # the item writes' limits; the process's decode budget, shared
        self.quarantine: dict[str, Quarantined] = {}
        """Stored audio name → why it could not be embedded (retried when a bundle replays the log)."""
        self._quarantine_lock = threading.Lock()
        self._corrupt_seen: tuple[str, int] = ("", 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.embedded_from_store = 0
        """Audio embeddings read from :mod:`index.items.embeddings` instead of decoded and encoded."""

    # ------------------------------------------------------------------ overlays

    def sync(self, searcher: object) -> ItemOverlay:
        """Bring ``searcher``'s overlay up to the log: the records since its version are appended
        (embedding only new audio and captions), or the log's file is replayed after a compaction."""
        lock: threading.Lock = searcher.items_lock  # type: ignore[attr-defined]
        bundle = searcher.bundle  # type: ignore[attr-defined]
        searcher.catalogue_id = self.log.log_id  # type: ignore[attr-defined]  # cache keys: this log's results only
        searcher.item_limits = self.limits  # type: ignore[attr-defined]
        windows = getattr(searcher, "keep_item_windows", None)
        with lock:
            for attempt in range(SYNC_TRIES):
                history = self.log.history()
                current: ItemOverlay = searcher.items  # type: ignore[attr-defined]
                missing: list[str] = []
                overlay = build_overlay(
                    current, history, clip_ids=searcher.clip_rows,  # type: ignore[attr-defined]
                    embed_audio=functools.partial(self._embed_audio, bundle, missing=missing, windows=windows),
                    embed_text=lambda texts: _batched(bundle.encode_text, list(texts), bundle.embed_dim),
                )
                if missing and attempt < SYNC_TRIES - 1 and self.log.history().generation != history.generation:
                    continue  # a compaction replaced the log meanwhile and removed that audio: replay the new file
                searcher.items = overlay  # type: ignore[attr-defined]
                refresh = getattr(searcher, "refresh_item_windows", None)
                if refresh is not None:  # the windows of deleted or replaced items go, the new ones' search is built
                    refresh(overlay)
                self._report(overlay)
                return overlay
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ quarantine

    def quarantined(self, overlay: ItemOverlay | None = None) -> list[dict[str, Any]]:
        """The items whose latest record is a put that cannot be embedded (with ``overlay``: those it
        does not hold live), by id."""
        with self._quarantine_lock:
            held = dict(self.quarantine)
        if not held:
            return []
        latest = list(self.log.state.items.values())  # one C-level copy: safe while the follower applies records
        live = overlay.row_of if overlay is not None else {}
        return [{"id": r.id, "added_at": r.at, "audio": r.audio, "reason": held[r.audio].reason,
                 "detail": held[r.audio].detail, "metadata": r.metadata}
                for r in sorted(latest, key=lambda r: r.id)
                if r.audio in held and r.id not in live]

    def corrupt_lines(self) -> list[dict[str, Any]]:
        """Lines of the log file that are not records (skipped by every reader)."""
        return [{"offset": c.offset, "length": c.length, "reason": c.reason} for c in list(self.log.corrupt)]

    def _quarantine(self, record: ItemRecord, reason: str, detail: str) -> None:
        name = record.audio or ""
        with self._quarantine_lock:
            known = self.quarantine.get(name)
            self.quarantine[name] = Quarantined(reason, detail)
        if known is None:
            log.error("item %r quarantined (%s): %s — not searchable until its audio is fixed or it is "
                      "re-posted; GET /v1/items?status=quarantined lists it", record.id, reason, detail)
            if self.metrics is not None:
                self.metrics.items_quarantine_events.labels(reason=reason).inc()

    def _report(self, overlay: ItemOverlay) -> None:
        """Log new corrupt lines and set the gauges (after each sync)."""
        corrupt = list(self.log.corrupt)
        seen_generation, seen = self._corrupt_seen
        if seen_generation != self.log.generation:
            seen = 0
        for line in corrupt[seen:]:
            log.error("item log %s: line at byte %d (%d bytes) skipped: %s", self.log.path, line.offset,
                      line.length, line.reason)
        self._corrupt_seen = (self.log.generation, len(corrupt))
        if self.metrics is not None:
            self.metrics.items_corrupt_lines.set(len(corrupt))
            self.metrics.items_quarantined.set(len(self.quarantined(overlay)) if self.quarantine else 0)

    def compact_if_due(self) -> bool:
        """Compact the log when the records a compaction drops are at least
        ``TONEARM_ITEMS_COMPACT_MIN`` and at least half the log (amortized: each compaction
        rewrites at most as many records as were dropped since the last one)."""
        least = self.settings.items_compact_min
        state = self.log.state
        if least <= 0 or state.garbage < max(least, state.records - state.garbage):
            return False
        done = self.log.compact(min_garbage=least)
        if done.compacted:
            log.info("item log compacted: %d records → %d, %d audio files removed (%d bytes)",
                     done.records_before, done.records_after, done.audio_removed, done.audio_bytes_removed)
            live = {record.audio for record in self.log.state.items.values() if record.audio}
            prune_embeddings(self.log.root, live)
        return done.compacted

    def _embed_audio(self, bundle: object, records: Sequence[ItemRecord], *, missing: list[str],
                     windows: WindowSink | None = None) -> np.ndarray:
        """The records' audio embeddings; a record that cannot be embedded is quarantined and gets a
        row of NaN (:data:`index.items.overlay.AudioEmbedder`: its row is added dead). Each record's moment
        windows (none for a recording of at most two windows) are read or computed with its vector, stored
        beside it (:mod:`index.items.embeddings`) and handed to ``windows`` (the searcher's): a moment query
        never embeds.

        Decoded :data:`EMBED_BATCH` records at a time and encoded before the next are decoded: a replay
        (replica start, a swap's re-embedding) passes every record of the log, and holding all their
        waveforms at once would cost items × decoded size (~3 GiB at 10 k items of 5 s)."""
        rate = int(bundle.sample_rate)  # type: ignore[attr-defined]
        stored = embedding_store(self.log.root, bundle)
        audios = [record.audio for record in records]
        found, out, sizes = stored.get(audios)  # embedded before, by this replica or another: not decoded again
        held_windows = stored.get_windows(audios)
        window = int(bundle.clip_samples)  # type: ignore[attr-defined]
        for held in np.flatnonzero(found).tolist():
            entry = held_windows[held]
            if not self._still_valid(records[held], int(sizes[held]), rate) or (
                    entry is not None and entry[0] != sizes[held]):
                found[held] = False  # stale: embedded again
                out[held] = np.nan
                continue
            if entry is None:  # a store written before windows were kept: a short recording has none, say so
                if not self._short_by_header(records[held], rate, window):
                    found[held] = False  # embedded again (once) for its windows
                    out[held] = np.nan
                    continue
                entry = (int(sizes[held]), np.zeros((0, 2)), np.zeros((0, out.shape[1]), np.float32))
                stored.put_windows(audios[held] or "", entry[1], entry[2], entry[0])
            if windows is not None:
                windows(records[held].id, audios[held] or "", entry[1], entry[2])
        todo = [row for row in range(len(records)) if not found[row]]
        for first in range(0, len(todo), EMBED_BATCH):
            batch = todo[first:first + EMBED_BATCH]
            computed: dict[int, tuple[np.ndarray, np.ndarray]] = {}
            rows = self._embed_batch(bundle, records, batch, out, rate=rate, missing=missing, windows=computed)
            audio_sizes = [self._audio_size(records[row]) for row in rows]
            stored.put([audios[row] for row in rows], out[rows], audio_sizes)
            for row, audio_size in zip(rows, audio_sizes, strict=True):
                if np.isnan(out[row]).any() or row not in computed:
                    continue
                spans, vectors = computed[row]
                stored.put_windows(audios[row] or "", spans, vectors, audio_size)
                if windows is not None:
                    windows(records[row].id, audios[row] or "", spans, vectors)
            with self._quarantine_lock:
                for row in rows:
                    if not np.isnan(out[row]).any():
                        self.quarantine.pop(records[row].audio or "", None)
        self.embedded_from_store += int(found.sum())
        return out

    def _audio_size(self, record: ItemRecord) -> int:
        """The stored audio's size (a stat, not a read: the batch's bytes were read and freed already)."""
        try:
            return (self.log.root / AUDIO_DIR / (record.audio or "")).stat().st_size
        except OSError:
            return -1

    def _still_valid(self, record: ItemRecord, size: int, rate: int) -> bool:
        """A stored embedding stands for its audio only while that audio is the file it was embedded
        from (same size: a torn or rewritten file decodes again, and is quarantined if it fails) and
        passes today's limits from its header (limits lowered since quarantine it, as a decode would)."""
        try:
            data = self.log.audio_path(record).read_bytes()
            if len(data) != size:
                return False
            check_upload_header(data, self.limits, rate)
        except (OSError, ServiceError):
            return False
        return True

    def _short_by_header(self, record: ItemRecord, rate: int, window: int) -> bool:
        """Whether the stored audio's header says it is well within two windows at the model's rate (then it has no
        moment windows, known without decoding it); False when the header does not tell (it is decoded)."""
        try:
            info = sf.info(io.BytesIO(self.log.audio_path(record).read_bytes()))
        except Exception:  # noqa: BLE001 - not readable by libsndfile: the decode decides
            return False
        if info.frames <= 0 or info.samplerate <= 0:
            return False
        return info.frames / info.samplerate * rate <= SHORT_BY_HEADER * LONG_RECORDING_WINDOWS * window

    def _embed_batch(self, bundle: object, records: Sequence[ItemRecord], batch: Sequence[int], out: np.ndarray, *,
                     rate: int, missing: list[str], windows: dict[int, tuple[np.ndarray, np.ndarray]]) -> list[int]:
        """Decode and encode ``records[batch]`` into ``out``; the rows that decoded. A long recording (longer
        than a search upload may be) is decoded and embedded by blocks on its own, never held whole
        (:func:`service.audio_input.embed_upload`), its moment windows computed in the same pass; a recording
        decoded whole gets its windows from its waveform (:func:`index.moments.windows.embed_windows`; none when
        it lasts at most two windows). ``windows``: row → ``(spans, vectors)``, filled here."""
        waves, rows, streamed = [], [], []
        for row in batch:
            record = records[row]
            try:
                data = self.log.audio_path(record).read_bytes()
                try:
                    long = embed_upload(data, bundle, limits=self.limits)
                except ServiceError:
                    raise  # over a limit, undecodable, the budget full: handled below
                except Exception as err:  # the encoder refused one of its windows
                    self._quarantine(record, "embedding-failed", f"the encoder failed: {err}"[:300])
                    continue
                if long is not None:
                    out[row] = long.clip
                    streamed.append(row)
                    windows[row] = ((long.spans, long.vectors) if len(long.spans)
                                    else (np.zeros((0, 2)), np.zeros((0, out.shape[1]), np.float32)))
                    continue
                waves.append(decode_upload(data, sample_rate=rate, limits=self.limits).waveform)
                rows.append(row)
            except FileNotFoundError:
                missing.append(record.audio or "")
                self._quarantine(record, "missing-audio", f"stored audio {record.audio} is missing from "
                                 f"{self.log.root / AUDIO_DIR}")
            except ServiceError as err:
                if err.slug == "overloaded":  # the memory budget is full now: nothing is wrong with the item
                    raise  # the sync fails whole (a write answers 503 after its record is durable; the follower retries)
                self._quarantine(record, "over-limit" if err.slug == "audio-limits" else "undecodable", err.detail)
            except OSError as err:
                self._quarantine(record, "unreadable", f"stored audio {record.audio}: {err.strerror or err}")
        encode = bundle.encode_audio  # type: ignore[attr-defined]
        try:
            out[rows] = _batched(encode, waves, out.shape[1])
        except Exception:  # one input the encoder refuses: find it, keep the others
            for row, wave in zip(rows, waves, strict=True):
                try:
                    out[row] = _batched(encode, [wave], out.shape[1])[0]
                except Exception as err:
                    self._quarantine(records[row], "embedding-failed", f"the encoder failed: {err}"[:300])
        window = int(bundle.clip_samples)  # type: ignore[attr-defined]
        for row, wave in zip(rows, waves, strict=True):
            if np.isnan(out[row]).any():
                continue
            if len(wave) <= LONG_RECORDING_WINDOWS * window:  # found by its clip vector: no windows
                windows[row] = (np.zeros((0, 2)), np.zeros((0, out.shape[1]), np.float32))
                continue
            try:
                windows[row] = embed_windows(wave, sample_rate=rate, window_samples=window,
                                             hop_samples=max(1, round(window * HOP_FRACTION)), encode=encode)
            except Exception as err:  # the encoder refused a window: not searchable, as a failed clip vector
                out[row] = np.nan
                self._quarantine(records[row], "embedding-failed", f"the encoder failed on a window: {err}"[:300])
        return sorted(rows + streamed)

    # ------------------------------------------------------------------ follower

    def start(self, active: Callable[[], object | None],
              on_stale: Callable[[str | None], None] | None = None) -> None:
        """Follow the log: apply other replicas' records to the active searcher (daemon thread).

        ``on_stale(reason)`` is called once the log could not be read for ``items_stale_s`` (the
        replica may be missing takedowns: not ready), and ``on_stale(None)`` once it reads it again."""

        def run() -> None:
            last_read, stale = time.monotonic(), False
            while not self._stop.wait(self.settings.items_poll_s):
                try:
                    self.log.follow()
                    last_read = time.monotonic()
                    if stale:
                        stale = False
                        log.info("items: the item log at %s is readable again; ready", self.log.root)
                        if on_stale is not None:
                            on_stale(None)
                    self.compact_if_due()
                    searcher = active()
                    if searcher is not None and searcher.items.version != self.log.version:  # type: ignore[attr-defined]
                        self.sync(searcher)
                except Exception as err:  # keep following; the next tick retries
                    unread_s = time.monotonic() - last_read
                    if not stale and unread_s >= self.settings.items_stale_s:
                        stale = True
                        reason = (f"the item log at {self.log.root} could not be read for {unread_s:.0f} s "
                                  f"({type(err).__name__}: {err}); this replica may be missing takedowns made on "
                                  "others, so it is not ready until it reads the log again (TONEARM_ITEMS_STALE_S)")
                        log.error("items: %s", reason)
                        if on_stale is not None:
                            on_stale(reason)
                    elif not stale:
                        log.exception("applying the item log failed")

        self._thread = threading.Thread(target=run, name="tonearm-items", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


WindowSink = Callable[[str, str, np.ndarray, np.ndarray], None]
"""``(item id, stored audio, spans, vectors)``: an item's moment windows (none: (0, 2) spans), computed while it is
embedded or read with its stored vector."""


def _batched(encode: Callable[[list], np.ndarray], inputs: list, dim: int) -> np.ndarray:
    if not inputs:
        return np.zeros((0, dim), np.float32)
    parts = [np.asarray(encode(inputs[i:i + EMBED_BATCH]), dtype=np.float32) for i in range(0, len(inputs), EMBED_BATCH)]
    return np.concatenate(parts)
