"""Long recordings as items (issue 54, part 3): item writes have their own duration and byte limits
(`TONEARM_MAX_ITEM_AUDIO_SECONDS`, an hour; `TONEARM_MAX_ITEM_UPLOAD_BYTES`, 64 MiB) while search uploads keep
theirs (60 s, 10 MiB), and a long item is decoded and embedded by blocks — its clip vector the encoder's
chunk-and-average of the whole recording, its moment windows those of the whole waveform — never held whole.

Through the in-process app with the keyword bundle (tests/service/fakes.py: 1-s windows at 16 kHz), default
limits; the reference vectors are the keyword model's own over the whole waveform."""

from __future__ import annotations

import io
import json
import tracemalloc
from pathlib import Path

import numpy as np
import soundfile as sf

from index.audio.decode import eval_chunks
from service.audio_input import embed_bytes, embed_upload, item_limits_of, probe_upload
from service.settings import Settings
from tests.service.conftest import ADMIN, make_settings
from tests.service.fakes import CLIPS, SAMPLE_RATE, KeywordBundle, tone
from tests.service.test_routes import assert_problem

MODEL = KeywordBundle(Path("/nonexistent"))
EVENT = (300.0, 306.0)
"""Seconds of the bell in the 10-minute recording (silence elsewhere)."""


def _wav(wave: np.ndarray, rate: int = SAMPLE_RATE, subtype: str = "PCM_16", fmt: str = "WAV") -> bytes:
    out = io.BytesIO()
    sf.write(out, wave, rate, format=fmt, subtype=subtype)
    return out.getvalue()


def _recording(seconds: float, event: tuple[float, float] | None = None) -> np.ndarray:
    wave = np.zeros(int(seconds * SAMPLE_RATE), np.float32)
    if event is not None:
        start, stop = (int(t * SAMPLE_RATE) for t in event)
        wave[start:stop] = tone(["bell"], seconds=event[1] - event[0])
    return wave


def _post(client, item_id: str, data: bytes):
    return client.post("/v1/items", headers=ADMIN, data={"id": item_id, "metadata": json.dumps({"kind": "walk"})},
                       files={"file": ("walk.wav", data, "audio/wav")})


def test_the_defaults_give_item_writes_an_hour_and_search_uploads_a_minute() -> None:
    settings = Settings()
    assert settings.max_audio_seconds == 60 and settings.max_upload_bytes == 10 << 20
    assert settings.max_item_audio_seconds == 3600 and settings.item_upload_limit == 64 << 20
    assert 3600 * 128_000 // 8 < settings.item_upload_limit  # an hour of 128-kbit/s MP3: 57.6 MB


def test_a_ten_minute_recording_is_added_and_its_moment_is_found(fake_client) -> None:
    wave = _recording(600.0, EVENT)
    data = _wav(wave)
    assert len(data) > 10 << 20  # over the search uploads' byte limit too: 19.2 MB of WAV
    r = _post(fake_client, "walk-10min", data)
    assert r.status_code == 201, r.text
    assert r.json()["duration_seconds"] == 600.0 and r.json()["metadata"]["duration"] == 600.0

    found = fake_client.post("/v1/search/moments", json={"query": "bell", "k": 1})
    assert found.status_code == 200, found.text
    (hit,) = found.json()["hits"]
    assert hit["id"] == "walk-10min"
    assert abs(hit["start"] - EVENT[0]) <= 1.0 and abs(hit["end"] - EVENT[1]) <= 1.0, hit

    # its clip vector is the keyword model's chunk-and-average of the whole waveform (as a bundle clip's)
    chunks = MODEL.encode_audio(list(eval_chunks(wave, MODEL.clip_samples))).astype(np.float64).sum(axis=0)
    reference = chunks / np.linalg.norm(chunks)
    similar = fake_client.get("/v1/search/similar/walk-10min", params={"k": len(CLIPS)}).json()["hits"]
    expected = sorted((float(MODEL.encode_audio([tone(c)])[0] @ reference) for c in CLIPS.values()), reverse=True)
    np.testing.assert_allclose([h["score"] for h in similar], expected, atol=1e-5)


def test_a_recording_over_the_item_limit_is_422_naming_the_limit_and_the_setting(fake_client) -> None:
    over = np.zeros(3601 * 1000, np.float32)  # an hour and a second at 1 kHz, 8-bit: 3.6 MB
    r = _post(fake_client, "too-long", _wav(over, rate=1000, subtype="PCM_U8"))
    body = assert_problem(r, 422, "audio-limits")
    assert "3600 s" in body["detail"] and "TONEARM_MAX_ITEM_AUDIO_SECONDS" in body["detail"], body["detail"]
    assert fake_client.get("/v1/items/too-long", headers=ADMIN).status_code == 404


def test_a_two_minute_search_upload_is_still_refused_by_the_minute_limit(fake_client) -> None:
    data = _wav(_recording(120.0, (10.0, 12.0)))
    r = fake_client.post("/v1/search/similar", params={"k": 1}, content=data)
    body = assert_problem(r, 422, "audio-limits")
    assert "60 s" in body["detail"] and "TONEARM_MAX_AUDIO_SECONDS" in body["detail"], body["detail"]


def test_embedding_a_long_item_holds_blocks_not_the_recording() -> None:
    """20 minutes at 16 kHz decode to 76.8 MB of float32; embedding them by blocks allocates at most
    :func:`service.audio_input.embed_bytes` (measured by tracemalloc: numpy's arrays are traced)."""
    data = _wav(_recording(1200.0, (600.0, 604.0)), fmt="FLAC")  # silence: a small file, a full decode
    limits = item_limits_of(make_settings())
    probed = probe_upload(data, sample_rate=SAMPLE_RATE, limits=limits)
    allowed = embed_bytes(probed, SAMPLE_RATE, MODEL.clip_samples)
    whole = 1200 * SAMPLE_RATE * 4
    assert probed.streamed and allowed < whole / 8

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        found = embed_upload(data, MODEL, limits=limits)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert found is not None and found.samples == 1200 * SAMPLE_RATE
    assert len(found.spans) == 2399  # every half second, the last ending at 1,200 s
    print(f"embedding 20 min by blocks: peak {peak / 2**20:.1f} MiB traced, {allowed / 2**20:.1f} MiB held in "
          f"the budget, {whole / 2**20:.1f} MiB decoded whole")
    assert peak <= allowed, (peak, allowed)
