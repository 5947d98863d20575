"""``audio_frontend.padding = "reflect"`` (PE-Audio): the service's numpy padding equals
``PeAudioFeatureExtractor``'s own, and the manifest records it only with its hop multiple."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from index.audio.frontend import keeps_short_clips, pad_short_clip
from index.bundle import format as fmt


@pytest.mark.parametrize("length", [1, 5, 1919, 1920, 1921, 24_000, 100_003])
def test_reflect_padding_is_the_extractors(length: int) -> None:
    from transformers import PeAudioFeatureExtractor

    wave = np.random.default_rng(length).standard_normal(length).astype(np.float32)
    expected = PeAudioFeatureExtractor()(wave, sampling_rate=48_000)["input_values"][0][0]
    got = pad_short_clip(wave, 480_000, "reflect", 1920)
    assert got.dtype == np.float32 and got.shape[0] % 1920 == 0
    np.testing.assert_array_equal(got, expected)
    assert keeps_short_clips("reflect") and not keeps_short_clips("repeatpad")


@pytest.mark.parametrize("length", [480_001, 500_003, 672_000])
def test_long_clips_whole_are_the_extractors_input(length: int) -> None:
    """``long_clips = "whole"``: a clip longer than the window is reflect-padded to the hop as the extractor
    pads it (a NaN tail from the training data path is dropped first)."""
    from transformers import PeAudioFeatureExtractor

    from index.audio.frontend import prepare_whole_clip

    wave = np.random.default_rng(length).standard_normal(length).astype(np.float32)
    expected = PeAudioFeatureExtractor()(wave, sampling_rate=48_000)["input_values"][0][0]
    np.testing.assert_array_equal(prepare_whole_clip(wave, 1920), expected)
    marked = np.concatenate([wave, np.full(1000, np.nan, np.float32)])
    np.testing.assert_array_equal(prepare_whole_clip(marked, 1920), expected)


def test_reflect_without_its_multiple_marks_the_tail_and_the_manifest_needs_it() -> None:
    marked = pad_short_clip(np.ones(10, np.float32), 100, "reflect")  # the training path: the tower pads
    assert marked.shape == (100,) and np.isnan(marked[10:]).all() and (marked[:10] == 1).all()
    with pytest.raises(ValidationError, match="long_clips 'whole' needs padding 'reflect'"):
        fmt.AudioFrontendInfo(padding="repeatpad", long_clips="whole", model_truncation="rand_trunc")
    with pytest.raises(ValidationError, match="pad_multiple"):
        fmt.AudioFrontendInfo(padding="reflect", model_truncation="none")
    with pytest.raises(ValidationError, match="pad_multiple"):
        fmt.AudioFrontendInfo(padding="repeatpad", pad_multiple=1920, model_truncation="rand_trunc")
