"""Training from `tonearm data shard` output streamed through fsspec (``data.shards``, SPEC §13).

``data.shards`` names the folder of the shards: a local path, ``s3://bucket/prefix`` (s3fs; the
endpoint and keys come from the usual ``AWS_*`` variables), ``gs://`` (gcsfs) or ``https://``.
``index.json`` and ``records.jsonl`` are read first (counts, languages, which clips are usable; a
rank keeps ids, shards and seconds as columns, no captions: training/data/shard_records.py —
each sample's ``.json`` member carries its captions); then each loader worker reads only the samples
of its share, by byte range (:func:`read_sample_ranges`: records.jsonl gives each sample's offset and
size; adjacent wanted samples are merged into one request; every reply is checked against the range
asked for before it is parsed, :func:`fetch_range`; a failed request or a wrong reply is retried with
backoff from its first sample not yet delivered, :class:`ReadPolicy` — the one retry layer: the
object-store library's own are off for these reads, :func:`data_filesystem`), never the whole corpus. Shard sets
written before the offsets were recorded are read as files from the first wanted sample on
(:func:`read_samples`: one read per member where the file seeks, webdataset's tar expander where it
does not; a failed read reopens the shard at the failing sample's header).

Every epoch (seeded by ``(seed, epoch)``) is cut by :mod:`training.data.epoch_plan`: the usable
clips of the shuffled train shards form one sequence, each rank takes the same number of them
(so the same number of batches: ranks stay in lockstep) and each of its loader workers a
contiguous chunk; an epoch serves every usable clip at most once and all but fewer than
``2 × world size`` of them. A clip without a caption in ``data.languages`` is left out of the
sequence (counted and named at start, from ``records.jsonl``); each worker reads only its
chunk's samples (several shards at once: the sequence interleaves 8 shards, epoch_plan), draws them
through its shuffle buffer and decodes the random crop of each (:func:`index.audio.decode.decode_window`
on the in-memory FLAC/WAV, seeded by ``(seed, epoch, clip row)`` like the file path). Items are
the same :class:`TrainItem` the manifest path gives, so every objective's strategy (views,
KCL's languages, clip indices) is unchanged.

A sample that cannot be decoded, or that a broken shard never delivers, is never replaced by a
clip served elsewhere: its worker fills the batch with its own next draw, so only the worker's last
batch comes up short, and the rank's main process tops every short batch up from the reserve the
rank keeps of its share, shared by all its workers (``data.bad_sample_reserve``,
:meth:`training.data.epoch_plan.SegmentCut.reserve_range`; :meth:`StreamBatches.__iter__`), so the
other ranks' batches are untouched; the error travels in ``TrainBatch.skipped`` (in the batch that
drew the sample) to :class:`BadSampleBudget`, which names and counts it, and the draws beyond the
batch's size (``TrainBatch.extra_draws``) and the reserve entries taken to the checkpoint's plan.
Only when a rank's losses exceed its reserve is a batch short; the loop then makes every rank train
the smallest batch of the step (:meth:`StreamBatches.lockstep`: the collectives' shapes must agree),
holding back — and logging — the others' surplus clips.

Resume: the checkpoint records the plan (layout, seed, corpus digest, the batches each segment
of the epoch ran). On the same layout the workers replay their draw order without reading the
samples already served and the batches are bit-identical to the uninterrupted run's; on another
world size, worker count or batch size the epoch's clips not yet served are cut anew.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from index.audio.decode import decode_window
from index.audio.frontend import Padding
from index.errors import AudioDecodeError, DataError
from training.config import ConfigError, TrainConfig, short_clip_padding
from training.data.dataset import TrainBatch, TrainCollate, TrainItem, _rng_seed
from training.data.epoch_plan import (
    MIX_SHARDS,
    Coverage,
    Layout,
    Segment,
    SegmentCut,
    coverage,
    draw_order,
    epoch_sequence,
    remaining,
    segment_cut,
    slot_seed,
)
from training.data.loader import local_world_size, node_memory, shuffle_entries
from training.data.manifest import ClipRecord
from training.data.node_fit import refuse_unless_node_fits, shm_size
from training.data.shard_records import ShardRecords, read_records
from training.interrupt import ignore_ctrl_c
from training.memory_plan import count_records

log = logging.getLogger(__name__)

TRAIN_SPLIT = "train"


def _join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}"


def read_text(url: str) -> str:
    import fsspec

    with fsspec.open(url, "rt", encoding="utf-8") as handle:
        return str(handle.read())


@dataclass
class ShardCorpus:
    """What ``index.json`` and ``records.jsonl`` say about a shard folder."""

    url: str
    index: dict[str, Any]
    records: dict[str, ShardRecords]
    """Per split, the clips with a caption in ``data.languages``, in records.jsonl order, as compact
    columns without their captions (training/data/shard_records.py); ``records[split][row].meta``
    holds the clip's shard and its ordinal (0-based position) in it."""

    @property
    def unusable(self) -> dict[str, list[str]]:
        """Per split, the ids of clips without a caption in ``data.languages`` (``drop_other_languages``)."""
        return {split: records.unusable for split, records in self.records.items() if records.unusable}

    def shards(self, split: str) -> list[tuple[str, int]]:
        """(name, clips) of the split's shards."""
        summary = self.index["splits"].get(split, {"shards": []})
        return [(s["name"], int(s["clips"])) for s in summary["shards"]]


def open_corpus(url: str, *, languages: Sequence[str], drop_other_languages: bool) -> ShardCorpus:
    """Read a shard folder's index and records; captions outside ``languages`` refuse (or drop).

    ``records.jsonl`` is read line by line and kept as columns without the captions
    (:func:`training.data.shard_records.read_records`; docs/training.md, memory per rank)."""
    try:
        index = json.loads(read_text(_join(url, "index.json")))
        if not index.get("complete"):
            raise DataError(f"{url}: index.json says the shards are incomplete; rerun `tonearm data shard` to finish")
        records = read_records(url, languages=languages, drop_other_languages=drop_other_languages)
    except FileNotFoundError as err:
        raise DataError(f"{url}: no index.json / records.jsonl there ({err}); write shards with "
                        "`tonearm data shard MANIFEST --out DIR`") from None
    return ShardCorpus(url=url, index=index, records=records)


def _tar_members(stream: Any, url: str) -> Iterator[dict[str, Any]]:
    """``{"fname", "data", "__url__"}`` of each regular member of a seekable tar, in order.

    Why not webdataset's ``tar_file_expander``: it opens every stream in tarfile's stream mode
    (``r|*``), which reads a member 10 KiB at a time and joins the pieces, copying a 2.8 MB FLAC
    (a 60-s clip) three times — ~5× the cost of reading it with one ``read`` (profile in
    docs/BENCHMARKS.md, data_path_shards). fsspec's local and object-store files seek, so tarfile's
    random-access mode reads each header and then each member's bytes with one call, in order
    (the object-store file's read-ahead cache keeps it one sequential stream).
    """
    import tarfile

    archive = tarfile.open(fileobj=stream, mode="r:")
    for info in archive:
        if info.isreg():
            handle = archive.extractfile(info)
            assert handle is not None  # a regular member always has a file object
            yield {"fname": info.name, "data": handle.read(), "__url__": url}
        archive.members = []  # type: ignore[attr-defined]  # streamed: keep no list of the shard's members (typeshed omits it)


def tar_samples(stream: Any, url: str) -> Iterator[dict[str, Any]]:
    """The samples (``{"__key__", ext: bytes, …}``) of one shard opened with fsspec: webdataset's
    grouping of members by key over :func:`_tar_members` when the file seeks, webdataset's own
    tar expander (stream mode, e.g. an ``https://`` server without ranges) when it does not."""
    from webdataset.tariterators import group_by_keys, tar_file_expander

    seekable = getattr(stream, "seekable", lambda: False)()
    members = _tar_members(stream, url) if seekable else tar_file_expander([{"url": url, "stream": stream}])
    return group_by_keys(members)


def refuse_unsupported(cfg: TrainConfig) -> None:
    """One line for what needs random access to the training clips' audio.

    Every objective trains from shards: distillation's teachers embed the streamed batch, ASK's
    knowledge bases stream the train shards by clip id (training/data/shard_passes.py)."""
    if cfg.data.val_fraction > 0:
        raise ConfigError("data.val_fraction carves clips out of the training set, which data.shards cannot; "
                          "shard a manifest with its own val split instead")


# --- the stream -----------------------------------------------------------------------------


@dataclass
class ReadPolicy:
    """How a worker reads its samples of a shard (docs/training.md, "Training on a large corpus")."""

    retries: int = 4
    """Attempts after the first, per request, on an error that may pass (a dropped connection, an
    object store's 5xx): waits of ``backoff``, 2 × ``backoff``, 4 × ``backoff``, …"""
    backoff: float = 0.5
    """Seconds before the first retry."""
    block: int = 8 * 2**20
    """Most bytes of one range request: adjacent wanted samples are merged up to it (a sample larger
    than it is one request of its own)."""


class _Permanent(Exception):
    """A read that no retry mends: the object is shorter than records.jsonl says, or its bytes there
    are not the sample recorded (the shard was rewritten)."""


class WrongReply(OSError):
    """A range request answered with other bytes than asked for: more bytes than the range (a server or
    proxy that ignored ``Range`` and sent the whole object with a 200), or a ``Content-Range`` naming
    another range. Never parsed as a sample: retried like a dropped connection (:class:`ReadPolicy`)."""


LIBRARY_RETRIES_OFF: dict[str, dict[str, Any]] = {
    protocol: {"config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"}}}
    for protocol in ("s3", "s3a")
}
"""Storage options that turn botocore's own retries off for the stream's shard reads
(``total_max_attempts=1``: one attempt per request); :func:`data_filesystem` sets s3fs' ``retries`` to
1 on that instance too (a class attribute in s3fs 2026.9, not a constructor argument: its
``_error_wrapper`` loops ``range(retries)``). So :class:`ReadPolicy` is the one retry layer, with the
documented total (docs/training.md, "Retries"). Left on, they nest: a persistent 503 ``SlowDown`` on
one sample took 5 (ours) × 5 (s3fs) × 5 (botocore's legacy mode) = 125 requests and ~210 s of their
backoff before it was given up (tests/training/test_shard_reads.py)."""


def data_filesystem(url: str) -> tuple[Any, str]:
    """``(filesystem, path)`` of ``url`` for reading shard bytes: the library's retries off where it has
    them (:data:`LIBRARY_RETRIES_OFF`; fsspec keeps this instance apart from the default one, through
    which ``index.json`` and ``records.jsonl`` are read with the library's retries)."""
    import fsspec

    protocol = fsspec.core.split_protocol(url)[0] or "file"
    fs, path = fsspec.core.url_to_fs(url, **LIBRARY_RETRIES_OFF.get(protocol, {}))
    if protocol in LIBRARY_RETRIES_OFF:
        fs.retries = 1  # this instance only: its storage options are ours alone
    return fs, path


async def _s3_range(fs: Any, path: str, start: int, end: int) -> tuple[bytes, str | None]:
    """Bytes ``start``–``end`` (exclusive) of an S3 object and the reply's ``Content-Range`` (s3fs'
    ``cat_file`` drops it)."""
    bucket, key, version = fs.split_path(path)
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}",
                             **({"VersionId": version} if version else {}))
    try:
        return bytes(await resp["Body"].read()), resp.get("ContentRange")
    finally:
        resp["Body"].close()


def fetch_range(fs: Any, path: str, start: int, end: int) -> bytes:
    """Bytes ``start``–``end`` (exclusive) of ``path``, checked: a reply of another length, or whose
    ``Content-Range`` (S3; other filesystems give none) names another range, raises :class:`WrongReply`;
    an object that ends before ``end`` raises :class:`_Permanent` (cut short since it was written)."""
    import sys

    content_range: str | None = None
    s3fs = sys.modules.get("s3fs")  # imported wherever an S3 filesystem exists
    if s3fs is not None and isinstance(fs, s3fs.S3FileSystem):
        from fsspec.asyn import sync

        data, content_range = sync(fs.loop, _s3_range, fs, path, start, end)
    else:
        data = bytes(fs.cat_file(path, start=start, end=end))
    return checked_reply(data, content_range, start, end)


def checked_reply(data: bytes, content_range: str | None, start: int, end: int) -> bytes:
    """``data`` if it is bytes ``start``–``end`` (exclusive) by its length and ``content_range``
    (``bytes FIRST-LAST/TOTAL`` or ``None``); :class:`WrongReply` or :class:`_Permanent` if not."""
    import re

    asked = f"bytes {start}-{end - 1}"
    if content_range is not None:
        match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", content_range.strip())
        if match is None:
            raise WrongReply(f"asked for {asked}, the reply's Content-Range is {content_range!r}")
        first, last, total = int(match[1]), int(match[2]), match[3]
        cut_short = total != "*" and last + 1 == int(total) < end
        if first != start or (last != end - 1 and not cut_short):
            raise WrongReply(f"asked for {asked}, the reply holds {content_range!r}")
        if len(data) != last + 1 - first:
            raise WrongReply(f"asked for {asked}, the reply says {content_range!r} but holds {len(data)} bytes")
    if len(data) > end - start:
        raise WrongReply(f"asked for {asked} ({end - start} bytes), the reply holds {len(data)} bytes (a server or "
                         "proxy that ignores Range and sends the whole object)")
    if len(data) < end - start:
        raise _Permanent(f"the shard ends at byte {start + len(data)}, before the sample's end at {end} "
                         "(cut short since it was written)")
    return data


@dataclass
class _Position:
    """How far :func:`read_samples` got in a shard: the byte where the next sample's first header
    starts and its ordinal (a retry reopens the shard there)."""

    offset: int = 0
    ordinal: int = 0


def read_samples(stream: Any, url: str, wanted: Collection[int],
                 position: _Position | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(ordinal, sample)`` of the samples of one shard whose ordinal (0-based position in the
    shard) is in ``wanted``, in order; the shard is read no further than the last one. Where the
    file seeks, the members of the other samples are passed over without reading their bytes —
    though an object store's file reads ahead whole blocks: shard sets with byte offsets are read
    with :func:`read_sample_ranges` instead. ``position``: start at its offset (a sample's first
    header) and ordinal, and keep it up to date as samples are passed (a retry resumes there)."""
    import tarfile

    from webdataset.tariterators import base_plus_ext

    if not wanted:
        return
    last = max(wanted)
    if not getattr(stream, "seekable", lambda: False)():
        for ordinal, sample in enumerate(tar_samples(stream, url)):
            if ordinal > last:
                return
            if ordinal in wanted:
                yield ordinal, sample
        return
    position = position if position is not None else _Position()
    stream.seek(position.offset)
    archive = tarfile.open(fileobj=stream, mode="r:")
    ordinal, key = position.ordinal - 1, None
    current: dict[str, Any] | None = None
    for info in archive:
        archive.members = []  # type: ignore[attr-defined]  # streamed: keep no list of the shard's members
        if not info.isreg():
            continue
        prefix, suffix = base_plus_ext(info.name)
        if prefix is None:
            continue
        if prefix != key:
            if current is not None:
                yield ordinal, current
            position.offset, position.ordinal = info.offset, ordinal + 1  # this sample starts here
            ordinal, key = ordinal + 1, prefix
            if ordinal > last:
                return
            current = {"__key__": prefix, "__url__": url} if ordinal in wanted else None
        if current is not None:
            handle = archive.extractfile(info)
            assert handle is not None  # a regular member always has a file object
            current[suffix.lower()] = handle.read()
    if current is not None:
        yield ordinal, current


def _parse_sample(data: bytes, url: str) -> dict[str, Any]:
    """The sample whose tar members (headers, data, padding) are exactly ``data``."""
    import tarfile

    from webdataset.tariterators import base_plus_ext

    sample: dict[str, Any] = {"__url__": url}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
            for info in archive:
                if not info.isreg():
                    continue
                prefix, suffix = base_plus_ext(info.name)
                if prefix is None:
                    continue
                if sample.setdefault("__key__", prefix) != prefix:
                    raise _Permanent(f"members of {sample['__key__']!r} and {prefix!r} where records.jsonl has one "
                                     "sample (the shard changed since it was written)")
                handle = archive.extractfile(info)
                assert handle is not None
                sample[suffix.lower()] = handle.read()
    except tarfile.TarError as err:
        raise _Permanent(f"not a sample at its recorded offset ({err}; the shard changed since it was written)") from err
    if "__key__" not in sample:
        raise _Permanent("no member at its recorded offset (the shard changed since it was written)")
    return sample


def merge_ranges(spans: Sequence[tuple[int, int, int]], block: int) -> list[list[tuple[int, int, int]]]:
    """``(ordinal, offset, size)`` of wanted samples, by offset, grouped into requests: each group's
    samples are adjacent in the shard (one's end is the next one's offset) and hold at most
    ``block`` bytes together (a larger sample is a group of its own)."""
    groups: list[list[tuple[int, int, int]]] = []
    total = 0
    for span in sorted(spans, key=lambda s: s[1]):
        previous = groups[-1][-1] if groups else None
        if previous is not None and previous[1] + previous[2] == span[1] and total + span[2] <= block:
            groups[-1].append(span)
            total += span[2]
        else:
            groups.append([span])
            total = span[2]
    return groups


def _transient(err: BaseException) -> bool:
    """Whether a read error may pass on a retry (a missing or forbidden object, or bytes that are not
    a tar where one should be — a shard cut short — will not)."""
    import tarfile

    return not isinstance(err, (_Permanent, tarfile.TarError, FileNotFoundError, PermissionError,
                                IsADirectoryError))


def read_sample_ranges(
    url: str, spans: Sequence[tuple[int, int, int]], policy: ReadPolicy | None = None, *, fs: Any = None,
    sleep: Any = None,
) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """``(ordinal, sample or error)`` for each ``(ordinal, offset, size)`` of ``spans``, in offset
    order: range requests of adjacent samples merged up to ``policy.block`` bytes, nothing else of
    the shard read. Every reply is checked (:func:`fetch_range`: its length, and its Content-Range
    where the filesystem gives one) before a byte of it is parsed. A request that fails — or is
    answered with other bytes (:class:`WrongReply`) — is retried with exponential backoff, from the
    byte offset of its first sample not yet delivered; after ``policy.retries`` retries each of its
    samples is asked for once more on its own (no further waits: the request's total stays the
    documented one, docs/training.md "Retries"), and only a sample that still cannot be read is an
    error (a string naming the cause). Bytes that are not the recorded sample, an object shorter
    than recorded, a missing one: :class:`_Permanent` / the error is raised (the caller reads the
    rest of the shard front to back, :func:`read_samples`). ``fs``: the filesystem to read through,
    else :func:`data_filesystem`'s (the object-store library's own retries off)."""
    import time

    policy = policy or ReadPolicy()
    sleep = sleep or time.sleep
    if fs is None:
        fs, path = data_filesystem(url)
    else:
        path = fs._strip_protocol(url)

    def fetch(group: list[tuple[int, int, int]], retries: int) -> bytes:
        start, end = group[0][1], group[-1][1] + group[-1][2]
        for attempt in range(retries + 1):
            try:
                return fetch_range(fs, path, start, end)
            except Exception as err:  # noqa: BLE001 - classified: transient ones are retried
                if not _transient(err) or attempt == retries:
                    raise
                wait = policy.backoff * 2**attempt
                log.warning("%s: reading bytes %d-%d failed (%s: %s); retry %d of %d in %.1f s", url, start, end,
                            type(err).__name__, err, attempt + 1, retries, wait)
                sleep(wait)
        raise AssertionError("unreachable")

    for group in merge_ranges(spans, policy.block):
        try:
            data = fetch(group, policy.retries)
        except _Permanent:
            raise
        except Exception as err:  # noqa: BLE001 - a sample that cannot be read is counted, never the run's end
            if not _transient(err):
                raise
            cause = f"{type(err).__name__}: {err}"
            if len(group) == 1:
                yield group[0][0], f"unreadable after {policy.retries} retries: {cause}"
                continue
            for single in group:  # narrow it down: one more request per sample, no more waits
                try:
                    piece = fetch([single], 0)
                except _Permanent:
                    raise
                except Exception as last:  # noqa: BLE001 - counted, never the run's end
                    if not _transient(last):
                        raise
                    yield single[0], (f"unreadable after {policy.retries} retries of its request of {len(group)} "
                                      f"samples ({cause}) and one of its own: {type(last).__name__}: {last}")
                    continue
                yield single[0], _parse_sample(piece, url)
            continue
        base = group[0][1]
        for ordinal, offset, size in group:
            yield ordinal, _parse_sample(data[offset - base:offset - base + size], url)


def lazy_merge(streams: Sequence[tuple[int, Iterator[tuple[int, Any]]]]) -> Iterator[tuple[int, Any]]:
    """``(j, …)`` of several streams, each ascending in ``j`` and starting at its given first ``j``,
    merged by ``j``; a stream is started (its shard opened, its first range read) only when its first
    ``j`` is due, so a worker holds the shards it is drawing from at the moment, not all of its share."""
    import heapq

    waiting = sorted(((first, number, stream) for number, (first, stream) in enumerate(streams)),
                     key=lambda w: (w[0], w[1]))
    heap: list[tuple[int, int, Any, Iterator[tuple[int, Any]]]] = []
    started = 0

    def start(upto: int | None) -> None:
        nonlocal started
        while started < len(waiting) and (upto is None or waiting[started][0] <= upto):
            _, number, stream = waiting[started]
            started += 1
            entry = next(stream, None)
            if entry is not None:
                heapq.heappush(heap, (entry[0], number, entry, stream))

    while heap or started < len(waiting):
        if not heap:
            start(waiting[started][0])
            continue
        start(heap[0][0])
        _, number, entry, stream = heapq.heappop(heap)
        yield entry
        following = next(stream, None)
        if following is not None:
            heapq.heappush(heap, (following[0], number, following, stream))


@dataclass
class StreamCorpus:
    """What the planner and the workers need of a shard corpus' train split (no captions: each
    sample's ``.json`` member carries its own). Numpy arrays, so forked workers share the pages."""

    names: list[str]
    """Train shards, index.json order."""
    members: list[int]
    """Samples in each shard (index.json's clip count)."""
    usable: list[np.ndarray]
    """Per shard, the ordinals of its clips with a caption in ``data.languages``, ascending."""
    rows: list[np.ndarray]
    """Per shard, the row (clip index) of each usable ordinal."""
    ids: Sequence[str]
    """Clip id of each row."""
    unusable: list[str]
    """Ids of the clips without a caption in ``data.languages`` (left out of every epoch)."""
    offsets: list[np.ndarray] = field(default_factory=list)
    """Per shard, the byte where each usable ordinal's sample starts (-1: not recorded)."""
    sizes: list[np.ndarray] = field(default_factory=list)
    """Per shard, the bytes of each usable ordinal's sample."""

    @property
    def mix(self) -> int:
        """Shards the epoch's sequence interleaves (epoch_plan's module doc): :data:`MIX_SHARDS` when
        every shard can be range-read; 1 for an older shard set without byte offsets, whose workers
        read their shards as files from the start (interleaving would have each read up to 8 of them)."""
        return MIX_SHARDS if all(self.ranged(s) for s in range(len(self.names)) if len(self.usable[s])) else 1

    def ranged(self, shard: int) -> bool:
        """Whether ``shard``'s samples can be range-read (records.jsonl has their offsets)."""
        return shard < len(self.offsets) and bool(len(self.offsets[shard])) and bool((self.offsets[shard] >= 0).all())

    @property
    def clips(self) -> int:
        return sum(self.members)

    @property
    def usable_clips(self) -> int:
        return sum(len(u) for u in self.usable)

    def digest(self) -> str:
        """What the epoch's sequence depends on in the corpus and how shards are interleaved (saved with
        a checkpoint: one written before the interleave, of a shard set with byte offsets, resumes its
        epoch afresh)."""
        parts: list[Any] = [self.names, self.members, [len(u) for u in self.usable]]
        if self.mix != 1:  # an interleaved sequence is another sequence; an older shard set's is unchanged
            parts.append({"mix": self.mix})
        text = json.dumps(parts)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def stream_corpus(corpus: ShardCorpus) -> StreamCorpus:
    shards = corpus.shards(TRAIN_SPLIT)
    number = {name: s for s, (name, _) in enumerate(shards)}
    records = corpus.records.get(TRAIN_SPLIT)
    empty = np.zeros(0, dtype=np.int64)
    usable, rows = [empty] * len(shards), [empty] * len(shards)
    offsets, sizes = [empty] * len(shards), [empty] * len(shards)
    if records is not None:
        for name, mine in records.rows_by_shard().items():
            if name in number:  # rows ascend with the ordinal: records.jsonl keeps each shard's order
                usable[number[name]], rows[number[name]] = records.ordinal[mine].astype(np.int64), mine
                if len(records.tar_offset):
                    offsets[number[name]], sizes[number[name]] = records.tar_offset[mine], records.tar_size[mine]
    return StreamCorpus(names=[name for name, _ in shards], members=[count for _, count in shards], usable=usable,
                        rows=rows, ids=records.ids if records is not None else [],
                        unusable=list(records.unusable if records is not None else []), offsets=offsets, sizes=sizes)


class ShardStream(IterableDataset):
    """This rank's training batches of an epoch, cut as :mod:`training.data.epoch_plan` says.

    Yields ``(items, errors)`` per batch: the batch's :class:`TrainItem` s (a sample that cannot be
    decoded, or that a broken shard never delivered, leaves a hole: no substitute) and the errors
    met. The epoch and the number of batches already delivered reach the (persistent) loader
    workers through a shared-memory tensor; ``segments`` (the parts of the epoch an interrupted
    run already served under another layout) are set before the workers start.
    """

    def __init__(
        self, corpus: ShardCorpus, *, rank: int, layout: Layout, sample_rate: int, clip_samples: int, seed: int,
        languages: Sequence[str], padding: Padding = "pad", read_policy: ReadPolicy | None = None,
    ) -> None:
        self.url = corpus.url
        self.plan = stream_corpus(corpus)
        self.extension = str(corpus.index.get("extension", "flac"))
        self.languages = set(languages)
        self.rank, self.layout = rank, layout
        self.sample_rate, self.clip_samples, self.padding = sample_rate, clip_samples, padding
        self.seed, self.shuffle_buffer = seed, layout.buffer
        self.read_policy = read_policy or ReadPolicy()
        self.segments: list[Segment] = []
        self.segments_epoch = -1
        self.extra_draws: dict[int, int] = {}
        """Per worker role: draws beyond the batches' sizes the resumed segment's first batches took
        (set by :meth:`StreamBatches.restore` before the workers start)."""
        self.shared = torch.zeros(2, dtype=torch.long).share_memory_()  # epoch, batches to skip
        self._cut_for: tuple[int, int] | None = None
        self._cut: tuple[np.ndarray, SegmentCut] | None = None

    def set_epoch(self, epoch: int, *, skip: int = 0) -> None:
        self.shared[0], self.shared[1] = epoch, skip

    def earlier(self, epoch: int) -> list[Segment]:
        return self.segments if epoch == self.segments_epoch else []

    def cut(self, epoch: int) -> tuple[np.ndarray, SegmentCut]:
        """(the epoch's positions this segment serves from, its cut) — cached per epoch."""
        earlier = self.earlier(epoch)
        key = (epoch, len(earlier))
        if self._cut_for != key or self._cut is None:
            left = remaining(self.plan.usable_clips, earlier, seed=self.seed, epoch=epoch)
            self._cut, self._cut_for = (left, segment_cut(len(left), self.layout)), key
        return self._cut

    def steps(self, epoch: int) -> int:
        """Batches this rank yields in the epoch's current segment."""
        return self.cut(epoch)[1].steps

    def _entries(self, epoch: int, positions: np.ndarray, keep: set[int],
                 errors: list[str]) -> Iterator[tuple[int, TrainItem | str]]:
        """``(j, item or error)`` for each kept entry ``j`` of the chunk, in chunk order: each shard's
        wanted samples read by :meth:`_shard_entries`, the shards' streams merged by ``j`` (a chunk
        of an interleaved sequence draws from several shards at once, epoch_plan's module doc)."""
        shards, ordinals = epoch_sequence(self.plan.usable, seed=self.seed, epoch=epoch, mix=self.plan.mix)
        by_shard: dict[int, dict[int, int]] = {}
        for j in sorted(keep):
            by_shard.setdefault(int(shards[positions[j]]), {})[int(ordinals[positions[j]])] = j
        yield from lazy_merge([(min(wanted.values()), self._shard_entries(shard, wanted, epoch, errors))
                               for shard, wanted in by_shard.items()])

    def _shard_entries(self, shard: int, wanted: dict[int, int], epoch: int,
                       errors: list[str]) -> Iterator[tuple[int, TrainItem | str]]:
        """``(j, item or error)`` of one shard's wanted samples (``{ordinal: j}``), ascending ``j``
        (ordinals ascend with ``j`` within a shard): range reads where records.jsonl has the
        samples' offsets, else (or for what is left when the shard's bytes are not the ones
        recorded) the shard read front to back from the first wanted sample; transient errors are
        retried either way (:class:`ReadPolicy`), what is still unreadable is one error per sample."""
        url = _join(self.url, self.plan.names[shard])
        fs, path = data_filesystem(url)  # the library's retries off: ReadPolicy is the one retry layer
        rows = dict(zip(self.plan.usable[shard].tolist(), self.plan.rows[shard].tolist(), strict=True))
        delivered: set[int] = set()
        if self.plan.ranged(shard):
            place = {o: i for i, o in enumerate(self.plan.usable[shard].tolist())}
            spans = [(o, int(self.plan.offsets[shard][place[o]]), int(self.plan.sizes[shard][place[o]]))
                     for o in sorted(wanted)]
            try:
                for ordinal, got in read_sample_ranges(url, spans, self.read_policy, fs=fs):
                    delivered.add(ordinal)
                    yield wanted[ordinal], (f"{url}: {self.plan.ids[rows[ordinal]]}: {got}" if isinstance(got, str)
                                            else self._decode(got, epoch, rows[ordinal], url))
            except Exception as err:  # noqa: BLE001 - the rest is read front to back below
                log.warning("%s: range read stopped (%s: %s); reading this worker's other %d samples of the shard "
                            "front to back", url, type(err).__name__, err, len(wanted) - len(delivered))
        rest = {o: j for o, j in wanted.items() if o not in delivered}
        if not rest:
            return
        position, reason, attempt = _Position(), "", 0
        while True:
            todo = {o: j for o, j in rest.items() if o not in delivered}
            try:
                with fs.open(path, "rb") as stream:
                    for ordinal, sample in read_samples(stream, url, todo, position):
                        delivered.add(ordinal)
                        attempt = 0
                        yield todo[ordinal], self._decode(sample, epoch, rows[ordinal], url)
            except Exception as err:  # noqa: BLE001 - a broken shard loses its samples, never the run
                reason = f"unreadable or cut short: {type(err).__name__}: {err}"
                if _transient(err) and attempt < self.read_policy.retries:
                    wait = self.read_policy.backoff * 2**attempt
                    attempt += 1
                    log.warning("%s: read failed at sample %d (byte %d: %s); retry %d of %d there in %.1f s", url,
                                position.ordinal, position.offset, reason, attempt, self.read_policy.retries, wait)
                    import time

                    time.sleep(wait)
                    continue
            else:
                reason = f"ended early: index.json says {self.plan.members[shard]} samples"
            break
        lost = sorted(set(wanted) - delivered)
        if lost:  # each lost sample is one named error: data.max_bad_fraction counts samples, not shards
            log.warning("%s: shard failed after %d of this worker's %d samples (%s); the other %d are skipped",
                        url, len(delivered), len(wanted), reason, len(lost))
            # Each reported in the batch that draws it (never in an earlier one: a resume after that
            # batch does not report it again), and replaced there from the worker's reserve.
            for ordinal in lost:  # ascending ordinals are ascending entries of the chunk
                yield wanted[ordinal], (f"{url}: {self.plan.ids[rows[ordinal]]}: skipped, not read: the shard "
                                        f"failed after {len(delivered)} of this worker's {len(wanted)} samples ({reason})")

    def _decode(self, sample: dict[str, Any], epoch: int, row: int, url: str) -> TrainItem | str:
        """The sample's training item, or the error that makes it unusable (a string)."""
        try:
            meta = json.loads(sample["json"])
        except (KeyError, ValueError) as err:
            return f"{url}: {sample.get('__key__')}: no readable .json member ({err})"
        expected = self.plan.ids[row]
        if meta.get("id") != expected:
            return (f"{url}: {sample['__key__']}: clip {meta.get('id')!r} where records.jsonl has {expected!r} "
                    "(shards and records.jsonl differ: rewrite them with `tonearm data shard`)")
        audio = sample.get(self.extension)
        if not audio:
            return f"{url}: {expected}: no .{self.extension} member"
        rng = np.random.default_rng(_rng_seed(self.seed, epoch, row))
        try:
            wave = decode_window(bytes(audio), sample_rate=self.sample_rate, n=self.clip_samples, mode="random",
                                 rng=rng, padding=self.padding)
        except AudioDecodeError as err:
            return f"{url}: {expected}: {str(err).split(': ', 1)[-1]}"
        captions = {lang: texts for lang, texts in meta["captions"].items() if lang in self.languages}
        return TrainItem(wave, captions, row, epoch=epoch)

    def __iter__(self) -> Iterator[tuple[list[TrainItem], list[str], int]]:
        info = get_worker_info()
        physical = info.id if info is not None else 0
        epoch, skip = int(self.shared[0]), int(self.shared[1])
        segment = len(self.earlier(epoch))
        left, cut = self.cut(epoch)
        slots = self.layout.slots
        # A resumed DataLoader starts its round-robin at worker 0: physical worker p takes the
        # chunk of the worker due p turns after the resume point (module doc of epoch_plan).
        role = (physical + skip) % slots
        chunk = cut.ranks[self.rank][role]
        done = len(range(role, min(skip, cut.steps), slots))
        order = draw_order(chunk.stop - chunk.start, buffer=self.shuffle_buffer, first=self.layout.batch_size,
                           seed=slot_seed(self.seed, epoch, segment, self.rank, role))
        first_draw = sum(chunk.sizes[:done]) + (self.extra_draws.get(role, 0) if done else 0)
        keep = set(order[first_draw:])
        errors: list[str] = []
        entries = self._entries(epoch, left[chunk.start:chunk.stop], keep, errors)
        store: dict[int, TrainItem | str] = {}
        pulled = -1
        draw = first_draw
        for size in chunk.sizes[done:]:
            # Draw until the batch is full: a lost sample is replaced by the worker's next draw, which
            # the chunk's reserve pays for (one rank's bad sample costs the others nothing).
            items: list[TrainItem] = []
            start = draw
            while len(items) < size and draw < len(order):
                j = order[draw]
                draw += 1
                while j not in store and pulled < j:
                    got = next(entries, None)
                    if got is None:
                        pulled = len(order)
                        break
                    pulled = got[0]
                    store[got[0]] = got[1]
                entry = store.pop(j, None)
                if isinstance(entry, str):
                    errors.append(entry)
                elif entry is not None:
                    items.append(entry)
                else:  # lost without an error of its own (reported with its shard's failure): replaced too
                    errors.append(f"{self.url}: entry {j} of a chunk: not delivered")
            yield items, errors[:], draw - start - size
            errors.clear()


class StreamCollate:
    """:class:`TrainCollate` of a stream's ``(items, errors)``: the errors travel as ``skipped``."""

    def __init__(self, collate: TrainCollate, clip_samples: int) -> None:
        self.collate, self.clip_samples = collate, clip_samples

    def __call__(self, batch: tuple[list[TrainItem], list[str], int]) -> TrainBatch:
        items, errors, extra = batch
        if items:
            return replace(self.collate(items), skipped=tuple(errors), extra_draws=extra)
        views = self.collate.strategy.num_views
        return TrainBatch(waveform=torch.zeros(0, self.clip_samples), input_ids=torch.zeros(views, 0, 1, dtype=torch.long),
                          attention_mask=torch.zeros(views, 0, 1, dtype=torch.long),
                          text_mask=torch.zeros(views, 0, dtype=torch.bool), clip_index=torch.zeros(0, dtype=torch.long),
                          texts=[[] for _ in range(views)], skipped=tuple(errors), extra_draws=extra)


def concat_batches(first: TrainBatch, second: TrainBatch, *, pad_id: int = 0) -> TrainBatch:
    """``first``'s clips then ``second``'s (token rows padded to the longer of the two: ``pad_id`` and
    a zero attention mask, as the collate pads); ``first``'s ``extra_draws``, both batches' errors."""
    import torch.nn.functional as F

    length = max(first.input_ids.shape[2], second.input_ids.shape[2])

    def padded(tensor: torch.Tensor, value: int) -> torch.Tensor:
        return F.pad(tensor, (0, length - tensor.shape[2]), value=value)

    return TrainBatch(
        waveform=torch.cat([first.waveform, second.waveform]),
        input_ids=torch.cat([padded(first.input_ids, pad_id), padded(second.input_ids, pad_id)], dim=1),
        attention_mask=torch.cat([padded(first.attention_mask, 0), padded(second.attention_mask, 0)], dim=1),
        text_mask=torch.cat([first.text_mask, second.text_mask], dim=1),
        clip_index=torch.cat([first.clip_index, second.clip_index]),
        texts=[a + b for a, b in zip(first.texts, second.texts, strict=True)] if first.texts and second.texts
        else first.texts or second.texts,
        skipped=first.skipped + second.skipped, extra_draws=first.extra_draws)


def truncate_batch(batch: TrainBatch, rows: int) -> TrainBatch:
    """The first ``rows`` clips of ``batch``."""
    return TrainBatch(waveform=batch.waveform[:rows], input_ids=batch.input_ids[:, :rows],
                      attention_mask=batch.attention_mask[:, :rows], text_mask=batch.text_mask[:, :rows],
                      clip_index=batch.clip_index[:rows], texts=[row[:rows] for row in batch.texts],
                      skipped=batch.skipped, extra_draws=batch.extra_draws)


class StreamBatches:
    """What the loop needs of a training loader: iterable batches, ``set_epoch(epoch, skip=)``,
    ``len`` (steps of a full epoch), the plan state a checkpoint records and the restore from it."""

    def __init__(self, stream: ShardStream, loader: DataLoader) -> None:
        self.stream = stream
        self.loader = loader
        self.skip = 0
        self.epoch = 0
        self.full_steps = segment_cut(stream.plan.usable_clips, stream.layout).steps
        self.before = 0
        self.served = 0
        self.held_back: list[str] = []
        self.pending: int | None = None
        """The epoch :meth:`restore` took up (its first :meth:`set_epoch` resumes there)."""
        self.resume_skip = 0
        self.coverage: Coverage | None = None
        self.drawn: list[int] = []
        """Per batch received since the segment's start or resume: draws beyond its size (lost samples
        replaced from its worker's reserve)."""
        self.extra: list[int] = [0] * stream.layout.slots
        """Per worker role, such draws of the batches before the resume point."""
        self.resume_extra: list[int] = [0] * stream.layout.slots
        self.all_extra: list[list[int]] | None = None
        """Every rank's :attr:`extra`, gathered by the loop before a checkpoint (:meth:`gather_extra`)."""
        self.reserve_used = 0
        """Entries of this rank's shared reserve taken so far in the segment (bad ones included)."""
        self.reserve_after: list[int] = []
        """Per batch received since the segment's start or resume: :attr:`reserve_used` after it."""
        self.resume_reserve = 0
        self.all_reserve: list[int] | None = None
        """Every rank's reserve taken, gathered with :attr:`all_extra`."""
        self._reserve: Iterator[tuple[int, TrainItem | str]] | None = None
        self.reserve_drawn = 0
        """Reserve entries taken in this epoch by this process (the epoch record's ``reserve_drawn``)."""

    def set_epoch(self, epoch: int, *, skip: int = 0, samples_in_epoch: int | None = None) -> None:
        """Start epoch ``epoch`` ``skip`` batches in (the loop's ``batch_in_epoch``), or, for the epoch
        a :meth:`restore` took up, where the checkpoint's plan says."""
        resuming = epoch == self.pending
        if resuming:
            skip = self.resume_skip
        self.pending = None
        steps = self.stream.steps(epoch)
        self.epoch, self.skip = epoch, min(skip, steps)
        self.before = self.full_steps - steps + self.skip
        self.served, self.held_back = 0, []
        self.extra = list(self.resume_extra) if resuming and self.skip else [0] * self.stream.layout.slots
        self.stream.extra_draws = dict(enumerate(self.extra))
        self.drawn = []
        self.reserve_used = self.resume_reserve if resuming and self.skip else 0
        self.reserve_after, self._reserve, self.reserve_drawn = [], None, 0
        self.stream.set_epoch(epoch, skip=self.skip)

    def restore(self, state: dict[str, Any] | None, *, epoch: int, batch_in_epoch: int, saved_world: int) -> str:
        """Take up the plan of a checkpoint's epoch (``data_plan`` in trainer_state.json); returns what
        the log says about it. The same layout continues exactly where it stopped; another one
        (world size, workers, batch) serves the clips the epoch has not served yet, cut anew."""
        layout = self.stream.layout
        self.pending = epoch
        if state is None:  # a checkpoint from before plans were recorded: its layout is assumed
            old = Layout(saved_world, layout.workers, layout.batch_size, layout.buffer)
            state = {"epoch": epoch, "segments": [Segment(old, batch_in_epoch).to_json()] if batch_in_epoch else []}
        mismatch = {key: (state[key], value) for key, value in (("seed", self.stream.seed),
                    ("corpus", self.stream.plan.digest())) if key in state and state[key] != value}
        segments = [Segment.from_json(s) for s in state.get("segments", [])] if int(state["epoch"]) == epoch else []
        if mismatch and segments:
            # Another corpus or seed: the interrupted epoch's sequence is not this one's.
            self.stream.segments, self.stream.segments_epoch = [], epoch
            self.resume_skip = 0
            return (f"the data plan changed ({', '.join(f'{k}: {a} -> {b}' for k, (a, b) in mismatch.items())}): "
                    f"epoch {epoch + 1} starts afresh")
        if segments and segments[-1].layout == layout:
            self.stream.segments, self.stream.segments_epoch = segments[:-1], epoch
            self.resume_skip = segments[-1].batches
            rank = self.stream.rank
            self.resume_extra = [segments[-1].extra_of(rank, role) for role in range(layout.slots)]
            self.resume_reserve = segments[-1].reserve_used_of(rank)
            return f"epoch {epoch + 1} continues at batch {batch_in_epoch} of the same plan"
        self.stream.segments, self.stream.segments_epoch = segments, epoch
        self.resume_skip = 0
        if not segments:
            return f"epoch {epoch + 1} starts"
        left = len(self.stream.cut(epoch)[0])
        was = segments[-1].layout
        return (f"layout changed (world {was.world} × {was.workers} workers × batch {was.batch_size}, buffer "
                f"{was.buffer} -> {layout.world} × {layout.workers} × {layout.batch_size}, {layout.buffer}): epoch "
                f"{epoch + 1} serves its "
                f"{left} clips not yet served, cut anew ({self.stream.steps(epoch)} steps)")

    def plan_state(self, epoch: int, batch_in_epoch: int) -> dict[str, Any]:
        """What a checkpoint records of the plan (restored by :meth:`restore`)."""
        state: dict[str, Any] = {"epoch": epoch, "seed": self.stream.seed, "corpus": self.stream.plan.digest(),
                                 "segments": []}
        if epoch == self.epoch and batch_in_epoch > 0:
            done = self.skip + max(0, batch_in_epoch - self.before)
            state["segments"] = [s.to_json() for s in self.stream.earlier(epoch)]
            extra = tuple(tuple(row) for row in (self.all_extra or [self.extra_before(done)]))
            reserve = tuple(self.all_reserve or [self.reserve_before(done)])
            state["segments"].append(Segment(self.stream.layout, done, extra, reserve).to_json())
        return state

    def reserve_before(self, done: int) -> int:
        """Entries of this rank's shared reserve the segment's first ``done`` batches took."""
        received = max(0, done - self.skip)
        if received == 0:
            return self.resume_reserve if self.skip else 0
        return self.reserve_after[min(received, len(self.reserve_after)) - 1]

    def extra_before(self, done: int) -> list[int]:
        """Per worker role, the draws beyond the batches' sizes of the segment's first ``done`` batches."""
        slots = len(self.extra)
        out = list(self.extra)
        for k, extra in enumerate(self.drawn[:max(0, done - self.skip)]):
            out[(self.skip + k) % slots] += extra
        return out

    def gather_extra(self, epoch: int, batch_in_epoch: int) -> None:
        """Every rank's reserve draws up to ``batch_in_epoch``, for rank 0's :meth:`plan_state` (every rank
        calls it before a checkpoint)."""
        from training import distributed

        done = self.skip + max(0, batch_in_epoch - self.before) if epoch == self.epoch else 0
        gathered = distributed.gather_objects((self.extra_before(done), self.reserve_before(done)))
        self.all_extra = [extra for extra, _ in gathered]
        self.all_reserve = [reserve for _, reserve in gathered]

    def remaining_steps(self) -> int:
        """Batches left in the epoch :meth:`restore` took up, from where it resumes."""
        epoch = self.epoch if self.pending is None else self.pending
        return max(0, self.stream.steps(epoch) - (self.resume_skip if self.pending is not None else self.skip))

    def batches_before(self) -> int:
        """Batches of a full epoch the current position has passed."""
        return self.before

    def samples_consumed(self, batch_in_epoch: int) -> int | None:
        """No world-size-independent clip count for a stream (the plan state says where it is)."""
        return None

    def lockstep(self, batch: TrainBatch) -> TrainBatch | None:
        """The batch every rank trains this step: ranks whose batch lost clips (undecodable, a broken
        shard) make the others hold back as many — the shapes of the collectives must agree. ``None``:
        some rank has fewer than 2 clips left, and every rank skips the step."""
        from training import distributed

        rows = int(batch.waveform.shape[0])
        agreed = rows
        if distributed.is_distributed():
            sizes = distributed.all_gather_no_grad(torch.tensor([rows], device=distributed.group_device()))
            agreed = int(sizes.min())
        if agreed < 2:  # no negatives on some rank: every rank skips this step (the loop)
            log.warning("epoch %d: a rank's batch has %d usable clip(s) (the others lost to errors): every rank "
                        "skips this step; first error here: %s", self.epoch + 1, agreed,
                        batch.skipped[0] if batch.skipped else "none")
            self.held_back.extend(self.stream.plan.ids[int(i)] for i in batch.clip_index)
            return None
        if agreed < rows:
            ids = [self.stream.plan.ids[int(i)] for i in batch.clip_index[agreed:]]
            if len(self.held_back) < NAMED_HELD_BACK:
                log.info("held back %d clip(s) this step so every rank trains %d (another rank's batch lost "
                         "clips): %s", rows - agreed, agreed, ", ".join(ids[:NAMED_HELD_BACK]))
            self.held_back.extend(ids)
            batch = truncate_batch(batch, agreed)
        self.served += agreed
        return batch

    def epoch_stats(self) -> dict[str, int]:
        """Clips this rank trained in the epoch (since the start or the resume), held back, and the entries
        of its shared reserve its short batches took."""
        return {"clips_served": self.served, "clips_held_back": len(self.held_back),
                "reserve_drawn": self.reserve_drawn}

    def __len__(self) -> int:
        return self.full_steps

    def __iter__(self) -> Iterator[Any]:
        """The loader's batches, each that came up short (its worker's losses outran its draws: its last
        batch) topped up from the rank's shared reserve, in batch order (module doc)."""
        left, cut = self.stream.cut(self.epoch)
        step = self.skip
        for batch in self.loader:  # the reserve draws of each batch's worker, for the checkpoint's plan
            self.drawn.append(int(getattr(batch, "extra_draws", 0)))
            if step < cut.steps and self.reserve_used < cut.reserve and isinstance(batch, TrainBatch):
                short = cut.batch_size(step) - int(batch.clip_index.shape[0])
                if short > 0:
                    batch = self.top_up(batch, short, left, cut)
            self.reserve_after.append(self.reserve_used)
            step += 1
            yield batch

    def top_up(self, batch: TrainBatch, short: int, left: np.ndarray, cut: SegmentCut) -> TrainBatch:
        """``batch`` with up to ``short`` clips more from this rank's shared reserve, read and decoded
        here (in the main process: a few clips an epoch), the reserve's bad entries as its errors."""
        if self._reserve is None:
            span = cut.reserve_range(self.stream.rank)
            positions = left[span.start:span.stop]
            self._reserve = self.stream._entries(self.epoch, positions, set(range(self.reserve_used, len(positions))),
                                                 [])
        items: list[TrainItem] = []
        errors: list[str] = []
        while len(items) < short and self.reserve_used < cut.reserve:
            got = next(self._reserve, None)
            if got is None:
                self.reserve_used = cut.reserve
                break
            j, entry = got
            self.reserve_drawn += j + 1 - self.reserve_used
            self.reserve_used = j + 1
            if isinstance(entry, str):
                errors.append(entry)
            else:
                items.append(entry)
        if not items and not errors:
            return batch
        collate: Any = self.loader.collate_fn
        pad_id = int(getattr(getattr(getattr(collate, "collate", None), "tokenizer", None), "pad_id", 0) or 0)
        return concat_batches(batch, collate((items, errors, 0)), pad_id=pad_id)


NAMED_HELD_BACK = 10


def build_stream_loader(
    cfg: TrainConfig, corpus: ShardCorpus, *, rank: int, world: int, options: dict[str, Any], strategy: Any,
    tokenizer: Any, sample_rate: int, clip_samples: int,
) -> StreamBatches:
    """The DataLoader over this rank's shard stream, with ``options`` from :func:`loader_options`."""
    workers = int(options.get("num_workers", 0))
    entry_bytes = clip_samples * 4  # a float32 crop (the captions are small beside it)
    buffer, buffer_bytes = shuffle_entries(cfg.data.shuffle_buffer, cfg.data.shuffle_buffer_bytes,
                                           entry_bytes=entry_bytes, workers=workers)
    layout = Layout(world=world, workers=workers, batch_size=cfg.optim.batch_size, buffer=buffer,
                    reserve=cfg.data.bad_sample_reserve)
    stream = ShardStream(
        corpus, rank=rank, layout=layout, sample_rate=sample_rate, clip_samples=clip_samples, seed=cfg.seed,
        languages=cfg.data.languages, padding=short_clip_padding(cfg.frontend),
        read_policy=ReadPolicy(retries=cfg.data.read_retries, backoff=cfg.data.read_backoff_seconds),
    )
    plan = stream.plan
    unranged = sum(1 for shard in range(len(plan.names)) if len(plan.usable[shard]) and not plan.ranged(shard))
    if unranged and rank == 0:
        log.warning("%d of %d train shards have no byte offsets in records.jsonl (written before `tonearm data "
                    "shard` recorded them): each worker reads those front to back, and an object store's file "
                    "reads ahead whole blocks of samples other workers serve; rewrite the shards (same command) "
                    "to range-read only this rank's samples", unranged, len(plan.names))
    cover = coverage(plan.usable_clips, plan.clips, layout)
    if cover.steps == 0:
        raise DataError(
            f"{corpus.url}: {plan.usable_clips} usable train clips do not give each of {world} rank(s) a batch of "
            "2 clips; use fewer processes or a larger corpus")
    log.info("%s", cover.line(layout))
    held = min(buffer, -(-(cover.served // max(1, world)) // layout.slots))  # a worker's share caps its buffer
    records = count_records(corpus, eval_split=cfg.eval.split, workers=workers, world=world, knowledge_pass=False)
    refuse_unless_node_fits(cfg, workers=workers, buffer_bytes=held * entry_bytes, crop=entry_bytes,
                            index=records.resident, ranks_on_node=local_world_size(), shm=shm_size(),
                            memory=node_memory())
    if cover.fraction < 0.99:
        log.warning("an epoch leaves out %d of %d usable clips (%.1f %%): each of %d rank(s) takes %d, in batches of "
                    "%d with none of one clip; a larger corpus or fewer ranks cover more", cover.left_out,
                    cover.usable, 100 * (1 - cover.fraction), world, cover.served // world, layout.batch_size)
    log.info("shuffle buffer: %d crops of %.2f MB per loader worker (%.2f GB per rank; data.shuffle_buffer=%s)",
             buffer, entry_bytes / 1e6, buffer_bytes * max(1, workers) / 1e9, cfg.data.shuffle_buffer)
    if plan.unusable:
        log.info("%d train clip(s) have no caption in data.languages and are left out of every epoch, e.g. %s",
                 len(plan.unusable), ", ".join(plan.unusable[:NAMED_HELD_BACK]))
    index_rate = int(corpus.index.get("sample_rate", sample_rate))
    if index_rate != sample_rate:
        log.warning("shards are at %d Hz, the model's front end at %d Hz: every crop is resampled "
                    "(reshard with --sample-rate %d)", index_rate, sample_rate, sample_rate)
    # A generator of its own: a DataLoader without one draws its workers' base seed from the global
    # torch RNG at every epoch, which would shift dropout after a resume (the draw happened before).
    # batch_size=None: the stream yields whole batches (their size can fall short by a bad sample).
    collate: Any = StreamCollate(TrainCollate(strategy, tokenizer, seed=cfg.seed), clip_samples)  # one (items, errors)
    loader = DataLoader(stream, batch_size=None, collate_fn=collate,
                        worker_init_fn=ignore_ctrl_c, generator=torch.Generator().manual_seed(cfg.seed), **options)
    batches = StreamBatches(stream, loader)
    batches.coverage = cover
    return batches

# --- records for the loop -------------------------------------------------------------------

_CORPORA: dict[tuple[str, tuple[str, ...], bool], ShardCorpus] = {}


def cached_corpus(cfg: TrainConfig) -> ShardCorpus:
    """:func:`open_corpus` of ``data.shards``, read once per process."""
    assert cfg.data.shards is not None
    key = (cfg.data.shards, tuple(cfg.data.languages), cfg.data.drop_other_languages)
    if key not in _CORPORA:
        _CORPORA[key] = open_corpus(cfg.data.shards, languages=cfg.data.languages,
                                    drop_other_languages=cfg.data.drop_other_languages)
    return _CORPORA[key]


def extract_split(corpus: ShardCorpus, split: str, folder: Path) -> list[ClipRecord]:
    """The clips of a (small) split written out as files, for evaluation's random access."""
    import fsspec

    folder.mkdir(parents=True, exist_ok=True)
    extension = str(corpus.index.get("extension", "flac"))
    records = corpus.records.get(split)
    by_id = {r.id: r for r in records.with_captions(range(len(records)))} if records is not None else {}
    out: list[ClipRecord] = []
    for name, _ in corpus.shards(split):
        url = _join(corpus.url, name)
        with fsspec.open(url, "rb") as stream:
            for sample in tar_samples(stream, url):
                meta = json.loads(sample["json"])
                record = by_id.get(meta["id"])
                if record is None:
                    continue
                path = folder / f"{sample['__key__']}.{extension}"
                if not path.is_file():  # ranks may extract at once: whole files only
                    tmp = path.with_name(f".{path.name}.{os.getpid()}")
                    tmp.write_bytes(sample[extension])
                    os.replace(tmp, path)
                out.append(ClipRecord(id=record.id, audio=path, captions=record.captions, split=split,
                                      meta=record.meta))
    return out


def load_shard_data(cfg: TrainConfig) -> tuple[ShardRecords, list[ClipRecord]]:
    """(train records, validation records) of ``data.shards``: the train split's columns (ids, shards,
    seconds; captions read again when needed) and the validation split extracted to
    ``out_dir/val_clips``, captions and all (docs/training.md)."""
    refuse_unsupported(cfg)
    corpus = cached_corpus(cfg)
    train = corpus.records.get(TRAIN_SPLIT)
    if train is None or len(train) < 2:
        raise DataError(f"{corpus.url}: {len(train or [])} clip(s) in split 'train'; training needs at least 2")
    if cfg.data.max_clips is not None:
        raise ConfigError("data.max_clips takes the first clips of a manifest; with data.shards write a smaller "
                          "shard set instead")
    split = cfg.eval.split
    folder = cfg.out_dir / "val_clips" / str(corpus.index.get("plan", "shards"))[:16]  # per shard set
    val = extract_split(corpus, split, folder) if corpus.records.get(split) else []
    present = {lang for r in val for lang, texts in r.captions.items() if texts}
    for name, count, languages in ((TRAIN_SPLIT, len(train), train.languages_present), (split, len(val), present)):
        missing = [lang for lang in cfg.data.languages if lang not in languages]
        if count and missing:
            raise DataError(f"{corpus.url}: no {name!r} captions in {missing} although data.languages lists them; "
                            "set data.languages to the shards' languages")
    if not val:
        log.warning("%s has no %r split: no validation; best/ will be the last weights", corpus.url, split)
    log.info("data.shards %s: %d train clips (%.1f h) in %d shards, %d %s clips extracted for validation",
             corpus.url, len(train), corpus.index["splits"][TRAIN_SPLIT].get("hours", 0.0),
             len(corpus.shards(TRAIN_SPLIT)), len(val), split)
    return train, val
