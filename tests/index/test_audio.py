from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr

from index.audio.decode import AudioTooLongError, decode_audio, eval_chunks, fit_length
from tonearm.errors import AudioDecodeError


def _sine(rate: int, seconds: float, freq: float = 440.0) -> np.ndarray:
    return np.sin(2 * np.pi * freq * np.arange(int(rate * seconds)) / rate)


@pytest.fixture()
def stereo_44k(tmp_path: Path) -> Path:
    """1.5 s at 44.1 kHz: left 0.5·sin, right 0.3·sin (mono mix 0.4·sin)."""
    tone = _sine(44100, 1.5)
    path = tmp_path / "stereo.wav"
    sf.write(path, np.stack([0.5 * tone, 0.3 * tone], axis=1), 44100, subtype="FLOAT")
    return path


def test_stereo_44k_becomes_16k_mono_of_the_right_length(stereo_44k: Path) -> None:
    wave = decode_audio(stereo_44k)
    assert wave.dtype == np.float32 and wave.shape == (24000,)
    expected = 0.4 * _sine(16000, 1.5)
    middle = slice(1000, 23000)  # resampler edge effects aside
    assert np.max(np.abs(wave[middle] - expected[middle])) < 1e-3


def test_bytes_decode_like_the_file(stereo_44k: Path) -> None:
    np.testing.assert_array_equal(decode_audio(stereo_44k.read_bytes()), decode_audio(stereo_44k))


def test_flac_at_target_rate_is_not_resampled(tmp_path: Path) -> None:
    tone = 0.25 * _sine(16000, 0.5)
    path = tmp_path / "tone.flac"
    sf.write(path, tone, 16000, subtype="PCM_16")
    np.testing.assert_allclose(decode_audio(path), tone, atol=1 / 32768 + 1e-7)


def test_max_seconds_rejects_longer_audio(stereo_44k: Path) -> None:
    assert decode_audio(stereo_44k, max_seconds=2.0).shape == (24000,)
    with pytest.raises(AudioTooLongError, match=r"1\.5 s .* limit of 1 s"):
        decode_audio(stereo_44k, max_seconds=1.0)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "empty"),
        (np.random.default_rng(0).bytes(4096), "not a supported audio format"),
        (b"RIFF\x24\x00\x00\x00WAVEfmt ", "not a supported audio format"),  # header cut short
    ],
)
def test_unreadable_files_raise_naming_the_file(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "broken.wav"
    path.write_bytes(content)
    with pytest.raises(AudioDecodeError, match=reason) as err:
        decode_audio(path)
    assert str(path) in str(err.value)


def test_corrupted_header_of_a_real_wav(stereo_44k: Path) -> None:
    data = bytearray(stereo_44k.read_bytes())
    data[0:4] = b"JUNK"
    stereo_44k.write_bytes(bytes(data))
    with pytest.raises(AudioDecodeError, match="stereo.wav"):
        decode_audio(stereo_44k)


def test_random_bytes_upload() -> None:
    with pytest.raises(AudioDecodeError, match=r"uploaded audio \(2000 bytes\): not a supported audio format"):
        decode_audio(np.random.default_rng(1).bytes(2000))
    with pytest.raises(AudioDecodeError, match="empty"):
        decode_audio(b"")


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(AudioDecodeError, match="nope.wav: audio file not found"):
        decode_audio(tmp_path / "nope.wav")
    with pytest.raises(AudioDecodeError, match="not a regular file"):
        decode_audio(tmp_path)


def test_wav_without_samples(tmp_path: Path) -> None:
    path = tmp_path / "silent.wav"
    sf.write(path, np.zeros(0), 16000)
    with pytest.raises(AudioDecodeError, match="no audio samples"):
        decode_audio(path)


def test_fit_length_by_hand() -> None:
    wave = np.arange(10, dtype=np.float32)
    np.testing.assert_array_equal(fit_length(wave, 4, mode="start"), [0, 1, 2, 3])
    np.testing.assert_array_equal(fit_length(wave, 4, mode="center"), [3, 4, 5, 6])
    for mode in ("start", "center", "random"):
        np.testing.assert_array_equal(
            fit_length(wave[:3], 5, mode=mode, rng=np.random.default_rng(0)), [0, 1, 2, 0, 0]
        )
    np.testing.assert_array_equal(fit_length(wave, 10, mode="center"), wave)


def test_fit_length_random_covers_every_offset_and_is_seeded() -> None:
    wave = np.arange(10, dtype=np.float32)
    rng = np.random.default_rng(0)
    starts = {int(fit_length(wave, 4, mode="random", rng=rng)[0]) for _ in range(200)}
    assert starts == set(range(7))
    a = fit_length(wave, 4, mode="random", rng=np.random.default_rng(5))
    b = fit_length(wave, 4, mode="random", rng=np.random.default_rng(5))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.diff(a), [1, 1, 1])
    with pytest.raises(ValueError, match="rng"):
        fit_length(wave, 4, mode="random")


def test_eval_chunks_by_hand() -> None:
    wave = np.arange(10, dtype=np.float32)
    np.testing.assert_array_equal(eval_chunks(wave, 4), [[0, 1, 2, 3], [4, 5, 6, 7], [6, 7, 8, 9]])
    np.testing.assert_array_equal(eval_chunks(wave[:8], 4), [[0, 1, 2, 3], [4, 5, 6, 7]])
    np.testing.assert_array_equal(eval_chunks(wave[:3], 4), [[0, 1, 2, 0]])
    np.testing.assert_array_equal(eval_chunks(wave[:4], 4), [[0, 1, 2, 3]])
    assert eval_chunks(wave, 4).dtype == np.float32


@pytest.mark.parametrize(("rate", "channels", "fmt"), [(44100, 2, "FLAC"), (48000, 8, "WAV"), (22050, 3, "OGG"),
                                                       (16000, 2, "FLAC")])
def test_block_wise_decoding_equals_decoding_the_whole_clip(rate: int, channels: int, fmt: str) -> None:
    """Blocks mixed down one by one and streamed through soxr are bit-identical to the reference of the
    whole clip: soundfile's own read of every channel, their mean, soxr's one-shot resampling, clipped."""
    from index.audio.decode import DECODE_BLOCK_FRAMES

    frames = 2 * DECODE_BLOCK_FRAMES + 12_345  # several blocks and a partial one
    data = (0.4 * np.random.default_rng(rate).standard_normal((frames, channels))).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, data, rate, format=fmt)
    whole, _ = sf.read(io.BytesIO(buf.getvalue()), dtype="float32", always_2d=True)
    mono = whole.mean(axis=1, dtype=np.float32)
    if rate != 16000:
        mono = soxr.resample(mono, rate, 16000, quality="HQ")
    np.testing.assert_array_equal(decode_audio(buf.getvalue(), sample_rate=16000), np.clip(mono, -1, 1))


def test_decoding_limits_are_checked_from_the_header_and_exact_at_the_limit() -> None:
    from index.audio.decode import AudioTooLargeError, decode_estimate

    rate, channels, frames = 48000, 4, 48000 * 3
    buf = io.BytesIO()
    sf.write(buf, np.zeros((frames, channels), np.float32), rate, format="FLAC")
    data = buf.getvalue()
    cost = decode_estimate(frames, channels, rate, 16000)
    assert decode_audio(data, max_samples=frames * channels, max_bytes=cost).shape == (16000 * 3,)
    with pytest.raises(AudioTooLargeError, match="samples to decode"):
        decode_audio(data, max_samples=frames * channels - 1)
    with pytest.raises(AudioTooLargeError, match="decoding needs"):
        decode_audio(data, max_bytes=cost - 1)
