"""`tonearm data shard`: a manifest → webdataset tar shards at the model's rate, mono (SPEC §13).

Layout of ``--out DIR``::

    train-000000.tar  train-000001.tar  …  val-000000.tar  …   one shard set per split
    records.jsonl                                             text-only manifest (id, split, captions,
                                                              seconds, shard, offset, size, members):
                                                              tokenizer, languages, counts, range reads
    index.json                                                counts, durations, languages, per-shard
                                                              sha256, skipped files with reasons

Each sample of a shard is ``KEY.flac`` (or ``KEY.wav`` for ``--codec pcm16``): the whole clip
decoded, downmixed and resampled once here with :func:`index.audio.decode.decode_audio`, and ``KEY.json``:
``{"id", "split", "captions": {lang: [...]}, "seconds", "sample_rate", "source", "meta"}``. Keys are
``{split}-{position:09d}`` (webdataset keys may not contain dots, ids may). Clips are shuffled once
(``--seed``) before being cut into shards, so a shard mixes the corpus' sources.

**Byte offsets.** Each clip's line of records.jsonl says where its sample lies in its shard:
``offset`` (the byte where the sample's first tar header starts), ``size`` (bytes up to the end of
its last member's 512-byte padding: the headers, pax headers and data of every member) and
``members`` (``{ext: [data offset, data size]}``), read back from the written tar with tarfile.
The stream range-reads ``[offset, offset + size)`` of the samples its share needs instead of the
whole shard (training/data/stream.py, :func:`~training.data.stream.read_sample_ranges`). Why
records.jsonl and not a sidecar of the webdataset tools: wids' member index is a pickle it builds
by scanning each tar (``NAME.tar.index``; unpickling a file from a bucket runs its code), and its
``wids-shard-index-v1`` JSON only has sample counts; records.jsonl is already one line per sample,
read by every rank at start, so the two numbers a rank keeps per clip cost no extra request.
Shard sets written before offsets existed have none: the stream reads those shards as before.

Shards are written by ``--workers`` processes, one shard per task, through ``webdataset.TarWriter``
(mtime 0: the same inputs give byte-identical shards). After every finished shard its entry goes
to ``.progress/NAME.json`` and a small ``index.json`` with ``"complete": false`` lists the finished
shards' sha256; a rerun with the same plan (manifest content, rate, codec, shard size, seed) keeps
every shard whose file is still the one written and writes only the others: an interrupted run
resumes (so does a complete one, from records.jsonl, e.g. after a shard file was damaged). Each
shard's size and *quick* digest (sha256 of its size, first and last MiB) are recorded when it is
written; a rerun checks kept shards by those, in parallel (``--rehash``: by the whole sha256).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import multiprocessing
import os
import random
import shutil
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from index.errors import AudioDecodeError, DataError

log = logging.getLogger(__name__)

FORMAT = "tonearm-shards/1"
Codec = Literal["flac", "pcm16"]
EXTENSION = {"flac": "flac", "pcm16": "wav"}
"""Member extension of the audio of a sample, per codec."""
INDEX = "index.json"
RECORDS = "records.jsonl"
PROGRESS = ".progress"


@dataclass
class ShardTask:
    """One shard to write: its name and the manifest rows (as plain dicts) it holds."""

    name: str
    split: str
    first: int
    """Position of the shard's first clip in its split (keys are split-position)."""
    rows: list[dict[str, Any]]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


QUICK_BYTES = 1 << 20
"""Bytes hashed at each end of a shard by :func:`quick_sha256_of`."""


def quick_sha256_of(path: Path) -> str:
    """sha256 of a file's size, its first and its last MiB: what a rerun checks of a kept shard
    (a shard cut short, rewritten or replaced differs; a flipped byte in its middle does not —
    ``--rehash`` checks the whole sha256). Two reads of 1 MiB, whatever the shard's size."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as handle:
        digest.update(handle.read(QUICK_BYTES))
        if size > QUICK_BYTES:
            handle.seek(max(QUICK_BYTES, size - QUICK_BYTES))
            digest.update(handle.read(QUICK_BYTES))
    return digest.hexdigest()


def encode_audio(wave: Any, sample_rate: int, codec: Codec) -> bytes:
    """float32 mono → FLAC or 16-bit WAV bytes."""
    import soundfile as sf

    buffer = io.BytesIO()
    if codec == "flac":
        sf.write(buffer, wave, sample_rate, format="FLAC", subtype="PCM_16")
    else:
        sf.write(buffer, wave, sample_rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def write_shard(task: ShardTask, *, out: Path, sample_rate: int, codec: Codec) -> dict[str, Any]:
    """Decode every clip of ``task`` and write its tar (atomically); returns the shard's index entry."""
    import webdataset as wds

    from index.audio.decode import decode_audio

    final = out / task.name
    partial = out / f".{task.name}.partial"
    clips: list[dict[str, Any]] = []
    keys: list[str] = []
    seconds, skipped = 0.0, []
    with partial.open("wb") as handle:
        writer = wds.TarWriter(handle, mtime=0.0)
        for offset, row in enumerate(task.rows):
            try:
                wave = decode_audio(row["audio"], sample_rate=sample_rate, complete=True)  # a cut file is refused
            except AudioDecodeError as err:
                skipped.append({"id": row["id"], "audio": row["audio"], "reason": str(err)})
                continue
            duration = len(wave) / sample_rate
            meta = {
                "id": row["id"], "split": row["split"], "captions": row["captions"],
                "seconds": round(duration, 4), "sample_rate": sample_rate, "source": row["audio"],
                "meta": row.get("meta", {}),
            }
            keys.append(f"{task.split}-{task.first + offset:09d}")
            writer.write({
                "__key__": keys[-1],
                EXTENSION[codec]: encode_audio(wave, sample_rate, codec),
                "json": json.dumps(meta, ensure_ascii=False).encode("utf-8"),
            })
            clips.append({"id": row["id"], "split": row["split"], "captions": row["captions"],
                          "seconds": meta["seconds"], "shard": task.name})
            seconds += duration
        writer.close()
    spans = sample_spans(partial)
    for clip, key in zip(clips, keys, strict=True):
        clip.update(spans[key])
    os.replace(partial, final)
    return {"name": task.name, "split": task.split, "sha256": sha256_of(final), "quick_sha256": quick_sha256_of(final),
            "bytes": final.stat().st_size, "clips": len(clips), "seconds": round(seconds, 3), "records": clips, "skipped": skipped}


def sample_spans(path: Path) -> dict[str, dict[str, Any]]:
    """Per sample key of a written tar: ``offset`` (its first header), ``size`` (through its last
    member's padding) and ``members`` (``{ext: [data offset, data size]}``) — module doc."""
    import tarfile

    from webdataset.tariterators import base_plus_ext

    spans: dict[str, dict[str, Any]] = {}
    with tarfile.open(path, mode="r:") as archive:
        for info in archive:
            if not info.isreg():
                continue
            key, ext = base_plus_ext(info.name)
            if key is None:
                continue
            end = info.offset_data + -(-info.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            span = spans.setdefault(key, {"offset": info.offset, "size": 0, "members": {}})
            span["size"] = end - span["offset"]
            span["members"][ext] = [info.offset_data, info.size]
    return spans


def _write_shard_star(args: tuple[ShardTask, Path, int, Codec]) -> dict[str, Any]:
    task, out, sample_rate, codec = args
    return write_shard(task, out=out, sample_rate=sample_rate, codec=codec)


def plan_shards(rows: Sequence[dict[str, Any]], *, shard_size: int, seed: int) -> list[ShardTask]:
    """Clips grouped by split, shuffled with ``seed``, cut into shards of ``shard_size``."""
    by_split: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_split.setdefault(row["split"], []).append(row)
    tasks = []
    for split in sorted(by_split):
        members = list(by_split[split])
        random.Random(f"{seed}:{split}").shuffle(members)
        for number, first in enumerate(range(0, len(members), shard_size)):
            tasks.append(ShardTask(f"{split}-{number:06d}.tar", split, first, members[first : first + shard_size]))
    return tasks


def plan_digest(rows: Sequence[dict[str, Any]], **settings: Any) -> str:
    """What decides the shards' contents: the manifest's rows and the writer's settings."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, ensure_ascii=False).encode("utf-8"))
    return digest.hexdigest()


def _manifest_rows(manifest: Path) -> list[dict[str, Any]]:
    from training.data.manifest import read_manifest

    rows = []
    for _, record in read_manifest(manifest, languages=None):
        rows.append({"id": record.id, "audio": str(record.audio), "split": record.split,
                     "captions": record.captions, "meta": record.meta})
    return rows


def _summary(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Per split: clips, hours, captions per language, shards (without their records)."""
    splits: dict[str, Any] = {}
    for entry in sorted(entries, key=lambda e: e["name"]):
        split = splits.setdefault(entry["split"], {"clips": 0, "seconds": 0.0, "captions": {}, "shards": []})
        split["clips"] += entry["clips"]
        split["seconds"] = round(split["seconds"] + entry["seconds"], 3)
        for record in entry["records"]:
            for lang, texts in record["captions"].items():
                split["captions"][lang] = split["captions"].get(lang, 0) + len(texts)
        split["shards"].append({k: entry[k] for k in ("name", "sha256", "quick_sha256", "bytes", "clips", "seconds")
                                if k in entry})
    for split in splits.values():
        split["hours"] = round(split["seconds"] / 3600, 3)
        split["languages"] = sorted(split["captions"])
    return splits


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_progress(out: Path, header: dict[str, Any], entry: dict[str, Any], done: list[dict[str, Any]]) -> None:
    """After each finished shard: its entry (records, skipped) in ``.progress/NAME.json`` and a small
    incomplete index.json naming the finished shards and their sha256 (constant work per shard)."""
    progress = out / PROGRESS
    progress.mkdir(exist_ok=True)
    _atomic_write(progress / f"{entry['name']}.json", json.dumps(entry, ensure_ascii=False))
    index = {**header, "complete": False, "finished": {e["name"]: e["sha256"] for e in done}}
    _atomic_write(out / INDEX, json.dumps(index, indent=1) + "\n")


def write_index(out: Path, header: dict[str, Any], entries: list[dict[str, Any]]) -> None:
    """The complete index.json and records.jsonl, replaced atomically; the progress files go."""
    ordered = sorted(entries, key=lambda e: e["name"])
    index = {
        **header, "complete": True, "splits": _summary(entries),
        "clips": sum(e["clips"] for e in entries),
        "hours": round(sum(e["seconds"] for e in entries) / 3600, 3),
        "skipped": [s for e in ordered for s in e["skipped"]],
    }
    _atomic_write(out / RECORDS, "".join(json.dumps(r, ensure_ascii=False) + "\n" for e in ordered
                                         for r in e["records"]))
    _atomic_write(out / INDEX, json.dumps(index, indent=1, ensure_ascii=False) + "\n")
    shutil.rmtree(out / PROGRESS, ignore_errors=True)


def _kept_entries(out: Path, plan: str, *, rehash: bool = False, workers: int = 1) -> dict[str, dict[str, Any]]:
    """Entries of a previous run with the same plan whose shard file is still the one written (see
    :func:`_still_written`), checked ``workers`` at a time."""
    path = out / INDEX
    if not path.is_file():
        return {}
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return {}
    if old.get("plan") != plan:
        return {}
    entries: dict[str, dict[str, Any]] = {}
    if not old.get("complete"):  # interrupted: the finished shards' entries are in .progress/
        for name, sha in old.get("finished", {}).items():
            sidecar = out / PROGRESS / f"{name}.json"
            if sidecar.is_file():
                entry = json.loads(sidecar.read_text(encoding="utf-8"))
                if entry.get("sha256") == sha:
                    entries[name] = entry
    else:  # complete: rebuild the entries from records.jsonl
        records_path = out / RECORDS
        if not records_path.is_file():
            return {}
        by_shard: dict[str, list[dict[str, Any]]] = {}
        for line in records_path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            by_shard.setdefault(record["shard"], []).append(record)
        skipped_by: dict[str, list[dict[str, Any]]] = {}
        for item in old.get("skipped", []):
            skipped_by.setdefault(item.get("shard", ""), []).append(item)
        for split in old["splits"].values():
            for shard in split["shards"]:
                entries[shard["name"]] = {**shard, "records": by_shard.get(shard["name"], []),
                                          "skipped": skipped_by.get(shard["name"], [])}
    started = time.monotonic()
    with ThreadPoolExecutor(max(1, workers)) as pool:  # hashlib and file reads release the GIL
        verdicts = dict(zip(entries, pool.map(lambda item: _still_written(out / item[0], item[1], rehash=rehash),
                                              entries.items()), strict=True))
    kept = {name: {**entry, "name": name, "split": name.rsplit("-", 1)[0]}
            for name, entry in entries.items() if verdicts[name]}
    if entries:
        log.info("checked %d shards of the previous run in %.1f s (%s): %d kept", len(entries),
                 time.monotonic() - started, "full sha256, --rehash" if rehash else
                 "size and the sha256 of their first and last MiB; --rehash checks every byte", len(kept))
    return kept


def _still_written(file: Path, entry: dict[str, Any], *, rehash: bool) -> bool:
    """Whether ``file`` is the shard ``entry`` describes: its size and quick digest (the whole sha256
    with ``rehash``, or for an index written before quick digests existed)."""
    if not file.is_file() or file.stat().st_size != entry["bytes"]:
        return False
    if rehash or "quick_sha256" not in entry:
        return sha256_of(file) == entry["sha256"]
    return quick_sha256_of(file) == entry["quick_sha256"]


def shard_manifest(
    manifest: Path, out: Path, *, sample_rate: int, codec: Codec = "flac", shard_size: int = 1000,
    workers: int | None = None, seed: int = 0, progress: bool = True, rehash: bool = False,
) -> dict[str, Any]:
    """Write the shards of ``manifest`` into ``out`` (module doc); returns index.json's content.

    ``rehash``: check the kept shards of a previous run by their whole sha256 rather than by
    size and quick digest."""
    if codec not in EXTENSION:
        raise DataError(f"unknown codec {codec!r}; use flac or pcm16")
    if shard_size < 1:
        raise DataError(f"--shard-size must be at least 1, got {shard_size}")
    rows = _manifest_rows(manifest)
    if not rows:
        raise DataError(f"{manifest}: no clips to shard")
    out.mkdir(parents=True, exist_ok=True)
    plan = plan_digest(rows, sample_rate=sample_rate, codec=codec, shard_size=shard_size, seed=seed)
    header = {"format": FORMAT, "plan": plan, "manifest": str(manifest), "sample_rate": sample_rate,
              "codec": codec, "extension": EXTENSION[codec], "shard_size": shard_size, "seed": seed}
    tasks = plan_shards(rows, shard_size=shard_size, seed=seed)
    from index.cpus import available_cores

    cores = workers or available_cores()
    kept = _kept_entries(out, plan, rehash=rehash, workers=cores)
    entries = [kept[t.name] for t in tasks if t.name in kept]
    todo = [t for t in tasks if t.name not in kept]
    if kept:
        log.info("resuming: %d of %d shards already written are kept", len(entries), len(tasks))
    workers = max(1, min(cores, len(todo) or 1))
    from tqdm import tqdm

    started = time.monotonic()
    bar = tqdm(total=len(rows), initial=sum(len(t.rows) for t in tasks if t.name in kept), unit="clip",
               desc="sharding", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    args = [(task, out, sample_rate, codec) for task in todo]
    context = multiprocessing.get_context("spawn" if sys.platform == "darwin" else "fork")
    try:
        pool = context.Pool(workers) if workers > 1 else None
        results: Iterable[dict[str, Any]] = (
            pool.imap_unordered(_write_shard_star, args) if pool else map(_write_shard_star, args)
        )
        for entry in results:
            for item in entry["skipped"]:
                item["shard"] = entry["name"]
                log.warning("skipped %s: %s", item["id"], item["reason"])
            entries.append(entry)
            write_progress(out, header, entry, entries)
            bar.update(entry["clips"] + len(entry["skipped"]))
        if pool is not None:
            pool.close()
            pool.join()
    finally:
        bar.close()
    header["seconds_to_write"] = round(time.monotonic() - started, 1)
    write_index(out, header, entries)
    index: dict[str, Any] = json.loads((out / INDEX).read_text(encoding="utf-8"))
    log.info("%d clips (%.1f h) in %d shards in %s; %d skipped (listed in index.json)",
             index["clips"], index["hours"], len(tasks), out, len(index["skipped"]))
    return index


def cli_shard(args: argparse.Namespace) -> int:
    """``tonearm data shard``."""
    shard_manifest(Path(args.manifest), Path(args.out), sample_rate=args.sample_rate, codec=args.codec,
                   shard_size=args.shard_size, workers=args.workers, seed=args.seed, rehash=args.rehash)
    return 0


def add_shard_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``shard`` to the ``tonearm data`` subcommands (handler: :func:`cli_shard`)."""
    p = subparsers.add_parser("shard", help="write a manifest as webdataset tar shards at the model's rate (mono)")
    p.add_argument("manifest", help="JSONL manifest (every split is sharded, one shard set per split)")
    p.add_argument("--out", required=True, help="output folder (shards, index.json, records.jsonl)")
    p.add_argument("--sample-rate", type=int, default=16_000, help="the model front end's rate (default 16000)")
    p.add_argument("--codec", choices=sorted(EXTENSION), default="flac", help="flac (default) or pcm16 (WAV)")
    p.add_argument("--shard-size", type=int, default=1000, help="clips per shard (default 1000)")
    p.add_argument("--workers", type=int, default=None, help="processes (default: every core)")
    p.add_argument("--seed", type=int, default=0, help="order in which clips are dealt into shards")
    p.add_argument("--rehash", action="store_true",
                   help="on a rerun, check kept shards by their whole sha256 (default: size and the sha256 of "
                        "their first and last MiB, recorded when written)")
    p.set_defaults(handler=cli_shard)
    return p
