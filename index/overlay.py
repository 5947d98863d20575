"""Items added through the API, searchable beside a bundle: an in-memory side index (the overlay).

The catalogue a search sees is the bundle's clips (its FAISS or Milvus index, frozen) plus an
:class:`ItemOverlay`: the items of the write-ahead log (:mod:`index.item_log`) embedded with the
*same bundle's* encoders, their captions, and the bundle rows hidden by a delete (a takedown) or
by an added item of the same id (an upsert replaces the clip). Rows are numbered bundle first:
clip rows ``0 … N-1`` then added items ``N …``; caption rows likewise after the bundle's
``text_items``. A search asks the bundle for its top ``k`` (hidden rows and the filter's failing
rows masked out) and ranks the added items exactly (numpy inner products, as a ``Flat`` index
would), then keeps the best ``k`` of both: the exact top-k over the catalogue whenever the
bundle's index is exact (``Flat``), on FAISS and on Milvus alike.

An overlay is immutable: :func:`build_overlay` makes the next one from the log's state, reusing
the vectors of items whose audio and captions did not change, so only new or changed items are
embedded (the callables it is given run the encoders; this module never loads a model).
The overlay's ``version`` is the number of log records it reflects: the same log prefix gives
the same overlay (same rows) in every replica of one bundle, so it keys cached results.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from index.filters import MetadataTable
from index.item_log import ItemRecord, ItemState
from index.vector_index import exact_subset_search

AudioEmbedder = Callable[[Sequence[ItemRecord]], np.ndarray]
"""(records) → (n, d) L2-normalized audio embeddings of their stored audio."""
TextEmbedder = Callable[[Sequence[str]], np.ndarray]


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
    """One bundle's view of the added items (see the module docstring)."""

    n_clips: int
    n_texts: int
    embed_dim: int
    version: int = 0
    items: tuple[AddedItem, ...] = ()
    vectors: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    caption_items: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Row (in ``items``) of each added caption."""
    caption_langs: tuple[str, ...] = ()
    caption_texts: tuple[str, ...] = ()
    caption_vectors: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    hidden: np.ndarray | None = None
    """Bundle clip rows that no search returns (deleted, or replaced by an added item); None: none."""
    hidden_ids: frozenset[str] = frozenset()
    table: MetadataTable | None = None

    @classmethod
    def empty(cls, n_clips: int, n_texts: int, embed_dim: int) -> ItemOverlay:
        return cls(n_clips, n_texts, embed_dim, vectors=np.zeros((0, embed_dim), np.float32),
                   caption_vectors=np.zeros((0, embed_dim), np.float32))

    @property
    def size(self) -> int:
        return len(self.items)

    @cached_property
    def row_of(self) -> dict[str, int]:
        """Added item id → its row in ``items`` (not the catalogue row: add ``n_clips``)."""
        return {item.id: row for row, item in enumerate(self.items)}

    def item(self, row: int) -> AddedItem:
        """The added item of a catalogue row ``row >= n_clips``."""
        return self.items[row - self.n_clips]

    def metadata_table(self) -> MetadataTable:
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
        """Exact top-``k`` of the added items (catalogue rows, ``n_clips + i``)."""
        mask = np.ones(self.size, bool) if allowed is None else allowed
        scores, rows = exact_subset_search(self.vectors, queries, k, mask)
        return scores, np.where(rows >= 0, rows + self.n_clips, -1)

    def search_captions(
        self, queries: np.ndarray, k: int, lang: str, allowed_items: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-``k`` of the added captions in ``lang`` (caption rows, ``n_texts + j``)."""
        mask = np.array([lg == lang for lg in self.caption_langs], dtype=bool)
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


# ---------------------------------------------------------------------- building


def _same(item: AddedItem, record: ItemRecord) -> bool:
    return item.audio == record.audio and item.captions == record.captions


def build_overlay(
    previous: ItemOverlay,
    state: ItemState,
    *,
    clip_ids: Mapping[str, int],
    embed_audio: AudioEmbedder,
    embed_text: TextEmbedder,
    version: int,
) -> ItemOverlay:
    """The overlay of ``state`` (the log's items and deletes) for one bundle whose clips are
    ``clip_ids`` (id → row): vectors of unchanged items come from ``previous``; new or changed
    items (another audio or other captions) are embedded with ``embed_audio``/``embed_text``."""
    d = previous.embed_dim
    old_rows = previous.row_of
    records = list(state.items.values())
    vectors = np.zeros((len(records), d), np.float32)
    reuse_caps: dict[int, tuple[np.ndarray, list[tuple[str, str]]]] = {}
    to_embed: list[int] = []
    by_audio = {item.audio: previous.vectors[row] for row, item in enumerate(previous.items)}
    for i, record in enumerate(records):
        row = old_rows.get(record.id)
        if record.audio in by_audio:
            vectors[i] = by_audio[record.audio]
        else:
            to_embed.append(i)
        if row is not None and _same(previous.items[row], record):
            at = np.flatnonzero(previous.caption_items == row)
            reuse_caps[i] = (previous.caption_vectors[at],
                             [(previous.caption_langs[j], previous.caption_texts[j]) for j in at])
    if to_embed:
        vectors[to_embed] = np.asarray(embed_audio([records[i] for i in to_embed]), dtype=np.float32)
    cap_items: list[int] = []
    cap_langs: list[str] = []
    cap_texts: list[str] = []
    cap_vectors: list[np.ndarray] = []
    new_texts: list[tuple[int, str, str]] = []
    for i, record in enumerate(records):
        if i in reuse_caps:
            vecs, pairs = reuse_caps[i]
            for vec, (lang, text) in zip(vecs, pairs, strict=True):
                cap_items.append(i)
                cap_langs.append(lang)
                cap_texts.append(text)
                cap_vectors.append(vec)
        else:
            new_texts.extend((i, lang, text) for lang, texts in sorted(record.captions.items()) for text in texts)
    if new_texts:
        encoded = np.asarray(embed_text([t for _, _, t in new_texts]), dtype=np.float32)
        for (i, lang, text), vec in zip(new_texts, encoded, strict=True):
            cap_items.append(i)
            cap_langs.append(lang)
            cap_texts.append(text)
            cap_vectors.append(vec)
    items = tuple(AddedItem(r.id, r.audio or "", r.at, dict(r.metadata), {k: list(v) for k, v in r.captions.items()})
                  for r in records)
    hidden_ids = frozenset(i for i in (*state.deleted, *state.items) if i in clip_ids)
    hidden = None
    if hidden_ids:
        hidden = np.zeros(previous.n_clips, dtype=bool)
        hidden[[clip_ids[i] for i in hidden_ids]] = True
    order = np.argsort(np.asarray(cap_items, dtype=np.int64), kind="stable")  # captions grouped by item
    return ItemOverlay(
        n_clips=previous.n_clips,
        n_texts=previous.n_texts,
        embed_dim=d,
        version=version,
        items=items,
        vectors=vectors,
        caption_items=np.asarray(cap_items, dtype=np.int64)[order],
        caption_langs=tuple(cap_langs[j] for j in order),
        caption_texts=tuple(cap_texts[j] for j in order),
        caption_vectors=(np.stack(cap_vectors)[order] if cap_vectors else np.zeros((0, d), np.float32)),
        hidden=hidden,
        hidden_ids=hidden_ids,
        table=MetadataTable.from_items([item.row_metadata() for item in items]),
    )
