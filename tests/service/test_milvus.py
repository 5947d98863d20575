"""The service on the Milvus backend, on both real engines (the standalone server of the `milvus`
package and milvus-lite 3.x): publish / activate / gate / rollback through the active aliases, a clear
409 for a bundle not yet published, and a follower replica that swaps without rewriting the aliases.
The backend's own defects are covered in tests/index/test_milvus_backend.py."""

from __future__ import annotations

from index.runtime.loader import LoadedBundle
from tests.milvus_server import require_milvus, unpublish
from tests.service.conftest import ADMIN, running_client
from tests.service.test_real_bundles import real_settings
from tests.service.test_routes import assert_problem
from tonearm.cli import main as tonearm_main

require_milvus()

from index.engines.milvus_index import MilvusTarget, active_bundle  # noqa: E402


def test_publish_activate_gate_rollback_through_milvus(real_bundles, milvus_uri, monkeypatch):
    uri = milvus_uri
    a, b, worse = (real_bundles.id(name) for name in ("a", "b", "worse"))
    unpublish(uri, worse)  # the session's server may hold it (b it may too: tests/service/test_items_in_milvus.py)
    assert tonearm_main(["bundle", "publish", str(real_bundles.a), "--milvus-uri", uri]) == 0
    target = MilvusTarget(uri=uri)
    settings = real_settings(real_bundles, index_backend="milvus", milvus_uri=uri)
    from service.app import create_app

    with running_client(create_app(settings)) as client:
        assert active_bundle(target) == a  # startup marked it
        problem = assert_problem(
            client.post("/v1/bundles/activate", json={"bundle_id": worse, "force": True}, headers=ADMIN),
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

        # A follower replica (Redis told it about b) swaps without touching the aliases: the
        # replica that activated already switched them (each follower rewrote them before).
        writes: list[str] = []
        milvus = target.client()  # the process's one client, the app's too
        for method in ("alter_alias", "create_alias", "drop_alias"):
            monkeypatch.setattr(milvus, method, lambda *args, _m=method, **kw: writes.append(_m))
        registry = client.app.state.tonearm.registry
        registry.apply_remote(b)
        assert registry.active_id == b and writes == [] and active_bundle(target) == a


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
