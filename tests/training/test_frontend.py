"""Log-mel frontend: hand-computed filterbank and spectrum values, padding policy, path parity."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from training.config import FrontendConfig
from training.models.frontend import LOG_EPS, LogMelFrontend, hz_to_mel, mel_filterbank, mel_to_hz


def test_htk_mel_scale_values() -> None:
    assert float(hz_to_mel(700.0)) == pytest.approx(2595.0 * math.log10(2.0))
    assert float(hz_to_mel(0.0)) == 0.0
    freqs = np.array([0.0, 125.0, 1000.0, 7999.0])
    np.testing.assert_allclose(mel_to_hz(hz_to_mel(freqs)), freqs, atol=1e-9)


def test_filterbank_triangles_peak_at_their_centres() -> None:
    fb = mel_filterbank(sample_rate=16000, n_fft=512, n_mels=8, f_min=0.0, f_max=8000.0)
    assert fb.shape == (8, 257)
    assert fb.min() >= 0.0 and fb.max() <= 1.0
    bin_hz = 16000 / 512
    centres = mel_to_hz(np.linspace(0.0, hz_to_mel(8000.0), 10))[1:-1]
    for m, centre in enumerate(centres):
        # the bin nearest the centre has the largest weight of the filter
        assert abs(int(fb[m].argmax()) * bin_hz - centre) <= bin_hz
        lower, upper = centres[m - 1] if m else 0.0, centres[m + 1] if m < 7 else 8000.0
        outside = (np.arange(257) * bin_hz <= lower) | (np.arange(257) * bin_hz >= upper)
        assert np.all(fb[m, outside] < 1e-6)


def test_frame_count_follows_padding_policy() -> None:
    frontend = LogMelFrontend(FrontendConfig())
    for samples in (400, 16000, 80000, 80159, 112000):
        out = frontend(torch.zeros(2, samples))
        assert out.shape == (2, 64, 1 + samples // 160)
        assert frontend.num_frames(samples) == out.shape[-1]


def test_silence_is_log_eps() -> None:
    out = LogMelFrontend(FrontendConfig())(torch.zeros(1, 1600))
    torch.testing.assert_close(out, torch.full_like(out, math.log(LOG_EPS)))


def test_sine_power_matches_hand_computed_value() -> None:
    """A 1 kHz sine (exactly bin 32 at n_fft 512) of amplitude A: |X| = A/2 · Σ hann = A/2 · 200."""
    frontend = LogMelFrontend(FrontendConfig())
    t = torch.arange(16000, dtype=torch.float64) / 16000
    wave = (0.5 * torch.sin(2 * math.pi * 1000.0 * t)).float()[None]
    for power in (frontend.power_fft(wave), frontend.power_dft(wave)):
        middle = power[0, :, 50]
        assert int(middle.argmax()) == 32
        assert float(middle[32]) == pytest.approx((0.5 / 2 * 200.0) ** 2, rel=1e-3)


def test_sine_lands_in_the_mel_band_around_its_frequency() -> None:
    cfg = FrontendConfig()
    frontend = LogMelFrontend(cfg)
    t = torch.arange(8000) / 16000
    for hz in (300.0, 1000.0, 4000.0):
        mel = frontend(torch.sin(2 * math.pi * hz * t)[None])[0, :, 20]
        centres = mel_to_hz(
            np.linspace(hz_to_mel(cfg.f_min), hz_to_mel(cfg.f_max), cfg.n_mels + 2)
        )[1:-1]
        assert abs(centres[int(mel.argmax())] - hz) < 0.1 * hz


@pytest.mark.parametrize("win_length", [400, 401, 512])
def test_fft_and_dft_paths_agree(win_length: int) -> None:
    frontend = LogMelFrontend(FrontendConfig(win_length=win_length))
    wave = torch.randn(3, 8017, generator=torch.Generator().manual_seed(0))
    fft, dft = frontend.power_fft(wave), frontend.power_dft(wave)
    assert fft.shape == dft.shape
    torch.testing.assert_close(dft, fft, rtol=0, atol=1e-4 * float(fft.max()))
    forced = LogMelFrontend(FrontendConfig(win_length=win_length), use_dft=True)
    torch.testing.assert_close(forced(wave), frontend(wave), rtol=0, atol=1e-3)


def test_batch_items_are_independent() -> None:
    frontend = LogMelFrontend(FrontendConfig())
    wave = torch.randn(3, 4000, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(frontend(wave)[1:2], frontend(wave[1:2]))


def test_features_stay_float32_under_autocast() -> None:
    frontend = LogMelFrontend(FrontendConfig())
    wave = torch.sin(torch.arange(16000) / 16000 * 2 * math.pi * 440.0)[None]
    expected = frontend(wave)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        got = frontend(wave)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected)
