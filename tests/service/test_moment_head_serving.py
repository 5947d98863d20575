"""A bundle carrying a trained moment head (SPEC §20): `/v1/search/moments` uses it and says so (`scorer`),
a bundle without one keeps the sliding windows, and a head trained for other encoders is refused at load.

The head here is an untrained, 8-wide one exported by `tonearm train-moments`' own code (its scores mean
nothing; what is tested is which scorer answers). Cost: ~10 s, most of it the long recording's `tonearm index`
(the fixtures of tests/service/test_moments_search.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from index.bundle.format import (
    encoder_digests,
    publish_with_moment_head,
    read_manifest,
    verify_files,
)
from index.errors import BundleError
from index.runtime.loader import LoadedBundle
from service.app import create_app
from tests.service.conftest import ADMIN, make_settings, running_client
from tests.service.test_moments_search import LENGTH, long_recording, moment_bundles  # noqa: F401 - fixtures
from tonearm.cli import main as tonearm_main
from training.models.moment_head import MomentHead
from training.moment_head import export_head


def _head(folder: Path, bundle: Path, **digests: str) -> Path:
    manifest = read_manifest(bundle)
    assert manifest.moments is not None
    torch.manual_seed(0)
    head = MomentHead(manifest.embed_dim, hidden=8, layers=1, window_seconds=manifest.moments.window_seconds).eval()
    export_head(head, folder, window_seconds=manifest.moments.window_seconds,
                hop_seconds=manifest.moments.hop_seconds,
                extra={"encoder_sha256": {**encoder_digests(manifest), **digests}})
    return folder


@pytest.fixture(scope="module")
def head_bundles(moment_bundles: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    head = _head(tmp_path_factory.mktemp("head"), moment_bundles / "walks")
    publish_with_moment_head(moment_bundles / "walks", head, moment_bundles, "walks-head")
    return moment_bundles


def test_the_moment_search_uses_the_head_when_the_bundle_has_one_and_says_so(
    head_bundles: Path, long_recording: dict  # noqa: F811
) -> None:
    manifest = verify_files(head_bundles / "walks-head")
    source = read_manifest(head_bundles / "walks")
    assert manifest.moment_head is not None and manifest.moment_head.source_bundle == "walks"
    assert manifest.moment_head.encoder_sha256 == encoder_digests(source)
    assert manifest.moments == source.moments  # the same windows, hard-linked or copied
    assert '"moment_head"' not in (head_bundles / "walks" / "manifest.json").read_text()  # old bundles unchanged
    for bundle, scorer in (("walks-head", "head"), ("walks", "windows")):
        app = create_app(make_settings(bundles_dir=head_bundles, bundle=bundle, gate_metric="t2a_mAP@10_mean"))
        with running_client(app) as client:
            r = client.post("/v1/search/moments", json={"query": long_recording["caption"], "k": 3, "lang": "eng"})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["scorer"] == scorer and body["bundle_id"] == bundle
            assert body["hits"] and all(0 <= h["start"] < h["end"] <= LENGTH for h in body["hits"])
            if scorer == "head":
                assert all(0.0 <= h["score"] <= 1.0 for h in body["hits"])  # the head's probabilities
            r = client.post("/v1/search/moments/audio", content=long_recording["snippet"],
                            headers={"content-type": "audio/wav"}, params={"k": 2})
            assert r.status_code == 200 and r.json()["scorer"] == scorer, r.text
            listed = {b["bundle_id"]: b for b in client.get("/v1/bundles", headers=ADMIN).json()["bundles"]}
            assert listed["walks-head"]["moment_scorer"] == "head"
            assert listed["walks"]["moment_scorer"] == "windows"
            schema = client.get("/openapi.json").json()["components"]["schemas"]["MomentSearchResponse"]
            assert schema["properties"]["scorer"]["enum"] == ["head", "windows"]


def test_bundle_verify_reports_the_moment_scorer(head_bundles: Path, capsys: pytest.CaptureFixture) -> None:
    assert tonearm_main(["bundle", "verify", str(head_bundles / "walks-head")]) == 0
    assert "moments: scored by the trained moment head" in capsys.readouterr().out
    assert tonearm_main(["bundle", "verify", str(head_bundles / "walks")]) == 0
    assert "moments: scored by the sliding windows" in capsys.readouterr().out


def test_a_head_trained_for_other_encoders_is_refused(head_bundles: Path, tmp_path: Path) -> None:
    walks = head_bundles / "walks"
    other = _head(tmp_path / "head", walks, audio="0" * 64)
    with pytest.raises(BundleError, match="another audio encoder"):
        publish_with_moment_head(walks, other, tmp_path, "refused")
    assert not (tmp_path / "refused").exists()
    # assembled anyway (as by hand): the loader refuses it, with or without the file checks
    publish_with_moment_head(walks, other, tmp_path, "mismatched", check=False)
    for verify in (True, False):
        with pytest.raises(BundleError, match="trained on another audio encoder.*tonearm train-moments"):
            LoadedBundle.open(tmp_path / "mismatched", verify=verify)
    described = json.loads((tmp_path / "mismatched" / "moment_head.json").read_text())
    assert described["encoder_sha256"]["audio"] == "0" * 64
    bundle = LoadedBundle.open(walks)  # a bundle without a head loads as before
    try:
        assert bundle.moment_head is None and bundle.moment_scorer == "windows"
    finally:
        bundle.close()
