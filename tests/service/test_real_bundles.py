"""The service over real exported bundles (ONNX + FAISS): routes, gate, tampering, hot swap under load."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from index.runtime.loader import LoadedBundle
from service.app import create_app
from tests.service.bundle_factory import copy_bundle, tamper
from tests.service.conftest import ADMIN, make_settings, running_client, wait_until
from tests.service.test_routes import assert_problem
from tonearm.cli import main as tonearm_main

TOKEN = ADMIN["Authorization"].removeprefix("Bearer ")


def real_settings(bundles, **extra):
    values = {"bundles_dir": bundles.root, "bundle": bundles.id("a"), "gate_metric": "t2a_mAP@10_mean"}
    values.update(extra)
    return make_settings(**values)


@pytest.fixture(scope="module")
def real_client(real_bundles):
    app = create_app(real_settings(real_bundles))
    with running_client(app) as client:
        yield client


def first_clip(bundles) -> dict:
    return json.loads((bundles.a / "audio_ids.jsonl").read_text(encoding="utf-8").splitlines()[0])


def test_text_search_in_french_and_japanese(real_client, real_bundles):
    clip = first_clip(real_bundles)
    for lang in ("fra", "jpn"):
        r = real_client.post("/v1/search/text", json={"query": clip["captions"][lang][0], "lang": lang, "k": 5})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["bundle_id"] == real_bundles.id("a") and len(body["hits"]) == 5
        scores = [h["score"] for h in body["hits"]]
        assert scores == sorted(scores, reverse=True) and all(-1.001 <= s <= 1.001 for s in scores)


def test_text_search_matches_the_bundle_computed_directly(real_client, real_bundles):
    bundle = LoadedBundle.open(real_bundles.a)
    query = first_clip(real_bundles)["captions"]["deu"][0]
    scores, rows = bundle.search_audio(bundle.encode_text([query]), 3)
    body = real_client.post("/v1/search/text", json={"query": query, "k": 3}).json()
    assert [h["id"] for h in body["hits"]] == [bundle.audio_items[r]["id"] for r in rows[0]]
    assert np.allclose([h["score"] for h in body["hits"]], scores[0], atol=1e-5)


def test_audio_upload_returns_captions_of_the_requested_languages(real_client, real_bundles):
    clip = first_clip(real_bundles)
    audio = (real_bundles.corpus.parent / clip["uri"]).read_bytes()
    r = real_client.post("/v1/search/audio?k=4&lang=jpn&lang=fra", content=audio)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["format"] == "wav"
    assert [h["lang"] for h in body["hits"]] == ["jpn"] * 4 + ["fra"] * 4  # top k per language, in request order
    multipart = real_client.post("/v1/search/audio?k=2", files={"file": ("clip.bin", audio, "text/plain")})
    languages = LoadedBundle.open(real_bundles.a).languages
    assert multipart.status_code == 200 and [h["lang"] for h in multipart.json()["hits"]] == sorted(
        languages * 2, key=languages.index
    )


def test_consistency_ranks_agree_with_a_full_search(real_client, real_bundles):
    clip = first_clip(real_bundles)
    captions = {lang: clip["captions"][lang][0] for lang in ("eng", "fra", "jpn")}
    body = real_client.post(
        "/v1/diagnostics/consistency", json={"captions": captions, "target_id": clip["id"], "k": 3}
    ).json()
    bundle = LoadedBundle.open(real_bundles.a)
    n = len(bundle.audio_items)
    ranks = []
    for lang, text in captions.items():
        scores, rows = bundle.search_audio(bundle.encode_text([text]), n)
        target = scores[0][list(rows[0]).index(0)]
        expected = int(np.sum(scores[0] >= target - 1e-6))  # pessimistic ties
        assert body["languages"][lang]["target_rank"] == expected
        ranks.append(expected)
    assert body["mrv"] == pytest.approx(float(np.var(ranks)))
    assert set(body["gap"]) == {"fra", "jpn"} and all(v >= 0 for v in body["dis"].values())


def test_heldout_report_comes_from_the_manifest(real_client, real_bundles):
    body = real_client.get("/v1/diagnostics/consistency").json()
    manifest = json.loads((real_bundles.a / "manifest.json").read_text())
    assert body["source"] == "manifest"
    assert body["report"] == pytest.approx(manifest["evaluation"]["report"])
    assert set(body["per_language"]) == {*manifest["languages"], "mean"}
    assert body["mrv_t2a"] == pytest.approx(manifest["evaluation"]["report"]["mrv_t2a"])


def test_gate_refuses_the_worse_bundle_and_the_old_one_keeps_serving(real_client, real_bundles):
    r = real_client.post("/v1/bundles/activate", json={"bundle_id": real_bundles.id("worse")}, headers=ADMIN)
    problem = assert_problem(r, 409, "quality-gate-rejected")
    verdict = problem["verdict"]
    assert verdict["candidate"]["t2a_mAP@10_mean"] < verdict["active"]["t2a_mAP@10_mean"] - 0.02
    assert verdict["compared_to"] == real_bundles.id("a")
    assert real_client.get("/readyz").json()["bundle_id"] == real_bundles.id("a")


def test_tampered_bundle_is_refused(real_bundles, tmp_path):
    copy_bundle(real_bundles.a, tmp_path)
    tamper(copy_bundle(real_bundles.b, tmp_path))
    app = create_app(real_settings(real_bundles, bundles_dir=tmp_path))
    with running_client(app) as client:
        r = client.post("/v1/bundles/activate", json={"bundle_id": real_bundles.id("b"), "force": True}, headers=ADMIN)
        problem = assert_problem(r, 422, "bundle-invalid")
        assert "text_ids.jsonl" in problem["detail"] and "sha256" in problem["detail"]
        ok = client.post("/v1/search/text", json={"query": "a dog barks", "k": 1})
        assert ok.status_code == 200 and ok.json()["bundle_id"] == real_bundles.id("a")
        listing = client.get("/v1/bundles", headers=ADMIN).json()
        assert listing["active"] == real_bundles.id("a")
        entry = next(b for b in listing["bundles"] if b["bundle_id"] == real_bundles.id("a"))
        manifest = json.loads((real_bundles.a / "manifest.json").read_text())
        for name in ("audio", "text"):  # the recall measured at export is what the listing reports
            recorded = manifest[f"{name}_index"]
            assert entry["indices"][name]["ann_recall_at_10"] == recorded["ann_recall_at_10"]
            assert entry["indices"][name]["factory"] == recorded["factory"]


def _query_loop(url: str, stop: threading.Event, log: list, audio: bytes | None, seed: int) -> None:
    """One client: queries until ``stop``; logs (start, end, status, bundle_id) or the exception."""
    queries = ["a dog barks", "un chien aboie", "犬が吠える", "sirène puis cloche", "rain and wind"]
    with httpx.Client(base_url=url, timeout=60) as client:
        i = seed
        while not stop.is_set():
            start = time.monotonic()
            try:
                if audio is not None:
                    r = client.post("/v1/search/audio?k=3", content=audio)
                else:
                    r = client.post("/v1/search/text", json={"query": f"{queries[i % 5]} {i}", "k": 5})
                bundle_id = r.json().get("bundle_id") if r.status_code == 200 else r.text
                log.append((start, time.monotonic(), r.status_code, bundle_id))
            except Exception as err:  # a failed request is what this test looks for
                log.append((start, time.monotonic(), -1, repr(err)))
            i += 1


def test_hot_swap_under_load_and_rollback_via_cli(real_bundles, uvicorn_runner, monkeypatch, capsys):
    monkeypatch.setenv("TONEARM_ADMIN_TOKEN", TOKEN)
    a, b = real_bundles.id("a"), real_bundles.id("b")
    audio = (real_bundles.corpus.parent / first_clip(real_bundles)["uri"]).read_bytes()
    app = create_app(real_settings(real_bundles, search_threads=4))
    with uvicorn_runner(app) as server:
        server.wait_ready()
        stop, log = threading.Event(), []
        clients = [
            threading.Thread(target=_query_loop, args=(server.url, stop, log, audio if i == 0 else None, i))
            for i in range(5)
        ]
        for thread in clients:
            thread.start()
        try:
            wait_until(lambda: len(log) >= 20, timeout=60, what="traffic before the swap")
            assert tonearm_main(["bundle", "activate", b, "--url", server.url, "--force"]) == 0
            activated_at = time.monotonic()
            wait_until(lambda: sum(1 for e in log if e[0] > activated_at) >= 20, timeout=60, what="traffic on b")
            # The server swaps back before the rollback call returns, so "answered by b" is only
            # guaranteed for requests that ended before the call began.
            rollback_called_at = time.monotonic()
            assert tonearm_main(["bundle", "rollback", "--url", server.url]) == 0
            rolled_back_at = time.monotonic()
            wait_until(lambda: sum(1 for e in log if e[0] > rolled_back_at) >= 20, timeout=60, what="traffic on a")
        finally:
            stop.set()
            for thread in clients:
                thread.join(timeout=60)
        assert tonearm_main(["bundle", "list", "--url", server.url]) == 0

    failures = [e for e in log if e[2] != 200]
    assert failures == [], failures[:5]
    started_on_b = [e[3] for e in log if activated_at < e[0] and e[1] < rollback_called_at]
    assert started_on_b and set(started_on_b) == {b}
    assert {e[3] for e in log if e[0] > rolled_back_at} == {a}
    assert {e[3] for e in log if e[1] < activated_at - 5} <= {a}
    out = capsys.readouterr().out
    assert "gate:" in out and b in out and "rolled back" in out


def test_cli_activate_prints_the_gate_rejection(real_bundles, uvicorn_runner, monkeypatch, capsys):
    monkeypatch.setenv("TONEARM_ADMIN_TOKEN", TOKEN)
    with uvicorn_runner(create_app(real_settings(real_bundles))) as server:
        server.wait_ready()
        assert tonearm_main(["bundle", "activate", real_bundles.id("worse"), "--url", server.url]) == 1
        monkeypatch.setenv("TONEARM_ADMIN_TOKEN", "wrong-token-wrong-token")
        assert tonearm_main(["bundle", "list", "--url", server.url]) == 2
    captured = capsys.readouterr()
    assert "rejected" in captured.out and "t2a_mAP@10_mean" in captured.out
    assert "401" in captured.err


def test_missing_initial_bundle_leaves_the_service_not_ready(real_bundles, tmp_path: Path):
    app = create_app(real_settings(real_bundles, bundle=str(tmp_path / "missing")))
    with running_client(app, ready=False) as client:
        assert app.state.tonearm.started.wait(30)
        assert_problem(client.get("/readyz"), 503, "not-ready")
        assert client.get("/healthz").status_code == 200
