"""Added items' moment windows on the Milvus item store (issue 54, part 4): embedded when the item is written
(before the 201) into a windows collection of the serving bundle, read by every replica — a long recording
added through one replica is found by a moment query on another, which calls no audio encoder for it; a
replaced or deleted recording's windows are never returned.

Two apps (two replicas) over the keyword bundle (tests/service/fakes.py: 1-s windows), their items in the
session's Milvus 2.3.5 server, the audio in one directory. ~20 s."""

from __future__ import annotations

import io
import json

import numpy as np
import soundfile as sf

from tests.milvus_server import require_milvus
from tests.service.conftest import ADMIN, fake_opener, make_settings, running_client
from tests.service.fakes import SAMPLE_RATE, tone

require_milvus()

EVENT = (61.0, 66.0)


def _drop_items(uri: str) -> None:
    from index.engines.milvus_index import MilvusTarget

    target = MilvusTarget(uri=uri)
    for name in target.client().list_collections():
        if name.startswith(f"{target.prefix}_items_"):
            target.client().drop_collection(name)


def _walk(seconds: float, event: tuple[float, float] | None, concept: str = "bell") -> bytes:
    wave = np.zeros(int(seconds * SAMPLE_RATE), np.float32)
    if event is not None:
        wave[int(event[0] * SAMPLE_RATE) : int(event[1] * SAMPLE_RATE)] = tone([concept], seconds=event[1] - event[0])
    out = io.BytesIO()
    sf.write(out, wave, SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return out.getvalue()


def _post(client, item_id: str, data: bytes) -> None:
    r = client.post("/v1/items", headers=ADMIN, data={"id": item_id, "metadata": json.dumps({"kind": "walk"})},
                    files={"file": ("walk.wav", data, "audio/wav")})
    assert r.status_code == 201, r.text


def _moments(client, query: str = "bell", **extra) -> list[dict]:
    r = client.post("/v1/search/moments", json={"query": query, "k": 3, **extra})
    assert r.status_code == 200, r.text
    return r.json()["hits"]


def test_a_long_item_added_on_one_replica_is_found_on_another_and_gone_when_replaced_or_deleted(
    fake_bundles, milvus_server, tmp_path
) -> None:
    from service.app import create_app

    _drop_items(milvus_server.uri)
    settings = make_settings(bundles_dir=fake_bundles, bundle="fake-a", gate_metric="t2a_R@1_mean", items_store="milvus",
                             milvus_uri=milvus_server.uri, items_audio_url=str(tmp_path / "audio"))
    try:
        first, second = create_app(settings, opener=fake_opener), create_app(settings, opener=fake_opener)
        with running_client(first) as a, running_client(second) as b:
            _post(a, "walk-2min", _walk(120.0, EVENT))
            _post(a, "walk-rain", _walk(90.0, (20.0, 30.0), concept="rain"))

            bundle = second.state.tonearm.registry.active_searcher().bundle
            encoded = []
            original = bundle.encode_audio
            bundle.encode_audio = lambda waves: encoded.append(len(waves)) or original(waves)
            try:
                hits = _moments(b)
            finally:
                bundle.encode_audio = original
            assert encoded == []  # the windows were embedded at the write, on the other replica
            assert hits[0]["id"] == "walk-2min", hits
            assert abs(hits[0]["start"] - EVENT[0]) <= 1.0 and abs(hits[0]["end"] - EVENT[1]) <= 1.0, hits[0]
            assert _moments(b, filter={"kind": "other"}) == []

            _post(b, "walk-2min", _walk(1.5, None))  # replaced by a short recording (two windows at most): none left
            assert "walk-2min" not in {h["id"] for h in _moments(a) + _moments(b)}
            _post(a, "walk-2min", _walk(120.0, EVENT))  # long again: found again
            assert _moments(b)[0]["id"] == "walk-2min"

            assert b.delete("/v1/items/walk-2min", headers=ADMIN).status_code == 200
            for client in (a, b):
                assert "walk-2min" not in {h["id"] for h in _moments(client)}
                assert "walk-2min" not in {h["id"] for h in _moments(client, "rain")}
            assert _moments(a, "rain")[0]["id"] == "walk-rain"
    finally:
        _drop_items(milvus_server.uri)
