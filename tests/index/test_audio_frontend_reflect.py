"""``audio_frontend.padding = "reflect"`` (PE-Audio): the service's numpy padding equals
``PeAudioFeatureExtractor``'s own, and the manifest records it only with its hop multiple."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from index import bundle as fmt
from index.audio_frontend import keeps_short_clips, pad_short_clip


@pytest.mark.parametrize("length", [1, 5, 1919, 1920, 1921, 24_000, 100_003])
def test_reflect_padding_is_the_extractors(length: int) -> None:
    from transformers import PeAudioFeatureExtractor

    wave = np.random.default_rng(length).standard_normal(length).astype(np.float32)
    expected = PeAudioFeatureExtractor()(wave, sampling_rate=48_000)["input_values"][0][0]
    got = pad_short_clip(wave, 480_000, "reflect", 1920)
    assert got.dtype == np.float32 and got.shape[0] % 1920 == 0
    np.testing.assert_array_equal(got, expected)
    assert keeps_short_clips("reflect") and not keeps_short_clips("repeatpad")


def test_reflect_needs_its_multiple() -> None:
    with pytest.raises(ValueError, match="pad_multiple"):
        pad_short_clip(np.ones(10, np.float32), 100, "reflect")
    with pytest.raises(ValidationError, match="pad_multiple"):
        fmt.AudioFrontendInfo(padding="reflect", model_truncation="none")
    with pytest.raises(ValidationError, match="pad_multiple"):
        fmt.AudioFrontendInfo(padding="repeatpad", pad_multiple=1920, model_truncation="rand_trunc")
