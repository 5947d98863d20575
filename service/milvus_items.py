"""Items added through the API on the Milvus backend: records, each bundle's vectors, audio in an object store.

With ``TONEARM_INDEX_BACKEND=milvus`` (``TONEARM_ITEMS_STORE=auto``) the catalogue's changes live in
the engine every replica already talks to, not in a file log on a shared volume (:mod:`service.items`
is that design, kept for FAISS): replicas share them through Milvus, none keeps a copy, and a write
acknowledged by one replica is seen by the next search of any other (``Strong`` reads).

* **Records** — ``<prefix>_items_records`` (a :class:`index.items.milvus_store.MilvusItemStore` with a
  2-d dummy vector: Milvus 2.3 needs a vector field) holds one row per id, independent of any model:
  an added item's record (``doc``: its audio's key in the audio store, metadata, captions, time and
  a *digest* of all three) or a delete (a takedown row). A delete is kept as a takedown: it hides the
  bundle clip of its id in every bundle, including bundles built later, as a delete record of the log
  does. Any record hides the bundle clip of its id (an added item replaces the clip).
* **Vectors** — per bundle, ``<prefix>_items_b_<bundle>``: the items embedded with *that* bundle's
  encoders, their filterable metadata (filters are Milvus expressions over it) and, in ``doc``, the
  digest of the record each row was embedded from. A row is a takedown row for a delete, and for a
  record that cannot be embedded (quarantined: ``doc.quarantine`` says why).
* **Audio** — the uploaded bytes, content-addressed (``<sha256>.<format>``) in the store of
  ``TONEARM_ITEMS_AUDIO_URL`` (fsspec: ``s3://bucket/prefix``, a local path), written *before* the
  record: an acknowledged item always has its audio.

A write stores the audio, upserts the record, embeds the item with the serving bundle and upserts its
row — all before the 201. **Syncing** a bundle's collection brings it to the records: rows whose digest
differs are re-embedded from the stored audio, deletes become takedown rows, rows without a record go.
It runs before a bundle goes live (startup, activation, rollback, a replica following an activation:
:attr:`service.bundles.BundleRegistry.prepare`), and a follower thread catches the active bundle up
with the records written in the last :data:`FOLLOW_WINDOW_MS` (those another replica wrote while it
served another bundle, mid-swap). A search asks the bundle for its top k, drops the clips that have a
record (one primary-key query for the ids it returned, asking further while any was dropped), asks the
bundle's item collection for its top k under the filter, and keeps the best k of both
(:class:`service.searcher.Searcher`). Results of searches are not cached on this backend (every search
depends on the shared catalogue, which has no cheap version to key them by); text embeddings still are.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from index.engines.filters import Filter
from index.engines.milvus_index import MilvusTarget
from index.engines.milvus_windows import MilvusWindows
from index.items.log import RECORD_MAX_FIELDS, ItemRecord, _now, check_metadata
from index.items.milvus_store import (
    DOC_FIELD,
    ORDER_FIELD,
    MilvusItemStore,
    _flush,
    flush_each_write,
    flushed_together,
)
from index.items.overlay import AddedItem
from index.moments.windows import HOP_FRACTION, LONG_RECORDING_WINDOWS, embed_windows
from service.audio_input import DecodedAudio, decode_upload, embed_upload, item_limits_of
from service.errors import ServiceError
from service.searcher import index_calls
from service.settings import Settings

log = logging.getLogger(__name__)

RECORDS_NAME = "records"
RECORD_DIM = 2
"""The records collection's vector: Milvus 2.3 needs one vector field in every collection."""
FOLLOW_WINDOW_MS = 60_000
"""The follower re-checks the records written in the last minute on every poll: clocks of the
replicas that stamp ``added_ms`` may differ by this much before a record could be missed."""
FOLLOW_POLL_MIN_S = 1.0
"""The follower polls at ``max(TONEARM_ITEMS_POLL_S, this)``: a query per poll, not a ``stat``."""
EMBED_BATCH = 16
WINDOWS_INDEX = "HNSW"
"""The added items' windows collection: HNSW from the start (it grows with every long recording added; Milvus
searches a segment too small to index exactly anyway)."""


class AudioStore:
    """Uploaded audio by content (``<sha256>.<format>``) under an fsspec URL (``s3://…``, a local path)."""

    def __init__(self, url: str) -> None:
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.root = self.root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def check(self) -> None:
        """Write, read back and remove a probe: what every upload needs (raises what failed)."""
        probe = self.path(f".probe-{uuid.uuid4().hex}")
        self._write(probe, b"probe")
        try:
            if self.fs.cat_file(probe) != b"probe":
                raise OSError(f"{self.url}: a probe written there reads back different bytes")
        finally:
            self.fs.rm_file(probe)

    def put(self, data: bytes, audio_format: str) -> str:
        """Store ``data`` (once per content) and return its key; durable when this returns."""
        key = f"{hashlib.sha256(data).hexdigest()}.{audio_format}"
        path = self.path(key)
        if not self.fs.exists(path):
            self._write(path, data)
        return key

    def _write(self, path: str, data: bytes) -> None:
        if not self.local:  # one PUT: an object is whole or absent
            self.fs.pipe_file(path, data)
            return
        import os

        os.makedirs(self.root, exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, key: str) -> bytes:
        """The stored bytes (FileNotFoundError when the object is gone)."""
        return bytes(self.fs.cat_file(self.path(key)))


def record_digest(audio: str, metadata: Mapping[str, Any], captions: Mapping[str, Sequence[str]]) -> str:
    """What a bundle's row is embedded from: a row with another digest is stale."""
    body = json.dumps({"audio": audio, "metadata": metadata, "captions": captions}, sort_keys=True,
                      ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(body.encode("utf-8")).hexdigest()[:32]


@dataclass(frozen=True)
class Record:
    """One row of the records collection: an added item (``audio`` set) or a delete (``takedown``)."""

    id: str
    takedown: bool
    doc: dict[str, Any]

    @property
    def digest(self) -> str:
        return str(self.doc.get("digest", "")) if not self.takedown else "takedown"

    @property
    def item(self) -> AddedItem:
        return AddedItem(self.id, str(self.doc.get("audio", "")), str(self.doc.get("at", "")),
                         dict(self.doc.get("metadata") or {}), dict(self.doc.get("captions") or {}))

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> Record:
        return cls(str(row["id"]), bool(row["takedown"]), dict(row.get(DOC_FIELD) or {}))


class BundleItems:
    """One bundle's side of the catalogue: its item collection and the records (what the searcher asks)."""

    def __init__(self, catalogue: MilvusCatalogue, store: MilvusItemStore, windows: MilvusWindows | None = None) -> None:
        self.catalogue = catalogue
        self.store = store
        self.windows = windows
        """The live added items' moment windows (a window source: ``searcher.milvus_item_windows``)."""

    def fields(self) -> dict[str, str]:
        """Field kinds of the added items (filters are checked against them and the bundle's)."""
        return self.store.fields()

    def expression(self, flt: Filter, fields: Mapping[str, str]) -> str:
        """The Milvus expression of ``flt`` (FilterError for one it cannot be)."""
        return self.store.expression(flt, fields)

    def hidden_among(self, ids: Iterable[str]) -> set[str]:
        """The ids among ``ids`` that have a record: their bundle clips are hidden (replaced or deleted)."""
        return self.catalogue.records.present(ids)

    def search(self, queries: np.ndarray, k: int, flt: Filter | None, fields: Mapping[str, str] | None,
               exclude: str | None = None) -> tuple[np.ndarray, list[list[str]]]:
        """Top-``k`` live added items per query (``exclude``: an id never returned)."""
        if exclude is None:
            return self.store.search(queries, k, flt, fields=fields)
        scores, ids = self.store.search(queries, k + 1, flt, fields=fields)
        kept_scores = np.full((len(ids), k), -np.inf, np.float32)
        kept: list[list[str]] = []
        for q, found in enumerate(ids):
            pairs = [(s, i) for s, i in zip(scores[q].tolist(), found, strict=False) if i != exclude][:k]
            kept.append([i for _, i in pairs])
            kept_scores[q, : len(pairs)] = [s for s, _ in pairs]
        return kept_scores, kept

    def get(self, item_id: str) -> tuple[AddedItem, np.ndarray] | None:
        """The live added item ``item_id`` and its vector in this bundle, or None."""
        row = self.store.get([item_id]).get(item_id)
        if row is None or row.takedown:
            return None
        record = Record(item_id, False, row.doc)
        return record.item, row.vector

    def items(self, ids: Iterable[str]) -> dict[str, AddedItem]:
        """The live added items among ``ids`` (one query)."""
        rows = self.store.get(list(dict.fromkeys(ids)))
        return {i: Record(i, False, row.doc).item for i, row in rows.items() if not row.takedown}

    def audio_of(self, item_id: str) -> tuple[bytes, str] | None:
        """The stored audio of the live added item ``item_id`` and its format, or None."""
        found = self.get(item_id)
        if found is None:
            return None
        key = found[0].audio
        return self.catalogue.audio.read(key), key.rsplit(".", 1)[-1]


class MilvusCatalogue:
    """The Milvus item store of one deployment (module docstring); :meth:`open` before use."""

    def __init__(self, settings: Settings, target: MilvusTarget, audio_url: str, *, metrics: Any = None) -> None:
        self.settings = settings
        self.target = target
        self.metrics = metrics
        self.limits = item_limits_of(settings)
        self.records = MilvusItemStore(target, dim=RECORD_DIM, name=RECORDS_NAME)
        self.audio = AudioStore(audio_url)
        self._stores: dict[str, MilvusItemStore] = {}
        self._windows: dict[str, MilvusWindows] = {}
        self._stores_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.flush = True
        """Item writes flush before they return (:func:`index.items.milvus_store.flush_each_write`; set by :meth:`open`)."""

    def open(self) -> MilvusCatalogue:
        """Create (or find) the records collection and check the audio store takes writes; raises
        IndexBackendError (Milvus) or OSError / another error of the object store."""
        self.flush = flush_each_write(self.target, self.settings.milvus_items_flush)
        self.records.flush = self.flush
        self.records.open()
        self.audio.check()
        log.info("items: in Milvus at %s (%s), writes %s", self.target.uri, self.records.collection,
                 "flushed before they return" if self.flush else "acknowledged from Milvus's write-ahead log")
        return self

    # ------------------------------------------------------------------ bundles' collections

    def bundle_store(self, searcher: Any) -> MilvusItemStore:
        """The item collection of ``searcher``'s bundle (its id and manifest hash: ``cache_bundle``)."""
        name = f"b_{searcher.cache_bundle}"
        with self._stores_lock:
            store = self._stores.get(name)
            if store is None:
                store = MilvusItemStore(self.target, dim=int(searcher.bundle.embed_dim), name=name,
                                        flush=self.flush).open()
                self._stores[name] = store
        return store

    def window_store(self, searcher: Any) -> MilvusWindows:
        """The moment windows of the added items in ``searcher``'s bundle: ``<item collection>_windows``."""
        store = self.bundle_store(searcher)
        with self._stores_lock:
            windows = self._windows.get(store.collection)
            if windows is None:
                windows = MilvusWindows(self.target, f"{store.collection}_windows", dim=int(searcher.bundle.embed_dim),
                                        index_type=WINDOWS_INDEX, consistency=store.consistency, flush=self.flush,
                                        flusher=_flush).ensure()
                self._windows[store.collection] = windows
        return windows

    def sync(self, searcher: Any) -> BundleItems:
        """Bring ``searcher``'s bundle collection up to every record (re-embedding stale rows and retrying
        quarantined ones) and hook it into the searcher; index problems as ServiceErrors (503/504)."""
        with index_calls(), flushed_together():
            store = self.bundle_store(searcher)
            windows = self.window_store(searcher)
            records = [Record.of(r) for r in self.records.rows()]
            held = {str(r["id"]): dict(r.get(DOC_FIELD) or {}) for r in store.rows()}
            self._apply(searcher, store, records, held, retry_quarantined=True)
            stale = sorted(set(held) - {r.id for r in records})
            windows.delete(stale)
            store.delete(stale)  # rows whose record is gone (a reset of the records): not the catalogue's
        items = BundleItems(self, store, windows)
        searcher.engine_items = items
        searcher.milvus_item_windows = windows
        return items

    def catch_up(self, searcher: Any) -> None:
        """Apply the records written in the last :data:`FOLLOW_WINDOW_MS` to ``searcher``'s collection."""
        store = self.bundle_store(searcher)
        since = int(time.time() * 1000) - FOLLOW_WINDOW_MS
        records = [Record.of(r) for r in self.records.rows(f"{ORDER_FIELD} >= {since}")]
        if not records:
            return
        held = {i: dict(row.doc) for i, row in store.get([r.id for r in records]).items()}
        with flushed_together():
            self._apply(searcher, store, records, held, retry_quarantined=False)

    def _apply(self, searcher: Any, store: MilvusItemStore, records: Sequence[Record],
               held: Mapping[str, Mapping[str, Any]], *, retry_quarantined: bool) -> None:
        takedowns = [r for r in records if r.takedown and held.get(r.id, {}).get("digest") != "takedown"]
        self.window_store(searcher).delete([r.id for r in takedowns])  # windows first: never found unreadable
        store.takedown([r.id for r in takedowns], docs=[{"digest": "takedown"} for _ in takedowns])
        stale = [r for r in records if not r.takedown and (
            held.get(r.id, {}).get("digest") != r.digest or (retry_quarantined and "quarantine" in held.get(r.id, {}))
            # a row written before the windows were kept in Milvus: its windows are written by the next full sync
            or (retry_quarantined and "windows" not in held.get(r.id, {"windows": 0})))]
        for start in range(0, len(stale), EMBED_BATCH):
            self._embed_into(searcher, store, stale[start : start + EMBED_BATCH])
        if stale or takedowns:
            log.info("items: %s synced (%d re-embedded, %d takedowns)", store.collection, len(stale), len(takedowns))

    def _embed_into(self, searcher: Any, store: MilvusItemStore, records: Sequence[Record],
                    waves: Sequence[np.ndarray] | None = None) -> None:
        """Embed ``records`` (from their stored audio, or the decoded ``waves``) and upsert their rows, their moment
        windows first (a long recording's: :meth:`window_store`; written before the 201, read by every replica);
        a record that cannot be embedded gets a quarantined takedown row and no windows."""
        bundle = searcher.bundle
        good: list[tuple[Record, np.ndarray]] = []
        bad: list[tuple[Record, str, str]] = []
        streamed: list[tuple[Record, np.ndarray]] = []  # long recordings: embedded by blocks from their bytes
        windows: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for i, record in enumerate(records):
            if waves is not None and waves[i].size:
                good.append((record, waves[i]))
                continue
            key = record.item.audio
            try:
                data = self.audio.read(key)
                try:
                    long = embed_upload(data, bundle, limits=self.limits)
                except ServiceError:
                    raise
                except Exception as err:  # the encoder refused one of its windows
                    bad.append((record, "embedding-failed", f"the encoder failed: {err}"[:300]))
                    continue
                if long is not None:
                    streamed.append((record, long.clip))
                    windows[record.id] = (long.spans, long.vectors)
                    continue
                good.append((record, decode_upload(data, sample_rate=int(bundle.sample_rate), limits=self.limits).waveform))
            except FileNotFoundError:
                bad.append((record, "missing-audio", f"stored audio {key} is missing from {self.audio.url}"))
            except ServiceError as err:
                bad.append((record, "over-limit" if err.slug == "audio-limits" else "undecodable", err.detail))
            except OSError as err:
                bad.append((record, "unreadable", f"stored audio {key}: {err.strerror or err}"))
        vectors: list[np.ndarray | None] = []
        if good:
            try:
                vectors = list(np.asarray(bundle.encode_audio([w for _, w in good]), dtype=np.float32))
            except Exception:  # one input the encoder refuses: find it, keep the others
                vectors = []
                for record, wave in good:
                    try:
                        vectors.append(np.asarray(bundle.encode_audio([wave]), dtype=np.float32)[0])
                    except Exception as err:
                        vectors.append(None)
                        bad.append((record, "embedding-failed", f"the encoder failed: {err}"[:300]))
        live = [(record, vec) for (record, _), vec in zip(good, vectors, strict=True) if vec is not None] + streamed
        for (record, wave), vec in zip(good, vectors, strict=True):
            if vec is not None:
                windows[record.id] = _windows_of(bundle, wave)
        window_store = self.window_store(searcher)
        window_store.put([(r.id, *windows[r.id]) for r, _ in live])  # a short recording: none (a long one's replaced)
        window_store.delete([r.id for r, _, _ in bad])
        store.put([(r.id, v, r.item.metadata) for r, v in live],
                  docs=[{"digest": r.digest, "audio": r.item.audio, "at": r.item.added_at,
                         "metadata": r.item.metadata, "captions": r.item.captions, "windows": len(windows[r.id][0])}
                        for r, _ in live])
        if bad:
            store.takedown([r.id for r, _, _ in bad], docs=[
                {"digest": r.digest, "audio": r.item.audio, "at": r.item.added_at, "metadata": r.item.metadata,
                 "quarantine": reason, "detail": detail} for r, reason, detail in bad])
            for record, reason, detail in bad:
                log.error("item %r quarantined in %s (%s): %s — not searchable until its audio is fixed or it is "
                          "re-posted; GET /v1/items?status=quarantined lists it", record.id, store.collection,
                          reason, detail)
                if self.metrics is not None:
                    self.metrics.items_quarantine_events.labels(reason=reason).inc()

    # ------------------------------------------------------------------ writes (the item routes)

    def add(self, registry: Any, searcher: Any,
            entries: Sequence[tuple[str, bytes, DecodedAudio, dict[str, Any], dict[str, list[str]]]]) -> list[ItemRecord]:
        """Store each item's audio, then its record, then its row in the serving bundle's collection:
        durable and searchable (on every replica) when this returns."""
        records, waves, out = [], [], []
        for item_id, data, audio, metadata, captions in entries:
            meta = check_metadata(metadata, max_fields=RECORD_MAX_FIELDS)
            key = self._put_audio(data, audio.format.lower())
            at = _now()
            doc = {"audio": key, "at": at, "metadata": meta, "captions": captions,
                   "digest": record_digest(key, meta, captions)}
            records.append(Record(item_id, False, doc))
            waves.append(audio.waveform)
            out.append(ItemRecord("put", item_id, at, key, meta, captions))
        with index_calls(), flushed_together():  # the record and the rows flushed at once, before the answer
            self.records.put([(r.id, np.ones(RECORD_DIM, np.float32), {}) for r in records], docs=[r.doc for r in records])
            self._embed_into(searcher, self.bundle_store(searcher), records, waves)
            self._sync_serving(registry, searcher, records)
        return out

    def _put_audio(self, data: bytes, audio_format: str) -> str:
        """:meth:`AudioStore.put`; an object store that cannot take it (unreachable, refusing credentials, a
        volume turned read-only) is ServiceError ``items-unavailable`` (503), a full volume stays the OSError
        the app answers 507 ``insufficient-storage``."""
        try:
            return self.audio.put(data, audio_format)
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
            reason = err.strerror or str(err) or type(err).__name__
        except Exception as err:  # botocore / fsspec errors of an object store: not OSErrors
            reason = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
        log.error("items: the audio store %s refused an upload: %s", self.audio.url, reason)
        raise ServiceError("items-unavailable", f"the item audio store ({self.audio.url}) cannot take the upload: "
                           f"{reason}")

    def delete(self, registry: Any, searcher: Any, item_id: str) -> ItemRecord:
        """Record the delete (a takedown of the id everywhere) and apply it to the serving bundle."""
        record = Record(item_id, True, {"at": _now(), "digest": "takedown"})
        with index_calls(), flushed_together():
            self.records.takedown([item_id], docs=[record.doc])
            self.window_store(searcher).delete([item_id])
            self.bundle_store(searcher).takedown([item_id], docs=[{"digest": "takedown"}])
            self._sync_serving(registry, searcher, [record])
        return ItemRecord("delete", item_id, str(record.doc["at"]))

    def _sync_serving(self, registry: Any, searcher: Any, records: Sequence[Record]) -> None:
        """A swap that went live meanwhile: its bundle gets these records too (as the file log's writes do)."""
        with registry.live_lock:
            active = registry.active_searcher()
        if active is None or active is searcher or active.cache_bundle == searcher.cache_bundle:
            return
        store = self.bundle_store(active)
        held = {i: dict(row.doc) for i, row in store.get([r.id for r in records]).items()}
        self._apply(active, store, records, held, retry_quarantined=False)

    # ------------------------------------------------------------------ reads

    def quarantined(self, searcher: Any) -> list[dict[str, Any]]:
        """The records the serving bundle could not embed, by id, with the reason."""
        store = self.bundle_store(searcher)
        with index_calls():
            rows = store.rows(f'takedown == true and exists {DOC_FIELD}["quarantine"]')
        out = []
        for row in sorted(rows, key=lambda r: str(r["id"])):
            doc = dict(row.get(DOC_FIELD) or {})
            out.append({"id": str(row["id"]), "added_at": doc.get("at", ""), "audio": doc.get("audio"),
                        "reason": doc.get("quarantine"), "detail": doc.get("detail", ""),
                        "metadata": doc.get("metadata") or {}})
        if self.metrics is not None:
            self.metrics.items_quarantined.set(len(out))
        return out

    # ------------------------------------------------------------------ follower

    def start(self, active: Callable[[], Any], on_stale: Callable[[str | None], None] | None = None) -> None:
        """Catch the active bundle up with recent records (other replicas' writes during their swaps).

        ``on_stale`` (the file log's signal) is never called here: every search reads the records from
        Milvus, and a Milvus that cannot be reached is ``index-unavailable`` on every replica."""

        def run() -> None:
            while not self._stop.wait(max(self.settings.items_poll_s, FOLLOW_POLL_MIN_S)):
                try:
                    searcher = active()
                    if searcher is not None:
                        self.catch_up(searcher)
                except Exception:  # keep following; the next tick retries
                    log.exception("items: catching up with the records in Milvus failed")

        self._thread = threading.Thread(target=run, name="tonearm-items-milvus", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


def _windows_of(bundle: Any, wave: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The moment windows of a recording decoded whole: none unless it is long (more than
    :data:`index.moments.windows.LONG_RECORDING_WINDOWS` windows), as a bundle's (:func:`embed_windows`)."""
    window = int(bundle.clip_samples)
    if len(wave) <= LONG_RECORDING_WINDOWS * window:
        return np.zeros((0, 2)), np.zeros((0, int(bundle.embed_dim)), np.float32)
    return embed_windows(wave, sample_rate=int(bundle.sample_rate), window_samples=window,
                         hop_samples=max(1, round(window * HOP_FRACTION)), encode=bundle.encode_audio)


def open_catalogue(settings: Settings, audio_url: str, *, metrics: Any = None) -> MilvusCatalogue:
    """The deployment's Milvus item store, opened (raises what keeps it from opening)."""
    from service.bundles import milvus_target

    target = milvus_target(settings, items=True)
    if target is None:
        raise ValueError("added items in Milvus need TONEARM_MILVUS_URI")
    return MilvusCatalogue(settings, target, audio_url, metrics=metrics).open()
