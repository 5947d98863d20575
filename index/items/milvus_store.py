"""Items added through the API, kept in Milvus: the item store of the Milvus backend (issue 47, part 5).

On the FAISS backend added items live in a write-ahead log on a volume (:mod:`index.items.log`) and
every replica keeps them in memory (:mod:`index.items.overlay`). On the Milvus backend the engine already
shares state between replicas, so a :class:`MilvusItemStore` keeps the items in a collection the
deployment owns, ``<prefix>_items_<name>``: every replica reads and writes the same rows, none keeps
a copy (docs/service.md, "Items on the Milvus backend").

One row per id (primary key ``id``, VARCHAR):

* an **added item**: its (L2-normalized) ``vector``, ``takedown = false``, ``meta`` (JSON: its
  filterable metadata and its ``id``, as :func:`index.engines.filters.milvus_metadata` lays a catalogue row
  out) and ``doc`` (JSON: the whole record the caller stored — metadata, audio file, captions, …);
* a **takedown** of a bundle clip: ``takedown = true`` and a zero vector (never a search hit: every
  search requires ``takedown == false``); the service hides the bundle clip of every takedown id.

``put`` is an upsert (a second put of an id replaces it, a put over a takedown replaces the
takedown), ``delete`` removes the rows (an item, or a takedown: the clip comes back), ``takedown``
writes takedown rows. Writes are flushed before they return (``flush=True``): Milvus keeps unflushed
rows only in its WAL, and a Milvus killed before a segment seals can come back without them (the
reason :func:`index.engines.milvus_index._register` flushes). Writes inside :func:`flushed_together` defer their
flushes to the end of the block and flush every collection they wrote at once (one wait, not one per
collection: a service write touches two or three collections).

**Filters** are evaluated by Milvus: a filter is checked against the store's field kinds (the same
errors as :meth:`index.engines.filters.MetadataTable.mask`: unknown field, several kinds, wrong operand)
and written as a Milvus expression by :func:`index.engines.filters.milvus_expr` over ``meta``. The kinds
are kept in a small side collection ``<prefix>_items_<name>_fields`` with one row per (field,
kind) ever written — a row per pair, so concurrent writers on several replicas never overwrite
each other's; a put writes only the pairs not there yet (those this process has not seen are
looked up once) and flushes them — a field row re-upserted on every put and left unflushed once went
missing after a Milvus restart (a 422 for a known field); a field written with two kinds is ``mixed``
(not filterable) from then on, even after the items that made it so are deleted (kinds are never
forgotten: a deliberate simplification).

**Reads** are ``Strong`` by default (``consistency``): a write acknowledged by one replica is seen by
the next search of any other. **Ties** are ordered by score, then id (fetch ``k`` + margin and widen
while the last fetched hit ties the ``k``-th), as :class:`index.engines.milvus_index.MilvusVectorIndex` does.
Errors are mapped in this module (:class:`index.errors.IndexUnavailable` /
:class:`index.errors.IndexBackendError`, a value Milvus refuses — an id over the key's 512 bytes —
:class:`index.errors.IndexInputRefused`, filters :class:`index.engines.filters.FilterError`).

pymilvus is imported lazily (through :class:`index.engines.milvus_index.MilvusTarget`).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from index.engines.filters import (
    Filter,
    FilterError,
    MetadataTable,
    _kind_of,
    item_metadata,
    milvus_expr,
    milvus_metadata,
    milvus_string,
)
from index.engines.milvus_index import (
    _NAME,
    MAX_LIMIT,
    TIE_MARGIN,
    MilvusTarget,
    _code,
    _index_params,
    _mapped,
    _reason,
    build_params,
    is_lite,
    search_params,
)
from index.errors import IndexBackendError, IndexInputRefused, TonearmError
from index.ids import MAX_ID_BYTES

log = logging.getLogger(__name__)

ID_MAX = MAX_ID_BYTES
"""Longest id (bytes, Milvus VARCHAR ``max_length``): the id grammar's byte limit, so every id the API
accepts fits (index/ids.py)."""
KIND_MAX = 16
META_FIELD = "meta"
DOC_FIELD = "doc"
ORDER_FIELD = "added_ms"
"""Milliseconds since the epoch at the write: informative, and the always-true ``added_ms >= 0`` that
:func:`index.engines.filters.milvus_expr` writes for ``{}``."""
QUERY_LIMIT = 16_384
"""Most rows one ``query`` returns (Milvus's result window); listings page by id."""


@dataclass(frozen=True)
class StoredItem:
    id: str
    vector: np.ndarray
    metadata: dict[str, Any]
    """The filterable metadata as stored in ``meta`` (with ``id``)."""
    doc: dict[str, Any] = field(default_factory=dict)
    takedown: bool = False


_DEFERRED = threading.local()
"""This thread's open :func:`flushed_together` block: ``.pending``, the collections to flush at its end
(keyed by name, with the target that wrote them)."""


@contextmanager
def flushed_together() -> Iterator[None]:
    """Item-store writes in this block (this thread) flush once, at its end, every collection they
    wrote concurrently: a flush waits for Milvus to seal and persist the segment (pymilvus polls
    every 0.5 s), and a service write — the record, the field kinds, the serving bundle's row —
    waited for two to three of them in a row. The block returns only once all are flushed, as each
    write did on its own. When the block fails, what it wrote is still flushed (best effort: a
    flush error is logged, the block's own error is raised). Nested blocks join the outermost."""
    if getattr(_DEFERRED, "pending", None) is not None:
        yield
        return
    pending: dict[str, MilvusTarget] = {}
    _DEFERRED.pending = pending
    try:
        yield
    except BaseException:
        _DEFERRED.pending = None
        try:
            _flush_now(pending)
        except Exception as err:  # noqa: BLE001 - the block's own error is the one to report
            log.warning("flushing %s after a failed write: %s", sorted(pending), err)
        raise
    _DEFERRED.pending = None
    _flush_now(pending)


def _flush(target: MilvusTarget, collection: str) -> None:
    pending = getattr(_DEFERRED, "pending", None)
    if pending is not None:
        pending[collection] = target
    else:
        _flush_now({collection: target})


def _flush_now(collections: Mapping[str, MilvusTarget]) -> None:
    """Flush ``collections`` concurrently (each a bulk call under its target's deadline); raises the
    first failure, mapped."""
    if not collections:
        return
    what = f"flushing {', '.join(sorted(collections))}"
    with _mapped(what, next(iter(collections.values()))):
        try:
            if len(collections) == 1:
                ((name, target),) = collections.items()
                target.call("flush", name, bulk=True)
                return
            with ThreadPoolExecutor(max_workers=len(collections), thread_name_prefix="milvus-flush") as pool:
                for done in [pool.submit(target.call, "flush", name, bulk=True) for name, target in collections.items()]:
                    done.result()
        except Exception as err:
            if _code(err) == RATE_LIMIT or "rate limit" in _reason(err).lower():
                raise IndexBackendError(
                    f"{what}: Milvus refused the flush ({_reason(err)}) — Milvus 2.4 and later limit flushes "
                    "per collection (quotaAndLimits.flushRate); let item writes rely on Milvus's write-ahead "
                    "log instead: TONEARM_MILVUS_ITEMS_FLUSH=off (or auto)") from None
            raise


FLUSH_MODES = ("auto", "write", "off")
RATE_LIMIT = 8
"""pymilvus's error code of a request refused by a rate limit (``ErrorCode.RATE_LIMIT``)."""
RATE_LIMITED_FLUSH_FROM = (2, 4)
"""Milvus 2.4 turned on a collection-level flush rate limit (``quotaAndLimits.flushRate``, 0.1 per
second per collection by default): a flush per write would refuse most uploads there."""


def flush_each_write(target: MilvusTarget, mode: str) -> bool:
    """Whether item writes flush before they return (``TONEARM_MILVUS_ITEMS_FLUSH``): ``write`` yes,
    ``off`` no (a write is acknowledged once Milvus holds it in its write-ahead log; refused before
    2.4 and on Milvus Lite, whose listings miss unflushed rows), ``auto`` yes on Milvus Lite and
    servers before :data:`RATE_LIMITED_FLUSH_FROM`, no from there (a version Milvus does not report
    as ``[v]MAJOR.MINOR…`` counts as new)."""
    if mode not in FLUSH_MODES:
        raise ValueError(f"flush mode {mode!r}: expected one of {', '.join(FLUSH_MODES)}")
    if mode == "write":
        return True
    if is_lite(target.uri):
        version = "Milvus Lite"
        rate_limited = False
    else:
        with _mapped("reading the Milvus version", target):
            version = str(target.call("get_server_version", bulk=True))
        found = re.match(r"v?(\d+)\.(\d+)", version.strip())
        rate_limited = found is None or (int(found[1]), int(found[2])) >= RATE_LIMITED_FLUSH_FROM
    if mode == "off" and not rate_limited:
        # Measured on 2.3.5 with pymilvus 2.5: the query iterator (every listing: ids(), rows(), a sync's
        # records) reads at a client-side timestamp there ("failed to get mvccTs") and missed unflushed rows.
        raise TonearmError(f"item writes unflushed (flush mode 'off') need Milvus 2.4 or later; {version} lists "
                           "only flushed rows reliably — use 'write' or 'auto'")
    return not rate_limited


def _literal_id(item_id: str) -> str:
    text = milvus_string(item_id)
    if text is None or not item_id or len(item_id.encode("utf-8")) > ID_MAX:
        raise IndexInputRefused(f"item id {item_id!r} cannot be stored in Milvus (empty, over {ID_MAX} bytes, "
                           "or holding a control character or lone surrogate)")
    return text


def _id_list(ids: Iterable[str]) -> str:
    return "[" + ", ".join(_literal_id(i) for i in ids) + "]"


def row_metadata(item_id: str, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """What a filter sees of an item (as :meth:`index.items.overlay.AddedItem.row_metadata` + ``item_metadata``)."""
    return item_metadata({**metadata, "id": item_id})


class MilvusItemStore:
    """Added items and takedowns in the Milvus collection ``<prefix>_items_<name>`` (module docstring)."""

    def __init__(self, target: MilvusTarget, *, dim: int, name: str = "items", index_type: str = "FLAT",
                 consistency: str = "Strong", flush: bool = True) -> None:
        self.target = target
        self.dim = dim
        self.collection = f"{target.prefix}_items_{_NAME.sub('_', name)}"
        self.fields_collection = f"{self.collection}_fields"
        self.index_type = index_type
        self.build = build_params(index_type, 1_000_000)
        self.consistency = consistency
        self.flush = flush
        self._in_operator = not is_lite(target.uri)
        self._known_kinds: set[str] = set()
        """(field, kind) keys known to be in the side collection: a put looks up only the others."""

    # ------------------------------------------------------------------ collections

    def open(self) -> MilvusItemStore:
        """Create the two collections when missing (idempotent: replicas race here safely), check the
        dimension of an existing one, and load both."""
        from pymilvus import DataType, MilvusClient

        with _mapped(f"opening the item store {self.collection}", self.target):
            if not self.target.call("has_collection", self.collection, bulk=True):
                schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
                schema.add_field("id", DataType.VARCHAR, is_primary=True, max_length=ID_MAX)
                schema.add_field(ORDER_FIELD, DataType.INT64)
                schema.add_field("takedown", DataType.BOOL)
                schema.add_field(META_FIELD, DataType.JSON)
                schema.add_field(DOC_FIELD, DataType.JSON)
                schema.add_field("vector", DataType.FLOAT_VECTOR, dim=self.dim)
                self._create(self.collection, schema, self.index_type, self.build)
            else:
                described = self.target.call("describe_collection", self.collection, bulk=True)
                dims = [f.get("params", {}).get("dim") for f in described.get("fields", []) if f.get("name") == "vector"]
                if dims and int(dims[0]) != self.dim:
                    raise TonearmError(f"the item store {self.collection} holds {dims[0]}-d vectors; "
                                       f"this bundle embeds {self.dim}-d (a swap to another model needs its own store)")
            if not self.target.call("has_collection", self.fields_collection, bulk=True):
                schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
                schema.add_field("key", DataType.VARCHAR, is_primary=True, max_length=ID_MAX)
                schema.add_field("field", DataType.VARCHAR, max_length=ID_MAX)
                schema.add_field("kind", DataType.VARCHAR, max_length=KIND_MAX)
                schema.add_field("vector", DataType.FLOAT_VECTOR, dim=2)  # Milvus needs one vector field
                self._create(self.fields_collection, schema, "FLAT", {})
            for name in (self.collection, self.fields_collection):
                self.target.call("load_collection", name, bulk=True)
        return self

    def _create(self, name: str, schema: Any, index_type: str, build: dict[str, int]) -> None:
        try:
            self.target.call("create_collection", name, schema=schema,
                             index_params=_index_params(self.target.client(), index_type, build), bulk=True)
        except Exception:
            if not self.target.call("has_collection", name, bulk=True):  # another replica created it first: fine
                raise

    def drop(self) -> None:
        """Remove both collections (tests, and `tonearm` tooling that resets a deployment's items)."""
        with _mapped(f"dropping the item store {self.collection}", self.target):
            for name in (self.collection, self.fields_collection):
                if self.target.call("has_collection", name, bulk=True):
                    self.target.call("drop_collection", name, bulk=True)
        self._known_kinds.clear()

    # ------------------------------------------------------------------ writes

    def put(self, items: Sequence[tuple[str, np.ndarray, Mapping[str, Any]]], *,
            docs: Sequence[Mapping[str, Any]] | None = None) -> None:
        """Upsert ``(id, vector, metadata)`` items (``docs[i]``: the record kept beside item ``i``); an id
        given twice keeps its last item (as two puts in a row would)."""
        if not items:
            return
        now = int(time.time() * 1000)
        rows: dict[str, dict[str, Any]] = {}
        kinds = {}
        for i, (item_id, vector, metadata) in enumerate(items):
            _literal_id(item_id)
            vec = np.asarray(vector, dtype=np.float32).reshape(-1)
            if vec.shape != (self.dim,) or not np.isfinite(vec).all():
                raise TonearmError(f"item {item_id!r}: expected a finite {self.dim}-d vector, got shape {vec.shape}")
            meta = row_metadata(item_id, metadata)
            own = {k: kind for k, v in meta.items() if (kind := _kind_of(v)) is not None and v != []}
            kinds.update({f"{k}\x1f{kind}": (k, kind) for k, kind in own.items()})
            rows.pop(item_id, None)  # keep the batch's order: the last put of an id is written last
            rows[item_id] = {"id": item_id, ORDER_FIELD: now, "takedown": False,
                             META_FIELD: milvus_metadata(meta, own),
                             DOC_FIELD: dict(docs[i]) if docs is not None else {}, "vector": vec.tolist()}
        with _mapped(f"writing items into {self.collection}", self.target):
            new_kinds = sorted(set(kinds) - self._known_kinds)
            if new_kinds:  # not seen by this process: look them up once (another replica may have written them)
                new_kinds = sorted(set(new_kinds) - self._kind_keys())
            if new_kinds:  # kinds first: an item is never searchable before its fields are filterable
                # Only pairs not yet written, and flushed: re-upserting known pairs on every put churned
                # delete+insert on the same keys, and unflushed rows can be lost to a killed Milvus —
                # together they once left a field unfilterable after a restart (a 422 for a known field).
                self.target.call("upsert", self.fields_collection, [
                    {"key": key, "field": kinds[key][0], "kind": kinds[key][1], "vector": [0.0, 0.0]}
                    for key in new_kinds], bulk=True)
                # flushed now, even in a flushed_together block: only flushed pairs count as known
                _flush_now({self.fields_collection: self.target})
                self._known_kinds.update(new_kinds)
            self.target.call("upsert", self.collection, list(rows.values()), bulk=True)
            self._flush()

    def takedown(self, ids: Sequence[str], *, docs: Sequence[Mapping[str, Any]] | None = None) -> None:
        """Record takedowns of bundle clips ``ids`` (an added item of the same id is replaced);
        ``docs[i]``: a record kept beside takedown ``i`` (default ``{}``)."""
        if not ids:
            return
        now = int(time.time() * 1000)
        doc_of = {i: dict(docs[j]) if docs is not None else {} for j, i in enumerate(ids)}
        rows = [{"id": i, ORDER_FIELD: now, "takedown": True, META_FIELD: {}, DOC_FIELD: doc_of[i],
                 "vector": [0.0] * self.dim} for i in dict.fromkeys(ids)]
        for i in ids:
            _literal_id(i)
        with _mapped(f"writing takedowns into {self.collection}", self.target):
            self.target.call("upsert", self.collection, rows, bulk=True)
            self._flush()

    def delete(self, ids: Sequence[str]) -> None:
        """Remove the rows of ``ids`` (added items or takedowns); ids with no row are ignored."""
        if not ids:
            return
        expression = f"id in {_id_list(ids)}"
        with _mapped(f"deleting items from {self.collection}", self.target):
            self.target.call("delete", self.collection, filter=expression, bulk=True)
            self._flush()

    def _flush(self) -> None:
        if self.flush:
            _flush(self.target, self.collection)

    # ------------------------------------------------------------------ reads

    def _kind_rows(self) -> list[dict[str, Any]]:
        with _mapped(f"reading the fields of {self.collection}", self.target):
            rows = list(self.target.call("query", self.fields_collection, filter='key != ""',
                                         output_fields=["key", "field", "kind"], limit=QUERY_LIMIT,
                                         consistency_level=self.consistency))
        self._known_kinds.update(str(row["key"]) for row in rows)
        return rows

    def _kind_keys(self) -> set[str]:
        return {str(row["key"]) for row in self._kind_rows()}

    def fields(self) -> dict[str, str]:
        """Field → kind of every field any item was written with (``mixed``: several kinds)."""
        rows = self._kind_rows()
        seen: dict[str, set[str]] = {}
        for row in rows:
            seen.setdefault(str(row["field"]), set()).add(str(row["kind"]))
        return {name: (kinds.pop() if len(kinds) == 1 else "mixed") for name, kinds in sorted(seen.items())}

    def get(self, ids: Sequence[str]) -> dict[str, StoredItem]:
        """The rows of ``ids`` that exist (items and takedowns)."""
        if not ids:
            return {}
        with _mapped(f"reading items from {self.collection}", self.target):
            rows = self.target.call("query", self.collection, filter=f"id in {_id_list(ids)}",
                                    output_fields=["id", "takedown", ORDER_FIELD, META_FIELD, DOC_FIELD, "vector"],
                                    consistency_level=self.consistency)
        latest: dict[str, Mapping[str, Any]] = {}
        for r in rows:  # one row per id, unless Milvus shows an upsert's old row beside the new one: the newest wins
            held = latest.get(str(r["id"]))
            if held is None or _newer(r, held):
                latest[str(r["id"])] = r
        return {i: StoredItem(id=i, vector=np.asarray(r["vector"], dtype=np.float32), metadata=dict(r[META_FIELD]),
                              doc=dict(r[DOC_FIELD]), takedown=bool(r["takedown"]))
                for i, r in latest.items()}

    def present(self, ids: Iterable[str]) -> set[str]:
        """Which of ``ids`` have a row (an item or a takedown): one query by primary key."""
        wanted = list(dict.fromkeys(ids))
        if not wanted:
            return set()
        with _mapped(f"reading ids from {self.collection}", self.target):
            rows = self.target.call("query", self.collection, filter=f"id in {_id_list(wanted)}",
                                    output_fields=["id"], consistency_level=self.consistency)
        return {str(r["id"]) for r in rows}

    def rows(self, expression: str = 'id != ""', *, fields: Sequence[str] = ("id", "takedown", DOC_FIELD)) -> list[dict[str, Any]]:
        """Every row passing ``expression`` with ``fields``, read :data:`QUERY_LIMIT` at a time with
        Milvus's query iterator (bulk work: the bulk deadline); in no particular order."""
        out: list[dict[str, Any]] = []
        with _mapped(f"reading {self.collection}", self.target):
            iterator = self.target.client().query_iterator(
                self.collection, batch_size=QUERY_LIMIT, filter=expression, output_fields=list(fields),
                timeout=self.target.bulk_timeout_s, consistency_level=self.consistency)
            try:
                while page := iterator.next():
                    out.extend(dict(r) for r in page)
            finally:
                iterator.close()
        return out

    def ids(self, *, takedown: bool | None = None) -> list[str]:
        """Every id (sorted), or only the items' (``takedown=False``) or the takedowns' (``True``), read
        :data:`QUERY_LIMIT` at a time with Milvus's query iterator (bulk work: the bulk deadline)."""
        expression = 'id != ""' if takedown is None else f"takedown == {'true' if takedown else 'false'}"
        out: list[str] = []
        with _mapped(f"listing {self.collection}", self.target):
            iterator = self.target.client().query_iterator(
                self.collection, batch_size=QUERY_LIMIT, filter=expression, output_fields=["id"],
                timeout=self.target.bulk_timeout_s, consistency_level=self.consistency)
            try:
                while page := iterator.next():
                    out.extend(str(r["id"]) for r in page)
            finally:
                iterator.close()
        return sorted(out)

    def count(self) -> int:
        """Live added items (takedowns not counted)."""
        with _mapped(f"counting {self.collection}", self.target):
            rows = self.target.call("query", self.collection, filter="takedown == false", output_fields=["count(*)"],
                                    consistency_level=self.consistency)
        return int(rows[0]["count(*)"]) if rows else 0

    def expression(self, flt: Filter | None, fields: Mapping[str, str] | None = None) -> str:
        """The Milvus expression a search runs: ``takedown == false`` and ``flt`` over ``meta``.

        ``fields`` (default :meth:`fields`): the catalogue's field kinds — the service passes the
        bundle's merged with the store's, as :meth:`MetadataTable.mask` takes them. The filter is
        checked first (:class:`FilterError`: unknown field, ``mixed``, wrong operand type)."""
        if flt is None or flt.matches_all:
            return "takedown == false"
        kinds = self.fields() if fields is None else dict(fields)
        MetadataTable(0, {}).mask(flt, fields=kinds)  # the same checks and errors as a catalogue's table
        written = milvus_expr(flt, {k: v for k, v in kinds.items() if v != "mixed"}, json_field=META_FIELD,
                              row_field=ORDER_FIELD, in_operator=self._in_operator)
        if written is None:
            raise FilterError("this filter holds a string Milvus cannot read back (a control character): "
                              "it cannot be evaluated on added items")
        return f"takedown == false and ({written})"

    def search(self, queries: np.ndarray, k: int, flt: Filter | None = None, *,
               fields: Mapping[str, str] | None = None) -> tuple[np.ndarray, list[list[str]]]:
        """Top-``k`` added items per query by inner product passing ``flt``: scores (n, k) float32
        (-inf where fewer hits) and ids (a list per query, shorter where fewer hits); ties by id."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        matrix = np.ascontiguousarray(queries, dtype=np.float32).reshape(-1, self.dim)
        expression = self.expression(flt, fields)
        scores = np.full((len(matrix), k), -np.inf, dtype=np.float32)
        ids: list[list[str]] = [[] for _ in range(len(matrix))]
        if len(matrix) == 0:
            return scores, ids
        first = min(MAX_LIMIT, k + TIE_MARGIN)
        hits = self._fetch(matrix, first, expression)
        for q, found in enumerate(hits):
            limit = first
            while limit < MAX_LIMIT and len(found) == limit and len(found) > k and found[-1][0] == found[k - 1][0]:
                limit = min(MAX_LIMIT, limit * 2)
                found = self._fetch(matrix[q : q + 1], limit, expression)[0]
            for j, (score, item_id) in enumerate(found[:k]):
                scores[q, j] = score
                ids[q].append(item_id)
        return scores, ids

    def _fetch(self, matrix: np.ndarray, limit: int, expression: str) -> list[list[tuple[float, str]]]:
        with _mapped(f"searching {self.collection}", self.target):
            found = self.target.call(
                "search", self.collection, data=matrix.tolist(), limit=limit, filter=expression,
                search_params={"metric_type": "IP", "params": search_params(self.index_type, self.build, limit)},
                output_fields=["id"], consistency_level=self.consistency,
            )
        return [sorted(((float(h["distance"]), _hit_id(h)) for h in hits), key=lambda h: (-h[0], h[1]))
                for hits in found]


def _newer(row: Mapping[str, Any], than: Mapping[str, Any]) -> bool:
    """``row`` was written after ``than`` (two versions of one id): later ``added_ms``; at the same millisecond
    a takedown (a delete follows the put it removes)."""
    return (int(row[ORDER_FIELD]), bool(row["takedown"])) > (int(than[ORDER_FIELD]), bool(than["takedown"]))


def _hit_id(hit: Mapping[str, Any]) -> str:
    entity = hit.get("entity") or {}
    return str(entity["id"] if "id" in entity else hit["id"])

