"""Crop before decode (SPEC §13): :func:`decode_window` gives decode-then-crop's window.

The reference is the whole-file path (``decode_audio`` + ``fit_length``, soundfile + soxr on
the full clip); the window path reads only the crop. Same rate: sample-exact. Across rates:
within float rounding of soxr's resampling of the whole clip.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from index.audio.decode import decode_audio, decode_window, fit_length, resampled_length
from index.errors import AudioDecodeError


def _noise(rate: int, seconds: float, channels: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.2 * rng.standard_normal((int(rate * seconds), channels))).astype(np.float32)


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """12.3-s clips: mono/stereo FLAC and WAV at 44.1 kHz, mono FLAC at 48 kHz and 16 kHz."""
    folder = tmp_path_factory.mktemp("window")
    made = {}
    for name, rate, channels, fmt, subtype in [
        ("flac44_mono", 44100, 1, "FLAC", "PCM_16"),
        ("flac44_stereo", 44100, 2, "FLAC", "PCM_24"),
        ("wav44_stereo", 44100, 2, "WAV", "FLOAT"),
        ("flac48_mono", 48000, 1, "FLAC", "PCM_16"),
        ("wav16_mono", 16000, 1, "WAV", "PCM_16"),
        ("ogg22_mono", 22050, 1, "OGG", "VORBIS"),
    ]:
        path = folder / f"{name}.{fmt.lower()}"
        sf.write(path, _noise(rate, 12.3, channels), rate, format=fmt, subtype=subtype)
        made[name] = path
    return made


def _whole_then_crop(path: Path, rate: int, n: int, mode: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return fit_length(decode_audio(path, sample_rate=rate), n, mode=mode, rng=rng)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["flac48_mono", "wav16_mono"])
@pytest.mark.parametrize("mode", ["random", "center", "start"])
def test_same_rate_windows_are_sample_exact(clips: dict[str, Path], name: str, mode: str) -> None:
    rate = int(sf.info(clips[name]).samplerate)
    for seed in range(5):
        window = decode_window(clips[name], sample_rate=rate, n=5 * rate, mode=mode,  # type: ignore[arg-type]
                               rng=np.random.default_rng(seed))
        np.testing.assert_array_equal(window, _whole_then_crop(clips[name], rate, 5 * rate, mode, seed))


@pytest.mark.parametrize("name", ["flac44_mono", "flac44_stereo", "wav44_stereo", "ogg22_mono", "flac48_mono"])
@pytest.mark.parametrize("rate", [48000, 16000])
def test_resampled_windows_match_the_whole_clip_resampled(clips: dict[str, Path], name: str, rate: int) -> None:
    n = 10 * rate
    for seed, mode in enumerate(["random", "random", "random", "center", "start"]):
        window = decode_window(clips[name], sample_rate=rate, n=n, mode=mode,  # type: ignore[arg-type]
                               rng=np.random.default_rng(seed))
        reference = _whole_then_crop(clips[name], rate, n, mode, seed)
        assert window.shape == (n,) and window.dtype == np.float32
        assert np.max(np.abs(window - reference)) < 1e-5, (name, rate, mode)


def test_a_clip_of_exactly_the_window_is_read_whole(tmp_path: Path) -> None:
    """10-s clips sharded at the model's rate: the window is the clip, read on the windowed path
    (no rng draw, like fit_length), equal to decode-then-crop."""
    path = tmp_path / "exact.flac"
    sf.write(path, _noise(16000, 2.0, 1), 16000, format="FLAC", subtype="PCM_16")
    for mode in ("random", "center", "start"):
        window = decode_window(path, sample_rate=16000, n=32000, mode=mode, rng=np.random.default_rng(0))  # type: ignore[arg-type]
        np.testing.assert_array_equal(window, _whole_then_crop(path, 16000, 32000, mode, 0))
    np.testing.assert_array_equal(decode_window(path.read_bytes(), sample_rate=16000, n=32000, mode="start"),
                                  decode_audio(path, sample_rate=16000))


def test_the_random_window_is_drawn_like_fit_length(clips: dict[str, Path]) -> None:
    """Same rng draw → same offset: windows of different seeds differ, same seed repeats."""
    path, rate = clips["flac44_mono"], 48000
    a = decode_window(path, sample_rate=rate, n=rate, mode="random", rng=np.random.default_rng(1))
    b = decode_window(path, sample_rate=rate, n=rate, mode="random", rng=np.random.default_rng(1))
    c = decode_window(path, sample_rate=rate, n=rate, mode="random", rng=np.random.default_rng(2))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)


def test_a_clip_shorter_than_the_window_is_zero_padded(clips: dict[str, Path]) -> None:
    n = 20 * 48000
    window = decode_window(clips["flac44_stereo"], sample_rate=48000, n=n, mode="random",
                           rng=np.random.default_rng(0))
    reference = _whole_then_crop(clips["flac44_stereo"], 48000, n, "random", 0)
    np.testing.assert_array_equal(window, reference)
    assert window[resampled_length(int(12.3 * 44100), 44100, 48000):].max() == 0.0


def test_resampled_length_is_soxrs() -> None:
    import soxr

    for frames, rate, target in [(441001, 44100, 48000), (7, 44100, 16000), (12345, 48000, 16000)]:
        out = soxr.resample(np.zeros(frames, np.float32), rate, target, quality="HQ")
        assert resampled_length(frames, rate, target) == len(out)


def test_a_file_shorter_than_its_header_says_is_refused(clips: dict[str, Path], tmp_path: Path) -> None:
    """A FLAC cut in half: its STREAMINFO still declares 12.3 s, so the center window (past the
    cut) cannot be read — an error naming the file, which training counts as a bad sample."""
    data = clips["flac48_mono"].read_bytes()
    cut = tmp_path / "cut.flac"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(AudioDecodeError, match=r"cut\.flac: (truncated or )?corrupt"):
        decode_window(cut, sample_rate=48000, n=48000, mode="center")


@pytest.mark.parametrize("channels", [1, 2, 3, 6])
def test_downmix_is_the_channel_mean_bit_for_bit(channels: int) -> None:
    from index.audio.decode import downmix

    data = (0.3 * np.random.default_rng(channels).standard_normal((40_001, channels))).astype(np.float32)
    np.testing.assert_array_equal(downmix(data), data.mean(axis=1, dtype=np.float32))


def test_short_clips_are_padded_as_the_model_asks(tmp_path: Path) -> None:
    """A clip shorter than the window reaches the tower as its extractor pads it (index.audio.frontend),
    in the training crop (decode_window), evaluation windows (eval_chunks) and fit_length alike."""
    from index.audio.decode import eval_chunks
    from index.audio.frontend import pad_short_clip

    wave = (0.3 * np.sin(np.arange(700) / 7.0)).astype(np.float32)
    sf.write(tmp_path / "short.wav", wave, 16000, subtype="FLOAT")
    n = 2000
    for padding in ("pad", "repeatpad", "repeat"):
        want = pad_short_clip(wave, n, padding)
        want = np.concatenate([want, np.zeros(n - len(want), np.float32)])
        assert np.array_equal(fit_length(wave, n, mode="center", padding=padding), want)
        assert np.array_equal(eval_chunks(wave, n, padding)[0], want)
        got = decode_window(tmp_path / "short.wav", sample_rate=16000, n=n, mode="random",
                            rng=np.random.default_rng(0), padding=padding)
        np.testing.assert_array_equal(got, want)
    tiled = fit_length(wave, n, mode="start", padding="repeatpad")
    assert np.array_equal(tiled[700:1400], wave) and not tiled[1400:].any()  # ⌊2000/700⌋ = 2 copies, then zeros
