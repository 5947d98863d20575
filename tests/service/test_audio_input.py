from __future__ import annotations

import numpy as np
import pytest

from service.audio_input import AudioLimits, decode_upload, sniff
from service.errors import ServiceError
from tests.service.fakes import tone, wav_bytes

LIMITS = AudioLimits(max_seconds=5.0, max_sample_rate=48_000, max_channels=2)


def slug_of(fn) -> str:
    with pytest.raises(ServiceError) as info:
        fn()
    return info.value.slug


@pytest.mark.parametrize(
    ("head", "fmt"),
    [
        (b"RIFF\x00\x00\x00\x00WAVEfmt ", "wav"),
        (b"fLaC\x00\x00\x00\x22", "flac"),
        (b"OggS\x00\x02", "ogg"),
        (b"ID3\x04\x00", "mp3"),
        (bytes([0xFF, 0xFB, 0x90, 0x64]), "mp3"),  # MPEG-1 layer III, 128 kb/s
    ],
)
def test_sniff_recognises_containers_by_magic_bytes(head, fmt):
    assert sniff(head) == fmt


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"hello world, not audio",
        b"%PDF-1.7 ...",
        bytes([0xFF, 0xF1, 0x50, 0x80]),  # AAC ADTS: layer bits 00 are not MPEG audio
        b"RIFF\x00\x00\x00\x00AVI LIST",
    ],
)
def test_sniff_rejects_non_audio(data):
    assert slug_of(lambda: sniff(data)) == "unsupported-audio"


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "OGG"])
def test_decode_upload_reads_real_containers_and_resamples(fmt):
    wave = tone(["dog"], seconds=1.0, rate=22_050)
    audio = decode_upload(wav_bytes(wave, rate=22_050, fmt=fmt), sample_rate=16_000, limits=LIMITS)
    assert audio.format == fmt.lower()
    assert abs(audio.waveform.shape[0] - 16_000) <= 1
    assert audio.duration_seconds == pytest.approx(1.0, abs=1e-3)
    assert audio.waveform.dtype == np.float32


def test_decode_upload_mixes_stereo_to_mono():
    wave = tone(["dog"], seconds=0.5)
    audio = decode_upload(wav_bytes(wave, channels=2), sample_rate=16_000, limits=LIMITS)
    assert np.allclose(audio.waveform, wave, atol=1e-4)


def test_decode_upload_enforces_limits():
    long = wav_bytes(tone(["dog"], seconds=6.0))
    assert slug_of(lambda: decode_upload(long, sample_rate=16_000, limits=LIMITS)) == "audio-limits"
    many = wav_bytes(tone(["dog"], seconds=0.2), channels=3)
    assert slug_of(lambda: decode_upload(many, sample_rate=16_000, limits=LIMITS)) == "audio-limits"
    fast = wav_bytes(tone(["dog"], seconds=0.2, rate=96_000), rate=96_000)
    assert slug_of(lambda: decode_upload(fast, sample_rate=16_000, limits=LIMITS)) == "audio-limits"


def test_decode_upload_rejects_corrupt_and_truncated_audio():
    good = wav_bytes(tone(["dog"], seconds=0.5))
    header_only = good[:12] + b"\x00" * 8
    assert slug_of(lambda: decode_upload(header_only, sample_rate=16_000, limits=LIMITS)) in {
        "audio-decode-failed"
    }
    garbage_flac = b"fLaC" + bytes(range(256)) * 4
    assert slug_of(lambda: decode_upload(garbage_flac, sample_rate=16_000, limits=LIMITS)) == "audio-decode-failed"
    fake_mp3 = bytes([0xFF, 0xFB, 0x90, 0x64]) + b"\x00" * 100
    assert slug_of(lambda: decode_upload(fake_mp3, sample_rate=16_000, limits=LIMITS)) == "audio-decode-failed"
