"""docs/service.md's error contract, exactly, over real HTTP (uvicorn) — issue 24 item 4.

Invalid JSON is 400 ``malformed-body`` naming the position; a body not sent as JSON is 415 with
a hint; truncated or corrupt audio is 422 ``audio-decode-failed`` (the whole stream is decoded,
not only the header); no problem detail shows a Python repr; a busy port is one line and exit
status 2; uploads and ``tonearm index`` accept the same formats (index.audio.formats).
"""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from index.audio.formats import FORMATS
from index.catalogue.own_audio import decode_file
from service.audio_input import AudioLimits, decode_upload
from service.errors import PYTHON_REPR, TYPE_PREFIX, ServiceError, problem_body
from tests.conftest import ROOT
from tests.service.conftest import ADMIN, fake_bundles_server
from tests.service.fakes import SAMPLE_RATE, tone, wav_bytes
from tonearm.errors import AudioDecodeError

JSON_ROUTES = ("/v1/search/text", "/v1/search/text:batch", "/v1/diagnostics/consistency", "/v1/bundles/activate")
VALID = {
    "/v1/search/text": b'{"query": "dog"}',
    "/v1/search/text:batch": b'{"queries": ["dog"]}',
    "/v1/diagnostics/consistency": b'{"captions": {"eng": "dog"}}',
    "/v1/bundles/activate": b'{"bundle_id": "fake-b"}',
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with fake_bundles_server(tmp_path_factory.mktemp("bundles")) as running:
        yield running


def problem(response: httpx.Response, status: int, slug: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert body["type"] == TYPE_PREFIX + slug and body["status"] == status
    assert not PYTHON_REPR.search(body["detail"]), body["detail"]
    return body


def post(server, path: str, content: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(server.url + path, content=content, headers={**ADMIN, **(headers or {})}, timeout=30)


# ------------------------------------------------------------------ JSON bodies


@pytest.mark.parametrize("path", JSON_ROUTES)
def test_invalid_json_is_400_malformed_body_with_the_position(server, path):
    body = problem(post(server, path, b'{"query": "dog",\n  k: 5}', {"content-type": "application/json"}),
                   400, "malformed-body")
    assert "line 2, column 3 (character 19)" in body["detail"], body["detail"]
    assert "property name" in body["detail"]


def test_a_body_that_is_not_utf8_is_400_malformed_body(server):
    body = problem(post(server, "/v1/search/text", b'{"query": "\xff\xfe"}', {"content-type": "application/json"}),
                   400, "malformed-body")
    assert "JSON" in body["detail"]


@pytest.mark.parametrize("path", JSON_ROUTES)
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_is_415_with_a_hint(server, path, content_type):
    headers = {"content-type": content_type} if content_type else {}
    response = post(server, path, VALID[path], headers)
    body = problem(response, 415, "unsupported-media-type")
    assert "Content-Type: application/json" in body["detail"]
    assert (content_type or "no content type") in body["detail"]


@pytest.mark.parametrize("path", JSON_ROUTES)
def test_the_same_body_as_json_is_accepted(server, path):
    response = post(server, path, VALID[path], {"content-type": "application/json; charset=utf-8"})
    assert response.status_code in (200, 409), response.text  # activate: the gate may refuse fake-b


def test_schema_documents_415_on_every_json_route(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
    for path in JSON_ROUTES:
        assert "415" in doc["paths"][path]["post"]["responses"], path


# ------------------------------------------------------------------ audio uploads

GOOD = {fmt: wav_bytes(tone(["dog"], seconds=2.0), fmt=fmt) for fmt in ("WAV", "FLAC", "MP3")}


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("wav cut to 2000 bytes", GOOD["WAV"][:2000]),
        ("wav cut to 30 bytes", GOOD["WAV"][:30]),
        ("wav header only", GOOD["WAV"][:44]),
        ("wav missing its last byte", GOOD["WAV"][:-2]),
        ("flac cut in half", GOOD["FLAC"][: len(GOOD["FLAC"]) // 2]),
        ("flac with a corrupt middle", GOOD["FLAC"][:4000] + bytes(1000) + GOOD["FLAC"][5000:]),
        ("mp3 cut in half", GOOD["MP3"][: len(GOOD["MP3"]) // 2]),
    ],
)
def test_truncated_or_corrupt_audio_is_422_audio_decode_failed(server, name, data):
    for headers in ({"content-type": "audio/wav"}, {}):
        body = problem(post(server, "/v1/search/audio", data, headers), 422, "audio-decode-failed")
        assert "object at" not in body["detail"] and "0x" not in body["detail"], (name, body["detail"])


def test_a_whole_file_in_each_format_is_searched(server):
    for fmt, data in GOOD.items():
        response = post(server, "/v1/search/audio?k=1", data)
        assert response.status_code == 200, (fmt, response.text)
        assert response.json()["duration_seconds"] == pytest.approx(2.0, abs=0.05)


def test_a_wav_with_an_unpatched_streaming_header_is_still_accepted(server):
    """Writers that stream WAV leave the data size at 0xFFFFFFFF: nothing to check, not truncated."""
    data = bytearray(GOOD["WAV"])
    at = data.index(b"data")
    data[at + 4 : at + 8] = b"\xff\xff\xff\xff"
    assert post(server, "/v1/search/audio", bytes(data)).status_code == 200


def test_no_problem_detail_shows_a_python_repr():
    body = problem_body("audio-decode-failed", "Error opening <_io.BytesIO object at 0x7fb02cd76430>: bad")
    assert body["detail"] == "Error opening the input: bad"


# ------------------------------------------------------------------ one list of formats

LIMITS = AudioLimits(max_seconds=60, max_sample_rate=192_000, max_channels=8)


def _written(fmt: str, subtype: str | None = None) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, tone(["bell"], seconds=0.5), SAMPLE_RATE, format=fmt, subtype=subtype)
    return buffer.getvalue()


SAMPLES = {
    "take.wav": _written("WAV"),
    "take.flac": _written("FLAC"),
    "take.ogg": _written("OGG"),
    "take.mp3": _written("MP3"),
    "take.au": _written("AU", "PCM_16"),  # libsndfile reads it; the service refuses it
    "take.aiff": _written("AIFF"),
    "cut.wav": _written("WAV")[:2000],
    "notes.txt": b"not audio at all\n",
}


def _upload_verdict(data: bytes) -> str:
    try:
        decode_upload(data, sample_rate=SAMPLE_RATE, limits=LIMITS)
    except ServiceError as err:
        return err.slug
    return "ok"


def test_uploads_and_tonearm_index_accept_the_same_files(tmp_path: Path):
    verdicts = {}
    for name, data in SAMPLES.items():
        (tmp_path / name).write_bytes(data)
        try:
            decode_file(tmp_path / name, SAMPLE_RATE)
            indexed = "ok"
        except AudioDecodeError:
            indexed = "skipped"
        verdicts[name] = (_upload_verdict(data), indexed)
    assert verdicts == {
        "take.wav": ("ok", "ok"), "take.flac": ("ok", "ok"), "take.ogg": ("ok", "ok"), "take.mp3": ("ok", "ok"),
        "take.au": ("unsupported-audio", "skipped"), "take.aiff": ("unsupported-audio", "skipped"),
        "cut.wav": ("audio-decode-failed", "skipped"), "notes.txt": ("unsupported-audio", "skipped"),
    }
    assert [f.media_type for f in FORMATS] == ["audio/wav", "audio/flac", "audio/ogg", "audio/mpeg"]


def test_the_schema_lists_the_accepted_formats_from_the_same_list(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
    content = doc["paths"]["/v1/search/audio"]["post"]["requestBody"]["content"]
    assert [m for m in content if m.startswith("audio/")] == [f.media_type for f in FORMATS]


# ------------------------------------------------------------------ a busy port


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_busy_port_is_one_line_naming_it_and_exit_status_2(tmp_path, how):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        env = {**os.environ, "TONEARM_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
        env.pop("TONEARM_BUNDLE", None)
        args = [sys.executable, "-m", "tonearm.cli", "serve"]
        if how == "flag":
            args += ["--port", str(port)]
        else:
            env["TONEARM_PORT"] = str(port)
        done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert str(port) in lines[0] and "TONEARM_PORT" in lines[0] and "--port" in lines[0]
    assert "Errno" not in lines[0]
    assert not (tmp_path / "home").exists()  # refused before any demo build started


def test_port_in_use_sees_a_listener_and_not_a_free_port():
    from tonearm.serve import port_in_use

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert port_in_use("127.0.0.1", port)
    assert not port_in_use("127.0.0.1", port)
    assert np.isfinite(port)
