"""Moments on the Milvus backend (issue 54, part 4): `tonearm bundle publish` writes the bundle's moment windows
to Milvus, and a replica serving the bundle from Milvus reads them there — started with the bundle's
``moments/`` files removed, it still answers ``/v1/search/moments``, with the top moment the file path gives.

The long recording and its bundle are tests/service/test_moments_search.py's (`tonearm index` of a 40-s
recording with one event, the real tiny bundle's encoders); the session's Milvus 2.3.5 server. ~15 s."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from index.bundle.format import read_manifest
from service.app import create_app
from tests.milvus_server import require_milvus
from tests.service.conftest import make_settings, running_client
from tests.service.test_moments_search import long_recording, moment_bundles  # noqa: F401 - module fixtures
from tonearm.cli import main as tonearm_main

require_milvus()


def _top(app, snippet: bytes) -> dict:
    with running_client(app) as client:
        r = client.post("/v1/search/moments/audio", content=snippet, headers={"content-type": "audio/wav"},
                        params={"k": 3})
        assert r.status_code == 200, r.text
        text = client.post("/v1/search/moments", json={"query": "an alarm beeps", "k": 2})
        assert text.status_code == 200, text.text
        source = app.state.tonearm.registry.active_searcher().bundle_window_source
        return {"audio": r.json()["hits"], "text": text.json()["hits"], "source": source}


def test_a_replica_without_the_moment_files_answers_from_milvus_as_the_files_do(
    moment_bundles: Path, long_recording: dict, milvus_server, tmp_path: Path,  # noqa: F811
) -> None:
    from index.engines.milvus_index import MilvusTarget, published_info
    from index.engines.milvus_windows import MilvusWindows

    served = tmp_path / "bundles"
    shutil.copytree(moment_bundles / "walks", served / "walks")
    manifest = read_manifest(served / "walks")
    assert manifest.moments is not None and manifest.moments.n_windows > 0
    assert tonearm_main(["bundle", "publish", str(served / "walks"), "--milvus-uri", milvus_server.uri]) == 0
    windows = published_info(MilvusTarget(uri=milvus_server.uri), manifest.bundle_id)["windows"]
    assert windows["n_windows"] == manifest.moments.n_windows and windows["n_recordings"] == manifest.moments.n_recordings
    assert windows["index_type"] == "FLAT" and windows["recall_at_10"] == 1.0  # small: exact

    for name in (manifest.moments.windows_file, manifest.moments.spans_file):
        (served / "walks" / name).unlink()  # the replica keeps no copy: it could not load one
    settings = {"bundle": "walks", "gate_metric": "t2a_mAP@10_mean"}
    from_files = _top(create_app(make_settings(bundles_dir=moment_bundles, **settings)), long_recording["snippet"])
    app = create_app(make_settings(bundles_dir=served, index_backend="milvus", milvus_uri=milvus_server.uri, **settings))
    from_milvus = _top(app, long_recording["snippet"])
    assert isinstance(from_milvus["source"], MilvusWindows) and from_files["source"] is None
    for kind in ("audio", "text"):
        files, milvus = from_files[kind][0], from_milvus[kind][0]
        # the same moment; its edges are read between window centres where the curve crosses a level, and the
        # windows are stored as float16 in Milvus: milliseconds apart
        assert milvus["id"] == files["id"], kind
        assert milvus["start"] == pytest.approx(files["start"], abs=0.05) and milvus["end"] == pytest.approx(
            files["end"], abs=0.05), (kind, milvus, files)
        assert milvus["score"] == pytest.approx(files["score"], abs=1e-3)
    assert from_milvus["audio"][0]["id"] == "walk.wav"
