"""Items added through the API, searchable beside a bundle: an in-memory side index (the overlay).

The catalogue a search sees is the bundle's clips (its FAISS or Milvus index, frozen) plus an
:class:`ItemOverlay`: the items of the write-ahead log (:mod:`index.items.log`) embedded with the
*same bundle's* encoders, their captions, and the bundle rows hidden by a delete (a takedown) or
by an added item of the same id (an upsert replaces the clip). Rows are numbered bundle first:
clip rows ``0 … N-1`` then added rows ``N …``; caption rows likewise after the bundle's
``text_items``. A search asks the bundle for its top ``k`` (hidden rows and the filter's failing
rows masked out) and ranks the live added rows exactly (numpy inner products, as a ``Flat`` index
would), then keeps the best ``k`` of both: the exact top-k over the catalogue whenever the
bundle's index is exact (``Flat``), on FAISS and on Milvus alike.

Rows of added items: one per ``put`` record of the log's current file, in the file's order; a
later put or a delete of the same id kills the row (a tombstone: its vector stays, every search
masks it out). So the layout at a version is a function of the log's records only — every
replica of a bundle, whether it followed the log write by write or replayed it at start, has the
same rows at the same version, which is what lets cached results (keyed by the version) be shared.
Dead rows go when the log is compacted (:meth:`index.items.log.ItemLog.compact`): the compacted file
is a new generation, replayed from its start.

An overlay is immutable; :func:`build_overlay` makes the next one. Within a generation it appends
to the previous overlay's buffers (amortized O(1) per record: arrays grow by doubling; a row's
death is stamped with the version that killed it, so an older overlay sharing the buffers still
sees the row alive) — a write costs the same with 100 or 100,000 items. Only new audio and new
caption texts are embedded (the callables it is given run the encoders; this module never loads a
model). What is O(live rows) is done lazily, once per overlay, by the first search that needs it
(the live mask, a filter's metadata columns).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, overload

import numpy as np

from index.engines.filters import Column, MetadataTable, _kind_of, _Vocabulary, item_metadata
from index.engines.vector_index import exact_subset_search
from index.items.log import ItemRecord, LogHistory

AudioEmbedder = Callable[[Sequence[ItemRecord]], np.ndarray]
"""(records) → (n, d) L2-normalized audio embeddings of their stored audio; a row of NaN says the
record's audio cannot be embedded (quarantined): its row is added dead — no search returns it, while
the record still replaces the id's earlier item (or hides the bundle clip of its id)."""
TextEmbedder = Callable[[Sequence[str]], np.ndarray]


ALIVE = np.iinfo(np.int64).max
"""Death stamp of a row no record has killed."""


@dataclass(frozen=True)
class AddedItem:
    id: str
    audio: str
    """File name of the stored audio under the log's ``audio/`` (content-addressed)."""
    added_at: str
    metadata: dict[str, Any]
    captions: dict[str, list[str]]

    def row_metadata(self) -> dict[str, Any]:
        """What a filter sees of this item: its metadata and its id."""
        return {**self.metadata, "id": self.id}


@dataclass(frozen=True)
class ItemOverlay:
    """One bundle's view of the added items at one version of the log (see the module docstring)."""

    n_clips: int
    n_texts: int
    embed_dim: int
    version: int = 0
    items: Sequence[AddedItem] = ()
    """One per added row, dead rows included (:attr:`alive` says which are live)."""
    vectors: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    caption_items: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Row (in ``items``) of each added caption."""
    caption_langs: Sequence[str] = ()
    caption_texts: Sequence[str] = ()
    caption_vectors: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    hidden: np.ndarray | None = None
    """Bundle clip rows that no search returns (deleted, or replaced by an added item); None: none."""
    hidden_ids: frozenset[str] = frozenset()
    table: MetadataTable | None = None
    deaths: np.ndarray | None = None
    """Per added row, the version of the record that killed it (:data:`ALIVE`: none); None: all live."""
    generation: str = ""
    """The log file (:attr:`index.items.log.LogHistory.generation`) the rows were numbered in."""
    ids: Mapping[str, int] | None = field(default=None, compare=False, repr=False)
    caption_lang_codes: np.ndarray | None = field(default=None, compare=False, repr=False)
    lang_codes: Mapping[str, int] | None = field(default=None, compare=False, repr=False)
    store: _Store | None = field(default=None, compare=False, repr=False)
    """The buffers this overlay is a prefix of (:func:`build_overlay` appends the next writes to them)."""

    @classmethod
    def empty(cls, n_clips: int, n_texts: int, embed_dim: int) -> ItemOverlay:
        return cls(n_clips, n_texts, embed_dim, vectors=np.zeros((0, embed_dim), np.float32),
                   caption_vectors=np.zeros((0, embed_dim), np.float32))

    @property
    def size(self) -> int:
        """Added rows, dead ones included (the length of a mask over them)."""
        return len(self.items)

    @cached_property
    def alive(self) -> np.ndarray:
        """Per added row: live at this version."""
        if self.deaths is None:
            return np.ones(self.size, dtype=bool)
        return np.asarray(self.deaths > self.version)

    @cached_property
    def live_size(self) -> int:
        return int(np.count_nonzero(self.alive))

    @cached_property
    def row_of(self) -> Mapping[str, int]:
        """Live added item id → its row in ``items`` (not the catalogue row: add ``n_clips``)."""
        if self.ids is not None:
            return self.ids
        alive = self.alive
        return {item.id: row for row, item in enumerate(self.items) if alive[row]}

    def item(self, row: int) -> AddedItem:
        """The added item of a catalogue row ``row >= n_clips``."""
        return self.items[row - self.n_clips]

    def live_items(self) -> list[AddedItem]:
        alive = self.alive
        return [item for row, item in enumerate(self.items) if alive[row]]

    def metadata_table(self) -> MetadataTable:
        """The rows' metadata as filter columns (one row per added row; a dead row's values may
        pass a filter: :meth:`search_items` masks dead rows whatever the filter says)."""
        if self.table is not None:
            return self.table
        return MetadataTable.from_items([item.row_metadata() for item in self.items])

    # ------------------------------------------------------------------ search

    def bundle_mask(self, allowed: np.ndarray | None) -> np.ndarray | None:
        """The mask to pass to the bundle's search: ``allowed`` (a filter's) without the hidden rows."""
        if self.hidden is None:
            return allowed
        return ~self.hidden if allowed is None else allowed & ~self.hidden

    def search_items(self, queries: np.ndarray, k: int, allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-``k`` of the live added rows ``allowed`` passes (catalogue rows, ``n_clips + i``)."""
        mask = self.alive if allowed is None else np.asarray(allowed, dtype=bool) & self.alive
        scores, rows = exact_subset_search(self.vectors, queries, k, mask)
        return scores, np.where(rows >= 0, rows + self.n_clips, -1)

    @cached_property
    def caption_alive(self) -> np.ndarray:
        if not len(self.caption_items):
            return np.zeros(0, dtype=bool)
        return self.alive[self.caption_items]

    def _caption_lang_mask(self, lang: str) -> np.ndarray:
        if self.caption_lang_codes is not None and self.lang_codes is not None:
            code = self.lang_codes.get(lang)
            if code is None:
                return np.zeros(len(self.caption_lang_codes), dtype=bool)
            return np.asarray(self.caption_lang_codes == code)
        return np.array([lg == lang for lg in self.caption_langs], dtype=bool)

    def search_captions(
        self, queries: np.ndarray, k: int, lang: str, allowed_items: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-``k`` of the live added captions in ``lang`` (caption rows, ``n_texts + j``)."""
        mask = self._caption_lang_mask(lang) & self.caption_alive
        if allowed_items is not None and mask.size:
            mask &= allowed_items[self.caption_items]
        scores, rows = exact_subset_search(self.caption_vectors, queries, k, mask)
        return scores, np.where(rows >= 0, rows + self.n_texts, -1)


def merge_top_k(
    first: tuple[np.ndarray, np.ndarray], second: tuple[np.ndarray, np.ndarray], k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The best ``k`` of two top-k lists per query (rows -1 / scores -inf past the end), best first;
    ties keep ``first``'s hits first."""
    scores = np.concatenate([first[0], second[0]], axis=1).astype(np.float32)
    rows = np.concatenate([first[1], second[1]], axis=1)
    scores = np.where(rows >= 0, scores, -np.inf)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    out_scores = np.take_along_axis(scores, order, axis=1)
    out_rows = np.take_along_axis(rows, order, axis=1)
    if out_rows.shape[1] < k:
        pad = k - out_rows.shape[1]
        out_scores = np.pad(out_scores, ((0, 0), (0, pad)), constant_values=-np.inf)
        out_rows = np.pad(out_rows, ((0, 0), (0, pad)), constant_values=-1)
    return out_scores, out_rows


# ---------------------------------------------------------------------- the shared buffers


class _Growable:
    """A numpy array whose rows are appended (capacity doubles) or set once; ``view(n)`` is a prefix.
    A view keeps the buffer it was taken from: later appends never change its rows (a grown buffer
    is a copy), so an overlay holding views is immutable in everything but :attr:`ItemOverlay.deaths`,
    whose later stamps are all newer than the overlay's version."""

    def __init__(self, tail: tuple[int, ...], dtype: Any, fill: Any) -> None:
        self.buf = np.full((16, *tail), fill, dtype=dtype)
        self.n = 0
        self.fill = fill

    def _reserve(self, n: int) -> None:
        if n > len(self.buf):
            grown = np.full((max(n, 2 * len(self.buf)), *self.buf.shape[1:]), self.fill, dtype=self.buf.dtype)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown

    def append(self, rows: np.ndarray) -> None:
        self._reserve(self.n + len(rows))
        self.buf[self.n : self.n + len(rows)] = rows
        self.n += len(rows)

    def set(self, row: int, value: Any) -> None:
        self._reserve(row + 1)
        self.buf[row] = value
        self.n = max(self.n, row + 1)

    def view(self, n: int) -> np.ndarray:
        buf = self.buf  # one read: a writer may swap in a grown copy meanwhile (same rows below n)
        if len(buf) >= n:
            return buf[:n]
        return np.concatenate([buf, np.full((n - len(buf), *buf.shape[1:]), self.fill, dtype=buf.dtype)])


class _Prefix(Sequence[Any]):
    """The first ``n`` entries of a list that only grows (an overlay's items, caption texts)."""

    def __init__(self, data: list[Any], n: int) -> None:
        self._data, self._n = data, n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self._data[i] for i in range(*index.indices(self._n))]
        if index < 0:
            index += self._n
        if not 0 <= index < self._n:
            raise IndexError(index)
        return self._data[index]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


class _LiveIds(Mapping[str, int]):
    """Live added item id → row, at one overlay's version (the store's rows of each id, newest first)."""

    def __init__(self, rows_of_id: dict[str, list[int]], deaths: np.ndarray, version: int) -> None:
        self._rows_of_id, self._deaths, self._version = rows_of_id, deaths, version

    def __getitem__(self, item_id: str) -> int:
        for row in reversed(self._rows_of_id.get(item_id, ())):
            if row < len(self._deaths):  # the newest row this overlay has; older ones died by it
                if self._deaths[row] > self._version:
                    return row
                break
        raise KeyError(item_id)

    def __iter__(self) -> Iterator[str]:
        alive = np.flatnonzero(self._deaths > self._version)
        owner = {row: item_id for item_id, rows in list(self._rows_of_id.items()) for row in rows}
        return iter([owner[int(row)] for row in alive])

    def __len__(self) -> int:
        return int(np.count_nonzero(self._deaths > self._version))


class _KindColumn:
    """One metadata field's values of one kind over a store's rows, as :class:`index.engines.filters.Column`
    holds them (a row whose value has another kind, or none, is missing here)."""

    FILL = {"number": np.nan, "boolean": -1, "string": -1}
    DTYPE = {"number": np.float64, "boolean": np.int8, "string": np.int64}

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.vocabulary = _Vocabulary() if kind in ("string", "strings") else None
        if kind == "strings":
            self.values = _Growable((), np.int64, -1)  # the code of each (row, code) pair
            self.pair_rows: _Growable | None = _Growable((), np.int64, -1)
        else:
            self.values = _Growable((), self.DTYPE[kind], self.FILL[kind])
            self.pair_rows = None

    def put(self, row: int, value: Any) -> None:
        if self.kind == "strings":
            assert self.vocabulary is not None and self.pair_rows is not None
            codes = sorted({self.vocabulary.code(v) for v in value})  # a repeated tag counts once
            self.values.append(np.asarray(codes, dtype=np.int64))
            self.pair_rows.append(np.full(len(codes), row, dtype=np.int64))
        elif self.kind == "string":
            assert self.vocabulary is not None
            self.values.set(row, self.vocabulary.code(value))
        else:
            self.values.set(row, float(value) if self.kind == "number" else int(value))

    def column(self, n: int) -> Column:
        if self.pair_rows is None:
            return Column(self.kind, self.values.view(n), self.vocabulary)  # type: ignore[arg-type]
        rows = self.pair_rows.view(self.pair_rows.n)
        count = int(np.searchsorted(rows, n, side="left"))  # pairs are appended in row order
        return Column("strings", self.values.view(count), self.vocabulary, rows[:count])


class _SnapshotTable(MetadataTable):
    """The metadata columns of an overlay's rows (the first ``n`` of its store), made on first use."""

    def __init__(self, store: _Store, n: int, kinds: Mapping[str, str]) -> None:
        self.n_rows = n
        self._store, self._kinds = store, kinds
        self._columns: dict[str, Column] | None = None

    @property
    def columns(self) -> dict[str, Column]:  # type: ignore[override]
        if self._columns is None:
            fields = self._store.fields
            self._columns = {name: Column("mixed", np.zeros(0)) if kind == "mixed"
                             else fields[name].by_kind[kind].column(self.n_rows)
                             for name, kind in self._kinds.items()}
        return self._columns

    @columns.setter
    def columns(self, value: dict[str, Column]) -> None:
        self._columns = value

    def fields(self) -> dict[str, str]:
        return dict(sorted(self._kinds.items()))


class _Field:
    def __init__(self) -> None:
        self.by_kind: dict[str, _KindColumn] = {}
        self.live: dict[str, int] = {}
        """Live rows holding a value of each kind (the field's kind is what live rows hold)."""


class _Store:
    """The append-only buffers of one chain of overlays (one bundle, one log generation)."""

    def __init__(self, dim: int, generation: str, clip_ids: Mapping[str, int], n_clips: int) -> None:
        self.dim, self.generation, self.clip_ids, self.n_clips = dim, generation, clip_ids, n_clips
        self.vectors = _Growable((dim,), np.float32, 0.0)
        self.deaths = _Growable((), np.int64, ALIVE)
        self.items: list[AddedItem] = []
        self.rows_of_id: dict[str, list[int]] = {}
        self.by_audio: dict[str, int] = {}  # stored audio name → a row holding its vector
        self.caption_items = _Growable((), np.int64, -1)
        self.caption_codes = _Growable((), np.int32, -1)
        self.caption_vectors = _Growable((dim,), np.float32, 0.0)
        self.caption_langs: list[str] = []
        self.caption_texts: list[str] = []
        self.lang_codes: dict[str, int] = {}
        self.by_text: dict[str, int] = {}  # caption text → a caption row holding its vector
        self.fields: dict[str, _Field] = {}
        self.kinds: dict[str, str] = {}  # live fields → kind ("mixed": several); replaced, never mutated
        self.hidden_ids: frozenset[str] = frozenset()
        self.hidden: np.ndarray | None = None
        self.head = -1
        """Version of the newest overlay made from this store: only it may be extended."""

    # the vectors a batch needs, found or embedded before anything changes (an embedding that fails
    # leaves the store as it was)
    def _vectors_for(
        self, records: Sequence[ItemRecord], embed_audio: AudioEmbedder, embed_text: TextEmbedder,
        reuse_audio: Mapping[str, np.ndarray], reuse_text: Mapping[str, np.ndarray],
    ) -> tuple[set[int], dict[str, np.ndarray], dict[str, np.ndarray]]:
        last = {record.id: i for i, record in enumerate(records)}
        survivors = {i for i, record in enumerate(records) if record.op == "put" and last[record.id] == i}
        audio: dict[str, np.ndarray] = {}
        texts: dict[str, np.ndarray] = {}
        embed: dict[str, ItemRecord] = {}
        new_texts: dict[str, None] = {}
        for i in sorted(survivors):
            record = records[i]
            name = record.audio or ""
            if name in self.by_audio:
                audio[name] = self.vectors.buf[self.by_audio[name]]
            elif name in reuse_audio:
                audio[name] = reuse_audio[name]
            else:
                embed.setdefault(name, record)
            for text in (t for ts in record.captions.values() for t in ts):
                if text in self.by_text:
                    texts[text] = self.caption_vectors.buf[self.by_text[text]]
                elif text in reuse_text:
                    texts[text] = reuse_text[text]
                else:
                    new_texts[text] = None
        if embed:
            encoded = np.asarray(embed_audio(list(embed.values())), dtype=np.float32)
            audio.update(zip(embed, encoded, strict=True))
        if new_texts:
            encoded = np.asarray(embed_text(list(new_texts)), dtype=np.float32)
            texts.update(zip(new_texts, encoded, strict=True))
        return survivors, audio, texts

    def apply(
        self, records: Sequence[ItemRecord], first_version: int, *, embed_audio: AudioEmbedder,
        embed_text: TextEmbedder, reuse_audio: Mapping[str, np.ndarray] | None = None,
        reuse_text: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Apply ``records`` (the first at ``first_version``): a put appends a row (and its captions)
        and kills the id's live row; a delete kills it. A row that dies within the batch gets no
        embedding (a zero vector: no search sees it)."""
        survivors, audio, texts = self._vectors_for(records, embed_audio, embed_text, reuse_audio or {},
                                                    reuse_text or {})
        zero = np.zeros(self.dim, np.float32)
        changed_fields: set[str] = set()
        hidden_ids = set()
        for i, record in enumerate(records):
            version = first_version + i
            old = self._live_row(record.id)
            if old is not None:
                self._kill(old, version, changed_fields)
            if record.id in self.clip_ids and record.id not in self.hidden_ids:
                hidden_ids.add(record.id)
            if record.op != "put":
                continue
            live = i in survivors
            row = len(self.items)
            item = AddedItem(record.id, record.audio or "", record.at, dict(record.metadata),
                             {k: list(v) for k, v in record.captions.items()})
            quarantined = live and bool(np.isnan(audio[item.audio]).any())
            live = live and not quarantined
            self.vectors.append((audio[item.audio] if live else zero)[None, :])
            if live and item.audio not in self.by_audio:
                self.by_audio[item.audio] = row
            self.deaths.append(np.array([version if quarantined else ALIVE], dtype=np.int64))
            for lang, lang_texts in sorted(item.captions.items()):
                code = self.lang_codes.setdefault(lang, len(self.lang_codes))
                for text in lang_texts:
                    j = len(self.caption_texts)
                    self.caption_items.append(np.array([row], dtype=np.int64))
                    self.caption_codes.append(np.array([code], dtype=np.int32))
                    self.caption_vectors.append((texts[text] if live else zero)[None, :])
                    if live and text not in self.by_text:
                        self.by_text[text] = j
                    self.caption_langs.append(lang)
                    self.caption_texts.append(text)
            for key, value in () if quarantined else _filterable(item).items():
                kind = _kind_of(value)
                if kind is None:
                    continue
                entry = self.fields.setdefault(key, _Field())
                column = entry.by_kind.get(kind)
                if column is None:
                    column = entry.by_kind[kind] = _KindColumn(kind)
                column.put(row, value)
                entry.live[kind] = entry.live.get(kind, 0) + 1
                if entry.live[kind] == 1:
                    changed_fields.add(key)
            self.items.append(item)  # last: a row is complete before anything counts it
            self.rows_of_id.setdefault(record.id, []).append(row)
        if hidden_ids:
            self.hidden_ids = self.hidden_ids | hidden_ids
            hidden = np.zeros(self.n_clips, dtype=bool) if self.hidden is None else self.hidden.copy()
            hidden[[self.clip_ids[i] for i in hidden_ids]] = True
            self.hidden = hidden
        if changed_fields:
            kinds = dict(self.kinds)
            for key in changed_fields:
                held = sorted(kind for kind, count in self.fields[key].live.items() if count > 0)
                if not held:
                    kinds.pop(key, None)
                else:
                    kinds[key] = held[0] if len(held) == 1 else "mixed"
            self.kinds = kinds

    def _live_row(self, item_id: str) -> int | None:
        rows = self.rows_of_id.get(item_id)
        if rows and self.deaths.buf[rows[-1]] == ALIVE:
            return rows[-1]
        return None

    def _kill(self, row: int, version: int, changed_fields: set[str]) -> None:
        self.deaths.buf[row] = version
        for key, value in _filterable(self.items[row]).items():
            kind = _kind_of(value)
            if kind is None:
                continue
            live = self.fields[key].live
            live[kind] -= 1
            if live[kind] == 0:
                changed_fields.add(key)

    def overlay(self, version: int, n_texts: int) -> ItemOverlay:
        n, m = len(self.items), len(self.caption_texts)
        self.head = version
        deaths = self.deaths.view(n)
        return ItemOverlay(
            n_clips=self.n_clips, n_texts=n_texts, embed_dim=self.dim, version=version,
            items=_Prefix(self.items, n), vectors=self.vectors.view(n),
            caption_items=self.caption_items.view(m), caption_langs=_Prefix(self.caption_langs, m),
            caption_texts=_Prefix(self.caption_texts, m), caption_vectors=self.caption_vectors.view(m),
            hidden=self.hidden, hidden_ids=self.hidden_ids, table=_SnapshotTable(self, n, self.kinds),
            deaths=deaths, generation=self.generation, ids=_LiveIds(self.rows_of_id, deaths, version),
            caption_lang_codes=self.caption_codes.view(m), lang_codes=self.lang_codes, store=self,
        )


def _filterable(item: AddedItem) -> dict[str, Any]:
    """What :meth:`index.engines.filters.MetadataTable.from_items` would make of the item's row."""
    return item_metadata(item.row_metadata())


# ---------------------------------------------------------------------- building


def build_overlay(
    previous: ItemOverlay,
    history: LogHistory,
    *,
    clip_ids: Mapping[str, int],
    embed_audio: AudioEmbedder,
    embed_text: TextEmbedder,
) -> ItemOverlay:
    """The overlay of the log at ``history.version`` for the bundle of ``previous`` (whose clips are
    ``clip_ids``: id → row). When ``previous`` is the newest overlay of its buffers and of the same
    log generation, the records since its version are appended (O(records)); otherwise the
    generation is replayed into new buffers, with the vectors of ``previous``'s live items and
    captions reused by stored audio and by text. New audio and texts go to ``embed_audio`` /
    ``embed_text``; if they raise, ``previous`` is untouched."""
    if previous.version == history.version and previous.generation == history.generation:
        return previous
    store = previous.store
    records = history.since(previous.version) if previous.generation == history.generation else None
    if store is not None and records is not None and store.head == previous.version:
        store.apply(records, previous.version + 1, embed_audio=embed_audio, embed_text=embed_text)
        return store.overlay(history.version, previous.n_texts)
    alive = previous.alive
    reuse_audio = {item.audio: previous.vectors[row] for row, item in enumerate(previous.items) if alive[row]}
    caption_alive = previous.caption_alive if len(previous.caption_items) else np.zeros(0, bool)
    reuse_text = {text: previous.caption_vectors[j] for j, text in enumerate(previous.caption_texts)
                  if caption_alive[j]}
    store = _Store(previous.embed_dim, history.generation, clip_ids, previous.n_clips)
    store.apply(history.all(), history.base + 1, embed_audio=embed_audio, embed_text=embed_text,
                reuse_audio=reuse_audio, reuse_text=reuse_text)
    return store.overlay(history.version, previous.n_texts)
