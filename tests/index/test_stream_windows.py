"""A recording embedded by blocks (issue 54, part 3: long items): :func:`index.moments.windows.embed_stream`
gives the vectors of the whole waveform — the moment windows of :func:`embed_windows` and the clip vector of
chunk-and-average (:func:`index.audio.decode.eval_chunks`) — whatever the blocks, lengths and windows; and
:func:`index.audio.decode.decode_blocks` concatenates to :func:`decode_audio`'s waveform."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from index.audio.decode import decode_audio, decode_blocks, eval_chunks
from index.moments.windows import embed_stream, embed_windows


def _encode(windows):
    """A deterministic encoder that sees every sample's place and the window's length (normalized)."""
    out = []
    for w in windows:
        w = np.asarray(w, dtype=np.float64)
        v = np.array([w[:50].sum(), w[-50:].sum(), w.mean(), (w ** 2).mean(), len(w) / 100, w[len(w) // 2], 1.0])
        out.append(v / np.linalg.norm(v))
    return np.asarray(out, dtype=np.float32)


def _clip(wave, n):
    if len(wave) < n:
        return _encode([wave])[0]
    total = _encode(list(eval_chunks(wave, n))).astype(np.float64).sum(axis=0)
    return total / np.linalg.norm(total)


@pytest.mark.parametrize(("window", "hop"), [(100, 50), (101, 51), (100, 100), (64, 16)])
@pytest.mark.parametrize("length", [30, 99, 100, 101, 199, 200, 201, 333, 1001, 1234])
@pytest.mark.parametrize("block", [1, 7, 64, 5000])
def test_by_blocks_is_the_whole_waveform(window: int, hop: int, length: int, block: int) -> None:
    wave = np.random.default_rng(length + window).normal(size=length).astype(np.float32)
    found = embed_stream((wave[i : i + block] for i in range(0, length, block)), sample_rate=10,
                         window_samples=window, hop_samples=hop, encode=_encode)
    assert found.samples == length
    np.testing.assert_allclose(found.clip, _clip(wave, window), atol=1e-5)
    if length > 2 * window:
        spans, vectors = embed_windows(wave, sample_rate=10, window_samples=window, hop_samples=hop, encode=_encode)
        np.testing.assert_allclose(found.spans, spans)
        np.testing.assert_allclose(found.vectors, vectors, atol=1e-6)
    else:
        assert found.spans.shape == (0, 2)


@pytest.mark.parametrize(("rate", "channels"), [(16_000, 1), (44_100, 2), (8_000, 3)])
def test_decode_blocks_concatenate_to_the_whole_decode(rate: int, channels: int) -> None:
    wave = np.random.default_rng(rate).uniform(-0.9, 0.9, (rate * 5 + 123, channels)).astype(np.float32)
    data = io.BytesIO()
    sf.write(data, wave, rate, format="FLAC")
    blocks = list(decode_blocks(data.getvalue(), sample_rate=16_000, complete=True))
    assert len(blocks) > 1
    np.testing.assert_array_equal(np.concatenate(blocks), decode_audio(data.getvalue(), sample_rate=16_000))
