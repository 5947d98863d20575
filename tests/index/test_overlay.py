"""The overlay of added items (index/items/overlay.py) against numpy brute force, and what it re-embeds."""

from __future__ import annotations

import copy

import faiss
import numpy as np
import pytest

from index.engines.vector_index import FaissVectorIndex
from index.items.log import ItemLog
from index.items.overlay import AddedItem, ItemOverlay, build_overlay, merge_top_k
from tests.index.filter_reference import passes


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("k", [1, 5, 40])
def test_bundle_plus_overlay_equals_brute_force_over_the_catalogue(k):
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
        return build_overlay(previous, log.history(), clip_ids={"clip-0": 0, "clip-1": 1, "clip-2": 2},
                             embed_audio=embed_audio, embed_text=embed_text)

    def live_ids(overlay):
        return [item.id for item in overlay.live_items()]

    log.put("a", b"aaa", audio_format="wav", metadata={"n": 1}, captions={"eng": ["one", "two"]})
    log.put("b", b"bbb", audio_format="wav")
    first = build(ItemOverlay.empty(3, 10, 3))
    assert calls == [["a", "b"]] and texts == [["one", "two"]]
    assert first.size == 2 and first.hidden is None and tuple(first.caption_texts) == ("one", "two")

    log.put("b", b"bbb", audio_format="wav", metadata={"n": 2})  # same audio: reused
    log.put("c", b"ccc", audio_format="wav")
    log.delete("clip-1")
    log.put("clip-2", b"ddd", audio_format="wav")  # replaces the bundle clip
    second = build(first)
    assert calls[1:] == [["c", "clip-2"]] and texts[1:] == []
    assert live_ids(second) == ["a", "b", "c", "clip-2"]  # in the order of their latest put
    assert second.items[second.row_of["b"]].metadata == {"n": 2}
    assert second.hidden is not None and second.hidden.tolist() == [False, True, True]
    np.testing.assert_array_equal(second.vectors[:2], first.vectors)
    np.testing.assert_array_equal(second.vectors[second.row_of["b"]], first.vectors[first.row_of["b"]])
    assert live_ids(first) == ["a", "b"] and first.row_of["b"] == 1  # the older overlay is unchanged
    log.delete("a")
    third = build(second)
    assert live_ids(third) == ["b", "c", "clip-2"] and "a" not in third.row_of
    assert not third.caption_alive.any()  # a's captions died with it
    assert third.metadata_table().fields() == {"id": "string", "n": "number"}
    assert second.row_of["a"] == 0 and second.caption_alive.all()


# ---------------------------------------------------------------------- random sequences against brute force

DIM = 8
CLIP_IDS = [f"clip-{i}" for i in range(12)]
LICENSES = ("cc0", "by", "sa")
TAGS = ("door", "rain", "wood", "bird")
TEXTS = {"eng": ("a door", "rain falls", "birds sing"), "fra": ("une porte", "la pluie")}
FILTERS = [
    None,
    {"license": "cc0"},
    {"duration": {"lte": 5}},
    {"tags": {"any": ["door", "rain"]}},
    {"tags": {"all": ["door", "wood"]}},
    {"not": {"license": "by"}},
    {"or": [{"flag": True}, {"duration": {"gt": 8}}]},
    {"and": [{"license": {"in": ["cc0", "sa"]}}, {"not": {"tags": "bird"}}]},
    {"id": {"in": ["item-1", "item-2", "item-3", "clip-4", "item-7"]}},
    {"license": {"ne": "sa"}},
    {"rating": {"gte": 3}},  # only some added items have it: an unknown field when no live one does
    {"mood": "calm"},  # a string on some items, a number on others: not filterable while both live
]

FIELD_KINDS = {"license": "string", "duration": "number", "tags": "strings", "flag": "boolean", "id": "string",
               "rating": "number", "mood": "string"}
"""The kind each filter above compares its field with."""


def _vector(seed: int) -> np.ndarray:
    return _unit(np.random.default_rng(seed).normal(size=(1, DIM)))[0]


def _text_vector(text: str) -> np.ndarray:
    return _vector(sum(map(ord, text)) * 7919)


def _reference_kind(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return "strings" if isinstance(value, list) else "string"


def _random_metadata(rng: np.random.Generator) -> dict:
    meta = {"license": str(rng.choice(LICENSES)), "duration": float(rng.integers(1, 11)),
            "tags": sorted({str(t) for t in rng.choice(TAGS, size=int(rng.integers(0, 3)))}),
            "flag": bool(rng.random() < 0.3)}
    if rng.random() < 0.3:
        meta["rating"] = int(rng.integers(1, 6))
    if rng.random() < 0.15:
        meta["mood"] = "calm" if rng.random() < 0.5 else 2
    return meta


def _check_against_brute_force(overlay, clips, clip_meta, live, rng) -> None:
    """The bundle (Flat) merged with the overlay, for every filter and k, against numpy over the live
    catalogue: clips not hidden by a put or delete of their id, and the latest put of each added id."""
    from index.engines.filters import FilterError, MetadataTable, merged_fields, parse_filter

    index = faiss.IndexFlatIP(DIM)
    index.add(clips)
    bundle = FaissVectorIndex(index, {})
    clip_table = MetadataTable.from_items([{**m, "id": i} for i, m in zip(CLIP_IDS, clip_meta, strict=True)])
    catalogue = {cid: (clips[row], {**clip_meta[row], "id": cid}) for row, cid in enumerate(CLIP_IDS)
                 if cid not in live["touched"]}
    catalogue.update({item_id: (_vector(seed), {**meta, "id": item_id}) for item_id, (seed, meta, _) in live["items"].items()})
    kinds: dict[str, set[str]] = {}
    for _, meta in catalogue.values():
        for key, value in meta.items():
            kinds.setdefault(key, set()).add(_reference_kind(value))
    for key, value in clip_meta[0].items():  # hidden clips still define the bundle's fields
        kinds.setdefault(key, set()).add(_reference_kind(value))
    kinds.setdefault("id", set()).add("string")
    queries = _unit(rng.normal(size=(3, DIM)))
    for raw in FILTERS:
        flt = parse_filter(raw) if raw is not None else None
        used = {k for k in (raw or {}) if k not in ("and", "or", "not")} | {
            k for part in (raw or {}).get("and", []) + (raw or {}).get("or", []) for k in part if k != "not"}
        unusable = any(kinds.get(field) != {FIELD_KINDS[field]} for field in used)  # unknown, mixed, or other type
        fields = merged_fields([clip_table, overlay.metadata_table()])
        if flt is None:
            clip_allowed, added_allowed = None, None
        elif unusable:
            with pytest.raises(FilterError):
                clip_table.mask(flt, fields=fields)
                overlay.metadata_table().mask(flt, fields=fields)
            continue
        else:
            clip_allowed = clip_table.mask(flt, fields=fields)
            added_allowed = overlay.metadata_table().mask(flt, fields=fields)
        passing = {i: vec for i, (vec, meta) in catalogue.items() if raw is None or passes(meta, raw)}
        for k in (1, 4, 30):
            found = merge_top_k(bundle.search(queries, k, allowed=overlay.bundle_mask(clip_allowed)),
                                overlay.search_items(queries, k, added_allowed), k)
            for q in range(len(queries)):
                expected = sorted((float(queries[q] @ vec) for vec in passing.values()), reverse=True)[:k]
                rows = [int(r) for r in found[1][q] if r >= 0]
                ids = [CLIP_IDS[r] if r < len(CLIP_IDS) else overlay.item(r).id for r in rows]
                assert len(ids) == len(set(ids)) == len(expected), (raw, k)
                np.testing.assert_allclose(found[0][q, : len(rows)], expected, atol=1e-5)
                for item_id, score in zip(ids, found[0][q], strict=False):
                    assert item_id in passing and abs(float(queries[q] @ passing[item_id]) - score) < 1e-5
    # the added captions, per language, against the live items' captions
    for lang in TEXTS:
        for raw in (None, {"license": "cc0"}):
            allowed = None if raw is None else overlay.metadata_table().mask(parse_filter(raw), fields=fields)
            scores, rows = overlay.search_captions(queries, 5, lang, allowed)
            pool = [(item_id, text) for item_id, (_, meta, caps) in live["items"].items()
                    for text in caps.get(lang, []) if raw is None or passes(meta, raw)]
            for q in range(len(queries)):
                expected = sorted((float(queries[q] @ _text_vector(t)) for _, t in pool), reverse=True)[:5]
                got = [j for j in rows[q] if j >= 0]
                np.testing.assert_allclose(scores[q, : len(got)], expected, atol=1e-5)
                for j in got:
                    owner = overlay.items[int(overlay.caption_items[j])].id
                    assert (owner, overlay.caption_texts[j]) in pool


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_puts_upserts_and_deletes_search_as_brute_force_over_the_live_items(tmp_path, seed):
    rng = np.random.default_rng(seed)
    clips = _unit(rng.normal(size=(len(CLIP_IDS), DIM)))
    clip_meta = [_random_metadata(rng) for _ in CLIP_IDS]
    for meta in clip_meta:  # the bundle's own fields: every clip has them, with one kind each
        meta.pop("rating", None)
        meta.pop("mood", None)
    clip_rows = {cid: row for row, cid in enumerate(CLIP_IDS)}
    def embed_audio(records):
        return np.stack([_vector(int(r.audio.split(".")[0], 16) % 2**31) for r in records])

    def embed_text(batch):
        return np.stack([_text_vector(t) for t in batch])

    log, replica_log = ItemLog(tmp_path), ItemLog(tmp_path)  # a second process following the same log
    overlay = replica = ItemOverlay.empty(len(CLIP_IDS), 0, DIM)
    live: dict = {"items": {}, "touched": set()}
    deferred = None
    ids = [f"item-{i}" for i in range(25)] + CLIP_IDS[:5]
    for _ in range(40):
        for _ in range(int(rng.integers(1, 9))):  # a batch of records between two syncs
            item_id = str(rng.choice(ids))
            if rng.random() < 0.3:
                log.delete(item_id)
                live["items"].pop(item_id, None)
            else:
                audio_seed = int(rng.integers(0, 40))  # repeated audio is stored (and embedded) once
                meta = _random_metadata(rng)
                caps = {lang: [str(t) for t in rng.choice(texts, size=int(rng.integers(0, 2)), replace=False)]
                        for lang, texts in TEXTS.items() if rng.random() < 0.5}
                caps = {lang: t for lang, t in caps.items() if t}
                data = f"{audio_seed:08x}".encode()
                record = log.put(item_id, data, audio_format="wav", metadata=meta, captions=caps)
                live["items"][item_id] = (int(record.audio.split(".")[0], 16) % 2**31, meta, caps)
            if item_id in clip_rows:
                live["touched"].add(item_id)
        if rng.random() < 0.1:
            log.compact()
        overlay = build_overlay(overlay, log.history(), clip_ids=clip_rows, embed_audio=embed_audio,
                                embed_text=embed_text)
        assert overlay.version == log.version
        assert {i: overlay.items[r].id for i, r in overlay.row_of.items()} == {i: i for i in live["items"]}
        if deferred is not None:  # an overlay a search still holds after the next writes answers as before
            _check_against_brute_force(*deferred, rng)
            deferred = None
        if rng.random() < 0.3:  # first used after the next write (its lazy parts are made then)
            deferred = (overlay, clips, clip_meta, copy.deepcopy(live))
        else:
            _check_against_brute_force(overlay, clips, clip_meta, live, rng)
        if rng.random() < 0.4:  # the replica follows at its own pace: the same rows at the same version
            replica = build_overlay(replica, replica_log.history(), clip_ids=clip_rows, embed_audio=embed_audio,
                                    embed_text=embed_text)
            if replica.version == overlay.version:
                assert dict(replica.row_of) == dict(overlay.row_of)
                np.testing.assert_array_equal(replica.alive, overlay.alive)
                np.testing.assert_array_equal(replica.vectors[replica.alive], overlay.vectors[overlay.alive])
                assert list(replica.caption_texts) == list(overlay.caption_texts)
