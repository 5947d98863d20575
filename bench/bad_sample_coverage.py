"""Benchmark: what 0.1 % bad samples cost an epoch at 4 ranks × 8 loader workers, batch 64 (issue 48).

A corpus of ``--clips`` short noise clips is sharded by `tonearm data shard` (shards of 1000) and
``--bad-fraction`` of its samples are garbled afterwards (their FLAC replaced by junk). Each of the 4
ranks then runs its real stream (:class:`training.data.stream.ShardStream`) through a DataLoader with 8
worker processes, exactly as training does; the loop's lockstep is applied across the ranks' batches
(every rank trains the smallest batch of the step, the others hold back their surplus). Reported per
``data.bad_sample_reserve``: clips served, held back, duplicates, coverage of the usable clips.

    PYTHONPATH=. flock /tmp/tonearm-heavy.lock python bench/bad_sample_coverage.py [--clips 64000]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

RATE, WORLD, WORKERS, BATCH = 16_000, 4, 8, 64


def make_shards(root: Path, clips: int, bad_fraction: float) -> tuple[Path, set[str]]:
    import webdataset as wds

    from training.data.shards import shard_manifest

    (root / "audio").mkdir(parents=True)
    rng = np.random.default_rng(0)
    sources = []
    for i in range(16):  # a few short files, each the audio of many clips
        path = root / "audio" / f"n{i}.flac"
        sf.write(path, (rng.standard_normal(RATE // 10) * 0.1).astype("float32"), RATE, subtype="PCM_16")
        sources.append(path)
    lines = [json.dumps({"id": f"c{i:06d}", "audio": str(sources[i % 16]), "split": "train",
                         "captions": {"eng": [f"noise {i}"]}}) for i in range(clips)]
    (root / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    shard_manifest(root / "manifest.jsonl", root / "shards", sample_rate=RATE, shard_size=1000, workers=2,
                   progress=False)
    bad = set(random.Random(1).sample([f"c{i:06d}" for i in range(clips)], round(bad_fraction * clips)))
    for tar in sorted((root / "shards").glob("train-*.tar")):
        samples = list(wds.WebDataset(str(tar), shardshuffle=False))
        if not any(json.loads(s["json"])["id"] in bad for s in samples):
            continue
        with wds.TarWriter(str(tar)) as writer:
            for s in samples:
                garbled = json.loads(s["json"])["id"] in bad
                writer.write({"__key__": s["__key__"], "json": s["json"],
                              "flac": b"fLaC" + bytes(256) if garbled else s["flac"]})
    return root / "shards", bad


def _rows(got: Any) -> tuple[list[int], int, int]:
    items, errors, extra = got
    return [item.index for item in items], len(errors), extra


def rank_batches(url: str, rank: int, reserve: float) -> list[list[int]]:
    """This rank's batches of epoch 0 (clip rows), from its stream through 8 loader worker processes."""
    from torch.utils.data import DataLoader

    from training.data.epoch_plan import Layout
    from training.data.stream import ShardStream, open_corpus

    corpus = open_corpus(url, languages=["eng"], drop_other_languages=False)
    stream = ShardStream(corpus, rank=rank, layout=Layout(WORLD, WORKERS, BATCH, 200, reserve), sample_rate=RATE,
                         clip_samples=RATE // 20, seed=0, languages=["eng"])
    stream.set_epoch(0)
    loader = DataLoader(stream, batch_size=None, collate_fn=_rows, num_workers=WORKERS,
                        multiprocessing_context="fork")
    return [rows for rows, _, _ in loader]


def simulate(url: str, reserve: float, usable: int, bad: int) -> dict[str, Any]:
    started = time.monotonic()
    ranks = [rank_batches(url, rank, reserve) for rank in range(WORLD)]
    steps = len(ranks[0])
    assert all(len(r) == steps for r in ranks)
    served: list[int] = []
    held_back = [0] * WORLD
    for t in range(steps):
        agreed = min(len(r[t]) for r in ranks)
        for rank, r in enumerate(ranks):
            take = agreed if agreed >= 2 else 0
            served += r[t][:take]
            held_back[rank] += len(r[t]) - take
    return {"reserve": reserve, "steps": steps, "served": len(served), "duplicates": len(served) - len(set(served)),
            "held_back": sum(held_back), "held_back_worst_rank": max(held_back),
            "coverage_usable": len(served) / usable, "coverage_decodable": len(served) / (usable - bad),
            "seconds": round(time.monotonic() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clips", type=int, default=64_000)
    parser.add_argument("--bad-fraction", type=float, default=0.001)
    parser.add_argument("--reserves", type=float, nargs="+", default=[0.0, 0.002])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        url, bad = make_shards(Path(tmp), args.clips, args.bad_fraction)
        print(f"{args.clips} clips sharded, {len(bad)} garbled ({time.monotonic() - started:.0f} s)", flush=True)
        for reserve in args.reserves:
            print(json.dumps(simulate(str(url), reserve, args.clips, len(bad))), flush=True)


if __name__ == "__main__":
    main()
