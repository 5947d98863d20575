"""Moment windows in Milvus: the window source of the Milvus backend (issue 54, part 4; docs/service.md
"Moments on the Milvus backend").

A :class:`MilvusWindows` is an :class:`index.moments.sources.ExcerptSource` over two collections:

* ``<name>`` — one row per window: ``wid`` (primary key ``"<key>#<seq>"``), ``key`` (the recording: a
  bundle's audio-index row as text, or an added item's id), ``seq`` (the window's position in time order) and
  its L2-normalized ``vector``. This is what :meth:`MilvusWindows.best_recordings` searches (an ANN index by
  size: :func:`window_index_type`).
* ``<name>_parts`` — each recording's windows packed for reading back: ``key``, ``part`` and ``data``, base64 of
  up to :data:`PART_BYTES` bytes (per window its start and end, float64, then its vector, float16), primary key
  ``"<key>#<part>"``: part ``p`` holds the windows ``p·P … p·P + P − 1`` (``P``: :data:`PART_WINDOWS`, fewer for
  wide vectors). One more row per recording, ``"<key>#s"`` (part −1), holds its window count and a *sample*:
  up to :data:`SAMPLE_WINDOWS` windows spread evenly over it. A query returning one row per window with its
  vector costs ~0.1 s per 1,000 windows in pymilvus (measured on 2.3.5, two cores: building a Python list per
  vector), the packed rows ~10 times less. float16 keeps a cosine within ~1e-3 of the float32 one (the windows
  are unit vectors) and halves what is read.

The moment search reads little of a recording (:class:`index.moments.sources.ExcerptSource`):
:meth:`MilvusWindows.hot_windows` finds the windows of its best recordings that can make a moment (one search
restricted to them), :meth:`MilvusWindows.excerpts` reads the parts around those windows and the sample by
primary key — at 1,000 h, reading the 10 best recordings whole (~740 windows each) cost more than the rest of a
query (bench/moments_scale.py). :meth:`MilvusWindows.windows_of` still reads a recording whole (the trained head,
and keys written before samples were).

Keys are written parts first, then windows (a recording is found by a search only once it can be read), and
deleted windows first. Primary keys are deterministic, so a put is an upsert: two replicas writing the same
recording at once (a catch-up) leave one copy, and a put of fewer windows deletes the rest.

Errors are mapped as in :mod:`index.engines.milvus_index` (:class:`index.errors.IndexUnavailable`,
:class:`index.errors.IndexBackendError`); writes are flushed as the item store's are
(``flusher``: the item store's, so that :func:`index.items.milvus_store.flushed_together` joins them).
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from index.engines.milvus_index import (
    INSERT_CHUNK,
    MAX_LIMIT,
    RECALL_QUERIES,
    MilvusTarget,
    _index_params,
    _mapped,
    _sample_rows,
    build_params,
    publish,
    published_info,
    search_params,
    target_from_args,
)
from index.engines.milvus_index import cli_publish as publish_clips
from index.errors import BundleError, TonearmError
from index.ids import MAX_ID_BYTES
from index.moments.sources import Allowed, Excerpt, HotWindows, Key, Stretch

KEY_MAX = MAX_ID_BYTES
WID_MAX = KEY_MAX + 16
PART_BYTES = 48_000
"""Raw bytes of one packed row at most (base64: 64,000 characters, under Milvus's 65,535-byte VARCHAR)."""
PART_WINDOWS = 16
"""Windows a packed row holds (fewer when they exceed :data:`PART_BYTES`): what a read around a hot window costs
at least — 8.4 KB at 256-d. At 100 h (bench/moments_scale.py's catalogue, k = 10) a query took 21 ms p50 with
parts of 16 windows, 26 ms with 32; whole recordings read as parts of 90 (the byte limit) took ~70 ms."""
SAMPLE_WINDOWS = 64
"""Windows of a recording's sample row (fewer when they exceed :data:`PART_BYTES`): its background level's
quantile and medians come from them (:func:`index.moments.sources._excerpt_moments`)."""
SAMPLE_PART = -1
"""The ``part`` of the sample row."""
DATA_MAX = 65_535
FLAT_UP_TO = 50_000
"""Windows searched exactly (FLAT) up to this many; HNSW above (:func:`window_index_type`)."""
FIRST_LIMIT = 64
"""Fewest windows the first search of :meth:`MilvusWindows.best_recordings` asks for."""
ROUNDS = 4
"""Most searches one :meth:`MilvusWindows.best_recordings` runs (the cap of the design: it reads candidates,
never every window)."""
IN_LIST_MAX = 4096
"""Most keys written into a search expression (an allowed set, or the recordings already found)."""
HNSW_EF = 1024
"""Smallest HNSW ``ef`` of a windows search (:meth:`MilvusWindows._search_params`)."""
READ_KEYS = 64
HOT_PER_KEY = 16
"""Windows per recording :meth:`MilvusWindows.hot_windows` asks for: an event's windows (2–16 at the demo's hop)
and a second run's; a run longer than that is read on from its stretch's edges anyway."""
"""Keys per query of :meth:`MilvusWindows.windows_of`."""


def window_index_type(n_windows: int) -> str:
    """FLAT (exact) for a small collection, HNSW above :data:`FLAT_UP_TO` windows (docs/service.md: HNSW's
    recall of the top recording was ≥ 0.99 in bench/moments_scale.py, IVF_FLAT needed a quarter of its lists
    probed for the same, which cost more than HNSW's search)."""
    return "FLAT" if n_windows <= FLAT_UP_TO else "HNSW"


def windows_build_params(index_type: str, n: int) -> dict[str, int]:
    """HNSW for windows: ``M`` 16 and ``efConstruction`` 100 — windows of one recording are near each other,
    and a build at 200 took twice as long for no recall gained at the top recording (bench/moments_scale.py)."""
    if index_type == "HNSW":
        return {"M": 16, "efConstruction": 100}
    return build_params(index_type, n)


def _pack(spans: np.ndarray, vectors: np.ndarray) -> bytes:
    return b"".join(np.asarray(spans[i], "<f8").tobytes() + np.asarray(vectors[i], "<f2").tobytes()
                    for i in range(len(spans)))


def _unpack(blob: bytes, dim: int) -> tuple[np.ndarray, np.ndarray]:
    record = np.dtype([("span", "<f8", (2,)), ("vector", "<f2", (dim,))])
    rows = np.frombuffer(blob, dtype=record)
    return rows["span"].astype(np.float64), rows["vector"].astype(np.float32)


def _text_list(values: Iterable[Key]) -> str:
    return json.dumps([str(v) for v in values], ensure_ascii=False)


class MilvusWindows:
    """The windows of some long recordings in Milvus (module docstring).

    ``int_keys``: the keys are a bundle's rows (returned as ints). ``consistency``: ``Strong`` where a write of another
    replica must be seen by the next search (added items), ``Eventually`` for a bundle's windows (written
    and flushed once, before the bundle is registered). ``flush``: writes flush before they return."""

    def __init__(self, target: MilvusTarget, name: str, *, dim: int, index_type: str = "FLAT",
                 build: dict[str, int] | None = None, consistency: str = "Strong", int_keys: bool = False,
                 flush: bool = True,
                 flusher: Callable[[MilvusTarget, str], None] | None = None) -> None:
        self.target = target
        self.collection = name
        self.parts = f"{name}_parts"
        self.dim = int(dim)
        self.index_type = index_type
        self.build = dict(build if build is not None else windows_build_params(index_type, 0))
        self.consistency = consistency
        self.int_keys = int_keys
        self.flush = flush
        self.flusher = flusher
        """How a write flushes a collection (the item store's :func:`index.items.milvus_store._flush`, which
        defers to the end of a :func:`index.items.milvus_store.flushed_together` block); None: at once."""
        record = 16 + 2 * self.dim
        self._per_part = max(1, min(PART_WINDOWS, PART_BYTES // record))
        self._per_sample = max(1, min(SAMPLE_WINDOWS, (PART_BYTES - 8) // record))

    # ------------------------------------------------------------------ collections

    def _schemas(self) -> tuple[Any, Any]:
        from pymilvus import DataType, MilvusClient

        windows = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
        windows.add_field("wid", DataType.VARCHAR, is_primary=True, max_length=WID_MAX)
        windows.add_field("key", DataType.VARCHAR, max_length=KEY_MAX)
        windows.add_field("seq", DataType.INT64)
        windows.add_field("vector", DataType.FLOAT_VECTOR, dim=self.dim)
        parts = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
        parts.add_field("pid", DataType.VARCHAR, is_primary=True, max_length=WID_MAX)
        parts.add_field("key", DataType.VARCHAR, max_length=KEY_MAX)
        parts.add_field("part", DataType.INT64)
        parts.add_field("data", DataType.VARCHAR, max_length=DATA_MAX)
        parts.add_field("vector", DataType.FLOAT_VECTOR, dim=2)  # Milvus 2.3 needs one vector field
        return windows, parts

    def create(self) -> MilvusWindows:
        """(Re)create both collections empty (publish: a collection left by an interrupted publish goes)."""
        windows, parts = self._schemas()
        with _mapped(f"creating {self.collection}", self.target):
            for name, schema, index_type, build in ((self.collection, windows, self.index_type, self.build),
                                                    (self.parts, parts, "FLAT", {})):
                if self.target.call("has_collection", name, bulk=True):
                    self.target.call("drop_collection", name, bulk=True)
                self.target.call("create_collection", name, schema=schema,
                                 index_params=_index_params(self.target.client(), index_type, build), bulk=True)
        return self

    def ensure(self) -> MilvusWindows:
        """Create both collections when missing (replicas race here safely), check the dimension, load them."""
        windows, parts = self._schemas()
        with _mapped(f"opening {self.collection}", self.target):
            for name, schema, index_type, build in ((self.collection, windows, self.index_type, self.build),
                                                    (self.parts, parts, "FLAT", {})):
                if not self.target.call("has_collection", name, bulk=True):
                    try:
                        self.target.call("create_collection", name, schema=schema,
                                         index_params=_index_params(self.target.client(), index_type, build),
                                         bulk=True)
                    except Exception:
                        if not self.target.call("has_collection", name, bulk=True):  # another replica won: fine
                            raise
            described = self.target.call("describe_collection", self.collection, bulk=True)
            dims = [f.get("params", {}).get("dim") for f in described.get("fields", []) if f.get("name") == "vector"]
            if dims and int(dims[0]) != self.dim:
                raise TonearmError(f"{self.collection} holds {dims[0]}-d windows; this bundle embeds {self.dim}-d")
        self.load()
        return self

    def load(self) -> None:
        with _mapped(f"loading {self.collection}", self.target):
            for name in (self.collection, self.parts):
                self.target.call("load_collection", name, bulk=True)

    def wait_indexed(self, timeout_s: float = 3600.0, progress: Callable[[str], None] | None = None) -> None:
        """Wait until Milvus has built the vector index of every sealed segment (a flush seals them; until then a
        search scans those segments exactly, slowly)."""
        deadline = time.monotonic() + timeout_s
        shown = -1
        while True:
            with _mapped(f"reading the index state of {self.collection}", self.target):
                names = self.target.call("list_indexes", self.collection, bulk=True)
                state = self.target.call("describe_index", self.collection, index_name=names[0], bulk=True) if names else {}
            pending = int(state.get("pending_index_rows", 0) or 0)
            total, indexed = int(state.get("total_rows", 0) or 0), int(state.get("indexed_rows", 0) or 0)
            if pending == 0 and indexed >= total:
                return
            if progress is not None and indexed != shown:
                progress(f"index of {self.collection}: {indexed:,} / {total:,} rows built")
                shown = indexed
            if time.monotonic() > deadline:
                raise TonearmError(f"{self.collection}: index not built after {timeout_s:.0f} s ({indexed}/{total} rows)")
            time.sleep(1.0)

    def release(self) -> None:
        """Free both collections' Milvus memory (a bundle closed); never raises (a swap must not fail on it)."""
        if not self.target.release_closed:
            return
        try:
            with _mapped(f"releasing {self.collection}", self.target):
                for name in (self.collection, self.parts):
                    self.target.call("release_collection", name, bulk=True)
        except TonearmError:
            pass

    def drop(self) -> None:
        with _mapped(f"dropping {self.collection}", self.target):
            for name in (self.collection, self.parts):
                if self.target.call("has_collection", name, bulk=True):
                    self.target.call("drop_collection", name, bulk=True)

    def count(self) -> int:
        """Windows held (a Strong count)."""
        with _mapped(f"counting {self.collection}", self.target):
            rows = self.target.call("query", self.collection, filter="", output_fields=["count(*)"],
                                    consistency_level="Strong", bulk=True)
        return int(rows[0]["count(*)"]) if rows else 0

    # ------------------------------------------------------------------ writes

    def put(self, recordings: Sequence[tuple[Key, np.ndarray, np.ndarray]], *, fresh: bool = False,
            progress: Callable[[int], None] | None = None) -> None:
        """Write each ``(key, spans (m, 2), vectors (m, d))``, replacing what the key held (a recording with no
        windows: removed). ``fresh``: the collections are new (publish) — plain inserts, nothing to replace.
        ``progress(windows)`` after each batch written."""
        empty = [key for key, spans, _ in recordings if not len(spans)]
        if empty and not fresh:
            self.delete(empty)
        kept = [(str(key), np.asarray(spans, np.float64), np.asarray(vectors, np.float32))
                for key, spans, vectors in recordings if len(spans)]
        for key, spans, vectors in kept:
            if len(key.encode("utf-8")) > KEY_MAX or vectors.shape != (len(spans), self.dim):
                raise TonearmError(f"windows of {key!r}: expected {len(spans)} × {self.dim} vectors under a key of "
                                   f"at most {KEY_MAX} bytes, got {vectors.shape}")
        method = "insert" if fresh else "upsert"
        with _mapped(f"writing windows into {self.collection}", self.target):
            part_rows: list[dict[str, Any]] = []
            for key, spans, vectors in kept:
                for part, first in enumerate(range(0, len(spans), self._per_part)):
                    last = first + self._per_part
                    part_rows.append({"pid": f"{key}#{part}", "key": key, "part": part, "vector": [0.0, 0.0],
                                      "data": base64.b64encode(_pack(spans[first:last], vectors[first:last])).decode()})
                picked = sample_positions(len(spans), self._per_sample)
                header = np.asarray([len(spans)], "<i8").tobytes()
                part_rows.append({"pid": f"{key}#s", "key": key, "part": SAMPLE_PART, "vector": [0.0, 0.0],
                                  "data": base64.b64encode(header + _pack(spans[picked], vectors[picked])).decode()})
            for first in range(0, len(part_rows), 64):  # 64 × 64 KB: one call well under gRPC's message limit
                self.target.call(method, self.parts, part_rows[first : first + 64], bulk=True)
            batch: list[dict[str, Any]] = []
            written = 0
            for key, _, vectors in kept:
                for seq, vector in enumerate(vectors):
                    batch.append({"wid": f"{key}#{seq}", "key": key, "seq": seq, "vector": vector.tolist()})
                    if len(batch) >= INSERT_CHUNK:
                        self.target.call(method, self.collection, batch, bulk=True)
                        written += len(batch)
                        batch = []
                        if progress is not None:
                            progress(written)
            if batch:
                self.target.call(method, self.collection, batch, bulk=True)
                written += len(batch)
                if progress is not None:
                    progress(written)
            if not fresh and kept:  # a recording written again with fewer windows: the rest go
                beyond = " or ".join(f"(key == {json.dumps(key)} and seq >= {len(spans)})" for key, spans, _ in kept)
                self.target.call("delete", self.collection, filter=beyond, bulk=True)
                tails = " or ".join(f"(key == {json.dumps(key)} and part >= {math.ceil(len(spans) / self._per_part)})"
                                    for key, spans, _ in kept)
                self.target.call("delete", self.parts, filter=tails, bulk=True)
        self._flush()

    def delete(self, keys: Sequence[Key]) -> None:
        """Remove every window of ``keys`` (windows first: a search never finds what cannot be read)."""
        if not keys:
            return
        expression = f"key in {_text_list(keys)}"
        with _mapped(f"deleting windows from {self.collection}", self.target):
            self.target.call("delete", self.collection, filter=expression, bulk=True)
            self.target.call("delete", self.parts, filter=expression, bulk=True)
        self._flush()

    def _flush(self) -> None:
        if not self.flush:
            return
        for name in (self.collection, self.parts):
            if self.flusher is not None:
                self.flusher(self.target, name)
            else:
                with _mapped(f"flushing {name}", self.target):
                    self.target.call("flush", name, bulk=True)

    # ------------------------------------------------------------------ reads

    def _key(self, text: str) -> Key:
        return int(text) if self.int_keys else text

    def best_recordings(self, query: np.ndarray, n: int, allowed: Allowed | None = None) -> list[tuple[Key, float]]:
        """Up to ``n`` recordings whose best window scores highest for ``query``, best first, with that score.

        Each search asks for the top windows of the recordings not yet seen (``key not in [...]``): every
        recording it finds scores at least the last window returned, so the recordings come out best first,
        each at its best window; the next search excludes them. At most :data:`ROUNDS` searches. ``allowed`` is
        asked about each search's new recordings only (a filter passing few recordings that score low may find
        none within the rounds: the cap that keeps a query from reading every window)."""
        return self.best_recordings_hot(query, n, allowed)[0]

    def best_recordings_hot(self, query: np.ndarray, n: int, allowed: Allowed | None = None
                            ) -> tuple[list[tuple[Key, float]], dict[Key, HotWindows]]:
        """:meth:`best_recordings`, and each recording's windows its searches returned: all of its windows scoring
        above the last one of the search that found it (later searches exclude it) — what the moment search
        needs of it without searching again (:meth:`index.moments.sources.ExcerptSource.best_recordings_hot`)."""
        if n < 1:
            return [], {}
        vector = np.asarray(query, dtype=np.float32).reshape(-1)
        found: list[tuple[Key, float]] = []
        hot: dict[Key, HotWindows] = {}
        seen: list[str] = []
        limit = min(MAX_LIMIT, max(FIRST_LIMIT, 8 * n))
        for _ in range(ROUNDS):
            hits = self._search_ids(vector, limit, f"key not in {_text_list(seen)}" if seen else "")
            new: dict[str, list[tuple[int, float]]] = {}
            for score, wid in hits:
                text, seq = wid.rsplit("#", 1)
                new.setdefault(text, []).append((int(seq), score))
            if new:
                texts = list(new)
                keep = np.ones(len(texts), bool) if allowed is None else np.asarray(
                    allowed([self._key(t) for t in texts]), dtype=bool)
                last = hits[-1][0] if len(hits) >= limit else -math.inf  # fewer than asked: every window returned
                for text, ok in zip(texts, keep, strict=True):
                    if ok:
                        key = self._key(text)
                        found.append((key, new[text][0][1]))
                        hot[key] = HotWindows([seq for seq, _ in new[text]], [sc for _, sc in new[text]], last)
                seen.extend(texts)
            if len(found) >= n or len(hits) < limit or len(seen) > IN_LIST_MAX:
                break
            limit = min(MAX_LIMIT, limit * 2)
        found.sort(key=lambda pair: -pair[1])
        kept = found[:n]
        return kept, {key: hot[key] for key, _ in kept}

    def _search_ids(self, vector: np.ndarray, limit: int, expression: str) -> list[tuple[float, str]]:
        """(score, primary key ``"<key>#<seq>"``) of the top ``limit`` windows passing ``expression``."""
        with _mapped(f"searching {self.collection}", self.target):
            result = self.target.call(
                "search", self.collection, data=[vector.tolist()], limit=limit, filter=expression,
                search_params={"metric_type": "IP", "params": self._search_params(limit)},
                output_fields=[], consistency_level=self.consistency,
            )
        # the key and position from the primary key: no output field, so Milvus skips the retrieve step
        return [(float(hit["distance"]), _wid(hit)) for hit in result[0]]

    def _search_params(self, limit: int) -> dict[str, int]:
        """:func:`index.engines.milvus_index.search_params`, with HNSW's ``ef`` at least :data:`HNSW_EF`: an event's
        few windows lie far from their recording's others: at ``ef`` 80 the top recording was missed for 8 % of the
        queries at 100 h, at 256 for 39 % at 1,000 h. At 1,000 h (1.4 M windows, M 16, k = 10, 100 queries, two
        cores shared with the server, bench/moments_scale.py's catalogue, 2026-11-29, AMD EPYC): ef 1024 missed it for 11 % (p50 / p99 26 / 76 ms
        a query), 2048 for 3 % (38 / 169 ms), 4096 for 1 % (59 / 79 ms), 8192 for none (119 / 157 ms) — 1024 keeps a
        query within the 50-ms target; docs/BENCHMARKS.md "moments_scale" says what that costs."""
        params = search_params(self.index_type, self.build, limit)
        if self.index_type == "HNSW":
            params["ef"] = max(params["ef"], HNSW_EF)
        return params

    def windows_of(self, keys: Sequence[Key]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each key's windows in time order: ``(spans (m, 2), vectors (m, d) float32)``; empty for a key
        with none. Vectors are the stored float16 ones, re-normalized."""
        texts = [str(key) for key in keys]
        blobs: dict[str, dict[int, bytes]] = {t: {} for t in texts}
        with _mapped(f"reading windows from {self.parts}", self.target):
            for first in range(0, len(texts), READ_KEYS):
                chunk = list(dict.fromkeys(texts[first : first + READ_KEYS]))
                rows = self.target.call("query", self.parts, filter=f"key in {_text_list(chunk)} and part >= 0",
                                        output_fields=["key", "part", "data"], limit=MAX_LIMIT,
                                        consistency_level=self.consistency)
                for row in rows:
                    blobs[str(row["key"])][int(row["part"])] = base64.b64decode(row["data"])
        out = []
        for text in texts:
            held = blobs[text]
            if not held:
                out.append((np.zeros((0, 2)), np.zeros((0, self.dim), np.float32)))
                continue
            spans, vectors = _unpack(b"".join(held[p] for p in sorted(held)), self.dim)
            out.append((spans, _normalized(vectors)))
        return out


    def hot_windows(self, query: np.ndarray, keys: Sequence[Key], floor: float) -> list[list[int]]:
        """:meth:`index.moments.sources.ExcerptSource.hot_windows`: one search restricted to ``keys`` (their top
        :data:`HOT_PER_KEY` windows each); each key's best window, and those scoring ``floor`` or more."""
        if not keys:
            return []
        texts = [str(key) for key in keys]
        limit = min(MAX_LIMIT, HOT_PER_KEY * len(set(texts)))
        seqs: dict[str, list[int]] = {t: [] for t in texts}
        for score, wid in self._search_ids(np.asarray(query, np.float32).reshape(-1), limit,
                                           f"key in {_text_list(dict.fromkeys(texts))}"):
            key, seq = wid.rsplit("#", 1)
            if key in seqs and (score >= floor or not seqs[key]):
                seqs[key].append(int(seq))
        return [sorted(seqs[t]) for t in texts]

    def excerpts(self, wanted: Sequence[tuple[Key, Sequence[tuple[int, int]]]]) -> list[Excerpt | None]:
        """:meth:`index.moments.sources.ExcerptSource.excerpts`: the parts holding the windows asked and the sample
        row, read by primary key in one query per :data:`READ_KEYS` keys; None for a key without a sample row."""
        out: list[Excerpt | None] = []
        for first in range(0, len(wanted), READ_KEYS):
            chunk = wanted[first : first + READ_KEYS]
            pids: list[str] = []
            for key, ranges in chunk:
                pids.append(f"{key}#s")
                for a, b in ranges:
                    pids.extend(f"{key}#{p}" for p in range(max(0, a) // self._per_part,
                                                            (max(a + 1, b) - 1) // self._per_part + 1))
            with _mapped(f"reading windows from {self.parts}", self.target):
                rows = self.target.call("query", self.parts, filter=f"pid in {_text_list(dict.fromkeys(pids))}",
                                        output_fields=["key", "part", "data"], limit=MAX_LIMIT,
                                        consistency_level=self.consistency)
            blobs: dict[str, dict[int, bytes]] = {str(key): {} for key, _ in chunk}
            for row in rows:
                if str(row["key"]) in blobs:
                    blobs[str(row["key"])][int(row["part"])] = base64.b64decode(row["data"])
            out.extend(self._excerpt(blobs[str(key)]) for key, _ in chunk)
        return out

    def _excerpt(self, held: dict[int, bytes]) -> Excerpt | None:
        sample = held.pop(SAMPLE_PART, None)
        if sample is None:
            return None
        n_windows = int(np.frombuffer(sample[:8], "<i8")[0])
        spans, vectors = _unpack(sample[8:], self.dim)
        stretches: list[Stretch] = []
        for part in sorted(held):
            part_spans, part_vectors = _unpack(held[part], self.dim)
            at = part * self._per_part
            if stretches and stretches[-1].stop == at:
                last = stretches.pop()
                part_spans = np.concatenate([last.spans, part_spans])
                part_vectors = np.concatenate([last.vectors, part_vectors])
                at = last.first
            stretches.append(Stretch(at, part_spans, part_vectors))
        return Excerpt(n_windows, Stretch(0, spans, _normalized(vectors)),
                       [Stretch(s.first, s.spans, _normalized(s.vectors)) for s in stretches])


def sample_positions(n: int, count: int) -> np.ndarray:
    """``count`` (at most ``n``) window positions spread evenly over ``n`` windows, first and last included."""
    if n <= count:
        return np.arange(n)
    return np.unique(np.rint(np.linspace(0, n - 1, count)).astype(np.int64))


def _normalized(vectors: np.ndarray) -> np.ndarray:
    vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return vectors


def _wid(hit: Any) -> str:
    """A hit's primary key (the server keys hits ``id``, milvus-lite 3.x by the field's name)."""
    for where in (hit, hit.get("entity") or {}):
        for name in ("wid", "id"):
            if name in where:
                return str(where[name])
    raise KeyError(f"no primary key in the hit {dict(hit)}")


# ----------------------------------------------------------------------------- a bundle's windows


def bundle_windows_name(target: MilvusTarget, bundle_id: str) -> str:
    """``<prefix>_<bundle>_<hash>_windows`` (beside the bundle's audio and text collections)."""
    return target.collection(bundle_id, "windows")


def bundle_windows(target: MilvusTarget, bundle_id: str, info: dict[str, Any]) -> MilvusWindows:
    """The published windows of a bundle (``info``: its registry row's ``windows`` entry), loaded."""
    if int(info.get("dim", 0)) <= 0:
        raise BundleError(f"the registry's windows entry of {bundle_id} has no dimension: {info}")
    source = MilvusWindows(target, bundle_windows_name(target, bundle_id), dim=int(info["dim"]),
                           index_type=str(info.get("index_type", "FLAT")), build=dict(info.get("build_params", {})),
                           consistency="Eventually", int_keys=True, flush=False)
    source.load()
    return source


# ----------------------------------------------------------------------------- publish (`tonearm bundle publish`)

PUBLISH_BATCH = 50_000
"""Windows per write call group of :func:`publish_windows` (what it holds in memory besides the mapped files)."""


def _recordings(spans: np.ndarray) -> list[tuple[int, int, int]]:
    """``(row, first, stop)`` of each recording in a bundle's spans table (grouped by row, time order)."""
    rows = spans[:, 0].astype(np.int64)
    starts = np.flatnonzero(np.diff(rows, prepend=-1)) if len(rows) else np.zeros(0, np.int64)
    stops = np.append(starts[1:], len(rows))
    return [(int(rows[a]), int(a), int(b)) for a, b in zip(starts, stops, strict=True)]


def exact_best_recordings(vectors: np.ndarray, recordings: Sequence[tuple[int, int, int]], queries: np.ndarray,
                          n: int, *, chunk: int = 100_000) -> list[list[int]]:
    """The ``n`` rows whose best window scores highest for each query (ties by row), exactly, reading
    ``vectors`` (a memory-mapped windows file) ``chunk`` windows at a time."""
    best = np.full((len(queries), len(recordings)), -np.inf, np.float32)
    first_of = np.array([a for _, a, _ in recordings], np.int64)
    stop_of = np.array([b for _, _, b in recordings], np.int64)
    for start in range(0, len(vectors), chunk):
        stop = min(len(vectors), start + chunk)
        scores = np.asarray(vectors[start:stop], np.float32) @ queries.T  # (c, q)
        inside = np.flatnonzero((stop_of > start) & (first_of < stop))
        for r in inside:
            a, b = max(first_of[r], start) - start, min(stop_of[r], stop) - start
            best[:, r] = np.maximum(best[:, r], scores[a:b].max(axis=0))
    rows = np.array([row for row, _, _ in recordings], np.int64)
    order = np.lexsort((np.broadcast_to(rows, best.shape), -best), axis=1)[:, :n]
    return [rows[o].tolist() for o in order]


def publish_windows(root: Path, manifest: Any, captions: np.ndarray, *, target: MilvusTarget,
                    progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Write a bundle's moment windows (``moments/windows.npy`` + ``spans.npy``, memory-mapped) into its windows
    collection (keys: the audio-index rows; index type by size, :func:`window_index_type`), flush it, measure the
    recall@10 of the best recordings against exact search (caption vectors as queries, else windows; up to
    256), release it; the registry's ``windows`` entry. ``{}`` for a bundle without windows."""
    moments = getattr(manifest, "moments", None)
    if moments is None or not moments.n_windows:
        return {}
    vectors = np.load(root / moments.windows_file, mmap_mode="r", allow_pickle=False)
    spans = np.load(root / moments.spans_file, allow_pickle=False)
    recordings = _recordings(spans)
    index_type = window_index_type(len(vectors))
    build = windows_build_params(index_type, len(vectors))
    source = MilvusWindows(target, bundle_windows_name(target, manifest.bundle_id), dim=int(manifest.embed_dim),
                           index_type=index_type, build=build, consistency="Strong", int_keys=True,
                           flush=False).create()
    began = time.monotonic()
    batch: list[tuple[Key, np.ndarray, np.ndarray]] = []
    held = done = 0

    def write() -> None:
        nonlocal batch, held, done
        source.put(batch, fresh=True)
        done += held
        batch, held = [], 0
        if progress is not None:
            progress(f"windows: {done:,} / {len(vectors):,} written ({time.monotonic() - began:.0f} s)")

    for row, first, stop in recordings:
        batch.append((row, spans[first:stop, 1:], np.asarray(vectors[first:stop], np.float32)))
        held += stop - first
        if held >= PUBLISH_BATCH:
            write()
    if batch:
        write()
    with _mapped(f"flushing {source.collection}", target):
        for name in (source.collection, source.parts):
            target.call("flush", name, bulk=True)
    source.wait_indexed(progress=progress)  # served from the index at once, not by exact scans of its segments
    source.load()
    built_s = time.monotonic() - began
    queries = captions if len(captions) else np.asarray(vectors[_sample_rows(len(vectors))], np.float32)
    queries = np.asarray(queries[_sample_rows(len(queries))][:RECALL_QUERIES], np.float32)
    exact = exact_best_recordings(vectors, recordings, queries, 10)
    hits = total = 0
    for query, expected in zip(queries, exact, strict=True):
        found = [int(key) for key, _ in source.best_recordings(query, 10)]
        hits += len(set(found) & set(expected))
        total += len(expected)
    source.release()
    return {"windows": {"n_windows": int(len(vectors)), "n_recordings": len(recordings), "dim": int(manifest.embed_dim),
                        "index_type": index_type, "build_params": build,
                        "recall_at_10": round(hits / max(total, 1), 4), "build_s": round(built_s, 1)}}


def publish_with_windows(bundle_dir: Path, target: MilvusTarget, *, index_type: str = "FLAT",
                         progress: Callable[[str], None] | None = None) -> bool:
    """:func:`index.engines.milvus_index.publish` with the bundle's moment windows (registered with it)."""
    return publish(bundle_dir, target, index_type=index_type,
                   steps=[lambda root, manifest, captions: publish_windows(root, manifest, captions, target=target,
                                                                             progress=progress)])


def cli_publish(args: argparse.Namespace) -> int:
    """`tonearm bundle publish`: the clip and caption collections, then the moment windows, then the registry row."""
    target = target_from_args(args.milvus_uri, args.milvus_token_env)
    console = Console(stderr=True)
    step = lambda root, manifest, captions: publish_windows(  # noqa: E731
        root, manifest, captions, target=target, progress=lambda line: console.print(line, highlight=False))
    return publish_clips(args, steps=[step])


def published_windows(bundle: Any) -> MilvusWindows | None:
    """The Milvus window source of a bundle served from Milvus (``bundle.milvus``) whose windows `tonearm bundle
    publish` wrote, loaded; None otherwise — FAISS, no windows, or a bundle published before its windows went to
    Milvus (its files serve them, as before)."""
    target = getattr(bundle, "milvus", None)
    manifest = getattr(bundle, "manifest", None)
    if target is None or manifest is None or getattr(manifest, "moments", None) is None:
        return None
    entry = (published_info(target, manifest.bundle_id) or {}).get("windows")
    return bundle_windows(target, manifest.bundle_id, entry) if entry else None
