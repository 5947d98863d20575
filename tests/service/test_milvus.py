"""Milvus backend against Milvus Lite (the milvus-lite 2.x wheel embeds the real engine): parity with FAISS
on exact indices, language filtering in Milvus, publish / activate / rollback through the active pointer,
and a clear 409 for a bundle not yet published."""

from __future__ import annotations

import numpy as np
import pytest

from index.loader import LoadedBundle
from tests.service.conftest import ADMIN, IN_CI, running_client
from tests.service.test_real_bundles import real_settings
from tests.service.test_routes import assert_problem
from tonearm.cli import main as tonearm_main

try:
    import milvus_lite  # noqa: F401
    import pymilvus  # noqa: F401
except ImportError:  # pragma: no cover - CI installs the milvus extra
    if IN_CI:
        raise
    pytest.skip("the milvus extra is not installed: pip install 'tonearm[milvus]'", allow_module_level=True)

from index.milvus_index import BundleNotPublished, MilvusTarget, active_bundle, publish  # noqa: E402


@pytest.fixture(scope="module")
def lite(tmp_path_factory) -> MilvusTarget:
    return MilvusTarget(uri=str(tmp_path_factory.mktemp("milvus") / "tonearm.db"))


def test_top10_equals_faiss_on_exact_indices_and_languages_filter_in_milvus(tiny_bundle, lite):
    assert publish(tiny_bundle, lite) is True
    assert publish(tiny_bundle, lite) is False  # already there: nothing rewritten
    local = LoadedBundle.open(tiny_bundle)
    remote = LoadedBundle.open(tiny_bundle, milvus=lite)
    try:
        assert local.manifest.audio_index.factory == local.manifest.text_index.factory == "Flat"
        queries = local.encode_text(["a dog barks", "un chien aboie", "犬が吠える", "rain on a roof", "bells"])
        _, faiss_rows = local.search_audio(queries, 10)
        _, milvus_rows = remote.search_audio(queries, 10)
        np.testing.assert_array_equal(milvus_rows, faiss_rows)

        clips = local.encode_audio(local.eval_set().waveforms[:4])
        for languages in (None, ["fra"], ["jpn", "eng"]):
            faiss_scores, faiss_rows = local.search_text(clips, 10, languages=languages)
            milvus_scores, milvus_rows = remote.search_text(clips, 10, languages=languages)
            np.testing.assert_array_equal(milvus_rows, faiss_rows)
            np.testing.assert_allclose(milvus_scores, faiss_scores, atol=1e-4)
            if languages:
                assert {local.text_items[r]["lang"] for r in milvus_rows.ravel()} <= set(languages)
        np.testing.assert_allclose(remote.audio_embeddings(), local.audio_embeddings(), atol=1e-6)
    finally:
        local.close()
        remote.close()


def test_opening_an_unpublished_bundle_says_how_to_publish(tiny_bundle, tmp_path):
    empty = MilvusTarget(uri=str(tmp_path / "empty.db"))
    with pytest.raises(BundleNotPublished, match="tonearm bundle publish"):
        LoadedBundle.open(tiny_bundle, milvus=empty)


def test_publish_activate_gate_rollback_through_milvus(real_bundles, tmp_path):
    uri = str(tmp_path / "service.db")
    a, b, worse = (real_bundles.id(name) for name in ("a", "b", "worse"))
    assert tonearm_main(["bundle", "publish", str(real_bundles.a), "--milvus-uri", uri]) == 0
    target = MilvusTarget(uri=uri)
    settings = real_settings(real_bundles, index_backend="milvus", milvus_uri=uri)
    from service.app import create_app

    with running_client(create_app(settings)) as client:
        assert active_bundle(target) == a  # startup marked it
        problem = assert_problem(
            client.post("/v1/bundles/activate", json={"bundle_id": b, "force": True}, headers=ADMIN),
            409, "bundle-not-published",
        )
        assert "tonearm bundle publish" in problem["detail"]
        for bundle_dir in (real_bundles.b, real_bundles.worse):
            assert tonearm_main(["bundle", "publish", str(bundle_dir), "--milvus-uri", uri]) == 0

        r = client.post("/v1/bundles/activate", json={"bundle_id": b, "force": True}, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert active_bundle(target) == b
        hits = client.post("/v1/search/text", json={"query": "a dog barks", "k": 3}).json()
        assert hits["bundle_id"] == b and len(hits["hits"]) == 3

        rejected = client.post("/v1/bundles/activate", json={"bundle_id": worse}, headers=ADMIN)
        assert_problem(rejected, 409, "quality-gate-rejected")
        assert active_bundle(target) == b  # the gate still guards the pointer

        assert client.post("/v1/bundles/rollback", headers=ADMIN).status_code == 200
        assert active_bundle(target) == a
        audio = client.post("/v1/search/audio?k=2&lang=fra", content=_wav(real_bundles.a))
        assert audio.status_code == 200, audio.text
        assert audio.json()["bundle_id"] == a and {h["lang"] for h in audio.json()["hits"]} == {"fra"}


def _wav(bundle_dir) -> bytes:
    import io

    import soundfile as sf

    bundle = LoadedBundle.open(bundle_dir, verify=False)
    try:
        wave = bundle.eval_set().waveforms[0]
        buffer = io.BytesIO()
        sf.write(buffer, wave, bundle.sample_rate, format="WAV")
        return buffer.getvalue()
    finally:
        bundle.close()
