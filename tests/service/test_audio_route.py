"""`GET /v1/audio/{clip_id}` over real uvicorn: byte ranges, and nothing outside the audio root."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from service.app import create_app
from service.routes.audio import parse_range
from tests.service.conftest import make_settings


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
