"""`export --pretrained`'s own parity check judges centred cosines (issue 49, :func:`training.bundle.pretrained.check_parity`):
the staged encoders pass against the model's own embeddings, and the same encoders fed short clips zero-padded
instead of the model's repeat-padding fail — a plain cosine near 1 is no evidence with random weights.

Cost: ~10-20 s on two cores (the small random ClapModel of tests/training/test_pretrained_quantize.py, exported once).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from index.audio.frontend import pad_short_clip
from training.bundle import pretrained
from training.bundle.onnx_export import ExportError


def test_parity_passes_the_model_and_refuses_zero_padding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.training.test_pretrained_quantize import write_small_clap

    clap = pretrained.load_pretrained(write_small_clap(tmp_path / "small_clap"))
    staging = tmp_path / "staging"
    staging.mkdir()
    encoders, _ = pretrained.export_pretrained_encoders(clap, staging, tmp_path / "scratch")
    rate, n = clap.settings.sample_rate, clap.settings.clip_samples
    t = np.arange(n) / rate
    sample = (0.3 * np.sin(2 * np.pi * 330 * t) * np.hanning(n)).astype(np.float32)
    clips = pretrained.parity_clips(sample, n)
    texts = ["a dog barks", "rain on a tin roof"]
    expected = pretrained.references(clap, clips, texts)
    audio, _text = pretrained.check_parity(encoders, clips, texts, expected)
    assert audio >= 0.999

    monkeypatch.setattr(pretrained, "pad_short_clip", lambda wave, samples, _padding, multiple=None: pad_short_clip(
        wave, samples, "pad", multiple))  # zero padding: the bug the centred check exists for
    with pytest.raises(ExportError, match="min cosine 0.99"):  # the plain check catches this one (0.9964) ...
        pretrained.check_parity(encoders, clips, texts, expected)
    monkeypatch.setattr(pretrained, "MIN_COSINE", 0.99)  # ... and where a plain cosine passes, centring does not
    with pytest.raises(ExportError, match="centred cosine"):
        pretrained.check_parity(encoders, clips, texts, expected)
