"""Measure PE-Audio's long-clip rules against the model's own whole-clip forward (issue 41).

For clips of 10–60 s, compares the window-mean (10-s windows, the last right-aligned, mean of the
L2-normalised window embeddings — the chunk-and-average rule of every tonearm bundle) with
``PeAudioModel.get_audio_embeds`` of the whole clip through ``PeAudioFeatureExtractor`` (what the
model itself does: it has no maximum length). Reports the raw cosine and the cosine of centred
embeddings (the mean over the set of different clips of that length removed), which is what differs
between clips. Also the forward's time per clip of each rule.

    PYTHONPATH=. python bench/pe_audio_long_clips.py FOLDER [--seconds 10 20 30 45 60] [--clips 6]

FOLDER: a saved PeAudioModel (tests/small_pe_audio.py builds a small random-weight one).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

RATE = 48_000
WINDOW = 10 * RATE


def signal(rng: np.random.Generator, seconds: float) -> np.ndarray:
    """A clip whose content changes over time: segments of tones, noise bursts and silence."""
    n = int(seconds * RATE)
    out = np.zeros(n, np.float32)
    t = np.arange(n) / RATE
    start = 0
    while start < n:
        length = int(rng.uniform(1.0, 6.0) * RATE)
        seg = slice(start, min(n, start + length))
        kind = rng.integers(0, 3)
        if kind == 0:
            out[seg] = 0.3 * np.sin(2 * np.pi * rng.uniform(100, 4000) * t[seg])
        elif kind == 1:
            out[seg] = rng.uniform(0.05, 0.4) * rng.standard_normal(seg.stop - seg.start)
        start += length
    return out


def windows(wave: np.ndarray) -> list[np.ndarray]:
    if wave.shape[0] <= WINDOW:
        return [wave]
    count = -(-wave.shape[0] // WINDOW)
    starts = [i * WINDOW for i in range(count - 1)] + [wave.shape[0] - WINDOW]
    return [wave[s : s + WINDOW] for s in starts]


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--seconds", type=float, nargs="+", default=[10, 20, 30, 45, 60])
    parser.add_argument("--clips", type=int, default=6)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model = transformers.PeAudioModel.from_pretrained(args.folder).eval()
    extractor = transformers.PeAudioFeatureExtractor.from_pretrained(args.folder)

    def embed(wave: np.ndarray) -> np.ndarray:
        inputs = extractor(wave, sampling_rate=RATE, return_tensors="pt")
        e = model.get_audio_embeds(inputs["input_values"], padding_mask=inputs["padding_mask"])[0]
        return torch.nn.functional.normalize(e, dim=-1).numpy()

    def unit(x: np.ndarray) -> np.ndarray:
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    rng = np.random.default_rng(0)
    print("| clip (s) | cos window-mean vs whole (min / mean) | centred cos (min / mean) | "
          "centred cos of 2 different clips, whole (mean) | s per clip: whole / windows |")
    print("|---|---|---|---|---|")
    for seconds in args.seconds:
        clips = [signal(rng, seconds) for _ in range(args.clips)]
        t0 = time.perf_counter()
        whole = np.stack([embed(c) for c in clips])
        t_whole = (time.perf_counter() - t0) / len(clips)
        t0 = time.perf_counter()
        mean = unit(np.stack([np.mean([embed(w) for w in windows(c)], axis=0) for c in clips]))
        t_win = (time.perf_counter() - t0) / len(clips)
        raw = (whole * mean).sum(-1)
        cw, cm = unit(whole - whole.mean(0)), unit(mean - mean.mean(0))
        centred = (cw * cm).sum(-1)
        others = (cw * np.roll(cw, 1, axis=0)).sum(-1)
        print(f"| {seconds:g} | {raw.min():.4f} / {raw.mean():.4f} | {centred.min():.3f} / {centred.mean():.3f} | "
              f"{others.mean():.3f} | {t_whole:.2f} / {t_win:.2f} |", flush=True)


if __name__ == "__main__":
    main()
