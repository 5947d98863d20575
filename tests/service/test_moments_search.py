"""Moments in long recordings through the HTTP API (SPEC §19): `tonearm index` stores windows, and
`POST /v1/search/moments[/audio]` finds one known event at the right time, on FAISS and on Milvus.

The recording: 40 s of quiet noise with one 8-s event placed at a known second — the first second
of a synthetic-corpus clip, repeated (an alarm that beeps every second): every window inside the
event then hears what the 2-s snippet query holds. The real tiny bundle's encoders embed it; they
are barely trained (noise and event score ~0.998 against each other), so only the snippet query
can be asked to find the time; the text query is checked for its form."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from index.audio.decode import decode_audio
from index.bundle.format import read_manifest
from service.app import create_app
from tests.service.conftest import ADMIN, make_settings, running_client
from tests.service.test_demo_page import browser  # noqa: F401 - the demo page's fixture (fails under CI=true without chromium)
from tests.service.test_routes import assert_problem
from tonearm.cli import main as tonearm_main
from training.data.manifest import load_manifest

EVENT_AT = 20.0
LENGTH = 40.0


@pytest.fixture(scope="module")
def long_recording(tiny_corpus: Path, tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A folder with the long recording (and one short clip, which gets no windows); the event's span."""
    rate = read_manifest(tiny_bundle).sample_rate
    record = load_manifest(tiny_corpus, languages=["eng"], drop_other_languages=True, split="test")[0]
    clip = decode_audio(record.audio, sample_rate=rate)
    event = np.tile(clip[:rate], 8)
    rng = np.random.default_rng(0)
    wave = rng.normal(0, 0.003, int(LENGTH * rate)).astype(np.float32)
    at = int(EVENT_AT * rate)
    wave[at : at + len(event)] += event
    folder = tmp_path_factory.mktemp("long_recordings")
    sf.write(folder / "walk.wav", np.clip(wave, -1, 1), rate)
    sf.write(folder / "short.wav", clip[: rate], rate)
    snippet = io.BytesIO()
    sf.write(snippet, event[: 2 * rate], rate, format="WAV")
    return {"folder": folder, "span": (EVENT_AT, EVENT_AT + len(event) / rate), "snippet": snippet.getvalue(),
            "caption": record.captions["eng"][0]}


@pytest.fixture(scope="module")
def moment_bundles(long_recording: dict, tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("moment_bundles")
    assert tonearm_main(["index", str(long_recording["folder"]), "--bundle", str(tiny_bundle),
                         "--out", str(root / "walks")]) == 0
    return root


def _settings(root: Path, **extra):
    return make_settings(bundles_dir=root, bundle="walks", gate_metric="t2a_mAP@10_mean", **extra)


def test_the_bundle_records_the_windows_of_the_long_recording_only(moment_bundles: Path, tiny_bundle: Path) -> None:
    manifest = read_manifest(moment_bundles / "walks")
    source = read_manifest(tiny_bundle)
    assert manifest.moments is not None
    assert manifest.moments.window_seconds == pytest.approx(source.clip_seconds)
    assert manifest.moments.hop_seconds == pytest.approx(source.clip_seconds / 2)
    assert manifest.moments.n_recordings == 1  # short.wav is one window long: no windows
    spans = np.load(moment_bundles / "walks" / manifest.moments.spans_file)
    assert len(spans) == manifest.moments.n_windows == int((LENGTH - source.clip_seconds) / manifest.moments.hop_seconds) + 1
    assert spans[-1, 2] == pytest.approx(LENGTH)


def _assert_found(hits: list[dict], span: tuple[float, float], window: float) -> None:
    """The top hit is the event: IoU ≥ 0.75 with it, each edge within a window. Not within half a
    window: the tiny bundle's scores are noise-limited (a window wholly inside the event can score
    below one that hears half of it), so an edge read at a level of the curve can land a hop (half
    a window) further than the hop it is off anyway."""
    top = hits[0]
    assert top["id"] == "walk.wav"
    assert abs(top["start"] - span[0]) <= window and abs(top["end"] - span[1]) <= window, (top, span)
    inter = max(0.0, min(top["end"], span[1]) - max(top["start"], span[0]))
    assert inter / ((top["end"] - top["start"]) + (span[1] - span[0]) - inter) >= 0.75, (top, span)


def _check_service(app, long_recording: dict) -> None:
    span = long_recording["span"]
    with running_client(app) as client:
        r = client.post("/v1/search/moments/audio", content=long_recording["snippet"],
                        headers={"content-type": "audio/wav"}, params={"k": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        _assert_found(body["hits"], span, body["window_seconds"])
        assert [h["score"] for h in body["hits"]] == sorted((h["score"] for h in body["hits"]), reverse=True)
        # the filter and min_score of every search
        gone = client.post("/v1/search/moments/audio", content=long_recording["snippet"],
                           headers={"content-type": "audio/wav"},
                           params={"filter": json.dumps({"id": {"eq": "short.wav"}})})
        assert gone.status_code == 200 and gone.json()["hits"] == []
        high = client.post("/v1/search/moments/audio", content=long_recording["snippet"],
                           headers={"content-type": "audio/wav"}, params={"min_score": 1.0})
        assert high.json()["hits"] == []
        # text, in any served language: ranked moments of the right shape
        r = client.post("/v1/search/moments", json={"query": long_recording["caption"], "k": 2, "lang": "eng"})
        assert r.status_code == 200, r.text
        hits = r.json()["hits"]
        assert 1 <= len(hits) <= 2 and all(0 <= h["start"] < h["end"] <= LENGTH for h in hits)
        assert_problem(client.post("/v1/search/moments", json={"query": "x", "lang": "xxx"}), 422, "unknown-language")
        assert_problem(client.post("/v1/search/moments", json={"query": "x", "filter": {"nope": {"eq": 1}}}),
                       422, "invalid-filter")


def test_a_known_event_is_found_at_its_time_through_http_on_faiss(moment_bundles: Path, long_recording: dict) -> None:
    _check_service(create_app(_settings(moment_bundles)), long_recording)


def test_a_bundle_without_windows_answers_409_until_a_long_recording_is_added(
    tiny_bundle: Path, long_recording: dict, tmp_path: Path
) -> None:
    app = create_app(make_settings(bundles_dir=tiny_bundle.parent, bundle=tiny_bundle.name,
                                   gate_metric="t2a_mAP@10_mean", items_dir=tmp_path / "items"))
    with running_client(app) as client:
        assert_problem(client.post("/v1/search/moments", json={"query": "a dog barks"}), 409, "no-moment-index")
        wav = (long_recording["folder"] / "walk.wav").read_bytes()
        r = client.post("/v1/items", headers=ADMIN, data={"id": "added-walk", "metadata": json.dumps({"kind": "walk"})},
                        files={"file": ("walk.wav", wav, "audio/wav")})
        assert r.status_code == 201, r.text
        r = client.post("/v1/search/moments/audio", content=long_recording["snippet"],
                        headers={"content-type": "audio/wav"}, params={"k": 2})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["hits"][0]["id"] == "added-walk"
        _assert_found([{**h, "id": "walk.wav"} for h in body["hits"]], long_recording["span"], body["window_seconds"])
        gone = client.post("/v1/search/moments/audio", content=long_recording["snippet"],
                           headers={"content-type": "audio/wav"},
                           params={"filter": json.dumps({"kind": {"eq": "other"}})})
        assert gone.status_code == 200 and gone.json()["hits"] == []
        assert client.delete("/v1/items/added-walk", headers=ADMIN).status_code == 200
        assert_problem(client.post("/v1/search/moments", json={"query": "a dog barks"}), 409, "no-moment-index")


@pytest.mark.slow
def test_a_known_event_is_found_at_its_time_through_http_on_milvus(
    moment_bundles: Path, long_recording: dict, milvus_uri: str
) -> None:
    from tests.milvus_server import require_milvus

    require_milvus()
    assert tonearm_main(["bundle", "publish", str(moment_bundles / "walks"), "--milvus-uri", milvus_uri]) == 0
    _check_service(create_app(_settings(moment_bundles, index_backend="milvus", milvus_uri=milvus_uri)), long_recording)


def test_the_demo_page_shows_the_moments_on_a_timeline_and_plays_from_start(
    moment_bundles: Path, long_recording: dict, uvicorn_runner, browser, tmp_path: Path  # noqa: F811
) -> None:
    from tests.service.test_demo_page import _screenshots, _watched_page

    with uvicorn_runner(create_app(_settings(moment_bundles))) as server:
        server.wait_ready()
        page, problems = _watched_page(browser, server.url)
        page.goto(server.url + "/")
        page.fill("#moment-query", long_recording["caption"])
        page.click("#moments-button")
        page.wait_for_selector("#moments li .timeline .mark.current")
        first = page.locator("#moments li").first
        assert "walk.wav" in first.inner_text()
        # the scorer that answered: this bundle has no trained head
        assert "scored by the sliding windows" in page.inner_text("#moments-status")
        assert page.get_attribute("#moments", "data-scorer") == "windows"
        start = float(page.evaluate("() => document.querySelector('#moments li audio').currentTime"))
        label = first.locator("button").inner_text()  # "Play from m:ss.s"
        minutes, seconds = label.removeprefix("Play from ").split(":")
        assert start == pytest.approx(60 * int(minutes) + float(seconds), abs=0.06)
        page.screenshot(path=str(_screenshots(tmp_path) / "5-moments.png"), full_page=True)
        page.close()
        assert problems == []
