"""One id grammar every item store accepts (issue 55, part 2): the Milvus item store (on the session's real
Milvus 2.3.5 server, whose VARCHAR keys count bytes) and the item log answer the same for an id over
512 bytes of UTF-8 (256 × 中 is 768: a 422 problem document on POST, GET, DELETE and similar, never a
500) and for one of exactly 512 bytes (taken by both: 201, then found, similar, deleted). A value Milvus
itself refuses is :class:`index.errors.IndexInputRefused`, a 422, not a 503."""

from __future__ import annotations

import time

import numpy as np
import pytest

from index.engines.milvus_index import MilvusTarget, _mapped
from index.errors import IndexInputRefused
from index.items.milvus_store import MilvusItemStore
from service.app import create_app
from service.searcher import index_problem
from tests.milvus_server import require_milvus
from tests.service.conftest import ADMIN, fake_opener, make_settings, running_client
from tests.service.test_items import _post

require_milvus()

TOO_LONG = "中" * 256  # 256 characters, 768 bytes: within the characters, over the bytes
EXACT = "中" * 170 + "ab"  # 512 bytes


def _drop_items(uri: str) -> None:
    target = MilvusTarget(uri=uri)
    for name in target.client().list_collections():
        if name.startswith(f"{target.prefix}_items_"):
            target.client().drop_collection(name)


@pytest.fixture
def clients(fake_bundles, milvus_server, tmp_path):
    """The same fake bundle served with its items in the server's Milvus and in an item log."""
    _drop_items(milvus_server.uri)  # the item collections of the session's server are this test's while it runs
    common = {"bundles_dir": fake_bundles, "bundle": "fake-a", "gate_metric": "t2a_R@1_mean"}
    in_milvus = make_settings(**common, items_store="milvus", milvus_uri=milvus_server.uri,
                              items_audio_url=str(tmp_path / "audio"))
    in_log = make_settings(**common, items_dir=tmp_path / "items")
    try:
        with running_client(create_app(in_milvus, opener=fake_opener)) as milvus, \
                running_client(create_app(in_log, opener=fake_opener)) as log:
            yield {"milvus": milvus, "log": log}
    finally:
        _drop_items(milvus_server.uri)


def _answers(client, item_id: str) -> dict[str, tuple[int, str]]:
    got = {
        "post": _post(client, item_id, ["bell"], {"license": "cc0"}),
        "get": client.get(f"/v1/items/{item_id}", headers=ADMIN),
        "similar": client.get(f"/v1/search/similar/{item_id}", params={"k": 3}),
        "delete": client.delete(f"/v1/items/{item_id}", headers=ADMIN),
    }
    out = {}
    for what, r in got.items():
        assert r.status_code < 500, (what, r.status_code, r.text)
        kind = r.json().get("type", "") if r.headers["content-type"].startswith("application/problem+json") else ""
        out[what] = (r.status_code, kind)
    return out


def test_an_id_over_512_bytes_is_refused_alike_and_one_of_512_taken_alike(clients):
    refused = {name: _answers(c, TOO_LONG) for name, c in clients.items()}
    assert refused["milvus"] == refused["log"], refused
    assert set(refused["log"].values()) == {(422, "urn:tonearm:problem:validation-error")}, refused
    r = _post(clients["milvus"], TOO_LONG, ["bell"])
    assert "512 bytes" in r.json()["detail"]

    taken = {name: _answers(c, EXACT) for name, c in clients.items()}
    assert taken["milvus"] == taken["log"], taken
    assert [status for status, _ in taken["log"].values()] == [201, 200, 200, 200], taken
    for c in clients.values():  # deleted on both; on the Milvus store a GET right after the DELETE once
        # answered 200 (CI-clone run, 2026-11-29: the delete not yet visible to the read — noted on issue
        # 55 for a look); the id's grammar is what this test is about, so it waits up to 10 s for the 404
        deadline = time.monotonic() + 10
        while (status := c.get(f"/v1/items/{EXACT}", headers=ADMIN).status_code) == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert status == 404


def test_a_value_milvus_refuses_is_the_callers_input(milvus_server):
    """Past the grammar (a key longer than the VARCHAR), the server's own refusal (code 1100) is mapped to
    IndexInputRefused, which the service answers 422 — the mapping a store call outside the grammar gets."""
    target = MilvusTarget(uri=milvus_server.uri)
    store = MilvusItemStore(target, dim=2, name="refusals").open()
    try:
        row = {"id": TOO_LONG, "added_ms": 0, "takedown": False, "meta": {}, "doc": {}, "vector": [1.0, 0.0]}
        with pytest.raises(IndexInputRefused, match="exceeds max length"), _mapped("writing", target):
            target.call("upsert", store.collection, [row], bulk=True)
        with pytest.raises(IndexInputRefused, match="512 bytes"):
            store.put([(TOO_LONG, np.array([1.0, 0.0], np.float32), {})])
        with pytest.raises(IndexInputRefused):
            store.get([TOO_LONG])
        problem = index_problem(IndexInputRefused("too long"))
        assert (problem.slug, problem.status) == ("validation-error", 422)
        store.put([(EXACT, np.array([1.0, 0.0], np.float32), {})])
        assert set(store.get([EXACT])) == {EXACT}
    finally:
        store.drop()
