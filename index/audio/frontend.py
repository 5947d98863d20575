"""Short-clip padding recorded in a bundle (``manifest.audio_frontend``; docs/models.md).

Bundles exported from a checkpoint zero-pad clips shorter than ``clip_samples``
(:func:`index.audio.decode.eval_chunks`). A pretrained CLAP bundle pads as its
``ClapFeatureExtractor`` does, before the waveform reaches the ONNX encoder:

* ``repeatpad``: the clip tiled ``⌊N / len⌋`` times, then zero-padded to N samples;
* ``repeat``: tiled ``⌊N / len⌋ + 1`` times and cut to N;
* ``pad``: zero-padded to N (the checkpoint bundles' behaviour);
* ``frames`` (AST's ``ASTFeatureExtractor``, issue 41): the tail up to N samples is NaN, a marker
  of "no audio here" — the encoder's front end (:class:`training.models.ast_frontend.ASTWaveFrontend`)
  turns every fbank frame that touches it into the extractor's padding frame (0 before the
  normalisation), which is what the extractor does with a short clip: it pads *frames* with
  zeros after the fbank, not the waveform. Zero-padding the waveform instead gives frames of
  log(floor) (normalised −1.28 where the extractor has 0.467) and moved the full-size AST's pooled
  output to cosine −0.28 of the model fed by its own extractor on a 0.5-s clip;
* ``reflect`` (PE-Audio's ``PeAudioFeatureExtractor._reflect_pad``): reflected at its end to the
  next multiple of ``multiple`` samples (the codec's hop) and kept at that length — the model has
  no fixed input length, so the loader embeds such a clip as one window of its own length
  (:func:`keeps_short_clips`). Without ``multiple`` (the training and evaluation data path of an
  ``hf_pe_audio`` tower, whose windows are stacked in batches) the tail up to N samples is NaN, as
  for ``frames``: the tower (:class:`training.models.pretrained_pe_audio.PeAudioAudioTower`) embeds
  the clip at its own length, reflect-padded to the hop, exactly as the bundle's loader does.

**Length buckets** (:func:`bucket_length`): a ``whole`` bundle whose audio encoder takes a
``padding_mask`` (``manifest.audio_encoder.inputs``; exported since issue 49) runs clips of different
lengths in one call, each zero-padded to its bucket — its hop-multiple length rounded up to one of
:data:`BUCKET_STEPS_PER_OCTAVE` lengths per octave — and masked there, so the embedding is the clip's own.

Clips of N samples or more are returned unchanged (the loader's chunk-and-average
handles them). numpy only: the service applies it to every upload, after decoding and
resampling to the bundle's sample rate.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

Padding = Literal["repeatpad", "repeat", "pad", "reflect", "frames"]


def prepare_whole_clip(wave: np.ndarray, multiple: int) -> np.ndarray:
    """A clip of any length as ``long_clips = "whole"`` embeds it: reflected at its end to the next multiple
    of ``multiple`` samples (``PeAudioFeatureExtractor._reflect_pad``; a NaN tail, the training path's marker,
    is dropped first)."""
    wave = np.asarray(wave, dtype=np.float32)
    if wave.shape[0] and np.isnan(wave[-1]):
        wave = wave[~np.isnan(wave)]
    return pad_short_clip(wave, wave.shape[0] + multiple, "reflect", multiple)


BUCKET_STEPS_PER_OCTAVE = 8
"""Bucket lengths per doubling of the clip length (:func:`bucket_length`): a clip is padded by less than
an eighth of its own length (< 11.1 % of a call's samples are padding, ~6 % on average over uniformly
spread lengths). The mask makes the padding exact, so this trades only compute (more padding) against
calls (more clips per bucket): 8 buckets per octave, 29 for a catalogue of 5–60-s clips at 48 kHz."""


def bucket_length(samples: int, multiple: int) -> int:
    """The bucket a clip of ``samples`` samples is zero-padded to (``samples`` a multiple of ``multiple``,
    the codec's hop, after :func:`prepare_whole_clip`): up to ``2 * BUCKET_STEPS_PER_OCTAVE`` hops every
    hop count is its own bucket; above, the hop count rounded up to a multiple of 1/``BUCKET_STEPS_PER_OCTAVE``
    of the power of two below it (4,800 hops → 5,120: 4,096 + 2 · 512). Fixed lengths, independent of
    the other clips of a call: a clip's call shape never depends on its neighbours."""
    hops = max(1, -(-int(samples) // multiple))
    octave = hops.bit_length() - 1
    step = 1 << max(0, octave - (BUCKET_STEPS_PER_OCTAVE.bit_length() - 1))
    return -(-hops // step) * step * multiple


def keeps_short_clips(padding: str) -> bool:
    """True when a padded short clip stays shorter than the window (embedded at its own length)."""
    return padding == "reflect"


def pad_short_clip(wave: np.ndarray, n: int, padding: Padding, multiple: int | None = None) -> np.ndarray:
    """``wave`` (1-D float32) brought to ``n`` samples when shorter, as the extractor pads it
    (``reflect``: to the next multiple of ``multiple`` instead)."""
    wave = np.asarray(wave, dtype=np.float32)
    length = wave.shape[0]
    if length >= n or length == 0 or padding == "pad":
        return wave
    if padding == "frames":
        return np.concatenate([wave, np.full(n - length, np.nan, np.float32)])
    if padding == "reflect":
        if not multiple:  # the training data path: the hf_pe_audio tower pads (and crops) itself
            return np.concatenate([wave, np.full(n - length, np.nan, np.float32)])
        if length % multiple == 0:
            return wave
        # numpy's reflect (edge sample not repeated) is what the extractor calls; it reflects
        # repeatedly when the pad is longer than the clip.
        return np.pad(wave, (0, multiple - length % multiple), mode="reflect").astype(np.float32, copy=False)
    if padding == "repeatpad":
        wave = np.tile(wave, n // length)
    elif padding == "repeat":
        wave = np.tile(wave, n // length + 1)[:n]
    else:
        raise ValueError(f"unknown padding {padding!r}; use repeatpad, repeat or pad")
    out = np.zeros(n, dtype=np.float32)
    out[: wave.shape[0]] = wave
    return out
