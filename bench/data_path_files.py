"""Benchmark: training items per second per core from audio files, whole-file decode vs window.

Measures ``TrainClipDataset.__getitem__``'s audio work on one core (one process, one thread):
the old path (decode the whole file, downmix, resample, then crop: ``fit_length(decode_audio)``)
and the crop-before-decode path (``decode_window``) on 10-s crops, at the CLAP (48 kHz) and AST
(16 kHz) front-end rates, for 44.1 kHz sources of 10 s and 60 s (FLAC, WAV, stereo FLAC) and a
10-min FLAC. Writes the ``data_path_files`` section of docs/BENCHMARKS.md with the arithmetic of
cores per 8-GPU node.

    OMP_NUM_THREADS=1 python bench/data_path_files.py [--seconds-per-cell 4] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import soundfile as sf

from index.audio.decode import decode_audio, decode_window, fit_length

from benchlib import cpu_model, publish_section

START = "<!-- bench:data_path_files:start -->"
END = "<!-- bench:data_path_files:end -->"
SOURCE_RATE = 44100
CROP_SECONDS = 10.0
GPU_SAMPLES_PER_S = {"CLAP-size (HTS-AT + RoBERTa-base)": (736, 48000), "AST-base + XLM-R-base": (303, 16000)}
"""bf16 training samples/s on one H100 (docs/BENCHMARKS.md, "GPU at real size") and the model's rate."""
INPUTS = [
    ("10-s mono FLAC", 10.0, 1, "FLAC"),
    ("10-s mono WAV", 10.0, 1, "WAV"),
    ("10-s stereo FLAC", 10.0, 2, "FLAC"),
    ("60-s mono FLAC", 60.0, 1, "FLAC"),
    ("60-s stereo FLAC", 60.0, 2, "FLAC"),
    ("600-s mono FLAC", 600.0, 1, "FLAC"),
]


def audio_like(seconds: float, channels: int, seed: int) -> np.ndarray:
    """Noise shaped like sound (1/f-ish spectrum, tones, an envelope): FLAC compresses it like real audio."""
    rng = np.random.default_rng(seed)
    n = int(seconds * SOURCE_RATE)
    white = rng.standard_normal((n, channels))
    shaped = np.cumsum(white, axis=0)
    shaped -= np.convolve(shaped[:, 0], np.ones(64) / 64, mode="same")[:, None]
    t = np.arange(n)[:, None] / SOURCE_RATE
    tone = 0.3 * np.sin(2 * np.pi * rng.uniform(100, 2000) * t)
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 0.3 * t)
    mix = shaped / (np.abs(shaped).max() + 1e-9) * 0.4 + tone * envelope
    return (mix / np.abs(mix).max() * 0.9).astype(np.float32)


def make_files(folder: Path, label: str, seconds: float, channels: int, fmt: str, count: int) -> list[Path]:
    paths = []
    for i in range(count):
        path = folder / f"{label.replace(' ', '_')}_{i}.{fmt.lower()}"
        sf.write(path, audio_like(seconds, channels, seed=i), SOURCE_RATE, format=fmt, subtype="PCM_16")
        paths.append(path)
    return paths


def items_per_second(read: Callable[[Path, np.random.Generator], np.ndarray], paths: list[Path],
                     budget_s: float) -> float:
    """Items/s over at least ``budget_s`` seconds (and at least one pass over ``paths``)."""
    read(paths[0], np.random.default_rng(0))  # warm the page cache and libraries
    rng = np.random.default_rng(1)
    done, started = 0, time.perf_counter()
    while True:
        for path in paths:
            read(path, rng)
            done += 1
        elapsed = time.perf_counter() - started
        if elapsed >= budget_s:
            return done / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds-per-cell", type=float, default=4.0)
    parser.add_argument("--files", type=int, default=8, help="files per input kind (page-cached)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load_start = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, seconds, channels, fmt in INPUTS:
            count = max(1, args.files if seconds <= 60 else 2)
            paths = make_files(Path(tmp), label, seconds, channels, fmt, count)
            row: dict[str, object] = {"input": label}
            for rate in (48000, 16000):
                n = int(CROP_SECONDS * rate)

                def whole(path: Path, rng: np.random.Generator, rate: int = rate, n: int = n) -> np.ndarray:
                    return fit_length(decode_audio(path, sample_rate=rate), n, mode="random", rng=rng)

                def window(path: Path, rng: np.random.Generator, rate: int = rate, n: int = n) -> np.ndarray:
                    return decode_window(path, sample_rate=rate, n=n, mode="random", rng=rng)

                row[f"whole_{rate}"] = items_per_second(whole, paths, args.seconds_per_cell)
                row[f"window_{rate}"] = items_per_second(window, paths, args.seconds_per_cell)
                print(label, rate, f"whole {row[f'whole_{rate}']:.1f}/s  window {row[f'window_{rate}']:.1f}/s",
                      flush=True)
            rows.append(row)
    load_end = os.getloadavg()[0]
    publish_section(markdown(rows, load=(load_start, load_end), args=args), start=START, end=END,
                    write=not args.no_write)


def markdown(rows: list[dict[str, object]], *, load: tuple[float, float], args: argparse.Namespace) -> str:
    def f(value: object) -> str:
        return f"{float(value):.0f}"  # type: ignore[arg-type]

    lines = [
        START,
        "## data_path_files — training items/s per core from audio files: whole-file decode vs crop-before-decode",
        "",
        f"`OMP_NUM_THREADS=1 python bench/data_path_files.py --seconds-per-cell {args.seconds_per_cell:g}` · "
        f"{cpu_model()}, one core (one process, one thread) · {dt.date.today().isoformat()} · "
        f"load average {load[0]:.2f} → {load[1]:.2f} (1-min, 2 cores)",
        "",
        "A 10-s random crop of 44.1 kHz PCM-16 sources (page-cached), decoded to float32 mono at the front "
        "end's rate: *whole* = decode the file, downmix, resample, crop (the path before crop-before-decode); "
        "*window* = `index.audio.decode.decode_window` (seek, read the crop + 50 ms each side, downmix, resample).",
        "",
        "| input | whole → 48 kHz | window → 48 kHz | × | whole → 16 kHz | window → 16 kHz | × |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        cells = [str(row["input"])]
        for rate in (48000, 16000):
            whole, window = float(row[f"whole_{rate}"]), float(row[f"window_{rate}"])  # type: ignore[arg-type]
            cells += [f(whole), f(window), f"{window / whole:.1f}×"]
        lines.append("| " + " | ".join(cells) + " |")
    by_input = {str(r["input"]): r for r in rows}
    ten, sixty = by_input["10-s mono FLAC"], by_input["60-s mono FLAC"]
    ratio = float(ten["window_48000"]) / float(sixty["window_48000"])  # type: ignore[arg-type]
    lines += [
        "",
        f"A 60-s mono FLAC costs {ratio:.2f}× a 10-s one per window at 48 kHz (whole-file: "
        f"{float(ten['whole_48000']) / float(sixty['whole_48000']):.1f}×).",  # type: ignore[arg-type]
        "",
        "Cores one 8×H100 node needs to feed bf16 training from files (8 GPUs × samples/s per GPU ÷ items/s "
        "per core), window path:",
        "",
        "| model | samples/s per node | 10-s mono FLAC | 60-s mono FLAC | 60-s stereo FLAC |",
        "|---|---:|---:|---:|---:|",
    ]
    for model, (per_gpu, rate) in GPU_SAMPLES_PER_S.items():
        node = 8 * per_gpu
        cores = [node / float(by_input[k][f"window_{rate}"])  # type: ignore[arg-type]
                 for k in ("10-s mono FLAC", "60-s mono FLAC", "60-s stereo FLAC")]
        lines.append(f"| {model} ({rate // 1000} kHz) | {node:,} | " + " | ".join(f"{c:.0f}" for c in cores) + " |")
    lines += [
        "",
        "What limits it: FLAC decoding and soxr's HQ resampling of the 10-s window (44.1 → 48 kHz is a "
        "non-integer ratio). Shards written at the model's rate (`tonearm data shard`) skip the resampling "
        "and the downmix; see data_path below for the shard figures.",
        END,
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
