"""Collapse and hubness diagnostics of the quality benchmark (bench/quality_diagnostics.py)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.quality_diagnostics import COLLAPSE_SPREAD, embedding_diagnostics, hubness


def _normalized(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_collapsed_embeddings_are_flagged_and_trained_ones_are_not() -> None:
    rng = np.random.default_rng(0)
    point = _normalized(rng.normal(size=(1, 16)))
    # every embedding the same point up to float noise: similarities all equal, spread ~0
    audio = _normalized(np.repeat(point, 50, axis=0) + 1e-6 * rng.normal(size=(50, 16)))
    text = _normalized(np.repeat(point, 200, axis=0) + 1e-6 * rng.normal(size=(200, 16)))
    collapsed = embedding_diagnostics(audio, text, ["eng"] * 200)
    assert collapsed["collapsed"] == 1.0
    assert collapsed["similarity_spread"] < COLLAPSE_SPREAD
    spread_out = embedding_diagnostics(_normalized(rng.normal(size=(50, 16))), _normalized(rng.normal(size=(200, 16))),
                                       ["eng"] * 200)
    assert spread_out["collapsed"] == 0.0
    assert spread_out["similarity_spread"] > 10 * COLLAPSE_SPREAD


def test_a_hub_caption_raises_hubness() -> None:
    rng = np.random.default_rng(1)
    audio = _normalized(rng.normal(size=(100, 8)))
    text = _normalized(rng.normal(size=(300, 8)))
    base = hubness(audio @ text.T)
    similarity = audio @ text.T
    similarity[:, :3] += 1.0  # three captions close to every audio: in every top 10
    assert hubness(similarity) > base + 3
    assert np.isfinite(hubness(np.zeros((5, 20))))  # ties: still a number


def test_hubness_is_the_skewness_of_k_occurrence_by_hand() -> None:
    # 4 audios, 3 captions, k = 1: caption 0 is every audio's nearest → counts (4, 0, 0)
    similarity = np.array([[0.9, 0.1, 0.0], [0.8, 0.2, 0.1], [0.7, 0.0, 0.3], [0.6, 0.5, 0.4]])
    counts = np.array([4.0, 0.0, 0.0])
    centred = counts - counts.mean()
    expected = np.mean(centred**3) / np.mean(centred**2) ** 1.5
    assert hubness(similarity, k=1) == pytest.approx(expected)


def test_hubness_is_averaged_over_caption_languages() -> None:
    rng = np.random.default_rng(2)
    audio = _normalized(rng.normal(size=(40, 8)))
    text = _normalized(rng.normal(size=(120, 8)))
    langs = ["eng"] * 60 + ["fra"] * 60
    out = embedding_diagnostics(audio, text, langs)
    sim = audio @ text.T
    assert out["hubness"] == pytest.approx(0.5 * (hubness(sim[:, :60]) + hubness(sim[:, 60:])))
