"""Benchmark: resident memory of a loader worker's shuffle buffer against `tonearm train --plan`'s figure.

400 noise clips of 12 s at 16 kHz are sharded (100 a shard); one stream (one rank, no loader
worker: the process is the worker) serves an epoch of 10-s crops in batches of 16 while its
resident memory is sampled after each batch. The plan counts ``data.shuffle_buffer`` float32
crops per worker; the buffer holds at most that many (fewer while it fills, and once the chunk
runs out: a 400-clip chunk with a buffer of 300 peaks at 208 entries), plus the batch in hand.

    PYTHONPATH=. flock /tmp/tonearm-heavy.lock python bench/shuffle_buffer_memory.py [--buffers 16 100 300]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf

RATE, CLIP_S, CROP_S, CLIPS, BATCH = 16_000, 12, 10, 400, 16


def rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_shards(root: Path) -> Path:
    from training.data.shards import shard_manifest

    (root / "audio").mkdir(parents=True)
    rng = np.random.default_rng(0)
    lines = []
    for i in range(CLIPS):
        path = root / "audio" / f"c{i}.flac"
        sf.write(path, (rng.standard_normal(RATE * CLIP_S) * 0.1).astype("float32"), RATE, subtype="PCM_16")
        lines.append(json.dumps({"id": f"c{i}", "audio": str(path), "split": "train", "captions": {"eng": [f"noise {i}"]}}))
    (root / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    shard_manifest(root / "manifest.jsonl", root / "shards", sample_rate=RATE, shard_size=100, workers=2, progress=False)
    return root / "shards"


def peak_entries(length: int, buffer: int, first: int) -> int:
    """The most entries the draw schedule holds (training.data.epoch_plan.draw_order's fill rule)."""
    most = 0
    for drawn in range(length):
        read = min(length, drawn + min(buffer, first + drawn))
        most = max(most, read - drawn)
    return most


def measure(url: str, buffer: int) -> tuple[int, int]:
    from training.data.epoch_plan import Layout
    from training.data.stream import ShardStream, open_corpus

    corpus = open_corpus(url, languages=["eng"], drop_other_languages=False)
    stream = ShardStream(corpus, rank=0, layout=Layout(1, 0, BATCH, buffer), sample_rate=RATE,
                         clip_samples=RATE * CROP_S, seed=0, languages=["eng"])
    stream.set_epoch(0)
    base, peak = rss(), 0
    for items, *_ in stream:
        peak = max(peak, rss() - base)
        del items
    return peak, peak_entries(CLIPS, buffer, BATCH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--buffers", type=int, nargs="+", default=[16, 100, 300])
    args = parser.parse_args()
    crop = RATE * CROP_S * 4
    with tempfile.TemporaryDirectory() as tmp:
        url = str(make_shards(Path(tmp)))
        for buffer in args.buffers:
            peak, entries = measure(url, buffer)
            print(f"data.shuffle_buffer={buffer}: --plan counts {buffer * crop / 1e6:.0f} MB; the schedule holds at most "
                  f"{entries} crops + a batch = {(entries + BATCH) * crop / 1e6:.0f} MB; measured peak RSS growth "
                  f"{peak / 1e6:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
