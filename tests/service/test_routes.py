"""Every route's happy path and documented errors, through the ASGI app with the keyword bundle."""

from __future__ import annotations

import pytest

from service.app import create_app
from service.errors import TYPE_PREFIX
from service.settings import Settings, SettingsError
from tests.service.conftest import ADMIN, fake_opener, make_settings, running_client
from tests.service.fakes import tone, wav_bytes


def assert_problem(response, status: int, slug: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert body["type"] == TYPE_PREFIX + slug and body["status"] == status
    assert body["detail"] and body["title"]
    return body


# ------------------------------------------------------------------ text search


def test_text_search_answers_with_hits_and_bundle_id(fake_client):
    r = fake_client.post("/v1/search/text", json={"query": "un chien", "lang": "fra", "k": 2})
    assert r.status_code == 200
    body = r.json()
    assert body["bundle_id"] == "fake-a" and body["lang"] == "fra"
    assert [h["id"] for h in body["hits"]] == ["clip-dog", "clip-dog-siren"]
    assert body["hits"][0]["uri"] == "file:///audio/clip-dog.wav"
    assert body["hits"][0]["captions"] is None


def test_text_search_with_captions_and_min_score(fake_client):
    r = fake_client.post(
        "/v1/search/text", json={"query": "犬", "k": 5, "min_score": 0.9, "include_captions": True}
    )
    hits = r.json()["hits"]
    assert len(hits) == 1 and hits[0]["captions"]["jpn"] == ["犬の音"]


@pytest.mark.parametrize(
    ("body", "status", "slug"),
    [
        ({"query": ""}, 422, "validation-error"),
        ({"query": "   "}, 422, "validation-error"),  # the schema's pattern (at least one non-space)
        ({"query": "x" * 513}, 422, "validation-error"),
        ({"query": "dog", "k": 0}, 422, "validation-error"),
        ({"query": "dog", "k": 101}, 422, "validation-error"),
        ({"query": "dog", "lang": "deu"}, 422, "unknown-language"),
        ({"query": "dog", "extra": 1}, 422, "validation-error"),
        ({"query": "dog", "min_score": 2}, 422, "validation-error"),
    ],
)
def test_text_search_errors(fake_client, body, status, slug):
    problem = assert_problem(fake_client.post("/v1/search/text", json=body), status, slug)
    if slug == "unknown-language":
        assert problem["supported"] == ["eng", "fra", "jpn"]
        assert "eng, fra, jpn" in problem["detail"]


def test_malformed_json_is_a_400_problem(fake_client):
    r = fake_client.post("/v1/search/text", content=b"{not json", headers={"content-type": "application/json"})
    assert_problem(r, 400, "malformed-body")


def test_batch_search(fake_client):
    r = fake_client.post("/v1/search/text:batch", json={"queries": ["cloche", "雨", "siren"], "k": 1})
    assert r.status_code == 200
    body = r.json()
    assert [x["hits"][0]["id"] for x in body["results"]] == ["clip-bell", "clip-rain", "clip-siren"]
    assert body["bundle_id"] == "fake-a"
    assert_problem(fake_client.post("/v1/search/text:batch", json={"queries": []}), 422, "validation-error")
    assert_problem(
        fake_client.post("/v1/search/text:batch", json={"queries": ["x"] * 65}), 422, "validation-error"
    )
    assert_problem(fake_client.post("/v1/search/text:batch", json={"queries": ["ok", " "]}), 422, "validation-error")


# ------------------------------------------------------------------ audio search


def test_audio_search_raw_body_and_multipart(fake_client):
    data = wav_bytes(tone(["siren"]))
    raw = fake_client.post(
        "/v1/search/audio?k=2&lang=fra", content=data, headers={"content-type": "application/octet-stream"}
    )
    assert raw.status_code == 200, raw.text
    body = raw.json()
    assert body["format"] == "wav" and body["duration_seconds"] == pytest.approx(1.0)
    assert [(h["clip_id"], h["lang"]) for h in body["hits"]] == [("clip-siren", "fra"), ("clip-dog-siren", "fra")]
    assert body["hits"][0]["text"] == "un son de sirène"
    # multipart, declared as an image: the content decides
    form = fake_client.post("/v1/search/audio", files={"file": ("x.png", wav_bytes(tone(["rain"]), fmt="FLAC"), "image/png")})
    assert form.status_code == 200, form.text
    assert form.json()["format"] == "flac" and form.json()["hits"][0]["clip_id"] == "clip-rain"


def test_audio_search_errors(fake_client):
    url = "/v1/search/audio"
    assert_problem(fake_client.post(url, content=b"plain text"), 415, "unsupported-audio")
    assert_problem(fake_client.post(url, content=b""), 415, "unsupported-audio")
    assert_problem(fake_client.post(url, content=b"RIFF\x10\x00\x00\x00WAVEjunkjunk"), 422, "audio-decode-failed")
    long = wav_bytes(tone(["dog"], seconds=61.0, rate=8000), rate=8000)
    assert_problem(fake_client.post(url, content=long), 422, "audio-limits")
    assert_problem(fake_client.post(url + "?lang=deu", content=wav_bytes(tone(["dog"]))), 422, "unknown-language")
    assert_problem(fake_client.post(url + "?k=0", content=wav_bytes(tone(["dog"]))), 422, "validation-error")
    assert_problem(fake_client.post(url, files={"a": ("a.wav", b"x"), "b": ("b.wav", b"y")}), 400, "bad-upload")
    assert_problem(fake_client.post(url, files={"note": (None, "no file")}), 400, "bad-upload")
    assert_problem(fake_client.post(url, data={"note": "x"}), 415, "unsupported-audio")  # urlencoded body
    broken = {"content-type": "multipart/form-data; boundary=zzz"}
    assert_problem(fake_client.post(url, content=b"--zzz\r\nnonsense", headers=broken), 400, "bad-upload")


def test_upload_size_limit_early_and_while_streaming(fake_bundles):
    settings = make_settings(bundles_dir=fake_bundles, bundle="fake-a", max_upload_bytes=4096)
    app = create_app(settings, opener=fake_opener)
    big = wav_bytes(tone(["dog"], seconds=1.0))  # 32 kB
    with running_client(app) as client:
        assert_problem(client.post("/v1/search/audio", content=big), 413, "upload-too-large")

        def chunks():  # no Content-Length: rejected while streaming
            for i in range(0, len(big), 1024):
                yield big[i : i + 1024]

        assert_problem(client.post("/v1/search/audio", content=chunks()), 413, "upload-too-large")
        assert_problem(client.post("/v1/search/audio", files={"file": ("a.wav", big)}), 413, "upload-too-large")


# ------------------------------------------------------------------ diagnostics


def test_consistency_post(fake_client):
    r = fake_client.post(
        "/v1/diagnostics/consistency",
        json={"captions": {"eng": "a dog", "fra": "un chien et une sirène"}, "target_id": "clip-dog", "k": 2},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["languages"]["eng"]["target_rank"] == 1 and body["languages"]["fra"]["target_rank"] == 3
    assert body["mrv"] == pytest.approx(1.0) and set(body["gap"]) == {"fra"}
    assert body["bundle_id"] == "fake-a"
    bad = {"captions": {"xx": "dog"}}
    assert_problem(fake_client.post("/v1/diagnostics/consistency", json=bad), 422, "unknown-language")
    missing = {"captions": {"eng": "dog"}, "target_id": "nope"}
    assert_problem(fake_client.post("/v1/diagnostics/consistency", json=missing), 404, "unknown-target")
    assert_problem(fake_client.post("/v1/diagnostics/consistency", json={"captions": {}}), 422, "validation-error")


def test_consistency_get_heldout_report(fake_client):
    body = fake_client.get("/v1/diagnostics/consistency").json()
    assert body["source"] == "computed" and body["bundle_id"] == "fake-a"
    assert set(body["per_language"]) == {"eng", "fra", "jpn", "mean"}
    assert body["per_language"]["fra"]["t2a"]["R@10"] == 1.0
    assert body["mrv_t2a"] == 0.0 and "Convention" in body["convention"]


# ------------------------------------------------------------------ bundles (admin)


def test_admin_routes_need_the_token(fake_client):
    r = fake_client.get("/v1/bundles")
    assert_problem(r, 401, "unauthorized")
    assert r.headers["www-authenticate"] == "Bearer"
    assert_problem(fake_client.get("/v1/bundles", headers={"Authorization": "Bearer wrong"}), 401, "unauthorized")


def test_list_activate_rollback(fake_client):
    listing = fake_client.get("/v1/bundles", headers=ADMIN).json()
    assert listing["active"] == "fake-a" and listing["previous"] is None
    assert {b["bundle_id"] for b in listing["bundles"]} >= {"fake-a", "fake-b", "fake-worse"}

    r = fake_client.post("/v1/bundles/activate", json={"bundle_id": "fake-b"}, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json()["changed"] and r.json()["previous"] == "fake-a" and r.json()["verdict"]["passed"]
    assert fake_client.post("/v1/search/text", json={"query": "dog"}).json()["bundle_id"] == "fake-b"

    again = fake_client.post("/v1/bundles/activate", json={"bundle_id": "fake-b"}, headers=ADMIN).json()
    assert again["changed"] is False

    back = fake_client.post("/v1/bundles/rollback", headers=ADMIN)
    assert back.json()["bundle_id"] == "fake-a" and back.json()["previous"] == "fake-b"
    assert fake_client.post("/v1/search/text", json={"query": "dog"}).json()["bundle_id"] == "fake-a"


def test_gate_rejects_worse_bundle_unless_forced(fake_client):
    r = fake_client.post("/v1/bundles/activate", json={"bundle_id": "fake-worse"}, headers=ADMIN)
    problem = assert_problem(r, 409, "quality-gate-rejected")
    assert problem["verdict"]["passed"] is False and problem["verdict"]["reasons"]
    assert fake_client.post("/v1/search/text", json={"query": "dog"}).json()["bundle_id"] == "fake-a"
    forced = fake_client.post("/v1/bundles/activate", json={"bundle_id": "fake-worse", "force": True}, headers=ADMIN)
    assert forced.status_code == 200 and forced.json()["verdict"]["forced"]


def test_bundle_admin_errors(fake_client):
    for bundle_id in ("nope", "../etc", "fake-a/../fake-b"):
        r = fake_client.post("/v1/bundles/activate", json={"bundle_id": bundle_id}, headers=ADMIN)
        assert_problem(r, 404, "bundle-not-found")
    assert_problem(fake_client.post("/v1/bundles/rollback", headers=ADMIN), 409, "no-previous-bundle")


# ------------------------------------------------------------------ operations


def test_health_ready_metrics(fake_client):
    assert fake_client.get("/healthz").json() == {"status": "ok", "bundle_id": None}
    assert fake_client.get("/readyz").json() == {"status": "ready", "bundle_id": "fake-a"}
    fake_client.post("/v1/search/text", json={"query": "dog"})
    fake_client.post("/v1/search/text", json={"query": "dog"})
    text = fake_client.get("/metrics").text
    assert 'tonearm_request_duration_seconds_count{method="POST",route="/v1/search/text",status="200"}' in text
    assert 'tonearm_cache_requests_total{kind="results",result="hit"} 1.0' in text
    assert 'tonearm_active_bundle_info{bundle_id="fake-a"' in text
    assert_problem(fake_client.get("/nope"), 404, "not-found")
    assert_problem(fake_client.get("/v1/search/text"), 405, "method-not-allowed")


def test_not_ready_without_bundle(fake_bundles):
    app = create_app(make_settings(bundles_dir=fake_bundles), opener=fake_opener)
    with running_client(app, ready=False) as client:
        assert client.get("/healthz").status_code == 200
        assert_problem(client.get("/readyz"), 503, "not-ready")
        assert_problem(client.post("/v1/search/text", json={"query": "dog"}), 503, "not-ready")
        r = client.post("/v1/bundles/activate", json={"bundle_id": "fake-a"}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["verdict"]["reasons"] == ["no active bundle to compare with"]
        assert client.get("/readyz").status_code == 200


def test_settings_refuse_unsafe_values(monkeypatch):
    with pytest.raises(SettingsError, match="TONEARM_ADMIN_TOKEN"):
        Settings(environment="production", admin_enabled=True)
    with pytest.raises(SettingsError, match="shorter than 16"):
        Settings(environment="production", admin_token="short")
    with pytest.raises(SettingsError, match="TONEARM_REDIS_URL"):
        Settings(workers=2)
    assert Settings(environment="development", admin_enabled=True).admin_on  # dev: allowed, warned
    assert not Settings(environment="production").admin_on  # no token → admin off by default
    monkeypatch.setenv("TONEARM_ADMIN_TOKEN", "a-long-enough-secret-token")
    monkeypatch.setenv("TONEARM_MAX_UPLOAD_BYTES", "2048")
    settings = Settings()
    assert settings.admin_on and settings.max_upload_bytes == 2048


def test_admin_routes_absent_when_disabled(fake_bundles):
    app = create_app(make_settings(bundles_dir=fake_bundles, bundle="fake-a", admin_token=None), opener=fake_opener)
    with running_client(app) as client:
        assert_problem(client.get("/v1/bundles", headers=ADMIN), 404, "not-found")
