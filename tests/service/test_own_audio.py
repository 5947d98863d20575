"""`tonearm index`: an index-only bundle of a folder of the user's own files (issue 13 item 6).

Real files (WAV/FLAC/OGG written with soundfile, nested), a corrupt file and a text
file; the real tiny bundle's ONNX encoders; the service through its real app."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from index.audio.decode import decode_audio
from index.runtime.loader import LoadedBundle, NoCaptionIndex
from index.runtime.verify import verify_bundle
from service.app import create_app
from tests.service.bundle_factory import copy_bundle
from tests.service.conftest import ADMIN, make_settings, running_client
from tests.service.test_routes import assert_problem
from tonearm.cli import main as tonearm_main
from tonearm.errors import BundleError

AUDIO = {"top.wav": "WAV", "birds/morning.flac": "FLAC", "birds/deep/night.ogg": "OGG", "b/x.wav": "WAV"}


@pytest.fixture(scope="module")
def own_folder(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four noise bursts of different lengths in three formats, nested, plus two files that are not audio."""
    rate = LoadedBundle.open(tiny_bundle).sample_rate
    folder = tmp_path_factory.mktemp("my_sounds")
    rng = np.random.default_rng(0)
    for i, (rel, kind) in enumerate(AUDIO.items()):
        wave = rng.uniform(-0.5, 0.5, rate // 2 * (i + 1)).astype(np.float32) * np.hanning(rate // 2 * (i + 1))
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        sf.write(folder / rel, wave.astype(np.float32), rate, format=kind)
    (folder / "birds" / "broken.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt garbage")
    (folder / "notes.txt").write_text("not audio\n")
    sf.write(folder / "sun.au", np.zeros(rate // 4, np.float32), rate, format="AU")  # uploads refuse AU: so does index
    whole = folder / "top.wav"
    (folder / "cut.wav").write_bytes(whole.read_bytes()[:2000])  # truncated: only its header is intact
    return folder


@pytest.fixture(scope="module")
def own_bundle(own_folder: Path, tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("own_bundles") / "my-sounds"
    assert tonearm_main(["index", str(own_folder), "--bundle", str(tiny_bundle), "--out", str(out)]) == 0
    return out


def test_bundle_holds_every_audio_file_and_verifies(own_bundle: Path) -> None:
    ids = [json.loads(line)["id"] for line in (own_bundle / "audio_ids.jsonl").read_text().splitlines()]
    assert sorted(ids) == sorted(AUDIO)
    manifest = verify_bundle(own_bundle)
    assert manifest.audio_index.ntotal == 4
    assert manifest.text_index is None and manifest.eval_set is None and manifest.evaluation is None
    assert manifest.source.audio_root and (Path(manifest.source.audio_root) / "birds/deep/night.ogg").is_file()


SKIPPED = ("birds/broken.wav", "notes.txt", "sun.au", "cut.wav")


def test_cli_reports_each_skipped_file_once(own_folder: Path, tiny_bundle: Path, tmp_path: Path, capfd) -> None:
    assert tonearm_main(["index", str(own_folder), "--bundle", str(tiny_bundle), "--out", str(tmp_path / "b")]) == 0
    captured = capfd.readouterr()
    out = captured.out + captured.err
    assert "4 files indexed, 4 skipped" in out
    for rel in SKIPPED:  # once: not a log warning as well as the summary line
        assert sum(line.startswith(f"skipped {rel}:") for line in out.splitlines()) == 1, (rel, out)
        assert out.count(f"/{rel}") <= 1, (rel, out)
    assert "sun.au: " in out and "not WAV, FLAC, OGG (Vorbis/Opus) or MP3 audio" in out
    assert "truncated WAV" in out
    assert tonearm_main(["index", str(own_folder), "--bundle", str(tiny_bundle), "--out", str(tmp_path / "b")]) == 2


def test_text_search_ranks_the_files_as_the_encoders_do(own_bundle: Path, own_folder: Path, tiny_bundle: Path) -> None:
    source = LoadedBundle.open(tiny_bundle)
    bundle = LoadedBundle.open(own_bundle)
    assert bundle.has_captions is False and source.has_captions is True
    ids = [item["id"] for item in bundle.audio_items]
    clips = source.encode_audio([decode_audio(own_folder / i, sample_rate=source.sample_rate) for i in ids])
    queries = ["a dog barks", "Regen fällt auf ein Dach", "鳥が鳴いている"]
    q = source.encode_text(queries)
    expected = [[ids[j] for j in np.argsort(-(clips @ row), kind="stable")] for row in q]
    scores, rows = bundle.search_audio(bundle.encode_text(queries), 4)
    assert [[ids[r] for r in found] for found in rows] == expected
    np.testing.assert_allclose(scores, np.sort(q @ clips.T, axis=1)[:, ::-1], atol=1e-4)
    with pytest.raises(NoCaptionIndex, match="no caption index"):
        bundle.search_text(clips[:1], 1)
    with pytest.raises(BundleError, match="no held-out set"):
        bundle.eval_set()


def test_service_searches_text_and_refuses_audio_to_text(own_bundle: Path, own_folder: Path) -> None:
    app = create_app(make_settings(bundles_dir=own_bundle.parent, bundle=own_bundle.name))
    with running_client(app) as client:
        r = client.post("/v1/search/text", json={"query": "rain on a roof", "k": 4})
        assert r.status_code == 200, r.text
        assert sorted(h["id"] for h in r.json()["hits"]) == sorted(AUDIO)
        audio = (own_folder / "top.wav").read_bytes()
        r = client.post("/v1/search/audio", files={"file": ("top.wav", audio, "audio/wav")})
        assert_problem(r, 409, "no-caption-index")
        assert_problem(client.get("/v1/diagnostics/consistency"), 409, "no-heldout-set")
        streamed = client.get("/v1/audio/birds/morning.flac")
        assert streamed.status_code == 200 and streamed.content == (own_folder / "birds/morning.flac").read_bytes()
        listing = client.get("/v1/bundles", headers=ADMIN).json()
        assert list(next(b for b in listing["bundles"] if b["bundle_id"] == own_bundle.name)["indices"]) == ["audio"]


def test_gate_cannot_compare_an_index_only_bundle_so_activation_needs_force(
    own_bundle: Path, tiny_bundle: Path, tmp_path: Path
) -> None:
    copy_bundle(tiny_bundle, tmp_path)
    copy_bundle(own_bundle, tmp_path)
    app = create_app(make_settings(bundles_dir=tmp_path, bundle=tiny_bundle.name))
    with running_client(app) as client:
        refused = client.post("/v1/bundles/activate", json={"bundle_id": own_bundle.name}, headers=ADMIN)
        body = assert_problem(refused, 409, "quality-gate-rejected")
        assert "no held-out set" in body["verdict"]["reasons"][0]
        assert client.get("/readyz").json()["bundle_id"] == tiny_bundle.name
        forced = client.post("/v1/bundles/activate", json={"bundle_id": own_bundle.name, "force": True}, headers=ADMIN)
        assert forced.status_code == 200, forced.text
        assert client.get("/readyz").json()["bundle_id"] == own_bundle.name
