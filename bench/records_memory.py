"""Benchmark: resident memory of a rank's corpus metadata (``records.jsonl`` read by ``open_corpus``)
against what `tonearm train --plan` counts for it.

A synthetic shard folder's ``index.json`` and ``records.jsonl`` are written with the shard
writer's own ``write_index`` (training/data/shards.py; no tar files: the metadata is what every
rank reads) for CLIPS clips × 8 languages × 5 captions (captions of 40–90 characters, accented
Latin for the European languages, CJK for jpn/zho; drawn from a pool, each line parsed into its
own objects all the same). A fresh process then reads it with
``training.data.stream.open_corpus`` as every rank does, and reports its resident memory before
and after, and its peak (VmHWM), beside ``RECORDS_RSS_FACTOR × the file's bytes`` — the index
line of ``--plan``. Writes the ``records_memory`` section of docs/BENCHMARKS.md.

    PYTHONPATH=. flock /tmp/tonearm-heavy.lock python bench/records_memory.py [--clips 400000] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import cpu_model, publish_section  # noqa: E402

START = "<!-- bench:records_memory:start -->"
END = "<!-- bench:records_memory:end -->"
LANGUAGES = ("eng", "fra", "deu", "spa", "nld", "cat", "jpn", "zho")
CAPTIONS = 5
SHARD_SIZE = 1000
LATIN = "abcdefghijklmnopqrstuvwxyz"
ACCENTS = "éèàçüöäñíóúß"


def caption_pool(lang: str, rng: random.Random, size: int = 4000) -> list[str]:
    """Captions of one language: words (with accents outside English) or CJK characters."""
    pool = []
    for _ in range(size):
        if lang in ("jpn", "zho"):
            pool.append("".join(chr(rng.randint(0x4E00, 0x62FF)) for _ in range(rng.randint(14, 30))))
            continue
        letters = LATIN + ("" if lang == "eng" else ACCENTS)
        words, length = [], rng.randint(40, 90)
        while sum(len(w) + 1 for w in words) < length:
            words.append("".join(rng.choice(letters) for _ in range(rng.randint(2, 9))))
        pool.append(" ".join(words))
    return pool


def write_metadata(out: Path, clips: int) -> None:
    """index.json + records.jsonl of ``clips`` train clips in shards of SHARD_SIZE (shards.write_index)."""
    from training.data.shards import EXTENSION, FORMAT, write_index

    rng = random.Random(0)
    pools = {lang: caption_pool(lang, rng) for lang in LANGUAGES}
    entries: list[dict[str, Any]] = []
    for number, first in enumerate(range(0, clips, SHARD_SIZE)):
        name = f"train-{number:06d}.tar"
        records = [{"id": f"clip{i:07d}", "split": "train",
                    "captions": {lang: rng.sample(pools[lang], CAPTIONS) for lang in LANGUAGES},
                    "seconds": round(rng.uniform(10, 60), 4), "shard": name}
                   for i in range(first, min(clips, first + SHARD_SIZE))]
        entries.append({"name": name, "split": "train", "sha256": "0" * 64, "quick_sha256": "0" * 64, "bytes": 0,
                        "clips": len(records), "seconds": round(sum(r["seconds"] for r in records), 3),
                        "records": records, "skipped": []})
    header = {"format": FORMAT, "plan": "synthetic", "manifest": "synthetic", "sample_rate": 48_000, "codec": "flac",
              "extension": EXTENSION["flac"], "shard_size": SHARD_SIZE, "seed": 0}
    out.mkdir(parents=True, exist_ok=True)
    write_index(out, header, entries)


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class PackedRecord:
    """The prototype of a compact record: captions as one UTF-8 JSON bytes, decoded on access."""

    __slots__ = ("captions_json", "id", "ordinal", "seconds", "shard")


def measure_packed(url: str) -> None:
    """In a fresh process: what the same records would take with packed captions (not what
    open_corpus does: the measurement behind a possible change), and the cost of a decode."""
    before = status_kib("VmRSS")
    started = time.perf_counter()
    rows: list[PackedRecord] = []
    shards: dict[str, str] = {}
    ordinal: dict[str, int] = {}
    with open(Path(url) / "records.jsonl", encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            record = PackedRecord()
            record.id, record.seconds = row["id"], row["seconds"]
            record.captions_json = json.dumps(row["captions"], ensure_ascii=False, separators=(",", ":")).encode()
            record.shard = shards.setdefault(row["shard"], row["shard"])
            record.ordinal = ordinal[record.shard] = ordinal.get(record.shard, -1) + 1
            rows.append(record)
    seconds = time.perf_counter() - started
    after, peak = status_kib("VmRSS"), status_kib("VmHWM")
    sample = rows[: min(len(rows), 100_000)]
    started = time.perf_counter()
    for record in sample:
        json.loads(record.captions_json)
    decode = (time.perf_counter() - started) / max(1, len(sample))
    print(json.dumps({"before": before * 1024, "after": after * 1024, "peak": peak * 1024, "seconds": seconds,
                      "clips": len(rows), "decode_us": decode * 1e6}))


def measure(url: str) -> None:
    """In a fresh process: RSS before/after open_corpus and the peak, as JSON on stdout."""
    from training.data.stream import open_corpus

    before = status_kib("VmRSS")
    started = time.perf_counter()
    corpus = open_corpus(url, languages=list(LANGUAGES), drop_other_languages=False)
    seconds = time.perf_counter() - started
    after, peak = status_kib("VmRSS"), status_kib("VmHWM")
    print(json.dumps({"before": before * 1024, "after": after * 1024, "peak": peak * 1024, "seconds": seconds,
                      "clips": len(corpus.records["train"])}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", type=int, default=400_000)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # the child processes
    parser.add_argument("--packed", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        (measure_packed if args.packed else measure)(args.measure)
        return
    from training.data.cluster_plan import RECORDS_RSS_FACTOR

    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "shards"
        started = time.perf_counter()
        write_metadata(folder, args.clips)
        written = time.perf_counter() - started
        size = (folder / "records.jsonl").stat().st_size
        print(f"records.jsonl: {size / 1e6:.0f} MB for {args.clips:,} clips, written in {written:.0f} s", flush=True)
        env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(Path(__file__).resolve().parents[1]))}
        results = []
        for extra in ([], ["--packed"]):
            child = subprocess.run([sys.executable, __file__, "--measure", str(folder), *extra], check=True,
                                   capture_output=True, text=True, env=env)
            results.append(json.loads(child.stdout.strip().splitlines()[-1]))
        got, packed = results
    load_end = os.getloadavg()[0]
    grown, peak = got["after"] - got["before"], got["peak"] - got["before"]
    planned = RECORDS_RSS_FACTOR * size
    print(f"grew {grown / 2**20:.0f} MiB (peak {peak / 2**20:.0f} MiB) in {got['seconds']:.0f} s; "
          f"--plan counts {planned / 2**20:.0f} MiB", flush=True)
    lines = [
        START,
        "## records_memory — a rank's corpus metadata (records.jsonl) in memory, beside `--plan`",
        "",
        f"`PYTHONPATH=. python bench/records_memory.py --clips {args.clips}` · {cpu_model()}, 2 cores · "
        f"{dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')} · load average {load_start:.2f} → "
        f"{load_end:.2f} (1-min)",
        "",
        f"A synthetic shard folder's metadata written by the shard writer (`write_index`): {args.clips:,} train "
        f"clips × 8 languages × 5 captions (40–90 characters, accented Latin; 14–30 CJK characters for jpn/zho), "
        f"shards of {SHARD_SIZE}. A fresh process reads it with `open_corpus` (what every rank does at start); "
        "resident memory from /proc/self/status before and after, and its peak (VmHWM) less the start.",
        "",
        "| clips | records.jsonl | read in | RSS growth | peak growth | growth ÷ file | `--plan` index figure |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {args.clips:,} | {size / 2**20:,.0f} MiB | {got['seconds']:.0f} s | {grown / 2**20:,.0f} MiB | "
        f"{peak / 2**20:,.0f} MiB | {grown / size:.2f}× | {planned / 2**20:,.0f} MiB ({RECORDS_RSS_FACTOR}× the file) |",
        "",
        f"A prototype of a compact record (`--packed`, in this script only; **not** what `open_corpus` "
        f"does): the captions of a clip kept as one UTF-8 JSON `bytes`, decoded when read, in a `__slots__` "
        f"object with its id, shard and ordinal, grows the same read by "
        f"**{(packed['after'] - packed['before']) / 2**20:,.0f} MiB** "
        f"({(packed['after'] - packed['before']) / size:.2f}× the file; {grown / (packed['after'] - packed['before']):.1f}× "
        f"less) for a decode of {packed['decode_us']:.0f} µs per clip when its captions are used.",
        "",
        "Per node that is 8 × the growth (each rank reads the file; forked loader workers share the pages "
        "copy-on-write). `--plan` counts the figure in its last column per rank. The load (other jobs on the "
        "machine) slows the read, not the memory figures.",
        END,
    ]
    publish_section("\n".join(lines), start=START, end=END, write=not args.no_write)


if __name__ == "__main__":
    main()
