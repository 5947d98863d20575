"""Benchmark: resident memory of a rank's corpus metadata (what ``open_corpus`` keeps of ``records.jsonl``)
against what `tonearm train --plan` counts for it, beside what the earlier reader kept.

A synthetic shard folder's ``index.json`` and ``records.jsonl`` are written with the shard
writer's own ``write_index`` (training/data/shards.py; no tar files: the metadata is what every
rank reads) for CLIPS clips × 8 languages × 5 captions (captions of 40–90 characters, accented
Latin for the European languages, CJK for jpn/zho; drawn from a pool, each line parsed into its
own objects all the same). Fresh processes then read it and report resident memory before and
after, and the peak (VmHWM):

* ``open_corpus`` + the stream's plan + one epoch's sequence, as a rank with its loader in-process
  holds them (training/data/shard_records.py: columns, no captions), beside
  ``training.memory_plan.count_records`` — the index line of ``--plan``; then the captions of one
  rank's share at world size 8 read again (the knowledge-base pass) and every caption read again
  clip by clip (the tokenizer, rank 0);
* the earlier reader (every line kept as a ``ClipRecord`` with its captions, as ``open_corpus``
  did until this change), reproduced here as the reference.

Writes the ``records_memory`` section of docs/BENCHMARKS.md.

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
WORLD = 8
"""Ranks whose one share of the corpus a knowledge-base pass reads again (one 8-GPU node)."""
TEXTS_CHUNK_NOTE = "the captions of 20,000 clips at a time (`TEXTS_CHUNK`)"
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


def measure_before(url: str) -> None:
    """In a fresh process: the earlier reader — every line a ClipRecord with its captions (a shard's
    clips sharing its name and path objects), as open_corpus kept them before this change."""
    from pathlib import PurePosixPath

    from training.data.manifest import ClipRecord

    before = status_kib("VmRSS")
    started = time.perf_counter()
    records: list[ClipRecord] = []
    shards: dict[str, tuple[str, PurePosixPath]] = {}
    ordinal: dict[str, int] = {}
    with open(Path(url) / "records.jsonl", encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            shard, path = shards.get(row["shard"]) or shards.setdefault(
                row["shard"], (row["shard"], PurePosixPath(url) / row["shard"]))
            place = ordinal[shard] = ordinal.get(shard, -1) + 1
            records.append(ClipRecord(id=row["id"], audio=path, captions=row["captions"], split=row["split"],
                                      meta={"seconds": row["seconds"], "shard": shard, "ordinal": place}))
    seconds = time.perf_counter() - started
    print(json.dumps({"before": before * 1024, "after": status_kib("VmRSS") * 1024, "peak": status_kib("VmHWM") * 1024,
                      "seconds": seconds, "clips": len(records)}))


def measure(url: str) -> None:
    """In a fresh process: RSS before/after what a rank keeps (open_corpus, the stream's plan, an
    epoch's sequence) and the peak, the plan's count of it, then the passes that read captions again."""
    import fsspec  # noqa: F401 - imported before the baseline, as a rank has it already
    import numpy as np

    from training.data.epoch_plan import epoch_sequence
    from training.data.shard_records import caption_texts
    from training.data.stream import TRAIN_SPLIT, open_corpus, stream_corpus
    from training.memory_plan import count_records

    before = status_kib("VmRSS")
    started = time.perf_counter()
    corpus = open_corpus(url, languages=list(LANGUAGES), drop_other_languages=False)
    plan = stream_corpus(corpus)
    sequence = epoch_sequence(plan.usable, seed=0, epoch=0)
    seconds = time.perf_counter() - started
    after, peak = status_kib("VmRSS"), status_kib("VmHWM")
    counted = count_records(corpus, eval_split="val", workers=0, world=WORLD, knowledge_pass=True)
    records = corpus.records[TRAIN_SPLIT]
    rows = np.arange(len(records) // WORLD)  # one rank's share of the shards (a KB pass)
    started = time.perf_counter()
    share = records.with_captions(rows)
    share_seconds, share_grown = time.perf_counter() - started, status_kib("VmRSS") - after
    del share
    started = time.perf_counter()
    texts = sum(1 for _ in caption_texts(records, LANGUAGES))
    texts_seconds = time.perf_counter() - started
    print(json.dumps({"before": before * 1024, "after": after * 1024, "peak": peak * 1024, "seconds": seconds,
                      "clips": len(records), "columns": records.nbytes, "planned": counted.resident,
                      "pass_share": counted.pass_share, "share_grown": share_grown * 1024,
                      "share_seconds": share_seconds, "texts": texts, "texts_seconds": texts_seconds,
                      "sequence": int(sum(a.nbytes for a in sequence))}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", type=int, default=400_000)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # the child processes
    parser.add_argument("--before", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        (measure_before if args.before else measure)(args.measure)
        return

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
        for extra in ([], ["--before"]):
            child = subprocess.run([sys.executable, __file__, "--measure", str(folder), *extra], check=True,
                                   capture_output=True, text=True, env=env)
            results.append(json.loads(child.stdout.strip().splitlines()[-1]))
        got, old = results
    load_end = os.getloadavg()[0]
    mib = 2**20
    grown, peak = got["after"] - got["before"], got["peak"] - got["before"]
    old_grown, old_peak = old["after"] - old["before"], old["peak"] - old["before"]
    print(f"now: grew {grown / mib:.0f} MiB (peak {peak / mib:.0f}) in {got['seconds']:.0f} s, --plan counts "
          f"{got['planned'] / mib:.0f} MiB; before: grew {old_grown / mib:.0f} MiB in {old['seconds']:.0f} s", flush=True)
    per_100k = grown / args.clips * 100_000
    lines = [
        START,
        "## records_memory — a rank's corpus metadata (records.jsonl) in memory, beside `--plan`",
        "",
        f"`PYTHONPATH=. flock /tmp/tonearm-heavy.lock python bench/records_memory.py --clips {args.clips}` · "
        f"{cpu_model()}, 2 cores · {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')} · load average "
        f"{load_start:.2f} → {load_end:.2f} (1-min)",
        "",
        f"A synthetic shard folder's metadata written by the shard writer (`write_index`): {args.clips:,} train "
        f"clips × 8 languages × 5 captions (40–90 characters, accented Latin; 14–30 CJK characters for jpn/zho), "
        f"shards of {SHARD_SIZE}; records.jsonl is {size / mib:,.0f} MiB. Fresh processes read it; resident memory "
        "from /proc/self/status before and after, and the peak (VmHWM) less the start.",
        "",
        "| what a rank keeps | read in | RSS growth | peak growth | per 100 k clips | `--plan` index figure |",
        "|---|---:|---:|---:|---:|---:|",
        f"| **now**: `open_corpus` (columns of ids, seconds, shard, ordinal, line offsets; no captions) + the "
        f"stream's plan + one epoch's sequence | {got['seconds']:.0f} s | **{grown / mib:,.0f} MiB** | "
        f"{peak / mib:,.0f} MiB | {per_100k / mib:,.1f} MiB | {got['planned'] / mib:,.0f} MiB (`count_records`, "
        "no loader worker) |",
        f"| before: every line a `ClipRecord` with its captions (the earlier `open_corpus`, reproduced in the "
        f"script) | {old['seconds']:.0f} s | {old_grown / mib:,.0f} MiB | {old_peak / mib:,.0f} MiB | "
        f"{old_grown / args.clips * 100_000 / mib:,.0f} MiB | {2.4 * size / mib:,.0f} MiB (2.4× the file, "
        "the earlier figure) |",
        "",
        f"Of the growth, the columns are {got['columns'] / mib:,.1f} MiB ({got['columns'] / got['clips']:.0f} B a "
        f"clip) and the epoch's sequence {got['sequence'] / mib:,.1f} MiB (each loader worker holds one); the "
        "rest is the interpreter's and numpy's own pages. Captions are read again when needed, by byte range: "
        f"one rank's share at world size {WORLD} (a knowledge-base pass over the train shards: "
        f"{args.clips // WORLD:,} clips) took {got['share_seconds']:.1f} s and held {got['share_grown'] / mib:,.0f} "
        f"MiB while the pass ran (`--plan` adds {got['pass_share'] / mib:,.0f} MiB to the rebuild's host figure); "
        f"every caption clip by clip (the tokenizer's {got['texts']:,} texts, rank 0, once) took "
        f"{got['texts_seconds']:.0f} s and holds {TEXTS_CHUNK_NOTE}.",
        "",
        "Per node that is 8 × the growth (each rank reads the file; forked loader workers share the numpy pages, "
        "which nothing writes). The load (other jobs on the machine) slows the reads, not the memory figures.",
        END,
    ]
    publish_section("\n".join(lines), start=START, end=END, write=not args.no_write)


if __name__ == "__main__":
    main()
