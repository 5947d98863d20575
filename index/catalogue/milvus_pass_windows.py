"""Moment windows of `tonearm index --ray --milvus-uri` (issue 54, part 5): the Ray actors write the long files'
windows straight into the bundle's Milvus windows collections, as they write the clip vectors, and the driver
holds none of them (docs/deploy.md, "Publishing straight to Milvus").

The collections, keys and registry entry are those of `tonearm bundle publish`
(:func:`index.engines.milvus_windows.publish_windows`), so a replica serving the bundle from Milvus reads them as
it reads a published bundle's (:func:`index.engines.milvus_windows.published_windows`):

* :func:`begin_windows` (driver, before the pass) creates ``<prefix>_<bundle>_<hash>_windows`` and its ``_parts``
  empty, with a FLAT index: how many windows the pass makes is known only after it.
* :class:`MilvusWindowSink` (each Ray actor) writes the windows of every long file it decodes, from the decode of
  its clip vector, keyed by the file's row among the files that passed the format check (the clip collection's
  key) — by upsert, so a batch Ray retries after a worker died leaves one copy; the actor returns only how many
  windows it wrote per file.
* :func:`finish_windows` (driver, after the pass, before the registry row): a long file after one that failed to
  decode on a worker (a gap of the clip collection, normally none) has its windows moved to its audio-index row
  (read back and written again, a bounded batch at a time: stored as float16 in the packed rows, they are then
  float16-rounded in the searched collection too, a cosine within ~1e-3); flushes; checks the collection holds exactly the windows the
  actors counted; when they are more than :data:`index.engines.milvus_windows.FLAT_UP_TO` replaces the FLAT index
  by HNSW (:func:`index.engines.milvus_windows.window_index_type`: released, index dropped, HNSW created and
  built over the sealed segments) — the index type `bundle publish` gives the same windows; waits for the build;
  measures recall@10 of the best recordings and returns the registry's ``windows`` entry.

The recall is measured as `bundle publish` measures it — the windows at evenly spaced positions (up to 256) as
queries, exact search over every window — but the exact side reads the windows back from Milvus a bounded
chunk at a time (:data:`index.engines.milvus_windows.PUBLISH_BATCH` windows), holding per query only the best
ten recordings so far: it reads every window once, and ranks the stored float16 copies, where `bundle publish`
ranks the bundle's float32 files. ``build_s`` is the time after the pass (moves, flush, index build, load); the
windows themselves are written during the pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from index.bundle.format import MomentsInfo
from index.catalogue.pass_windows import WindowPlan
from index.engines.milvus_index import (
    RECALL_QUERIES,
    MilvusTarget,
    _index_params,
    _mapped,
    _sample_rows,
)
from index.engines.milvus_windows import (
    PUBLISH_BATCH,
    MilvusWindows,
    bundle_windows_name,
    window_index_type,
    windows_build_params,
)
from index.errors import IndexBackendError
from index.moments.windows import SPANS_FILE, WINDOWS_FILE

log = logging.getLogger(__name__)

CHUNK_KEYS = 256
"""Most recordings one read or move of :func:`finish_windows` handles (the keys of one filter expression)."""


@dataclass(frozen=True)
class MilvusWindowSink:
    """A Ray actor's :data:`index.catalogue.ray_embed.WindowSink`: writes ``[(row, spans, vectors), ...]`` into the
    windows collections of :func:`begin_windows` (picklable: a target and a name; the actor connects on first
    use). By upsert (:meth:`MilvusWindows.put` without ``fresh``): a batch written twice leaves one copy."""

    target: MilvusTarget
    collection: str
    dim: int

    def __call__(self, recordings: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
        _store(self.target, self.collection, self.dim).put(recordings)

    @classmethod
    def of(cls, store: MilvusWindows) -> MilvusWindowSink:
        return cls(store.target, store.collection, store.dim)


def _store(target: MilvusTarget, name: str, dim: int, index_type: str = "FLAT",
           build: dict[str, int] | None = None) -> MilvusWindows:
    """The windows collections ``name`` as the pass writes and finishes them (keys: rows; no flush per write)."""
    return MilvusWindows(target, name, dim=dim, index_type=index_type,
                         build=build if build is not None else windows_build_params(index_type, 0),
                         consistency="Strong", int_keys=True, flush=False)


def begin_windows(target: MilvusTarget, bundle_id: str, *, dim: int) -> MilvusWindows:
    """(Re)create the bundle's windows collections empty, FLAT (a collection left by an interrupted run goes)."""
    return _store(target, bundle_windows_name(target, bundle_id), dim).create()


def finish_windows(store: MilvusWindows, counts: Sequence[int], kept: Sequence[int], *,
                   progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """After the pass (module docstring): ``counts[i]`` the windows the actors wrote under key ``i`` (a file's row
    among those that passed the format check), ``kept`` those rows of the files that decoded, in the bundle's
    order (audio-index row ``r`` is ``kept[r]``). Returns ``{"windows": entry}`` as
    :func:`index.engines.milvus_windows.publish_windows` does, or ``{}`` (collections dropped) when no file was long."""
    began = time.monotonic()
    target = store.target
    long = [(row, key, int(counts[key])) for row, key in enumerate(kept) if counts[key]]
    if not long:
        store.drop()
        return {}
    n_windows = sum(n for _, _, n in long)
    moved = [(key, row, n) for row, key, n in long if key != row]
    for first, last in _chunks([n for _, _, n in moved]):
        _move(store, moved[first:last])
    if moved:
        log.info("windows of %d long files moved to their audio-index rows (files before them failed to decode)",
                 len(moved))
    with _mapped(f"flushing {store.collection}", target):
        for name in (store.collection, store.parts):
            target.call("flush", name, bulk=True)
    held = store.count()
    if held != n_windows:
        raise IndexBackendError(f"{store.collection} holds {held} windows after the writers finished, expected "
                                f"{n_windows}; index the audio again")
    index_type = window_index_type(n_windows)
    build = windows_build_params(index_type, n_windows)
    if index_type != store.index_type:
        store = _reindexed(store, index_type, build)
    store.wait_indexed(progress=progress)  # served from the index at once, as a published bundle's
    store.load()
    built_s = time.monotonic() - began
    recall = recall_at_10(store, [(row, n) for row, _, n in long])
    store.release()
    return {"windows": {"n_windows": n_windows, "n_recordings": len(long), "dim": store.dim,
                        "index_type": index_type, "build_params": build, "recall_at_10": recall,
                        "build_s": round(built_s, 1)}}


def _chunks(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``[first, last)`` ranges of consecutive recordings of ``sizes`` windows, each at most
    :data:`PUBLISH_BATCH` windows (or one recording) and :data:`CHUNK_KEYS` recordings."""
    ranges: list[tuple[int, int]] = []
    first = 0
    while first < len(sizes):
        last, held = first, 0
        while last < len(sizes) and last - first < CHUNK_KEYS and (last == first or held + sizes[last] <= PUBLISH_BATCH):
            held += int(sizes[last])
            last += 1
        ranges.append((first, last))
        first = last
    return ranges


def _move(store: MilvusWindows, moves: Sequence[tuple[int, int, int]]) -> None:
    """Rewrite the windows of ``moves`` (``(key, new key, windows)``, ascending, each new key below its key) under
    their new keys: read, delete the old keys, write the new ones. A new key may be an old key of the same batch
    (deleted first), never one of a later batch (all above the batch's keys), and an earlier batch's new keys are
    below this batch's keys, so batches in ascending order never overwrite what is still to move."""
    read = store.windows_of([key for key, _, _ in moves])
    store.delete([key for key, _, _ in moves])
    store.put([(row, spans, vectors) for (_, row, _), (spans, vectors) in zip(moves, read, strict=True)])


def _reindexed(store: MilvusWindows, index_type: str, build: dict[str, int]) -> MilvusWindows:
    """``store``'s collection with its vector index replaced by ``index_type`` (built from the sealed segments)."""
    target = store.target
    with _mapped(f"indexing {store.collection} as {index_type}", target):
        target.call("release_collection", store.collection, bulk=True)
        for name in target.call("list_indexes", store.collection, bulk=True):
            target.call("drop_index", store.collection, name, bulk=True)
        target.call("create_index", store.collection, _index_params(target.client(), index_type, build), bulk=True)
    return _store(target, store.collection, store.dim, index_type, build)


def recall_at_10(store: MilvusWindows, recordings: Sequence[tuple[int, int]]) -> float:
    """Recall@10 of ``store.best_recordings`` against exact search over every window of ``recordings`` (``(key,
    windows)`` in key order: the windows of a bundle, ordered as its files), the loaded ``store`` read back a
    bounded chunk at a time (module docstring). Queries: the windows at :func:`_sample_rows` positions, up to
    :data:`RECALL_QUERIES`, as `bundle publish` picks them."""
    keys = np.array([key for key, _ in recordings], np.int64)
    sizes = np.array([n for _, n in recordings], np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    picks = _sample_rows(int(sizes.sum()))[:RECALL_QUERIES]
    owner = np.searchsorted(starts, picks, side="right") - 1
    wanted = sorted({int(keys[i]) for i in owner})
    read = dict(zip(wanted, (vectors for _, vectors in store.windows_of(wanted)), strict=True))
    queries = np.stack([read[int(keys[i])][p - starts[i]] for i, p in zip(owner, picks, strict=True)])
    k = min(10, len(recordings))
    top_scores = np.zeros((len(queries), 0), np.float32)
    top_keys = np.zeros((len(queries), 0), np.int64)
    for first, last in _chunks(sizes.tolist()):
        chunk = keys[first:last]
        best = np.stack([(vectors @ queries.T).max(axis=0) for _, vectors in store.windows_of(chunk.tolist())], 1)
        scores = np.concatenate([top_scores, best], axis=1)
        ids = np.concatenate([top_keys, np.broadcast_to(chunk, best.shape)], axis=1)
        order = np.lexsort((ids, -scores), axis=1)[:, :k]  # ties by key, as exact_best_recordings
        top_scores, top_keys = np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)
    hits = 0
    for query, expected in zip(queries, top_keys, strict=True):
        found = {int(key) for key, _ in store.best_recordings(query, 10)}
        hits += len(found & set(expected.tolist()))
    return round(hits / max(top_keys.size, 1), 4)


def moments_info(plan: WindowPlan, entry: dict[str, Any]) -> MomentsInfo | None:
    """The manifest's ``moments`` entry of a bundle whose windows are only in Milvus (``entry``: what
    :func:`finish_windows` returned): that of the same windows written into a bundle
    (:func:`index.moments.windows.write_bundle_windows`), naming files the bundle does not hold — a bundle served
    from Milvus may lack them (:func:`index.runtime.loader._files_to_verify`; docs/service.md "Moments on the
    Milvus backend")."""
    windows = entry.get("windows")
    if not windows:
        return None
    return MomentsInfo(windows_file=WINDOWS_FILE, spans_file=SPANS_FILE,
                       window_seconds=plan.window_samples / plan.sample_rate,
                       hop_seconds=plan.hop_samples / plan.sample_rate, n_windows=int(windows["n_windows"]),
                       n_recordings=int(windows["n_recordings"]))
