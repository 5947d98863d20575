"""Items through the API with the keyword bundle (in-process ASGI app, real FAISS for the bundle's
clips): upsert, delete (added items and takedowns of bundle clips), every search route, filters over
clips and added items together, and hostile inputs as problem documents.

References are numpy over the keyword model's own vectors for the whole catalogue (bundle clips and
added items), picked here in plain Python.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from index.items.log import LOG_NAME
from tests.service.conftest import ADMIN
from tests.service.fakes import CLIPS, KeywordBundle, text_vector, tone, wav_bytes
from tests.service.test_routes import assert_problem

MODEL = KeywordBundle(Path("/nonexistent"))
"""A fresh instance of the keyword model: its encoder gives the reference vectors."""
LICENSE = {clip: ("cc0", "by")[row % 2] for row, clip in enumerate(CLIPS)}


def _post(client, item_id, concepts, metadata=None, captions=None, headers=ADMIN):
    data = {"id": item_id, "metadata": json.dumps(metadata or {})}
    if captions is not None:
        data["captions"] = json.dumps(captions)
    return client.post("/v1/items", headers=headers, data=data,
                       files={"file": ("x.wav", wav_bytes(tone(concepts)), "audio/wav")})


def _catalogue(added: dict[str, tuple[str, ...]]) -> dict[str, np.ndarray]:
    """id → vector of every catalogue item (bundle clips, then added ones replacing clips of their id)."""
    waves = {**CLIPS, **added}
    return {item: MODEL.encode_audio([tone(concepts)])[0] for item, concepts in waves.items()}


def _brute_force(query: np.ndarray, vectors: dict[str, np.ndarray], k: int, exclude: str | None = None):
    q = query / np.linalg.norm(query)
    scored = sorted(((float(v @ q), item) for item, v in vectors.items() if item != exclude), key=lambda p: -p[0])
    return scored[:k]


def _assert_same(hits, expected):
    """Same scores rank by rank; every hit has its reference score (tied items may swap)."""
    np.testing.assert_allclose([h["score"] for h in hits], [s for s, _ in expected], atol=1e-5)
    score_of = {item: s for s, item in expected}
    for hit in hits:
        if hit["id"] in score_of:
            assert abs(score_of[hit["id"]] - hit["score"]) < 1e-5


def _text_hits(client, query, k=10, **extra):
    r = client.post("/v1/search/text", json={"query": query, "k": k, **extra})
    assert r.status_code == 200, r.text
    return r.json()["hits"]


def test_an_added_item_is_found_by_every_search_and_a_repost_replaces_it(fake_client):
    r = _post(fake_client, "added-bell-rain", ["bell", "rain"], {"license": "cc0", "collection": "foley"},
              {"fra": ["une cloche et la pluie"]})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["source"] == "added" and body["metadata"]["duration"] == 1.0 and body["added_at"]
    got = fake_client.get("/v1/items/added-bell-rain", headers=ADMIN).json()
    assert got["metadata"] == {"license": "cc0", "collection": "foley", "duration": 1.0}
    assert got["captions"] == {"fra": ["une cloche et la pluie"]} and got["source"] == "added"
    clip = fake_client.get("/v1/items/clip-bell", headers=ADMIN).json()
    assert clip["source"] == "bundle" and clip["added_at"] is None and clip["metadata"]["license"] == LICENSE["clip-bell"]

    catalogue = _catalogue({"added-bell-rain": ("bell", "rain")})
    hits = _text_hits(fake_client, "bell rain", k=len(catalogue))
    assert {h["id"] for h in hits} == set(catalogue)
    _assert_same(hits, _brute_force(text_vector("bell rain"), catalogue, len(catalogue)))
    assert hits[0]["id"] == "added-bell-rain"

    similar = fake_client.get("/v1/search/similar/added-bell-rain", params={"k": 3}).json()["hits"]
    _assert_same(similar, _brute_force(catalogue["added-bell-rain"], catalogue, 3, exclude="added-bell-rain"))
    assert "added-bell-rain" not in {h["id"] for h in similar}
    like_clip = fake_client.get("/v1/search/similar/clip-rain", params={"k": 1}).json()["hits"]
    assert like_clip[0]["id"] == "added-bell-rain"

    captions = fake_client.post("/v1/search/audio", params={"lang": "fra", "k": 1},
                                content=wav_bytes(tone(["bell", "rain"]))).json()["hits"]
    assert [(h["clip_id"], h["text"]) for h in captions] == [("added-bell-rain", "une cloche et la pluie")]

    # re-posting the id replaces the item: new audio, new metadata, one hit
    assert _post(fake_client, "added-bell-rain", ["dog"], {"license": "by"}).status_code == 201
    catalogue = _catalogue({"added-bell-rain": ("dog",)})
    hits = _text_hits(fake_client, "bell rain", k=len(catalogue))
    assert [h["id"] for h in hits].count("added-bell-rain") == 1
    _assert_same(hits, _brute_force(text_vector("bell rain"), catalogue, len(catalogue)))
    assert fake_client.get("/v1/items/added-bell-rain", headers=ADMIN).json()["metadata"]["license"] == "by"
    captions = fake_client.post("/v1/search/audio", params={"lang": "fra", "k": 5},
                                content=wav_bytes(tone(["bell", "rain"]))).json()["hits"]
    assert "une cloche et la pluie" not in {h["text"] for h in captions}

    # reposting a bundle clip's id replaces the clip
    assert _post(fake_client, "clip-siren", ["bell"]).status_code == 201
    catalogue = _catalogue({"added-bell-rain": ("dog",), "clip-siren": ("bell",)})
    hits = _text_hits(fake_client, "a siren", k=10)
    assert [h["id"] for h in hits].count("clip-siren") == 1
    _assert_same(hits, _brute_force(text_vector("a siren"), catalogue, 10))


def test_delete_removes_an_added_item_and_takes_a_bundle_clip_down(fake_client):
    assert _post(fake_client, "added-dog", ["dog"], captions={"eng": ["a dog"]}).status_code == 201
    deleted = fake_client.delete("/v1/items/added-dog", headers=ADMIN)
    assert deleted.status_code == 200 and deleted.json()["source"] == "added"
    takedown = fake_client.delete("/v1/items/clip-dog-siren", headers=ADMIN)
    assert takedown.status_code == 200 and takedown.json()["source"] == "bundle"

    gone = {"added-dog", "clip-dog-siren"}
    remaining = {c: v for c, v in _catalogue({}).items() if c not in gone}
    hits = _text_hits(fake_client, "dog siren", k=10)
    assert not gone & {h["id"] for h in hits}
    _assert_same(hits, _brute_force(text_vector("dog siren"), remaining, 10))
    similar = fake_client.post("/v1/search/similar", params={"k": 10}, content=wav_bytes(tone(["dog", "siren"])))
    assert not gone & {h["id"] for h in similar.json()["hits"]}
    captions = fake_client.post("/v1/search/audio", params={"k": 10}, content=wav_bytes(tone(["dog"])))
    assert not gone & {h["clip_id"] for h in captions.json()["hits"]}
    for item in gone:
        assert_problem(fake_client.get(f"/v1/items/{item}", headers=ADMIN), 404, "not-found")
        assert_problem(fake_client.delete(f"/v1/items/{item}", headers=ADMIN), 404, "not-found")
        assert_problem(fake_client.get(f"/v1/search/similar/{item}"), 404, "unknown-target")
    # a taken-down clip can be put back through the API
    assert _post(fake_client, "clip-dog-siren", ["dog", "siren"]).status_code == 201
    assert _text_hits(fake_client, "dog siren", k=1)[0]["id"] == "clip-dog-siren"


@pytest.mark.parametrize(
    ("flt", "passes"),
    [
        ({"license": "cc0"}, lambda item, meta: meta.get("license") == "cc0"),
        ({"collection": "foley"}, lambda item, meta: meta.get("collection") == "foley"),
        ({"not": {"collection": "foley"}}, lambda item, meta: meta.get("collection") != "foley"),
        ({"duration": {"lte": 1.5}}, lambda item, meta: meta["duration"] <= 1.5),
        ({"tags": {"any": ["rain", "x"]}}, lambda item, meta: bool({"rain", "x"} & set(meta.get("tags", ())))),
    ],
)
def test_filters_apply_to_added_items_and_clips_alike(fake_client, flt, passes):
    added = {"a-cc0": (("rain", "dog"), {"license": "cc0", "collection": "foley", "tags": ["x"]}),
             "a-by": (("rain",), {"license": "by", "duration": 9.0}),
             "a-none": (("bell", "dog"), {})}
    for item, (concepts, meta) in added.items():
        assert _post(fake_client, item, list(concepts), meta).status_code == 201
    metas = {c: {"license": LICENSE[c], "duration": float(1 + row), "tags": list(CLIPS[c])}
             for row, c in enumerate(CLIPS)}
    metas.update({item: {"duration": 1.0, **meta} for item, (_, meta) in added.items()})
    vectors = _catalogue({item: concepts for item, (concepts, _) in added.items()})
    passing = {item: v for item, v in vectors.items() if passes(item, metas[item])}
    hits = _text_hits(fake_client, "rain and a dog", k=10, filter=flt)
    assert {h["id"] for h in hits} <= set(passing)
    _assert_same(hits, _brute_force(text_vector("rain and a dog"), passing, 10))
    similar = fake_client.get("/v1/search/similar/a-none", params={"k": 10, "filter": json.dumps(flt)})
    assert similar.status_code == 200, similar.text
    _assert_same(similar.json()["hits"], _brute_force(vectors["a-none"], passing, 10, exclude="a-none"))


def test_filter_types_are_checked_against_clips_and_added_items(fake_client):
    assert _post(fake_client, "a-1", ["dog"], {"collection": "foley", "license": 3}).status_code == 201
    r = fake_client.post("/v1/search/text", json={"query": "dog", "filter": {"collection": 5}})
    assert "collection" in assert_problem(r, 422, "invalid-filter")["fields"]
    r = fake_client.post("/v1/search/text", json={"query": "dog", "filter": {"license": "cc0"}})
    assert "several types" in assert_problem(r, 422, "invalid-filter")["detail"]


def test_the_record_is_on_disk_when_the_201_is_sent(fake_client, fake_bundles):
    assert _post(fake_client, "durable", ["bell"], {"n": 1}).status_code == 201
    lines = (fake_bundles / ".items" / LOG_NAME).read_text().splitlines()
    record = json.loads(lines[-1])
    assert record["op"] == "put" and record["id"] == "durable" and record["metadata"] == {"n": 1, "duration": 1.0}
    assert (fake_bundles / ".items" / "audio" / record["audio"]).read_bytes() == wav_bytes(tone(["bell"]))


def test_a_batch_adds_every_item_or_none(fake_client):
    files = [("file", (f"{c}.wav", wav_bytes(tone([c])), "audio/wav")) for c in ("rain", "bell")]
    specs = [{"id": "b-rain", "metadata": {"n": 1}, "captions": {"eng": ["rain falls"]}}, {"id": "b-bell"}]
    r = fake_client.post("/v1/items:batch", headers=ADMIN, files=files, data={"items": json.dumps(specs)})
    assert r.status_code == 201, r.text
    assert [i["id"] for i in r.json()["items"]] == ["b-rain", "b-bell"]
    assert _text_hits(fake_client, "rain", k=10, filter={"n": 1})[0]["id"] == "b-rain"
    bad = [("file", ("a.wav", wav_bytes(tone(["dog"])), "audio/wav")), ("file", ("b.wav", b"not audio", "audio/wav"))]
    r = fake_client.post("/v1/items:batch", headers=ADMIN, files=bad,
                         data={"items": json.dumps([{"id": "never-1"}, {"id": "never-2"}])})
    assert_problem(r, 415, "unsupported-audio")
    assert fake_client.get("/v1/items/never-1", headers=ADMIN).status_code == 404


WAV = wav_bytes(tone(["dog"]))


@pytest.mark.parametrize(
    ("kwargs", "status", "slug"),
    [
        ({"headers": {}}, 401, "unauthorized"),
        ({"content": b"RIFF...", "headers": {**ADMIN, "content-type": "audio/wav"}}, 400, "bad-upload"),
        ({"files": {}}, 400, "bad-upload"),
        ({"files": [("file", ("a.wav", WAV, "audio/wav"))] * 2}, 400, "bad-upload"),
        ({"data": {"id": "x", "metadata": "{not json"}}, 422, "validation-error"),
        ({"data": {"id": "x", "metadata": "[1, 2]"}}, 422, "validation-error"),
        ({"data": {"id": "x", "metadata": '{"a": {"b": 1}}'}}, 422, "validation-error"),
        ({"data": {"id": "x", "metadata": '{"a": 1e400}'}}, 422, "validation-error"),
        ({"data": {"id": "x", "metadata": '{"and": 1}'}}, 422, "validation-error"),
        ({"data": {"id": "x", "metadata": json.dumps({f"f{i}": i for i in range(65)})}}, 422, "validation-error"),
        ({"data": {"id": "x", "metadata": json.dumps({"t": ["a"] * 2000})}}, 422, "validation-error"),
        ({"data": {"id": "x" * 300}}, 422, "validation-error"),
        ({"data": {"id": "a\nb"}}, 422, "validation-error"),
        ({"data": {}}, 422, "validation-error"),
        ({"data": {"id": "x", "extra": "1"}}, 422, "validation-error"),
        ({"data": {"id": "x", "captions": '{"zzz": ["hi"]}'}}, 422, "unknown-language"),
        ({"data": {"id": "x", "captions": '{"eng": "hi"}'}}, 422, "validation-error"),
        ({"data": {"id": "x", "captions": '{"eng": ["   "]}'}}, 422, "validation-error"),
        ({"files": {"file": ("a.wav", b"not audio at all", "audio/wav")}}, 415, "unsupported-audio"),
        ({"files": {"file": ("a.wav", WAV[:60], "audio/wav")}}, 422, "audio-decode-failed"),
    ],
)
def test_hostile_item_requests_are_problem_documents(fake_client, kwargs, status, slug):
    request = {"headers": ADMIN, "data": {"id": "x"}, "files": {"file": ("a.wav", WAV, "audio/wav")}, **kwargs}
    if "content" in request:
        request.pop("files")
        request.pop("data")
    assert_problem(fake_client.post("/v1/items", **request), status, slug)
    assert fake_client.get("/v1/items/x", headers=ADMIN).status_code == 404


@pytest.mark.parametrize(
    "items",
    ["not json", "{}", "[]", json.dumps([{"id": "a"}, {"id": "b"}]), json.dumps([{"id": "a", "x": 1}]),
     json.dumps([{"id": 5}])],
)
def test_hostile_batches_are_422(fake_client, items):
    r = fake_client.post("/v1/items:batch", headers=ADMIN, data={"items": items},
                         files=[("file", ("a.wav", WAV, "audio/wav"))])
    assert_problem(r, 422, "validation-error")


def test_texts_the_log_cannot_hold_or_split_are_handled(fake_client):
    """Line separators inside strings (U+2028, U+0085, \\x1c) stay one record; lone surrogates are 422.
    (An id may not hold a line separator: the id grammar refuses it, tests/service/test_hostile.py.)"""
    meta = {"title": "a\u2028b\u0085c\x1cd", "tags": ["\u2029"]}
    assert _post(fake_client, "odd-id", ["dog"], meta, {"eng": ["a dog\u2028barks"]}).status_code == 201
    got = fake_client.get("/v1/items/odd-id", headers=ADMIN).json()
    assert got["metadata"]["title"] == meta["title"] and got["captions"] == {"eng": ["a dog\u2028barks"]}
    for field, value in (("metadata", '{"a": "\\ud800"}'), ("captions", '{"eng": ["\\udfff x"]}')):
        r = fake_client.post("/v1/items", headers=ADMIN, data={"id": "lone", field: value},
                             files={"file": ("a.wav", WAV, "audio/wav")})
        assert_problem(r, 422, "validation-error")


def test_the_follower_compacts_the_log_and_every_search_still_sees_the_live_items(fake_bundles):
    from service.app import create_app
    from tests.service.conftest import fake_opener, make_settings, running_client, wait_until

    # compact_min 5: due only once b's delete makes its put garbage too (after the eight puts alone 4 of 8
    # records are garbage — with 4, a follower tick between the puts and the deletes compacted then,
    # b's audio stayed referenced and the audio GC below never came)
    settings = make_settings(bundles_dir=fake_bundles, bundle="fake-a", items_compact_min=5, items_poll_s=0.05)
    log_path = fake_bundles / ".items" / LOG_NAME
    with running_client(create_app(settings, opener=fake_opener)) as client:
        for item_id, concepts in [("a", ["dog"]), ("b", ["rain"]), ("c", ["bell"]), ("a", ["siren"]),
                                  ("d", ["dog", "bell"]), ("d", ["rain", "bell"]), ("d", ["dog"]),
                                  ("d", ["bell"])]:  # 5 of the 10 records are garbage: half the log
            assert _post(client, item_id, concepts, {"license": "cc0"}).status_code == 201
        assert client.delete("/v1/items/b", headers=ADMIN).status_code == 200
        assert client.delete("/v1/items/clip-rain", headers=ADMIN).status_code == 200  # a takedown survives it
        wait_until(lambda: '"op":"compacted"' in log_path.read_text().splitlines()[0], timeout=10,
                   what="the follower to compact the log")
        store = client.app.state.tonearm.items
        wait_until(lambda: client.app.state.tonearm.registry.active_searcher().items.version == store.log.version,
                   timeout=10, what="the overlay to follow the compacted log")

        added = {"a": ("siren",), "c": ("bell",), "d": ("bell",)}
        catalogue = {k: v for k, v in _catalogue(added).items() if k != "clip-rain"}
        hits = _text_hits(client, "a bell in the rain", k=len(catalogue))
        _assert_same(hits, _brute_force(text_vector("a bell in the rain"), catalogue, len(catalogue)))
        assert {h["id"] for h in hits} == set(catalogue)
        similar = client.get("/v1/search/similar/d", params={"k": 4, "filter": json.dumps({"license": "cc0"})})
        cc0 = {k: v for k, v in catalogue.items() if k in added or LICENSE[k] == "cc0"}
        _assert_same(similar.json()["hits"], _brute_force(catalogue["d"], cc0, 4, exclude="d"))
        for item_id in ("b", "clip-rain"):
            assert client.get(f"/v1/items/{item_id}", headers=ADMIN).status_code == 404
        audio = client.get("/v1/audio/d")
        assert audio.status_code == 200 and audio.content == wav_bytes(tone(["bell"]))
        current = {hashlib.sha256(wav_bytes(tone(list(concepts)))).hexdigest() + ".wav" for concepts in added.values()}
        # the uploads replaced (a's dog, d's first three) or deleted (b's rain) are gone — the audio GC
        # follows the compacted log's rename, so a loaded machine may see the header first
        wait_until(lambda: {p.name for p in (fake_bundles / ".items" / "audio").iterdir()} == current, timeout=10,
                   what="the compaction's audio GC")

        assert _post(client, "e", ["rain"], {"license": "by"}).status_code == 201  # writes go on
        assert _text_hits(client, "rain", k=1)[0]["id"] == "e"
