"""Benchmark: training items per second per core streamed from `tonearm data shard` output.

44.1 kHz mono sources of 10 s and 60 s (the shapes of data_path_files) are sharded at 48 kHz (the
CLAP front end's rate) as FLAC and as PCM-16 WAV, then one process with one thread iterates
:class:`training.data.stream.ShardStream` (tar read from a page-cached local folder, shuffle
buffer, crop-before-decode of a 10-s window of the in-memory FLAC/WAV, no resampling) — what one
loader worker does per item before collation. Targets (issue 30): ≥ 150 items/s per core, and a
60-s source ≤ 1.2× the cost of a 10-s one. Writes the ``data_path_shards`` section of
docs/BENCHMARKS.md with the cores per 8×H100 node.

    OMP_NUM_THREADS=1 flock /tmp/tonearm-heavy.lock python bench/data_path_shards.py [--no-write]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import tempfile
import time
from pathlib import Path

import soundfile as sf
from data_path_files import GPU_SAMPLES_PER_S, SOURCE_RATE, audio_like

from benchlib import cpu_model, publish_section

START = "<!-- bench:data_path_shards:start -->"
END = "<!-- bench:data_path_shards:end -->"
RATE = 48_000
CROP_SECONDS = 10.0
NOTE = (
    "Where the time went (cProfile and per-step timings, 60-s sources, this machine under load): before "
    "2026-11-25 webdataset's tar expander read every member in tarfile's stream mode, 10 KiB at a time "
    "with the pieces joined and sliced (three copies): ~3.2 ms per 60-s FLAC sample (2.8 MB) and ~7.7 ms per "
    "60-s PCM-16 one (5.8 MB), the whole of what a 60-s source added. fsspec's local and object-store files "
    "seek, so `ShardStream` now reads them in tarfile's random-access mode, one `read` per member "
    "(~0.5 ms / ~1 ms for the same samples; webdataset still groups members by key, and reads streams that "
    "cannot seek). Clips exactly as long as the crop (10-s sources at the model's rate) now take "
    "`decode_window`'s direct read instead of the whole-file decoder (~25 % faster). What is left: the FLAC "
    "window decode itself (libFLAC, ~6.5 ms for 480 k samples; reading int16 or int32 instead of float32 is "
    "no faster), which puts FLAC at ~150 items/s per core at best; PCM-16 decodes ~4× faster, but its 60-s "
    "samples carry 6× the bytes of the crop and every byte of a streamed sample is read (a crop cannot skip "
    "the bytes before it in a stream), so its 60-s cost stays above 1.2×. Cutting long clips into segments "
    "would not change this: the tar bytes are read either way, and the FLAC window decode is already "
    "windowed (libsndfile seeks in the FLAC, no seek table needed: the 60-s FLAC crop decodes as fast as "
    "the 10-s one)."
)


def make_manifest(folder: Path, seconds: float, count: int) -> Path:
    (folder / "audio").mkdir(parents=True)
    lines = []
    for i in range(count):
        path = folder / "audio" / f"clip{i}.flac"
        sf.write(path, audio_like(seconds, 1, seed=i)[:, 0], SOURCE_RATE, format="FLAC", subtype="PCM_16")
        lines.append(json.dumps({"id": f"clip{i}", "audio": f"audio/{path.name}", "split": "train",
                                 "captions": {"eng": [f"sound number {i}"]}}))
    manifest = folder / "manifest.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def items_per_second(url: str, budget_s: float) -> float:
    from training.data.epoch_plan import Layout
    from training.data.stream import ShardStream, open_corpus

    corpus = open_corpus(url, languages=["eng"], drop_other_languages=False)
    stream = ShardStream(corpus, rank=0, layout=Layout(world=1, workers=1, batch_size=1, buffer=64),
                         sample_rate=RATE, clip_samples=int(CROP_SECONDS * RATE), seed=0, languages=["eng"])
    stream.set_epoch(0)
    for _ in stream:  # warm the page cache and libraries
        pass
    done, epoch, started = 0, 1, time.perf_counter()
    while True:
        stream.set_epoch(epoch)
        for items, *_ in stream:  # batches of one
            done += len(items)
        epoch += 1
        elapsed = time.perf_counter() - started
        if elapsed >= budget_s:
            return done / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds-per-cell", type=float, default=5.0)
    parser.add_argument("--clips", type=int, default=16, help="clips per source length")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from training.data.shards import shard_manifest

    load_start = os.getloadavg()[0]
    rows: dict[tuple[float, str], float] = {}
    sizes: dict[tuple[float, str], int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seconds in (10.0, 60.0):
            manifest = make_manifest(Path(tmp) / f"src{seconds:g}", seconds, args.clips)
            for codec in ("flac", "pcm16"):
                out = Path(tmp) / f"shards{seconds:g}_{codec}"
                shard_manifest(manifest, out, sample_rate=RATE, codec=codec, shard_size=8, workers=1,  # type: ignore[arg-type]
                               progress=False)
                sizes[seconds, codec] = sum(p.stat().st_size for p in out.glob("*.tar")) // args.clips
                rows[seconds, codec] = items_per_second(str(out), args.seconds_per_cell)
                print(f"{seconds:g}-s source, {codec}: {rows[seconds, codec]:.0f} items/s", flush=True)
    load_end = os.getloadavg()[0]
    publish_section(markdown(rows, sizes, load=(load_start, load_end), args=args), start=START, end=END,
                    write=not args.no_write)


def markdown(rows: dict[tuple[float, str], float], sizes: dict[tuple[float, str], int], *,
             load: tuple[float, float], args: argparse.Namespace) -> str:
    lines = [
        START,
        "## data_path_shards — training items/s per core streamed from shards (48 kHz, 10-s crops)",
        "",
        f"`OMP_NUM_THREADS=1 python bench/data_path_shards.py --seconds-per-cell {args.seconds_per_cell:g}` · "
        f"{cpu_model()}, one core (one process, one thread) · {dt.date.today().isoformat()} · "
        f"load average {load[0]:.2f} → {load[1]:.2f} (1-min, 2 cores)",
        "",
        "44.1 kHz mono sources sharded by `tonearm data shard --sample-rate 48000` (8 clips a shard, "
        "page-cached local folder); `ShardStream` as one loader worker runs it: tar read, shuffle buffer of "
        "64, crop-before-decode of the in-memory audio (no resampling: the shards are at the model's rate), "
        "no collation. Target: ≥ 150 items/s per core, a 60-s source ≤ 1.2× a 10-s one.",
        "",
        "| codec | 10-s source | 60-s source | 60-s cost ÷ 10-s | bytes per 60-s clip |",
        "|---|---:|---:|---:|---:|",
    ]
    for codec in ("flac", "pcm16"):
        ten, sixty = rows[10.0, codec], rows[60.0, codec]
        lines.append(f"| {codec} | {ten:.0f} | {sixty:.0f} | {ten / sixty:.2f}× | {sizes[60.0, codec] / 1e6:.1f} MB |")
    lines += ["", "Targets: " + "; ".join(
        f"{codec}: ≥ 150 items/s {'met' if rows[10.0, codec] >= 150 else 'not met'} "
        f"({rows[10.0, codec]:.0f}), 60-s ≤ 1.2× {'met' if rows[10.0, codec] / rows[60.0, codec] <= 1.2 else 'not met'} "
        f"({rows[10.0, codec] / rows[60.0, codec]:.2f}×)" for codec in ("flac", "pcm16")) + "."]
    lines += ["", NOTE]
    lines += ["", "Cores to feed one 8×H100 node from shards of 60-s clips (one loader worker per core, the "
              "measured 60-s figure; WavCaps clips average about a minute):", ""]
    for name, (per_gpu, rate) in GPU_SAMPLES_PER_S.items():
        note = "" if rate == RATE else f" (measured at 48 kHz; a {rate // 1000} kHz shard decodes faster)"
        cores = ", ".join(f"{codec} {8 * per_gpu:,} ÷ {rows[60.0, codec]:.0f} = **{8 * per_gpu / rows[60.0, codec]:.0f}**"
                          for codec in ("flac", "pcm16"))
        lines.append(f"- {name}: 8 × {per_gpu} items/s → cores: {cores}{note}")
    lines.append(END)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
