"""`GET /v1/audio/{clip_id}` over real uvicorn: byte ranges, nothing outside the audio root, and the
audio of items added through `POST /v1/items` (none of deleted items or taken-down clips)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from service.app import create_app
from service.routes.audio import parse_range
from tests.service.conftest import ADMIN, make_settings
from tests.service.fakes import tone, wav_bytes


def _clip(bundle: Path) -> tuple[str, str]:
    """(id, uri) of the bundle's first clip."""
    with (bundle / "audio_ids.jsonl").open(encoding="utf-8") as handle:
        first = json.loads(handle.readline())
    return first["id"], first["uri"]


@pytest.fixture
def served(tiny_bundle: Path, uvicorn_runner):
    def start(**settings):
        app = create_app(make_settings(bundle=str(tiny_bundle), **settings))
        return app, uvicorn_runner(app)

    return start


def test_full_file_and_byte_ranges(served, tiny_bundle: Path, tiny_corpus: Path) -> None:
    clip_id, uri = _clip(tiny_bundle)
    data = (tiny_corpus.parent / uri).read_bytes()
    size = len(data)
    app, server = served()
    with server:
        server.wait_ready()
        url = f"{server.url}/v1/audio/{clip_id}"
        full = httpx.get(url)
        assert full.status_code == 200 and full.content == data
        assert full.headers["content-type"] == "audio/wav" and full.headers["accept-ranges"] == "bytes"
        for header, start, end in (("bytes=0-99", 0, 99), ("bytes=100-", 100, size - 1),
                                   ("bytes=-44", size - 44, size - 1), (f"bytes=10-{size + 500}", 10, size - 1)):
            part = httpx.get(url, headers={"Range": header})
            assert part.status_code == 206, header
            assert part.headers["content-range"] == f"bytes {start}-{end}/{size}"
            assert part.content == data[start:end + 1]
        too_far = httpx.get(url, headers={"Range": f"bytes={size}-"})
        assert too_far.status_code == 416
        assert too_far.json()["type"].endswith("range-not-satisfiable")
        # several ranges: allowed to answer with the whole file
        assert httpx.get(url, headers={"Range": "bytes=0-1,5-6"}).status_code == 200


def test_unknown_clips_and_traversal_attempts_get_404(served, tiny_bundle: Path) -> None:
    app, server = served()
    with server:
        server.wait_ready()
        for path in ("nope", "..%2F..%2Fetc%2Fpasswd", "%2Fetc%2Fpasswd", "..", "test-00040.wav"):
            response = httpx.get(f"{server.url}/v1/audio/{path}")
            assert response.status_code == 404, path
            assert b"root:" not in response.content
        # a tampered bundle whose URI climbs out of the audio root is refused too
        clip_id, _ = _clip(tiny_bundle)
        entry = app.state.tonearm.registry.acquire()
        try:
            items = entry.searcher.bundle.audio_items
            row = entry.searcher.clip_rows[clip_id]
            original = items[row]["uri"]
            for uri in ("../" * 12 + "etc/passwd", "/etc/passwd"):
                items[row]["uri"] = uri
                response = httpx.get(f"{server.url}/v1/audio/{clip_id}")
                assert response.status_code == 404 and b"root:" not in response.content, uri
            items[row]["uri"] = original
        finally:
            app.state.tonearm.registry.release(entry)


def test_a_symlink_out_of_the_audio_root_is_not_followed(served, tiny_bundle: Path, tmp_path: Path) -> None:
    clip_id, uri = _clip(tiny_bundle)
    root = tmp_path / "root"
    (root / uri).parent.mkdir(parents=True)
    secret = tmp_path / "secret.wav"
    secret.write_bytes(b"RIFF-secret")
    os.symlink(secret, root / uri)
    _, server = served(audio_root=root)
    with server:
        server.wait_ready()
        response = httpx.get(f"{server.url}/v1/audio/{clip_id}")
        assert response.status_code == 404 and b"secret" not in response.content


def test_added_items_are_served_and_deleted_items_and_takedowns_are_not(served, tiny_bundle: Path,
                                                                        tiny_corpus: Path, tmp_path: Path) -> None:
    with (tiny_bundle / "audio_ids.jsonl").open(encoding="utf-8") as handle:
        clips = [json.loads(line) for line, _ in zip(handle, range(3), strict=False)]
    (replaced, _), (taken_down, taken_uri) = [(c["id"], c["uri"]) for c in clips[:2]]
    wav = wav_bytes(tone(["dog"], seconds=0.5))
    flac = wav_bytes(tone(["bell"], seconds=0.5), fmt="FLAC")
    bell = wav_bytes(tone(["bell", "rain"], seconds=0.5))
    app, server = served(items_dir=tmp_path / "items")
    with server:
        server.wait_ready()

        def audio(item_id: str, **headers: str) -> httpx.Response:
            return httpx.get(f"{server.url}/v1/audio/{item_id}", headers=headers)

        def post(item_id: str, data: bytes, name: str) -> None:
            r = httpx.post(f"{server.url}/v1/items", headers=ADMIN, data={"id": item_id},
                           files={"file": (name, data, "application/octet-stream")})
            assert r.status_code == 201, r.text

        assert audio("added/dog").status_code == 404
        post("added/dog", wav, "x.bin")  # the declared type and name say nothing: the content does
        post("added-bell", flac, "y.bin")
        post(replaced, bell, "z.bin")  # an upsert of a bundle clip's id replaces its audio too
        for item_id, data, media_type in (("added/dog", wav, "audio/wav"), ("added-bell", flac, "audio/flac"),
                                          (replaced, bell, "audio/wav")):
            full = audio(item_id)
            assert full.status_code == 200 and full.content == data, item_id
            assert full.headers["content-type"] == media_type and full.headers["cache-control"] == "no-cache"
            part = audio(item_id, Range="bytes=4-11")
            assert part.status_code == 206 and part.content == data[4:12]
            assert part.headers["content-range"] == f"bytes 4-11/{len(data)}"
        clip = audio(taken_down)
        assert clip.status_code == 200 and clip.content == (tiny_corpus.parent / taken_uri).read_bytes()

        for item_id in ("added/dog", taken_down, replaced):
            assert httpx.delete(f"{server.url}/v1/items/{item_id}", headers=ADMIN).status_code == 200
            gone = audio(item_id)
            assert gone.status_code == 404 and gone.json()["type"].endswith("not-found"), item_id
            assert gone.content not in (wav, bell)
        assert audio("added-bell").content == flac  # the others are untouched
        post(taken_down, wav, "w.bin")  # putting a taken-down id back serves the new audio
        assert audio(taken_down).content == wav


def test_parse_range() -> None:
    assert parse_range(None, 100) is None
    assert parse_range("bytes=5-9", 100) == (5, 9)
    assert parse_range("bytes=-10", 100) == (90, 99)
    assert parse_range("bytes=-1000", 100) == (0, 99)
    assert parse_range("items=1-2", 100) is None
    from service.errors import ServiceError

    for bad in ("bytes=100-", "bytes=9-5", "bytes=-0"):
        with pytest.raises(ServiceError):
            parse_range(bad, 100)
