"""Added items in Milvus (the Milvus backend's item store, service/milvus_items.py) through the HTTP API of
two real apps — two replicas: nothing shared but the session's Milvus 2.3.5 server, a real S3 server
(moto) holding the uploaded audio, and Redis (result cache and activations).

* items and takedowns written through one replica are searched through the other, with filters, equal to
  an independent brute force (numpy over the bundle's own vectors and the items' audio embedded by the
  bundle's encoder; filters by tests/index/filter_reference.py); a cached answer never hides a takedown;
* everything is still there after Milvus is SIGKILLed and restarted;
* a swap to a bundle of another model re-embeds every item into that bundle's collection before it goes
  live (brute force with the new model), an item whose stored audio is gone is quarantined (listed, the
  replica ready, the activation done), and a rollback keeps every item, one added after the swap too.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from index.engines.filters import item_metadata
from tests.index.filter_reference import passes
from tests.milvus_server import require_milvus
from tests.s3_server import s3_endpoint  # noqa: F401  (pytest fixture, used by name)
from tests.service.conftest import ADMIN, running_client, wait_until
from tests.service.fakes import tone, wav_bytes
from tests.service.test_real_bundles import real_settings
from tonearm.cli import main as tonearm_main

require_milvus()

SOUNDS = {  # id → (concepts, metadata)
    "m-dog": (["dog"], {"license": "cc0", "tags": ["animal", "dog"]}),
    "m-bells": (["bell", "siren"], {"license": "by", "tags": ["city"]}),
    "m-rain": (["rain"], {"license": "cc0", "tags": ["weather"], "rating": 4}),
    "m-rain-long": (["rain", "dog"], {"license": "by-nc", "rating": 2}),
    "m-siren": (["siren"], {"license": "cc0", "rating": 5}),
}
FILTERS = [
    None,
    {"license": "cc0"},
    {"not": {"license": "cc0"}},
    {"or": [{"tags": "dog"}, {"rating": {"gte": 4}}]},
    {"duration": {"gt": 1.2}},
]
QUERIES = ["a dog barks", "rain on a roof", "a siren in the city"]


def _drop_items(uri: str) -> None:
    from index.engines.milvus_index import MilvusTarget

    target = MilvusTarget(uri=uri)
    for name in target.client().list_collections():
        if name.startswith(f"{target.prefix}_items_"):
            target.client().drop_collection(name)


@pytest.fixture(scope="module")
def deployment(real_bundles, milvus_server, s3_endpoint, shared_redis):  # noqa: F811
    import boto3

    uri = milvus_server.uri
    for bundle_dir in (real_bundles.a, real_bundles.b):
        assert tonearm_main(["bundle", "publish", str(bundle_dir), "--milvus-uri", uri]) == 0
    _drop_items(uri)  # this module owns the item collections of the session's server while it runs
    bucket = f"items-{uuid.uuid4().hex[:8]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    prefix = f"mi{uuid.uuid4().hex[:8]}"

    def settings(**extra: Any) -> Any:
        return real_settings(real_bundles, index_backend="milvus", milvus_uri=uri, items_audio_url=f"s3://{bucket}/audio",
                             redis_url=shared_redis.url, key_prefix=prefix, pubsub_channel=f"{prefix}:activations",
                             **extra)

    yield SimpleNamespace(settings=settings, uri=uri, bucket=bucket, bundles=real_bundles)
    _drop_items(uri)


def _post(client, item_id: str, concepts: list[str], metadata: dict, rate: int, seconds: float = 1.0):
    audio = wav_bytes(tone(concepts, seconds=seconds, rate=rate), rate=rate)
    r = client.post("/v1/items", headers=ADMIN, data={"id": item_id, "metadata": json.dumps(metadata)},
                    files={"file": ("a.wav", audio, "audio/wav")})
    assert r.status_code == 201, r.text
    return audio


class Reference:
    """Brute force over one bundle's catalogue: its clips' own vectors and the added items' audio
    embedded by its encoder, minus the hidden clips; filters by the independent evaluator."""

    def __init__(self, bundle_dir, added: dict[str, tuple[bytes, dict]], hidden: set[str]) -> None:
        from index.runtime.loader import LoadedBundle
        from service.audio_input import decode_upload, limits_of
        from service.settings import Settings

        bundle = LoadedBundle.open(bundle_dir, device="cpu")
        try:
            clips = [c for c in bundle.audio_items if str(c["id"]) not in hidden and str(c["id"]) not in added]
            rows = [int(i) for i, c in enumerate(bundle.audio_items) if c in clips]
            vectors = [np.asarray(bundle.audio_embeddings(), np.float32)[rows]]
            self.ids = [str(c["id"]) for c in clips]
            self.metas = [item_metadata(c) for c in clips]
            limits = limits_of(Settings())
            for item_id, (audio, meta) in added.items():
                wave = decode_upload(audio, sample_rate=bundle.sample_rate, limits=limits)
                vectors.append(np.asarray(bundle.encode_audio([wave.waveform]), np.float32))
                self.ids.append(item_id)
                self.metas.append(item_metadata({**meta, "duration": round(wave.duration_seconds, 3), "id": item_id}))
            self.vectors = np.concatenate(vectors)
            self.encode_text = bundle.encode_text
            self.queries = {q: np.asarray(bundle.encode_text([q]), np.float32)[0] for q in QUERIES}
        finally:
            bundle.close()

    def top(self, query: np.ndarray, k: int, flt: dict | None, exclude: str | None = None) -> list[tuple[float, str]]:
        scores = self.vectors @ query
        kept = [(float(s), i) for s, i, m in zip(scores, self.ids, self.metas, strict=True)
                if i != exclude and (flt is None or passes(m, flt))]
        return sorted(kept, key=lambda p: (-p[0], p[1]))[:k]


def _assert_same(hits: list[dict], expected: list[tuple[float, str]], what: str) -> None:
    assert len(hits) == len(expected), (what, hits, expected)
    np.testing.assert_allclose([h["score"] for h in hits], [s for s, _ in expected], atol=1e-4, err_msg=what)
    score_of = {i: s for s, i in expected}
    for hit in hits:  # ids may differ only among equal scores
        assert hit["id"] in score_of or abs(hit["score"] - expected[-1][0]) < 1e-4, (what, hit, expected)


def _assert_catalogue(client, reference: Reference, k: int = 8, *, again: bool = False) -> None:
    """Every filter × query against the brute force; ``again``: the same catalogue through the other
    replica — one unfiltered and one filtered query (both replicas run the same code on the same
    Milvus; what differs is what each holds, which the first query shows; each search costs several
    Strong reads, ~0.5 s on two cores)."""
    for flt in FILTERS[:2] if again else FILTERS:
        for query in QUERIES[:1] if again else QUERIES:
            body: dict[str, Any] = {"query": query, "k": k}
            if flt is not None:
                body["filter"] = flt
            r = client.post("/v1/search/text", json=body)
            assert r.status_code == 200, r.text
            _assert_same(r.json()["hits"], reference.top(reference.queries[query], k, flt), f"{query} {flt}")


def test_items_in_milvus_equal_brute_force_from_a_second_replica_and_survive_a_restart(deployment, milvus_server):
    from index.bundle.format import read_manifest
    from service.app import create_app
    from service.milvus_items import MilvusCatalogue

    rate = read_manifest(deployment.bundles.a).sample_rate
    first, second = create_app(deployment.settings()), create_app(deployment.settings())
    with running_client(first) as a, running_client(second) as b:
        assert isinstance(first.state.tonearm.items, MilvusCatalogue)
        assert a.get("/readyz").status_code == 200 and b.get("/readyz").status_code == 200
        clips = [str(c["id"]) for c in first.state.tonearm.registry.active_searcher().bundle.audio_items]
        added = {item_id: (_post(a, item_id, concepts, meta, rate, seconds=1.0 + 0.25 * n), meta)
                 for n, (item_id, (concepts, meta)) in enumerate(SOUNDS.items())}
        replaced = clips[1]  # an added item with a clip's id replaces the clip
        added[replaced] = (_post(a, replaced, ["bell"], {"license": "cc0"}, rate), {"license": "cc0"})

        # the second replica answers a query before the takedown (Redis is shared): no cached answer
        # may hide the takedown from it afterwards
        top = b.post("/v1/search/text", json={"query": QUERIES[0], "k": 3}).json()["hits"]
        taken_down = next(h["id"] for h in top if h["id"] in clips and h["id"] != replaced)
        assert a.delete(f"/v1/items/{taken_down}", headers=ADMIN).status_code == 200
        again = b.post("/v1/search/text", json={"query": QUERIES[0], "k": 3}).json()["hits"]
        assert taken_down not in {h["id"] for h in again}

        reference = Reference(deployment.bundles.a, added, {taken_down})
        _assert_catalogue(b, reference)
        for item_id in ("m-dog", "m-rain"):  # audio→audio from a stored vector, itself excluded
            r = b.get(f"/v1/search/similar/{item_id}", params={"k": 5})
            assert r.status_code == 200, r.text
            query = reference.vectors[reference.ids.index(item_id)]
            _assert_same(r.json()["hits"], reference.top(query, 5, None, exclude=item_id), f"similar {item_id}")
        got = b.get("/v1/items/m-rain", headers=ADMIN).json()
        assert got["source"] == "added" and got["metadata"]["rating"] == 4
        assert b.get(f"/v1/items/{taken_down}", headers=ADMIN).status_code == 404
        assert b.get(f"/v1/audio/{taken_down}").status_code == 404
        served = b.get("/v1/audio/m-dog")
        assert served.status_code == 200 and served.content == added["m-dog"][0]
        assert b.get("/v1/items/m-dog", headers=ADMIN).json()["source"] == "added"
        bad = b.post("/v1/search/text", json={"query": "dog", "k": 3, "filter": {"rating": "high"}})
        assert bad.status_code == 422 and bad.json()["type"].endswith("invalid-filter")

        # a delete through the second replica: gone from the first at its answer
        assert b.delete("/v1/items/m-siren", headers=ADMIN).status_code == 200
        del added["m-siren"]
        reference = Reference(deployment.bundles.a, added, {taken_down, "m-siren"})
        _assert_catalogue(a, reference)

        milvus_server.kill()
        milvus_server.start()
        wait_until(lambda: a.post("/v1/search/text", json={"query": "dog", "k": 3}).status_code == 200,
                   timeout=120, interval=0.5, what="searches after the Milvus restart")
        _assert_catalogue(b, reference)
        _assert_catalogue(a, reference, again=True)


def test_a_swap_re_embeds_items_quarantines_a_broken_one_and_rollback_keeps_every_item(deployment):
    import s3fs

    from index.bundle.format import read_manifest
    from service.app import create_app

    ids = {name: deployment.bundles.id(name) for name in ("a", "b")}
    rate_a = read_manifest(deployment.bundles.a).sample_rate
    rate_b = read_manifest(deployment.bundles.b).sample_rate
    first, second = create_app(deployment.settings()), create_app(deployment.settings())
    with running_client(first) as a, running_client(second) as b:
        added = {}
        for item_id in ("s-dog", "s-rain"):  # beside what the first test left (it shares the server)
            concepts, meta = SOUNDS["m-" + item_id[2:]]
            added[item_id] = (_post(a, item_id, concepts, meta, rate_a), meta)
        broken = _post(a, "s-broken", ["siren", "bell"], {"license": "cc0"}, rate_a, seconds=1.7)
        fs = s3fs.S3FileSystem()
        key = f"{deployment.bucket}/audio/{hashlib.sha256(broken).hexdigest()}.wav"
        assert fs.exists(key)  # content-addressed, written before the record
        fs.rm_file(key)  # its audio is gone: bundle b cannot embed it

        r = a.post("/v1/bundles/activate", json={"bundle_id": ids["b"], "force": True}, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert a.get("/readyz").status_code == 200
        quarantined = a.get("/v1/items", params={"status": "quarantined"}, headers=ADMIN).json()["items"]
        assert [(q["id"], q["reason"]) for q in quarantined] == [("s-broken", "missing-audio")]
        wait_until(lambda: b.get("/readyz").json().get("bundle_id") == ids["b"], timeout=60, what="b follows")

        everything = _catalogue_items(first)
        reference = Reference(deployment.bundles.b, everything, _hidden(first) | {"s-broken"})
        _assert_catalogue(b, reference)
        _assert_catalogue(a, reference, again=True)

        late = "s-late"  # added while b is live: rollback must keep it
        added[late] = (_post(b, late, ["dog", "bell"], {"license": "by"}, rate_b), {"license": "by"})
        assert a.post("/v1/bundles/rollback", headers=ADMIN).status_code == 200
        wait_until(lambda: b.get("/readyz").json().get("bundle_id") == ids["a"], timeout=60, what="b rolls back")
        # a embedded s-broken when it was posted (from the upload itself) and keeps that row
        everything = {**_catalogue_items(first), "s-broken": (broken, {"license": "cc0"})}
        reference = Reference(deployment.bundles.a, everything, _hidden(first))
        assert late in reference.ids
        _assert_catalogue(a, reference)
        _assert_catalogue(b, reference, again=True)


def _catalogue_items(app) -> dict[str, tuple[bytes, dict]]:
    """Every live added item of the deployment (records in Milvus, audio from the store)."""
    store = app.state.tonearm.items
    out = {}
    for row in store.records.rows():
        if row["takedown"]:
            continue
        doc = row["doc"]
        try:
            audio = store.audio.read(doc["audio"])
        except FileNotFoundError:
            continue
        meta = {k: v for k, v in doc["metadata"].items() if k != "duration"}
        out[str(row["id"])] = (audio, meta)
    return out


def _hidden(app) -> set[str]:
    store = app.state.tonearm.items
    return {str(r["id"]) for r in store.records.rows() if r["takedown"]}


# ---------------------------------------------------------------- cheap: milvus-lite, the keyword bundle


@pytest.fixture
def lite_client(fake_bundles, tmp_path):
    from service.app import create_app
    from tests.service.conftest import fake_opener, make_settings

    settings = make_settings(bundles_dir=fake_bundles, bundle="fake-a", gate_metric="t2a_R@1_mean", items_store="milvus",
                             milvus_uri=str(tmp_path / "items.db"), items_audio_url=str(tmp_path / "audio"))
    app = create_app(settings, opener=fake_opener)
    with running_client(app) as client:
        yield client


def test_the_keyword_bundle_with_items_in_milvus_lite_equals_brute_force(lite_client, tmp_path):
    """The same catalogue as tests/service/test_items.py's on the file log: replace, takedown, filters,
    similar, a swap (re-embedded from the stored audio) and an item whose audio is gone (quarantined)."""
    from tests.service.fakes import text_vector
    from tests.service.test_items import LICENSE, _brute_force, _catalogue
    from tests.service.test_items import _assert_same as same
    from tests.service.test_items import _post as post

    c = lite_client
    assert post(c, "added-bell-rain", ["bell", "rain"], {"license": "cc0"},
                {"fra": ["une cloche et la pluie"]}).status_code == 201
    assert post(c, "clip-siren", ["bell"], {"license": "by"}).status_code == 201  # replaces the clip
    assert c.delete("/v1/items/clip-dog", headers=ADMIN).status_code == 200  # a takedown
    catalogue = _catalogue({"added-bell-rain": ("bell", "rain"), "clip-siren": ("bell",)})
    del catalogue["clip-dog"]
    license_of = {**LICENSE, "added-bell-rain": "cc0", "clip-siren": "by"}
    for query in ("bell rain", "a dog", "a siren"):
        hits = c.post("/v1/search/text", json={"query": query, "k": 10}).json()["hits"]
        same(hits, _brute_force(text_vector(query), catalogue, 10))
        hits = c.post("/v1/search/text", json={"query": query, "k": 10, "filter": {"license": "cc0"}}).json()["hits"]
        same(hits, _brute_force(text_vector(query), {i: v for i, v in catalogue.items() if license_of[i] == "cc0"}, 10))
    top = c.post("/v1/search/text", json={"query": "bell rain", "k": 1, "include_captions": True}).json()["hits"]
    assert top[0]["id"] == "added-bell-rain" and top[0]["captions"] == {"fra": ["une cloche et la pluie"]}
    similar = c.get("/v1/search/similar/added-bell-rain", params={"k": 3}).json()["hits"]
    same(similar, _brute_force(catalogue["added-bell-rain"], catalogue, 3, exclude="added-bell-rain"))
    assert c.get("/v1/search/similar/clip-dog").status_code == 404
    assert c.get("/v1/items/clip-siren", headers=ADMIN).json()["source"] == "added"
    assert c.get("/v1/audio/clip-dog").status_code == 404

    # an item whose stored audio disappears: quarantined by the next bundle, which still goes live
    assert post(c, "added-lost", ["dog", "siren"], {"license": "by"}).status_code == 201
    stored = c.app.state.tonearm.items.audio
    lost = c.app.state.tonearm.registry.active_searcher().engine_items.get("added-lost")[0].audio
    (tmp_path / "audio" / lost).unlink()
    assert stored.local
    r = c.post("/v1/bundles/activate", json={"bundle_id": "fake-b", "force": True}, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert c.get("/readyz").status_code == 200
    quarantined = c.get("/v1/items", params={"status": "quarantined"}, headers=ADMIN).json()
    assert quarantined["bundle_id"] == "fake-b"
    assert [(q["id"], q["reason"]) for q in quarantined["items"]] == [("added-lost", "missing-audio")]
    hits = c.post("/v1/search/text", json={"query": "bell rain", "k": 10}).json()["hits"]
    same(hits, _brute_force(text_vector("bell rain"), catalogue, 10))  # re-embedded; added-lost not searchable


def test_a_replica_that_cannot_reach_the_milvus_of_its_items_is_not_ready(fake_bundles, tmp_path):
    from service.app import create_app
    from tests.service.conftest import fake_opener, free_port, make_settings

    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    settings = make_settings(bundles_dir=fake_bundles, bundle="fake-a", items_store="milvus", milvus_uri=uri,
                             milvus_timeout_s=0.5, items_audio_url=str(tmp_path / "audio"))
    with running_client(create_app(settings, opener=fake_opener)) as client:
        r = client.get("/readyz")
        assert r.status_code == 503 and r.json()["type"].endswith("items-unavailable")
        assert uri in r.json()["detail"]
        assert client.post("/v1/items", headers=ADMIN, data={"id": "x"}).status_code == 503
