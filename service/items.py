"""Items added through the API, for the service: the shared write-ahead log and each bundle's overlay.

Storage is :mod:`index.item_log` (a JSONL log + content-addressed audio on the bundles volume,
``<bundles_dir>/.items`` unless ``TONEARM_ITEMS_DIR`` says otherwise) and search is
:mod:`index.overlay`; this module embeds (decodes the stored audio and runs the bundle's own
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
  (``TONEARM_ITEMS_COMPACT_MIN``, :meth:`index.item_log.ItemLog.compact`), off the request path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from index.item_log import ItemLog, ItemRecord
from index.overlay import ItemOverlay, build_overlay
from service.audio_input import AudioLimits, decode_upload
from service.settings import Settings

log = logging.getLogger(__name__)

ITEMS_DIR_NAME = ".items"
"""Under the bundles directory (a dot name: never listed as a bundle)."""
EMBED_BATCH = 16
SYNC_TRIES = 3
"""A sync that finds a record's stored audio gone (a compaction replaced the log meanwhile) reads
the log again and retries: the new file no longer holds that record."""


def items_dir_of(settings: Settings, bundles_dir: Path | None) -> Path | None:
    if settings.items_dir is not None:
        return settings.items_dir
    return bundles_dir / ITEMS_DIR_NAME if bundles_dir is not None else None


class ItemStore:
    """The log of one deployment and the code that keeps searchers' overlays in step with it."""

    def __init__(self, root: Path, settings: Settings) -> None:
        self.log = ItemLog(root)
        self.settings = settings
        self.limits = AudioLimits(
            max_seconds=settings.max_audio_seconds,
            max_sample_rate=settings.max_sample_rate,
            max_channels=settings.max_channels,
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ overlays

    def sync(self, searcher: object) -> ItemOverlay:
        """Bring ``searcher``'s overlay up to the log: the records since its version are appended
        (embedding only new audio and captions), or the log's file is replayed after a compaction."""
        lock: threading.Lock = searcher.items_lock  # type: ignore[attr-defined]
        bundle = searcher.bundle  # type: ignore[attr-defined]
        with lock:
            for attempt in range(SYNC_TRIES):
                history = self.log.history()
                current: ItemOverlay = searcher.items  # type: ignore[attr-defined]
                try:
                    overlay = build_overlay(
                        current, history, clip_ids=searcher.clip_rows,  # type: ignore[attr-defined]
                        embed_audio=lambda records: self._embed_audio(bundle, records),
                        embed_text=lambda texts: _batched(bundle.encode_text, list(texts), bundle.embed_dim),
                    )
                except FileNotFoundError:
                    if attempt == SYNC_TRIES - 1:
                        raise
                    continue
                searcher.items = overlay  # type: ignore[attr-defined]
                return overlay
        raise AssertionError("unreachable")

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
        return done.compacted

    def _embed_audio(self, bundle: object, records: Sequence[ItemRecord]) -> np.ndarray:
        rate = int(bundle.sample_rate)  # type: ignore[attr-defined]
        waves = [decode_upload(self.log.audio_path(r).read_bytes(), sample_rate=rate, limits=self.limits).waveform
                 for r in records]
        return _batched(bundle.encode_audio, waves, int(bundle.embed_dim))  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ follower

    def start(self, active: Callable[[], object | None]) -> None:
        """Follow the log: apply other replicas' records to the active searcher (daemon thread)."""

        def run() -> None:
            while not self._stop.wait(self.settings.items_poll_s):
                try:
                    self.log.follow()
                    self.compact_if_due()
                    searcher = active()
                    if searcher is not None and searcher.items.version != self.log.version:  # type: ignore[attr-defined]
                        self.sync(searcher)
                except Exception:  # keep following; the next tick retries
                    log.exception("applying the item log failed")

        self._thread = threading.Thread(target=run, name="tonearm-items", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


def _batched(encode: Callable[[list], np.ndarray], inputs: list, dim: int) -> np.ndarray:
    if not inputs:
        return np.zeros((0, dim), np.float32)
    parts = [np.asarray(encode(inputs[i:i + EMBED_BATCH]), dtype=np.float32) for i in range(0, len(inputs), EMBED_BATCH)]
    return np.concatenate(parts)
