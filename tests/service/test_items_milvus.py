"""Items of the file log on the Milvus backend (``TONEARM_ITEMS_STORE=log``; both engines): the same item
log, held beside the Milvus collection in the overlay, answers every search as the FAISS backend does over
the same log (two apps sharing one item directory, as two replicas would: one takes the writes, the other
follows). The Milvus item store (the default on this backend) is tests/service/test_items_in_milvus.py."""

from __future__ import annotations

import json

import numpy as np

from tests.milvus_server import require_milvus
from tests.service.conftest import ADMIN, running_client, wait_until
from tests.service.fakes import tone, wav_bytes
from tests.service.test_real_bundles import real_settings
from tonearm.cli import main as tonearm_main

require_milvus()


def test_items_on_milvus_answer_as_on_faiss(real_bundles, milvus_uri, tmp_path):
    from index.bundle.format import read_manifest
    from service.app import create_app

    assert tonearm_main(["bundle", "publish", str(real_bundles.a), "--milvus-uri", milvus_uri]) == 0
    rate = read_manifest(real_bundles.a).sample_rate
    items_dir = tmp_path / "items"
    milvus_app = create_app(real_settings(real_bundles, items_dir=items_dir, index_backend="milvus",
                                          milvus_uri=milvus_uri, items_store="log"))
    faiss_app = create_app(real_settings(real_bundles, items_dir=items_dir))
    with running_client(milvus_app) as milvus, running_client(faiss_app) as faiss:
        sounds = {"m-dog": (["dog"], "cc0"), "m-bells": (["bell", "siren"], "by"), "m-rain": (["rain"], "cc0")}
        for item_id, (concepts, license_) in sounds.items():
            r = milvus.post("/v1/items", headers=ADMIN, data={"id": item_id, "metadata": json.dumps({"license": license_})},
                            files={"file": ("a.wav", wav_bytes(tone(concepts, rate=rate), rate=rate), "audio/wav")})
            assert r.status_code == 201, r.text
        clips = [str(item["id"]) for item in faiss_app.state.tonearm.registry.active_searcher().bundle.audio_items]
        taken_down = clips[0]
        assert faiss.delete(f"/v1/items/{taken_down}", headers=ADMIN).status_code == 200
        wait_until(lambda: milvus.get(f"/v1/items/{taken_down}", headers=ADMIN).status_code == 404
                   and faiss.get("/v1/items/m-rain", headers=ADMIN).status_code == 200, timeout=30, what="both synced")

        n = len(clips) + len(sounds)
        for body in ({"query": "a dog barks", "k": n},
                     {"query": "rain on a roof", "k": 5, "filter": {"license": "cc0"}},
                     {"query": "bells", "k": n, "filter": {"not": {"license": "cc0"}}}):
            got = [milvus.post("/v1/search/text", json=body).json()["hits"],
                   faiss.post("/v1/search/text", json=body).json()["hits"]]
            np.testing.assert_allclose([h["score"] for h in got[0]], [h["score"] for h in got[1]], atol=1e-4)
            ids = [{h["id"] for h in hits} for hits in got]
            assert taken_down not in ids[0] | ids[1]
            if "filter" not in body:
                assert ids[0] == ids[1] == (set(clips) | set(sounds)) - {taken_down}
        for item_id in sounds:
            similar = [c.get(f"/v1/search/similar/{item_id}", params={"k": 6}).json()["hits"] for c in (milvus, faiss)]
            np.testing.assert_allclose([h["score"] for h in similar[0]], [h["score"] for h in similar[1]], atol=1e-4)
            assert item_id not in {h["id"] for h in similar[0]}
        assert milvus.get(f"/v1/search/similar/{taken_down}").status_code == 404
