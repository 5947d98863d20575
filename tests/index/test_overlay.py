"""The overlay of added items (index/overlay.py) against numpy brute force, and what it re-embeds."""

from __future__ import annotations

import numpy as np
import pytest

from index.item_log import ItemLog
from index.overlay import AddedItem, ItemOverlay, build_overlay, merge_top_k
from index.vector_index import FaissVectorIndex


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("k", [1, 5, 40])
def test_bundle_plus_overlay_equals_brute_force_over_the_catalogue(k):
    import faiss

    rng = np.random.default_rng(k)
    clips, added, queries = _unit(rng.normal(size=(30, 8))), _unit(rng.normal(size=(7, 8))), _unit(rng.normal(size=(4, 8)))
    index = faiss.IndexFlatIP(8)
    index.add(clips)
    bundle = FaissVectorIndex(index, {})
    hidden = np.zeros(30, bool)
    hidden[[3, 17]] = True
    items = tuple(AddedItem(f"added-{i}", f"{i}.wav", "", {}, {}) for i in range(7))
    overlay = ItemOverlay(30, 0, 8, version=1, items=items, vectors=added, hidden=hidden)
    clip_allowed = rng.random(30) < 0.6
    added_allowed = rng.random(7) < 0.6
    found = merge_top_k(bundle.search(queries, k, allowed=overlay.bundle_mask(clip_allowed)),
                        overlay.search_items(queries, k, added_allowed), k)

    catalogue = np.concatenate([clips, added])
    passing = np.concatenate([clip_allowed & ~hidden, added_allowed])
    scores = queries @ catalogue.T
    for q in range(4):
        rows = np.flatnonzero(passing)
        order = rows[np.argsort(-scores[q, rows], kind="stable")][:k]
        n = order.size
        np.testing.assert_allclose(found[0][q, :n], scores[q, order], atol=1e-6)
        assert set(found[1][q, :n]) == set(order)
        assert (found[1][q, n:] == -1).all()


def test_build_overlay_embeds_only_new_or_changed_items_and_hides_clips(tmp_path):
    log = ItemLog(tmp_path)
    calls: list[list[str]] = []
    texts: list[list[str]] = []

    def embed_audio(records):
        calls.append([r.id for r in records])
        return _unit(np.array([[len(r.audio or ""), sum(map(ord, r.audio or "")), 1.0] for r in records]))

    def embed_text(batch):
        texts.append(list(batch))
        return _unit(np.array([[len(t), 1.0, 0.0] for t in batch]))

    def build(previous):
        state = log.snapshot()
        return build_overlay(previous, state, clip_ids={"clip-0": 0, "clip-1": 1, "clip-2": 2},
                             embed_audio=embed_audio, embed_text=embed_text, version=state.records)

    log.put("a", b"aaa", audio_format="wav", metadata={"n": 1}, captions={"eng": ["one", "two"]})
    log.put("b", b"bbb", audio_format="wav")
    first = build(ItemOverlay.empty(3, 10, 3))
    assert calls == [["a", "b"]] and texts == [["one", "two"]]
    assert first.size == 2 and first.hidden is None and first.caption_texts == ("one", "two")

    log.put("b", b"bbb", audio_format="wav", metadata={"n": 2})  # same audio: reused
    log.put("c", b"ccc", audio_format="wav")
    log.delete("clip-1")
    log.put("clip-2", b"ddd", audio_format="wav")  # replaces the bundle clip
    second = build(first)
    assert calls[1:] == [["c", "clip-2"]] and texts[1:] == []
    assert [item.id for item in second.items] == ["a", "b", "c", "clip-2"]
    assert second.items[1].metadata == {"n": 2}
    assert second.hidden is not None and second.hidden.tolist() == [False, True, True]
    np.testing.assert_array_equal(second.vectors[:2], first.vectors)
    log.delete("a")
    third = build(second)
    assert [item.id for item in third.items] == ["b", "c", "clip-2"] and third.caption_texts == ()
    assert third.metadata_table().fields() == {"id": "string", "n": "number"}
