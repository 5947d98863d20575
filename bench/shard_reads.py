"""Benchmark: bytes an epoch fetches from an S3-compatible server per byte of the samples it serves.

A corpus of CLIPS noise clips of SECONDS s (PCM-16 WAV at 16 kHz) is sharded with `tonearm data
shard`'s writer (SHARD clips a shard) and uploaded to a `moto_server` twice: as written (records.jsonl
with each sample's byte range) and with records.jsonl stripped of the ranges (a shard set written
before they were recorded). s3fs reaches the server through a TCP relay counting every byte the
server sends back (tests/s3_server.py: read-ahead, headers and all). For each layout (ranks ×
loader workers × batch), every rank's every worker's share of one epoch is read by the stream's own
reader (``ShardStream._entries``, one process, worker after worker) and the fetched bytes are set
against the bytes of the samples served (their tar members: headers, data, padding).
Target (issue 48): ≤ 1.05× at 1 rank and at 4 × 8. Writes the ``shard_reads`` section of
docs/BENCHMARKS.md.

    PYTHONPATH=. flock /tmp/tonearm-heavy.lock python bench/shard_reads.py [--no-write]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.benchlib import cpu_model, publish_section  # noqa: E402

START = "<!-- bench:shard_reads:start -->"
END = "<!-- bench:shard_reads:end -->"
CLIPS, SECONDS, RATE, SHARD = 960, 4.0, 16_000, 40
LAYOUTS = [(1, 0, 64), (1, 8, 16), (4, 8, 16), (4, 23, 8)]
"""(ranks, loader workers per rank, batch): one process; 1 × 8; the issue's 4 × 8; `num_workers: auto`
on 4 nodes' worth of 24-core shares (23 workers)."""


def make_shards(folder: Path) -> Path:
    from training.data.shards import shard_manifest

    rng = np.random.default_rng(0)
    lines = []
    for i in range(CLIPS):
        sf.write(folder / f"c{i}.wav", rng.uniform(-0.5, 0.5, int(SECONDS * RATE)).astype(np.float32), RATE,
                 subtype="PCM_16")
        lines.append(json.dumps({"id": f"clip.{i}", "audio": f"c{i}.wav", "split": "train",
                                 "captions": {"eng": [f"noise {i}"]}}))
    (folder / "m.jsonl").write_text("\n".join(lines) + "\n")
    out = folder / "shards"
    shard_manifest(folder / "m.jsonl", out, sample_rate=RATE, codec="pcm16", shard_size=SHARD, workers=1,
                   progress=False)
    return out


def epoch(url: str, sizes: list[int], proxy: Any, *, world: int, workers: int, batch: int) -> dict[str, Any]:
    from training.data.epoch_plan import Layout
    from training.data.stream import ShardStream, open_corpus

    corpus = open_corpus(url, languages=["eng"], drop_other_languages=False)
    streams = [ShardStream(corpus, rank=r, layout=Layout(world, workers, batch, 64), sample_rate=RATE,
                           clip_samples=RATE, seed=0, languages=["eng"]) for r in range(world)]
    proxy.reset()
    served, count, started = 0, 0, time.monotonic()
    for stream in streams:
        stream.set_epoch(0)
        left, cut = stream.cut(0)
        for chunk in cut.ranks[stream.rank]:
            errors: list[str] = []
            for _, item in stream._entries(0, left[chunk.start:chunk.stop], set(range(chunk.stop - chunk.start)),
                                           errors):
                if isinstance(item, str):
                    raise RuntimeError(item)
                served += sizes[item.index]
                count += 1
    return {"fetched": proxy.down, "served": served, "samples": count, "seconds": time.monotonic() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    import boto3
    import s3fs

    from tests.s3_server import CountingProxy, free_port, wait_for_port

    load_before = os.getloadavg()[0]
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, server, "moto_server")
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                          AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
        with tempfile.TemporaryDirectory() as tmp:
            shards = make_shards(Path(tmp))
            lines = (shards / "records.jsonl").read_text().splitlines()
            sizes = [json.loads(line)["size"] for line in lines]
            (Path(tmp) / "old.jsonl").write_text("".join(json.dumps({k: v for k, v in json.loads(line).items()
                                                                     if k not in ("offset", "size", "members")}) + "\n"
                                                         for line in lines))
            client = boto3.client("s3")
            client.create_bucket(Bucket="bench")
            for path in sorted(shards.iterdir()):
                client.upload_file(str(path), "bench", f"new/{path.name}")
                client.upload_file(str(Path(tmp) / "old.jsonl") if path.name == "records.jsonl" else str(path),
                                   "bench", f"old/{path.name}")
            corpus_bytes = sum(p.stat().st_size for p in shards.glob("train-*.tar"))
        proxy = CountingProxy(os.environ["AWS_ENDPOINT_URL"])
        os.environ["AWS_ENDPOINT_URL"] = proxy.url
        s3fs.S3FileSystem.clear_instance_cache()
        rows = []
        for world, workers, batch in LAYOUTS:
            new = epoch("s3://bench/new", sizes, proxy, world=world, workers=workers, batch=batch)
            old = epoch("s3://bench/old", sizes, proxy, world=world, workers=workers, batch=batch)
            rows.append((world, workers, batch, new, old))
            print(world, workers, batch, new, old, flush=True)
        proxy.close()
    finally:
        server.terminate()
        server.wait(timeout=10)
    load_after = os.getloadavg()[0]
    table = ["| ranks × workers, batch | samples served | served MiB | **range reads: fetched / served** | "
             "before (no offsets): fetched / served | fetched / corpus bytes, before |",
             "|---|---:|---:|---:|---:|---:|"]
    for world, workers, batch, new, old in rows:
        table.append(f"| {world} × {workers}, {batch} | {new['samples']} | {new['served'] / 2**20:.1f} | "
                     f"**{new['fetched'] / new['served']:.4f}** | {old['fetched'] / old['served']:.2f} | "
                     f"{old['fetched'] / corpus_bytes:.2f} |")
    section = "\n".join([
        START,
        "## shard_reads — bytes an epoch fetches from the bucket per byte it serves (range reads, issue 48)",
        "",
        f"`PYTHONPATH=. flock /tmp/tonearm-heavy.lock python bench/shard_reads.py` · {cpu_model()} · {when} · "
        f"load average {load_before:.2f} → {load_after:.2f} (1-min)",
        "",
        f"{CLIPS} clips of {SECONDS:g} s (PCM-16 WAV, {sizes[0] / 1024:.0f} KiB a sample) in {CLIPS // SHARD} shards of "
        f"{SHARD} ({corpus_bytes / 2**20:.1f} MiB), on `moto_server`, read through s3fs and a TCP relay counting "
        "every byte the server sends back (headers, bodies, read-ahead). Each layout's every rank and loader "
        "worker reads its share of one epoch with the stream's own reader (one process, worker after worker); "
        "served = the tar bytes (headers, data, padding) of the samples the epoch serves. \"Before\": the same "
        "shards with records.jsonl stripped of the byte ranges (a shard set written before they were "
        "recorded: each worker opens its shards as files and reads them from its first sample on, s3fs "
        "reading ahead whole blocks into the samples other workers serve; such shard sets keep the sequence "
        "of one shard after the other, not interleaved).",
        "",
        *table,
        "",
        "With offsets the excess is the HTTP response headers of the range requests (one per run of adjacent "
        "wanted samples, at most `ReadPolicy.block` = 8 MiB) — the target was ≤ 1.05×. The load does not "
        "change the byte counts, only the time.",
        END,
    ])
    publish_section(section, start=START, end=END, write=not args.no_write)


if __name__ == "__main__":
    main()
