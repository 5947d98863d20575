"""Search over one loaded bundle: text→audio, audio→text, consistency diagnostics.

No FastAPI here: a :class:`Searcher` takes plain Python values, returns plain
dataclasses and raises :class:`service.errors.ServiceError` for bad input, so it
is unit-testable alone. One instance per loaded bundle, shared by all requests;
it never mutates the bundle's index state.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from index.engines.filters import (
    Filter,
    FilterError,
    MetadataTable,
    merged_fields,
    merged_kinds,
    parse_filter,
)
from index.errors import IndexBackendError, IndexInputRefused, IndexTimeout
from index.items.overlay import AddedItem, ItemOverlay, merge_top_k
from index.languages import ENGLISH
from index.metrics.report import METRIC_CONVENTION
from index.metrics.retrieval import (
    dis,
    gap,
    mean_rank_std,
    mean_rank_variance,
    t2a_ranks_from_embeddings,
)
from index.moments.sources import Allowed, Key, WindowSource, search_sources
from index.moments.windows import HOP_FRACTION, ExactWindows
from service.audio_input import AudioLimits
from service.cache import (
    QueryCache,
    cache_key,
    decode_hits,
    decode_vector,
    encode_hits,
    encode_vector,
    normalize_query,
)
from service.errors import ServiceError
from service.gate import eval_data, evaluate

log = logging.getLogger(__name__)

INDEX_RETRY_AFTER_S = 1
"""Retry-After of ``index-unavailable``: Milvus outages are retried by clients, not by workers."""


def index_unavailable(err: BaseException | str) -> ServiceError:
    """The 503 ``index-unavailable`` problem (with Retry-After) for an index backend failure."""
    return ServiceError(
        "index-unavailable", f"{err}; retry after {INDEX_RETRY_AFTER_S} s", retry_after=INDEX_RETRY_AFTER_S
    )


def index_problem(err: BaseException) -> ServiceError:
    """An index backend failure as a problem: a value Milvus refuses (:class:`IndexInputRefused`: an id
    over its key's bytes) → 422 ``validation-error``, the caller's input; one call past its deadline while
    Milvus answers others (:class:`IndexTimeout`) → 504 ``index-timeout``; anything else → 503
    ``index-unavailable``; both with Retry-After."""
    if isinstance(err, IndexInputRefused):
        return ServiceError("validation-error", f"the index backend refused the input: {err}")
    if isinstance(err, IndexTimeout):
        return ServiceError(
            "index-timeout", f"{err}; retry after {INDEX_RETRY_AFTER_S} s", retry_after=INDEX_RETRY_AFTER_S
        )
    return index_unavailable(err)


@contextmanager
def index_calls() -> Iterator[None]:
    """Index backend failures become ``index-timeout`` (this call was slow) or ``index-unavailable``
    (Milvus unreachable) problems (:func:`index_problem`)."""
    try:
        yield
    except IndexBackendError as err:
        raise index_problem(err) from None


class BundleLike(Protocol):
    """The part of :class:`index.runtime.loader.LoadedBundle` the service uses."""

    path: Path
    bundle_id: str
    languages: list[str]
    embed_dim: int
    sample_rate: int
    audio_items: list[dict[str, Any]]
    text_items: list[dict[str, Any]]

    def encode_text(self, texts: Sequence[str]) -> np.ndarray: ...

    def encode_audio(self, waveforms: Sequence[np.ndarray]) -> np.ndarray: ...

    def search_audio(
        self, queries: np.ndarray, k: int, *, allowed: np.ndarray | None = None, where: Filter | None = None
    ) -> tuple[np.ndarray, np.ndarray]: ...

    def search_text(
        self,
        queries: np.ndarray,
        k: int,
        *,
        languages: Collection[str] | None = None,
        allowed_clips: np.ndarray | None = None,
        where: Filter | None = None,
    ) -> tuple[np.ndarray, np.ndarray]: ...

    def warmup(self) -> None: ...

    def close(self) -> None: ...


class EngineItems(Protocol):
    """Added items kept by the index engine (:class:`service.milvus_items.BundleItems`, Milvus) for one
    bundle: every replica reads the same rows, so nothing is held here."""

    def fields(self) -> dict[str, str]: ...

    def expression(self, flt: Filter, fields: Mapping[str, str]) -> str: ...

    def hidden_among(self, ids: Collection[str]) -> set[str]: ...

    def search(self, queries: np.ndarray, k: int, flt: Filter | None, fields: Mapping[str, str] | None,
               exclude: str | None = None) -> tuple[np.ndarray, list[list[str]]]: ...

    def get(self, item_id: str) -> tuple[AddedItem, np.ndarray] | None: ...

    def items(self, ids: Collection[str]) -> dict[str, AddedItem]: ...


class AddedHits:
    """The added items one request's engine searches found, numbered after the bundle's clips as an
    overlay's rows are (row ``n_clips + j`` is ``items[j]``): what :meth:`Searcher._audio_hits` reads.
    One per request — its rows mean nothing to another — and never cached."""

    _serial = itertools.count(1)

    def __init__(self, n_clips: int, engine: EngineItems) -> None:
        self.n_clips = n_clips
        self.engine = engine
        self.items: list[AddedItem] = []
        self.version = -next(self._serial)
        """Unique and negative (an overlay's versions are >= 0): micro-batches never group two requests' hits."""
        self._resolved = False

    @property
    def size(self) -> int:
        return len(self.items)

    def rows_of(self, scores: np.ndarray, ids: Sequence[Sequence[str]]) -> tuple[np.ndarray, np.ndarray]:
        """``(scores, rows)`` of an engine search's ids, as catalogue rows of this collection."""
        rows = np.full(scores.shape, -1, dtype=np.int64)
        for q, found in enumerate(ids):
            for j, item_id in enumerate(found):
                rows[q, j] = self.n_clips + len(self.items)
                self.items.append(AddedItem(item_id, "", "", {}, {}))
        return scores, rows

    def item(self, row: int) -> AddedItem:
        return self.items[row - self.n_clips]

    def resolve(self) -> None:
        """Read the hits' records (captions, metadata): only where an answer shows them."""
        if self._resolved:
            return
        found = self.engine.items({item.id for item in self.items})  # one query
        self.items = [found.get(item.id, item) for item in self.items]
        self._resolved = True


Catalogue = ItemOverlay | AddedHits
"""What a search's rows refer to: the overlay of the file log, or one request's engine hits."""


@dataclass(frozen=True)
class ClipFilter:
    """A parsed filter and the clips it passes (a mask over ``audio_items``), and the added items it
    passes (a mask over ``items.items``, the overlay the masks were made for)."""

    filter: Filter
    allowed: np.ndarray
    items: ItemOverlay | None = None
    added: np.ndarray | None = None

    @property
    def key(self) -> str:
        """A short digest of the filter's canonical JSON (cache keys stay small for large filters)."""
        return hashlib.sha256(self.filter.canonical.encode("utf-8")).hexdigest()[:32]


@dataclass(frozen=True)
class TextLookup:
    """Normalized queries and what the cache already knew (None = miss)."""

    texts: list[str]
    k: int
    results: list[tuple[np.ndarray, np.ndarray] | None]
    clip_filter: ClipFilter | None = None
    items: Catalogue | None = None
    """The overlay of added items the results' rows refer to."""

    @property
    def complete(self) -> bool:
        return all(r is not None for r in self.results)


@dataclass(frozen=True)
class AudioQuery:
    """One decoded upload to rank captions for (``languages`` empty = all)."""

    waveform: np.ndarray
    languages: tuple[str, ...]
    k: int
    min_score: float | None = None
    clip_filter: ClipFilter | None = None


@dataclass(frozen=True)
class AudioHit:
    id: str
    score: float
    uri: str | None = None
    captions: dict[str, list[str]] | None = None


@dataclass(frozen=True)
class MomentResult:
    """A moment of a catalogue recording: seconds from its start, and the cosine of its best window."""

    id: str
    start: float
    end: float
    score: float
    uri: str | None


@dataclass(frozen=True)
class CaptionHit:
    clip_id: str
    lang: str
    text: str
    score: float
    uri: str | None = None


@dataclass(frozen=True)
class LanguageDiagnosis:
    hits: list[AudioHit]
    target_rank: int | None


@dataclass(frozen=True)
class HeldoutReport:
    report: dict[str, float]
    convention: str
    source: str  # "manifest" (computed at export) or "computed" (at first request)


@dataclass(frozen=True)
class ConsistencyDiagnosis:
    target_id: str | None
    per_language: dict[str, LanguageDiagnosis]
    mrv: float | None
    mean_rank_std: float | None
    gap: dict[str, float] = field(default_factory=dict)
    dis: dict[str, float] = field(default_factory=dict)


class Searcher:
    """Query-time operations over one bundle, with a query cache keyed by the bundle id."""

    def __init__(self, bundle: BundleLike, *, cache: QueryCache, key_prefix: str, max_query_chars: int):
        self.bundle = bundle
        self.cache = cache
        self.key_prefix = key_prefix
        self.max_query_chars = max_query_chars
        self.clip_rows = {str(item["id"]): row for row, item in enumerate(bundle.audio_items)}
        self._gallery: np.ndarray | None = None  # loaded on first diagnosis
        self._gallery_lock = threading.Lock()
        self._heldout: HeldoutReport | None = None
        self._catalogue: MetadataTable | None = None  # built on first filter
        self.items = ItemOverlay.empty(
            len(bundle.audio_items), len(getattr(bundle, "text_items", None) or ()), int(bundle.embed_dim)
        )
        """Items added through the API (service.items keeps it in step with the log); replaced whole."""
        self.items_lock = threading.Lock()
        self.catalogue_id = ""
        """The item log's id (:attr:`index.items.log.ItemLog.log_id`, set by service.items before this
        bundle goes live; "" without items): cached results name it beside the log's version."""
        self.engine_items: EngineItems | None = None
        """Added items in the index engine (service.milvus_items sets it before this bundle goes live);
        then ``items`` stays empty, hidden clips are asked per search and results are never cached."""
        manifest_sha = str(getattr(getattr(bundle, "manifest", None), "manifest_sha256", "") or "")
        self.cache_bundle = f"{self.bundle_id}.{manifest_sha[:16]}" if manifest_sha else self.bundle_id
        """The bundle's part of every cache key: its id and its manifest's hash (two bundles that
        reuse an id never share entries)."""
        self._item_windows: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        """Stored audio name → its moment windows (:meth:`keep_item_windows`), for the live added items."""
        self._item_windows_lock = threading.Lock()
        self._added_source: tuple[ItemOverlay, ExactWindows | None] | None = None
        """The added items' window source of the last overlay asked about (:meth:`added_window_source`)."""
        self._added_windowed: tuple[tuple[str, str], ...] = ()
        """The (id, audio) of the items with windows that source holds: a write that changes none reuses it."""
        self._windows_missing: set[str] = set()
        self.item_limits: AudioLimits | None = None
        """The item writes' limits (service.items sets them)."""
        self.bundle_window_source: WindowSource | None = None
        """The bundle's moment windows in the engine (the Milvus wiring sets it when the bundle's windows were
        published); None: ``bundle.moment_windows()`` (in memory, or FAISS over a memory-mapped file)."""
        self.milvus_item_windows: WindowSource | None = None
        """The added items' moment windows in Milvus, keyed by item id (the Milvus wiring sets it); None: the
        file backend's stored item windows (:meth:`added_window_source`)."""

    # ------------------------------------------------------------------ filters

    @property
    def catalogue(self) -> MetadataTable:
        """The clips' metadata as columns (:mod:`index.engines.filters`), built once on first use."""
        with self._gallery_lock:
            if self._catalogue is None:
                self._catalogue = MetadataTable.from_items(self.bundle.audio_items)
            return self._catalogue

    def catalogue_fields(self, items: ItemOverlay | None = None) -> dict[str, str]:
        """Metadata fields (name → kind) of the bundle's clips and the added items together."""
        if self.engine_items is not None:
            with index_calls():
                return merged_kinds([self.catalogue.fields(), self.engine_items.fields()])
        items = self.items if items is None else items
        if not items.size:
            return self.catalogue.fields()
        return merged_fields([self.catalogue, items.metadata_table()])

    def clip_filter(self, obj: Any) -> ClipFilter | None:
        """The clips and added items a request's ``filter`` passes (None: no filter); ``invalid-filter``
        for a field or a type the catalogue does not have (the form was checked by the request schema)."""
        if obj is None:
            return None
        items = self.items
        try:
            flt = parse_filter(obj)
            if flt.matches_all:
                return None
            if self.engine_items is not None:  # checked here: a filter the engine cannot take is a 400 too
                fields = self.catalogue_fields()
                allowed = self.catalogue.mask(flt, fields=fields)
                self.engine_items.expression(flt, fields)
                return ClipFilter(flt, allowed)
            if not items.size:
                return ClipFilter(flt, self.catalogue.mask(flt), items)
            fields = self.catalogue_fields(items)
            return ClipFilter(flt, self.catalogue.mask(flt, fields=fields), items,
                              items.metadata_table().mask(flt, fields=fields))
        except FilterError as err:
            raise ServiceError("invalid-filter", str(err), fields=self.catalogue_fields(items)) from None

    def search_clips(
        self, queries: np.ndarray, k: int, items: Catalogue, clip_filter: ClipFilter | None = None,
        *, bundle_allowed: np.ndarray | None = None, added_allowed: np.ndarray | None = None,
        exclude: str | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` catalogue rows (bundle clips, then added items: :mod:`index.items.overlay`): the
        bundle's index without its hidden rows, merged with the exact ranking of the added items.
        ``bundle_allowed``/``added_allowed`` override the filter's masks; ``exclude``: an added item's id
        never returned (with the engine; the overlay takes ``added_allowed``)."""
        if clip_filter is not None:
            bundle_allowed = clip_filter.allowed if bundle_allowed is None else bundle_allowed
            added_allowed = clip_filter.added if added_allowed is None else added_allowed
        if isinstance(items, AddedHits):
            return self._search_engine(queries, k, items, clip_filter, bundle_allowed, exclude)
        mask = items.bundle_mask(bundle_allowed)
        with index_calls():
            if mask is None:
                found = self.bundle.search_audio(queries, k)
            else:  # ``where``: a backend that evaluates filters itself (Milvus) gets the filter the mask came from
                found = self.bundle.search_audio(queries, k, allowed=mask,
                                                 where=clip_filter.filter if clip_filter is not None else None)
        if not items.size:
            return found
        return merge_top_k(found, items.search_items(queries, k, added_allowed), k)

    def _search_engine(
        self, queries: np.ndarray, k: int, hits: AddedHits, clip_filter: ClipFilter | None,
        bundle_allowed: np.ndarray | None, exclude: str | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`search_clips` with the added items in the engine: the bundle's top k without the clips
        that have a record, merged with the engine's top k of the added items under the filter."""
        where = clip_filter.filter if clip_filter is not None else None

        def search(mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
            if mask is None:
                return self.bundle.search_audio(queries, k)
            return self.bundle.search_audio(queries, k, allowed=mask, where=where)

        engine = hits.engine
        with index_calls():
            found = self.visible(search, lambda result: result[1], bundle_allowed)
            fields = self.catalogue_fields() if where is not None else None
            added = hits.rows_of(*engine.search(queries, k, where, fields, exclude=exclude))
        return merge_top_k(found, added, k)

    def visible(
        self, search: Callable[[np.ndarray | None], Any], clip_rows_of: Callable[[Any], np.ndarray],
        allowed: np.ndarray | None,
    ) -> Any:
        """``search(mask)`` again until none of the clips it returns has a record in the engine (an added
        item replaced it, or it was deleted): each round masks the hidden clips it found. With the file
        log the overlay's mask already hides them (one round). ``clip_rows_of``: a result's clip rows."""
        mask = allowed
        engine = self.engine_items
        while True:
            found = search(mask)
            if engine is None:
                return found
            rows = np.asarray(clip_rows_of(found)).ravel()  # a row the mask refuses (a padded -inf hit) is no news
            ids = {str(self.bundle.audio_items[r]["id"]) for r in rows.astype(np.int64).tolist()
                   if r >= 0 and (mask is None or mask[r])}
            hidden = engine.hidden_among(ids)
            if not hidden:
                return found
            mask = np.ones(len(self.bundle.audio_items), dtype=bool) if mask is None else mask.copy()
            mask[[self.clip_rows[i] for i in hidden]] = False

    def catalogue_items(self) -> Catalogue:
        """What a new request's rows will refer to: the current overlay, or a fresh engine hit list."""
        if self.engine_items is not None:
            return AddedHits(len(self.bundle.audio_items), self.engine_items)
        return self.items

    def added_item(self, item_id: str) -> AddedItem | None:
        """The live added item ``item_id`` of the catalogue (None: not one)."""
        if self.engine_items is not None:
            with index_calls():
                found = self.engine_items.get(item_id)
            return found[0] if found is not None else None
        items = self.items
        row = items.row_of.get(item_id)
        return items.items[row] if row is not None else None

    def clip_hidden(self, item_id: str) -> bool:
        """Whether the bundle clip ``item_id`` is hidden (deleted, or replaced by an added item)."""
        if self.engine_items is not None:
            with index_calls():
                return bool(self.engine_items.hidden_among([item_id]))
        return item_id in self.items.hidden_ids

    @property
    def bundle_id(self) -> str:
        return self.bundle.bundle_id

    @property
    def languages(self) -> list[str]:
        return list(self.bundle.languages)

    # ------------------------------------------------------------------ validation

    def check_language(self, lang: str | None) -> None:
        """Raise ``unknown-language`` (listing the supported codes) unless ``lang`` is served."""
        if lang is not None and lang not in self.bundle.languages:
            raise ServiceError(
                "unknown-language",
                f"language {lang!r} is not supported by bundle {self.bundle_id}; "
                f"supported: {', '.join(self.bundle.languages)}",
                supported=self.languages,
            )

    def normalized(self, query: str) -> str:
        """Normalized query text, or ``invalid-query`` when empty or longer than the limit."""
        text = normalize_query(query)
        if not text:
            raise ServiceError("invalid-query", "query is empty (only whitespace)")
        if len(text) > self.max_query_chars:
            raise ServiceError(
                "invalid-query", f"query has {len(text)} characters; the limit is {self.max_query_chars}"
            )
        return text

    # ------------------------------------------------------------------ text embeddings

    def _key(self, kind: str, text: str) -> str:
        return cache_key(prefix=self.key_prefix, bundle_id=self.cache_bundle, kind=kind, text=text)

    def embed_texts(self, texts: Sequence[str]) -> np.ndarray:
        """(n, d) embeddings of already-normalized texts; cached ones are not re-encoded."""
        out = np.empty((len(texts), self.bundle.embed_dim), dtype=np.float32)
        missing: list[int] = []
        for i, text in enumerate(texts):
            raw = self.cache.get(self._key("temb", text), kind="embedding")
            vector = decode_vector(raw, self.bundle.embed_dim) if raw is not None else None
            if vector is None:
                missing.append(i)
            else:
                out[i] = vector
        if missing:
            encoded = np.asarray(self.bundle.encode_text([texts[i] for i in missing]), dtype=np.float32)
            for i, vector in zip(missing, encoded, strict=True):
                out[i] = vector
                self.cache.set(self._key("temb", texts[i]), encode_vector(vector))
        return out

    # ------------------------------------------------------------------ text → audio

    def search_text(
        self,
        queries: Sequence[str],
        *,
        lang: str | None = None,
        k: int,
        min_score: float | None = None,
        include_captions: bool = False,
        clip_filter: ClipFilter | None = None,
    ) -> list[list[AudioHit]]:
        """Top-``k`` clips for each query; results are cached per (bundle, query, k, filter)."""
        lookup = self.lookup_text(queries, lang=lang, k=k, clip_filter=clip_filter)
        return self.hits_of(self.complete_text(lookup), min_score=min_score, include_captions=include_captions,
                            items=lookup.items)

    def _results_kind(self, k: int, clip_filter: ClipFilter | None, items: Catalogue) -> str:
        """Cached results are keyed by the filter and by the catalogue: the item log's id and version
        (rows of added items are the same in every replica at one version of one log; a replica on
        another log, or on none, never reads them)."""
        kind = f"t2a-k{k}" if clip_filter is None else f"t2a-k{k}-f{clip_filter.key}"
        if self.catalogue_id:
            return f"{kind}-L{self.catalogue_id}-v{items.version}"
        return f"{kind}-v{items.version}" if items.version else kind

    def lookup_text(
        self, queries: Sequence[str], *, lang: str | None, k: int, clip_filter: ClipFilter | None = None
    ) -> TextLookup:
        """Validate and normalize the queries and look their results up in the cache.

        Cheap and non-blocking with the in-process cache, so the app runs it on the event
        loop and sends only misses to the thread pool (:meth:`complete_text`)."""
        self.check_language(lang)
        texts = [self.normalized(q) for q in queries]
        items = (clip_filter.items if clip_filter is not None and clip_filter.items is not None
                 else self.catalogue_items())
        results: list[tuple[np.ndarray, np.ndarray] | None] = []
        for text in texts:
            if isinstance(items, AddedHits):  # the engine's catalogue has no version to key results by
                results.append(None)
                continue
            raw = self.cache.get(self._key(self._results_kind(k, clip_filter, items), text), kind="results")
            hit = decode_hits(raw) if raw is not None else None
            if hit is not None and int(hit[1].max(initial=-1)) >= items.n_clips + items.size:
                hit = None  # rows this catalogue does not have (a foreign entry): searched again, never a 500
            results.append(hit)
        return TextLookup(texts=texts, k=k, results=results, clip_filter=clip_filter, items=items)

    def complete_text(self, lookup: TextLookup) -> list[tuple[np.ndarray, np.ndarray]]:
        """Encode and search the queries the cache did not answer (blocking: encoder + FAISS)."""
        return self.complete_text_batch([lookup])[0]

    def complete_text_batch(self, lookups: Sequence[TextLookup]) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        """:meth:`complete_text` for several requests at once (a micro-batch): the texts the cache
        did not answer are encoded in one encoder call and searched in one FAISS call per ``k``."""
        results = [list(lookup.results) for lookup in lookups]
        missing = [(r, i) for r, lookup in enumerate(lookups) for i, hit in enumerate(lookup.results) if hit is None]
        if missing:
            texts = list(dict.fromkeys(lookups[r].texts[i] for r, i in missing))  # a repeated query is encoded once
            embeddings = self.embed_texts(texts)
            row_of = {text: row for row, text in enumerate(texts)}
            groups: dict[tuple[int, str, int], list[tuple[int, int]]] = {}
            for r, i in missing:
                flt = lookups[r].clip_filter
                version = self._lookup_items(lookups[r]).version
                groups.setdefault((lookups[r].k, flt.key if flt else "", version), []).append((r, i))
            for (k, _, _), group in sorted(groups.items()):
                flt = lookups[group[0][0]].clip_filter
                items = self._lookup_items(lookups[group[0][0]])
                queries = embeddings[[row_of[lookups[r].texts[i]] for r, i in group]]
                scores, rows = self.search_clips(queries, k, items, flt)
                kind = self._results_kind(k, flt, items)
                for j, (r, i) in enumerate(group):
                    results[r][i] = (scores[j], rows[j])
                    if not isinstance(items, AddedHits):
                        self.cache.set(self._key(kind, lookups[r].texts[i]), encode_hits(scores[j], rows[j]))
        return [[hit for hit in found if hit is not None] for found in results]

    def _lookup_items(self, lookup: TextLookup) -> Catalogue:
        return lookup.items if lookup.items is not None else self.items

    def hits_of(
        self, results: list[tuple[np.ndarray, np.ndarray]], *, min_score: float | None, include_captions: bool,
        items: Catalogue | None = None,
    ) -> list[list[AudioHit]]:
        """Hits of searched rows; ``items``: the overlay the rows refer to (the lookup's)."""
        return [self._audio_hits(s, r, min_score=min_score, include_captions=include_captions, items=items)
                for s, r in results]

    def _audio_hits(
        self, scores: np.ndarray, rows: np.ndarray, *, min_score: float | None, include_captions: bool,
        items: Catalogue | None = None,
    ) -> list[AudioHit]:
        items = self.items if items is None else items
        if include_captions and isinstance(items, AddedHits):
            with index_calls():
                items.resolve()
        n_clips = items.n_clips
        hits = []
        for score, row in zip(scores.tolist(), rows.tolist(), strict=True):
            if row < 0 or (min_score is not None and score < min_score):
                continue
            if row >= n_clips:
                added = items.item(row)
                hits.append(AudioHit(id=added.id, score=float(score), uri=None,
                                     captions=added.captions if include_captions else None))
                continue
            item = self.bundle.audio_items[row]
            hits.append(
                AudioHit(
                    id=str(item["id"]),
                    score=float(score),
                    uri=item.get("uri"),
                    captions=item.get("captions") if include_captions else None,
                )
            )
        return hits

    # ------------------------------------------------------------------ audio → text

    def search_audio(
        self,
        waveform: np.ndarray,
        *,
        languages: Collection[str] | None = None,
        k: int,
        min_score: float | None = None,
    ) -> list[CaptionHit]:
        """Top-``k`` captions *per language* for one decoded waveform (at the bundle's rate).

        Scores are not comparable across languages (one language's captions can all score
        above another's), so a single global top k would starve languages; each requested
        language (default: every served one) is searched on its own. Hits come grouped by
        language, in the order requested (else the bundle's), each group best first."""
        return self.search_audio_batch([AudioQuery(waveform, tuple(languages or ()), k, min_score)])[0]

    def search_audio_batch(self, queries: Sequence[AudioQuery]) -> list[list[CaptionHit]]:
        """:meth:`search_audio` for several uploads at once (a micro-batch): one encoder call for
        all waveforms, one FAISS search per (language, k) over the uploads that ask for it."""
        if not getattr(self.bundle, "has_captions", True):
            raise ServiceError(
                "no-caption-index",
                f"bundle {self.bundle_id} holds only audio (built by `tonearm index`, no captions): "
                "audio→text search needs a bundle from `tonearm export`",
            )
        requested = [list(dict.fromkeys(q.languages)) if q.languages else self.languages for q in queries]
        for langs in requested:
            for lang in langs:
                self.check_language(lang)
        embeddings = np.asarray(self.bundle.encode_audio([q.waveform for q in queries]), dtype=np.float32)
        per_language: dict[tuple[int, str], list[CaptionHit]] = {}
        current = self.items

        def items_of(q: AudioQuery) -> ItemOverlay:
            flt = q.clip_filter
            return flt.items if flt is not None and flt.items is not None else current

        def fkey(q: AudioQuery) -> str:
            return f"{q.clip_filter.key}-v{items_of(q).version}" if q.clip_filter else ""

        jobs = {(lang, q.k, fkey(q)) for q, langs in zip(queries, requested, strict=True) for lang in langs}
        for lang, k, key in sorted(jobs):
            group = [j for j, q in enumerate(queries) if q.k == k and fkey(q) == key and lang in requested[j]]
            flt = queries[group[0]].clip_filter
            items = items_of(queries[group[0]])
            mask = items.bundle_mask(flt.allowed if flt is not None else None)

            def search(mask: np.ndarray | None, lang: str = lang, group: list[int] = group, k: int = k,
                       flt: ClipFilter | None = flt) -> tuple[np.ndarray, np.ndarray]:
                if mask is None:
                    return self.bundle.search_text(embeddings[group], k, languages=[lang])
                return self.bundle.search_text(embeddings[group], k, languages=[lang], allowed_clips=mask,
                                               where=flt.filter if flt is not None else None)

            with index_calls():
                found = self.visible(search, self._caption_clip_rows, mask)
            if items.caption_langs:
                added = items.search_captions(embeddings[group], k, lang, flt.added if flt is not None else None)
                found = merge_top_k(found, added, k)
            scores, rows = found
            for g, j in enumerate(group):
                per_language[j, lang] = self._caption_hits(scores[g], rows[g], min_score=queries[j].min_score,
                                                           items=items)
        return [[hit for lang in langs for hit in per_language[j, lang]] for j, langs in enumerate(requested)]

    def _caption_clip_rows(self, found: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """The clip rows of a caption search's rows (-1 past the end)."""
        rows = found[1].ravel()
        return np.array([int(self.bundle.text_items[int(r)]["clip_row"]) if r >= 0 else -1 for r in rows], np.int64)

    def _caption_hits(
        self, scores: np.ndarray, rows: np.ndarray, *, min_score: float | None, items: ItemOverlay
    ) -> list[CaptionHit]:
        hits = []
        for score, row in zip(scores.tolist(), rows.tolist(), strict=True):
            if row < 0 or (min_score is not None and score < min_score):
                continue
            if row >= items.n_texts:
                j = row - items.n_texts
                owner = items.items[int(items.caption_items[j])]
                hits.append(CaptionHit(clip_id=owner.id, lang=items.caption_langs[j], text=items.caption_texts[j],
                                       score=float(score), uri=None))
                continue
            item = self.bundle.text_items[row]
            clip = self.bundle.audio_items[int(item["clip_row"])]
            hits.append(
                CaptionHit(
                    clip_id=str(item["clip_id"]),
                    lang=str(item["lang"]),
                    text=str(item["text"]),
                    score=float(score),
                    uri=clip.get("uri"),
                )
            )
        return hits

    # ------------------------------------------------------------------ audio → audio

    def similar_to_item(
        self, item_id: str, *, k: int, min_score: float | None = None, clip_filter: ClipFilter | None = None
    ) -> list[AudioHit]:
        """Top-``k`` catalogue items by audio–audio cosine to the catalogue's item ``item_id`` (an added
        item or a bundle clip; itself excluded)."""
        if self.engine_items is not None:
            return self._similar_in_engine(item_id, k=k, min_score=min_score, clip_filter=clip_filter)
        items = clip_filter.items if clip_filter is not None and clip_filter.items is not None else self.items
        n_clips = len(self.bundle.audio_items)
        bundle_allowed = (np.ones(n_clips, dtype=bool) if clip_filter is None else clip_filter.allowed.copy())
        added_allowed = (np.ones(items.size, dtype=bool) if clip_filter is None or clip_filter.added is None
                         else clip_filter.added.copy())
        added_row = items.row_of.get(item_id)
        row = self.clip_rows.get(item_id)
        if added_row is not None:
            vector = items.vectors[added_row]
            added_allowed[added_row] = False
        elif row is not None and item_id not in items.hidden_ids:
            with index_calls():
                vector = self.clip_vector(row)
            bundle_allowed[row] = False
        else:
            raise ServiceError("unknown-target", f"{item_id!r} is not in the catalogue of bundle {self.bundle_id}")
        scores, rows = self.search_clips(vector[None, :], k, items, clip_filter, bundle_allowed=bundle_allowed,
                                         added_allowed=added_allowed)
        return self._audio_hits(scores[0], rows[0], min_score=min_score, include_captions=False, items=items)

    def _similar_in_engine(
        self, item_id: str, *, k: int, min_score: float | None, clip_filter: ClipFilter | None
    ) -> list[AudioHit]:
        """:meth:`similar_to_item` with the added items in the engine (its vector is the bundle's row)."""
        hits = AddedHits(len(self.bundle.audio_items), self.engine_items)  # type: ignore[arg-type]
        bundle_allowed = (np.ones(hits.n_clips, dtype=bool) if clip_filter is None else clip_filter.allowed.copy())
        with index_calls():
            added = self.engine_items.get(item_id)  # type: ignore[union-attr]
        row = self.clip_rows.get(item_id)
        exclude = None
        if added is not None:
            vector, exclude = added[1], item_id
        elif row is not None and not self.clip_hidden(item_id):
            with index_calls():
                vector = self.clip_vector(row)
            bundle_allowed[row] = False
        else:
            raise ServiceError("unknown-target", f"{item_id!r} is not in the catalogue of bundle {self.bundle_id}")
        scores, rows = self.search_clips(vector[None, :], k, hits, clip_filter, bundle_allowed=bundle_allowed,
                                         exclude=exclude)
        return self._audio_hits(scores[0], rows[0], min_score=min_score, include_captions=False, items=hits)

    def similar_to_audio(
        self, waveform: np.ndarray, *, k: int, min_score: float | None = None, clip_filter: ClipFilter | None = None
    ) -> list[AudioHit]:
        """Top-``k`` catalogue items by audio–audio cosine to an uploaded (decoded) waveform."""
        items = (clip_filter.items if clip_filter is not None and clip_filter.items is not None
                 else self.catalogue_items())
        embedding = np.asarray(self.bundle.encode_audio([waveform]), dtype=np.float32)
        scores, rows = self.search_clips(embedding, k, items, clip_filter)
        return self._audio_hits(scores[0], rows[0], min_score=min_score, include_captions=False, items=items)

    # ------------------------------------------------------------------ moments (SPEC §19)

    def search_moments(
        self, embedding: np.ndarray, *, k: int, min_score: float | None = None, clip_filter: ClipFilter | None = None,
        stored_audio: Callable[[str], Path | None] | None = None,
    ) -> list[MomentResult]:
        """Top-``k`` moments of the bundle's long recordings and the added items' for one query vector (text or
        audio), best first (:func:`index.moments.sources.search_sources` over :meth:`moment_sources`);
        ``no-moment-index`` when neither has any. No window is embedded here: an added item's were computed when
        it was written (service.items); ``stored_audio`` is not read (the routes' older argument)."""
        items = clip_filter.items if clip_filter is not None and clip_filter.items is not None else self.items
        sources = self.moment_sources(items, clip_filter)
        if not sources:
            raise ServiceError("no-moment-index", f"bundle {self.bundle_id} indexes no recording longer than "
                               "two windows: build it with `tonearm index` or `tonearm export` from long recordings, "
                               "or add long recordings with POST /v1/items")
        query = np.asarray(embedding, dtype=np.float32).reshape(-1)
        head = getattr(self.bundle, "moment_head", None)  # the bundle's trained head, else the sliding windows
        with index_calls():
            hits = search_sources(query, k, [source for source, _, _ in sources],
                                  allowed=[keep for _, keep, _ in sources], min_score=min_score, head=head)
        results = []
        for hit in hits:
            if sources[hit.source][2] == "bundle":
                item = self.bundle.audio_items[int(hit.key)]
                item_id, uri = str(item["id"]), item.get("uri")
            else:
                item_id, uri = str(hit.key), None
            results.append(MomentResult(id=item_id, start=round(hit.start, 3), end=round(hit.end, 3),
                                        score=hit.score, uri=uri))
        return results

    def moment_sources(
        self, items: ItemOverlay, clip_filter: ClipFilter | None,
    ) -> list[tuple[WindowSource, Allowed | None, Literal["bundle", "items"]]]:
        """The window sources a moment query reads, each with what it may return: the bundle's
        (:attr:`bundle_window_source` when set — Milvus — else ``bundle.moment_windows()``) without the clips the
        filter refuses or an added item hides, and the added items' (:attr:`milvus_item_windows` when set,
        else :meth:`added_window_source`) that are live and pass the filter."""
        sources: list[tuple[WindowSource, Allowed | None, Literal["bundle", "items"]]] = []
        bundle_windows = self.bundle_window_source
        if bundle_windows is None:
            opener = getattr(self.bundle, "moment_windows", None)
            bundle_windows = opener() if callable(opener) else None
        if bundle_windows is not None:
            mask = items.bundle_mask(clip_filter.allowed if clip_filter is not None else None)
            sources.append((bundle_windows, self._bundle_allowed(mask), "bundle"))
        if self.milvus_item_windows is not None:
            sources.append((self.milvus_item_windows, self._engine_items_allowed(clip_filter), "items"))
        else:
            added = self.added_window_source(items)
            if added is not None:
                sources.append((added, _overlay_allowed(items, clip_filter), "items"))
        return sources

    def _bundle_allowed(self, mask: np.ndarray | None) -> Allowed | None:
        """Bundle recordings (rows) a moment query may return: those ``mask`` allows and, with the engine's
        items, that no added item hides (asked of the engine about the candidates only)."""
        engine = self.engine_items
        if mask is None and engine is None:
            return None

        def allowed(keys: Sequence[Key]) -> np.ndarray:
            rows = np.asarray(keys, dtype=np.int64)
            ok = np.ones(len(rows), dtype=bool)
            if mask is not None:
                ok = rows < len(mask)
                ok[ok] = mask[rows[ok]]
            if engine is not None and ok.any():
                ids = {int(r): str(self.bundle.audio_items[int(r)]["id"]) for r in rows[ok]}
                hidden = engine.hidden_among(set(ids.values()))
                if hidden:
                    ok &= np.array([ids.get(int(r)) not in hidden for r in rows], dtype=bool)
            return ok

        return allowed

    def _engine_items_allowed(self, clip_filter: ClipFilter | None) -> Allowed:
        """Added items (ids) in the engine a moment query may return: live ones, passing the filter."""
        engine = self.engine_items

        def allowed(keys: Sequence[Key]) -> np.ndarray:
            ids = [str(key) for key in keys]
            if engine is None:
                return np.zeros(len(ids), dtype=bool)
            live = engine.items(ids)
            ok = np.array([i in live for i in ids], dtype=bool)
            if clip_filter is not None and ok.any():
                found = [i for i in ids if i in live]
                passes = MetadataTable.from_items([live[i].row_metadata() for i in found]).mask(
                    clip_filter.filter, fields=self.catalogue_fields())
                passing = {i for i, p in zip(found, passes, strict=True) if p}
                ok &= np.array([i in passing for i in ids], dtype=bool)
            return ok

        return allowed

    def added_window_source(self, items: ItemOverlay) -> ExactWindows | None:
        """The windows of ``items``' live added items, keyed by item id (None: none has windows): built from the
        windows service.items computed or read when it embedded them (:meth:`keep_item_windows`), once per
        overlay version (by :meth:`refresh_item_windows` when it goes live). Nothing is embedded here; a live item
        whose windows are unknown is a bug, logged."""
        with self._item_windows_lock:
            cached = self._added_source
            if cached is not None and cached[0] is items:
                return cached[1]
            recordings = []
            for row in np.flatnonzero(items.alive):
                item = items.items[int(row)]
                held = self._item_windows.get(item.audio)
                if held is None:
                    if items is self.items and item.audio not in self._windows_missing:
                        self._windows_missing.add(item.audio)
                        log.error("added item %r (audio %s) is live without moment windows: its moments are not "
                                  "searched (service.items computes them when it embeds an item)", item.id, item.audio)
                    continue
                if len(held[0]):
                    recordings.append((item.id, item.audio, *held))
            windowed = tuple((item_id, audio) for item_id, audio, _, _ in recordings)
            if cached is not None and windowed == self._added_windowed:
                source = cached[1]  # the write changed no recording with windows (a short item, metadata)
            else:
                found = ExactWindows.of_recordings([(i, s, v) for i, _, s, v in recordings], int(self.bundle.embed_dim))
                source = found if found.n_recordings else None
            self._added_source, self._added_windowed = (items, source), windowed
            return source

    def keep_item_windows(self, item_id: str, audio: str, spans: np.ndarray, vectors: np.ndarray) -> None:
        """An added item's moment windows (none: (0, 2) spans), computed when it was embedded or read with its
        stored vector (service.items, :mod:`index.items.embeddings`); kept per stored audio."""
        with self._item_windows_lock:
            self._item_windows[audio] = (np.asarray(spans, np.float64), np.asarray(vectors, np.float32))
            self._windows_missing.discard(audio)

    def refresh_item_windows(self, items: ItemOverlay) -> None:
        """``items`` went live (service.items, at the end of a sync): forget the windows of audio none of its live
        items holds (deleted or replaced items) and build its window source now, so that no query pays for it."""
        live = {items.items[int(row)].audio for row in np.flatnonzero(items.alive)}
        with self._item_windows_lock:
            for audio in [a for a in self._item_windows if a not in live]:
                del self._item_windows[audio]
        self.added_window_source(items)

    def moment_scorer(self) -> Literal["head", "windows"]:
        """What scores the moments of :meth:`search_moments`: ``head`` (the bundle's trained moment head) or
        ``windows`` (the sliding-window scorer)."""
        return "head" if getattr(self.bundle, "moment_head", None) is not None else "windows"

    def moment_resolution(self) -> tuple[float, float]:
        """``(window, hop)`` seconds of the moment windows: the model's window, half of it."""
        window = int(self.bundle.clip_samples) / int(self.bundle.sample_rate)  # type: ignore[attr-defined]
        hop = max(1, round(int(self.bundle.clip_samples) * HOP_FRACTION)) / int(self.bundle.sample_rate)  # type: ignore[attr-defined]
        return window, hop

    def clip_vector(self, row: int) -> np.ndarray:
        """One clip's stored vector (the audio index's own, as every search scores it)."""
        gallery = self.gallery()
        if gallery is None:
            raise ServiceError("unknown-target", f"bundle {self.bundle_id} does not expose its clip vectors")
        return gallery[row]

    # ------------------------------------------------------------------ diagnostics

    def gallery(self) -> np.ndarray | None:
        """(N, d) clip embeddings when the bundle exposes them (``audio_embeddings()``), else None."""
        with self._gallery_lock:
            if self._gallery is None:
                with index_calls():
                    self._gallery = clip_embeddings(self.bundle)
            return self._gallery

    def consistency(
        self, captions: Mapping[str, str], *, target_id: str | None = None, k: int = 10
    ) -> ConsistencyDiagnosis:
        """Per-language hits and target ranks of one query group (a caption and its translations)."""
        for lang in captions:
            self.check_language(lang)
        if target_id is not None and target_id not in self.clip_rows:
            raise ServiceError("unknown-target", f"clip {target_id!r} is not in bundle {self.bundle_id}")
        langs = list(captions)
        texts = [self.normalized(captions[lang]) for lang in langs]
        embeddings = self.embed_texts(texts)
        with index_calls():
            scores, rows = self.bundle.search_audio(embeddings, k)
            ranks = self._target_ranks(embeddings, target_id)
        per_language = {
            lang: LanguageDiagnosis(
                hits=self._audio_hits(scores[i], rows[i], min_score=None, include_captions=False),
                target_rank=int(ranks[i]) if ranks is not None else None,
            )
            for i, lang in enumerate(langs)
        }
        table = ranks[None, :].astype(np.float64) if ranks is not None and len(langs) >= 2 else None
        gaps, diss = _gap_dis(dict(zip(langs, embeddings, strict=True)))
        return ConsistencyDiagnosis(
            target_id=target_id,
            per_language=per_language,
            mrv=mean_rank_variance(table) if table is not None else None,
            mean_rank_std=mean_rank_std(table) if table is not None else None,
            gap=gaps,
            dis=diss,
        )

    def heldout_report(self) -> HeldoutReport:
        """The bundle's own held-out report: from its manifest, else computed once from its eval set.

        With the manifest's moment reports: the sliding windows' keys as they are (``moment_R1@0.7_eng`` …) and,
        when the bundle carries a trained head, the head's on the same queries as ``moment_head_*``
        (``moment_head_R1@0.7_eng`` …), so both scorers are side by side as in ``GET /v1/bundles``."""
        manifest = getattr(self.bundle, "manifest", None)
        evaluation = getattr(manifest, "evaluation", None)
        moments = getattr(getattr(manifest, "moments", None), "heldout", None) or {}
        head = getattr(getattr(manifest, "moment_head", None), "heldout", None) or {}
        moments = {**moments, **{f"moment_head_{key.removeprefix('moment_')}": value for key, value in head.items()}}
        if evaluation is not None and evaluation.report:  # with the moment reports' keys (moment_*), if any
            return HeldoutReport({**evaluation.report, **moments}, str(evaluation.convention), "manifest")
        if getattr(getattr(self.bundle, "manifest", None), "eval_set", True) is None:
            raise ServiceError(
                "no-heldout-set",
                f"bundle {self.bundle_id} has no held-out set (built by `tonearm index` from audio files only)",
            )
        with self._gallery_lock:
            if self._heldout is None:
                data = eval_data(self.bundle)
                langs = [lang for lang in self.bundle.languages if np.any(data.lang == lang)]
                with index_calls():
                    report = evaluate(self.bundle, data, langs)
                self._heldout = HeldoutReport(report, METRIC_CONVENTION, "computed")
            return self._heldout

    def _target_ranks(self, embeddings: np.ndarray, target_id: str | None) -> np.ndarray | None:
        """1-based rank of the target among all clips, pessimistic ties (as :mod:`index.metrics.retrieval`).

        Exact from the clip embeddings when available; otherwise from a search over every
        clip (exact for the Flat indices of collections up to 100 k clips)."""
        if target_id is None:
            return None
        row = self.clip_rows[target_id]
        gallery = self.gallery()
        if gallery is not None:
            clips = np.full(embeddings.shape[0], row, dtype=np.int64)
            return t2a_ranks_from_embeddings(embeddings, gallery, clips)
        scores, rows = self.bundle.search_audio(embeddings, len(self.bundle.audio_items))
        ranks = np.empty(embeddings.shape[0], dtype=np.int64)
        for i in range(embeddings.shape[0]):
            found = np.flatnonzero(rows[i] == row)
            target = scores[i, found[0]] if found.size else -np.inf
            ranks[i] = int(np.count_nonzero(scores[i][rows[i] >= 0] >= target))
        return ranks


def _overlay_allowed(items: ItemOverlay, clip_filter: ClipFilter | None) -> Allowed:
    """Added items (ids) of the overlay a moment query may return: live at its version, passing the filter."""
    live = items.alive if clip_filter is None or clip_filter.added is None else items.alive & clip_filter.added
    row_of = items.row_of

    def allowed(keys: Sequence[Key]) -> np.ndarray:
        rows = [row_of.get(str(key)) for key in keys]
        return np.array([row is not None and bool(live[row]) for row in rows], dtype=bool)

    return allowed


def _gap_dis(by_lang: dict[str, np.ndarray]) -> tuple[dict[str, float], dict[str, float]]:
    """Gap/Dis (ATRI Eq. 14–15) of each non-English query embedding against the English one."""
    if ENGLISH not in by_lang:
        return {}, {}
    eng = by_lang[ENGLISH][None, :]
    others = {lang: v[None, :] for lang, v in by_lang.items() if lang != ENGLISH}
    return (
        {lang: gap(eng, v) for lang, v in others.items()},
        {lang: dis(eng, v) for lang, v in others.items()},
    )


def clip_embeddings(bundle: BundleLike) -> np.ndarray | None:
    """All clip vectors (row order = ``audio_items``) if the bundle offers ``audio_embeddings()``."""
    getter = getattr(bundle, "audio_embeddings", None)
    return np.asarray(getter(), dtype=np.float32) if callable(getter) else None
