"""What a rank holds of a shard folder's ``records.jsonl`` (docs/training.md, "Training on a large corpus").

``records.jsonl`` is the text-only manifest `tonearm data shard` writes beside the shards: one line
per clip (id, split, captions, seconds, shard), shard after shard, each in the shard's order. Of it
a rank needs, for every clip of a split:

* its **id** (errors and logs name clips by it; the teacher cache and the knowledge-base pass key
  clips by it), its **shard** and **ordinal** in the shard (the epoch plan), its **seconds**
  (balancing the extra passes across ranks, the teacher cache's rule), and where its sample lies in
  the shard (**offset**, **size**: the stream's range reads; -1 / 0 for shard sets written before
  `tonearm data shard` recorded them);

and the **captions** of only some clips, now and then: the knowledge-base pass's share (the clips
of the shards this rank embeds), the validation split (extracted once), the tokenizer's texts
(rank 0, once, when it trains one). The training stream never needs them here: each sample's
``.json`` member carries its captions (training/data/stream.py).

So :func:`read_records` keeps, per split, numpy columns — the ids as one UTF-8 buffer and their
end offsets, seconds, shard number, ordinal, and where the clip's line lies in records.jsonl
(byte offset, length) — about 45 bytes a clip, and :meth:`ShardRecords.with_captions` reads the
lines of the clips asked for again, by byte range, when their captions are needed. Why not the
captions too, packed in one buffer: they are ~90 % of the file (16 M captions at 400 k clips ×
8 languages × 5: 1.4 GiB per rank, measured in bench/records_memory.py), the stream never reads
them, and the clips a pass needs them for change with every pass and world size. Numpy columns
also keep forked loader workers from copying the pages they read (a Python object's reference
count writes to its page; a numpy buffer is only read).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, cast, overload

import numpy as np

from index.errors import DataError
from training.data.manifest import ClipRecord

READ_BLOCK = 4 * 2**20
"""Bytes read at a time when lines are read again (one range request on an object store)."""
TEXTS_CHUNK = 20_000
"""Clips whose captions :meth:`ShardRecords.texts` holds at a time."""


@dataclass(frozen=True)
class ShardClip:
    """One clip of :class:`ShardRecords`, without its captions (:meth:`ShardRecords.with_captions`
    reads them): what :class:`ClipRecord` has but the captions, so a caller that wants captions
    from it fails loudly instead of finding none."""

    id: str
    audio: PurePosixPath
    """The clip's shard (it names the shard; never opened as a file)."""
    split: str
    meta: dict[str, Any]
    """``seconds``, ``shard`` and ``ordinal`` (0-based position in the shard)."""


class ClipIds(Sequence[str]):
    """The ids of a :class:`ShardRecords` by row, decoded from its buffer when asked for."""

    def __init__(self, records: ShardRecords) -> None:
        self._records = records

    def __len__(self) -> int:
        return len(self._records)

    @overload
    def __getitem__(self, row: int) -> str: ...
    @overload
    def __getitem__(self, row: slice) -> list[str]: ...
    def __getitem__(self, row: int | slice) -> str | list[str]:
        if isinstance(row, slice):
            return [self._records.clip_id(r) for r in range(len(self))[row]]
        return self._records.clip_id(row)


@dataclass(eq=False)
class ShardRecords(Sequence[ShardClip]):
    """The clips of one split with a caption in the run's languages, in records.jsonl order (module
    doc). ``records[row]`` is a :class:`ShardClip`; the row is the clip's index everywhere in a run."""

    url: str
    """The folder's records.jsonl."""
    folder: str
    split: str
    languages: tuple[str, ...]
    shard_names: list[str]
    id_bytes: np.ndarray
    id_ends: np.ndarray
    seconds: np.ndarray
    shard: np.ndarray
    """Index into ``shard_names``."""
    ordinal: np.ndarray
    line_start: np.ndarray
    line_length: np.ndarray
    pairs: int
    """(clip, caption) pairs in ``languages``."""
    languages_present: frozenset[str]
    """Languages with at least one caption in the split."""
    unusable: list[str] = field(default_factory=list)
    """Ids of the split's clips without a caption in ``languages`` (left out of the rows)."""
    tar_offset: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Byte where each clip's sample starts in its shard (-1: not recorded, an older shard set)."""
    tar_size: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Bytes of each clip's sample in its shard (headers, data and padding of its members)."""

    def __len__(self) -> int:
        return len(self.seconds)

    @overload
    def __getitem__(self, row: int) -> ShardClip: ...
    @overload
    def __getitem__(self, row: slice) -> list[ShardClip]: ...
    def __getitem__(self, row: int | slice) -> ShardClip | list[ShardClip]:
        if isinstance(row, slice):
            return [self[r] for r in range(len(self))[row]]
        if not -len(self) <= row < len(self):
            raise IndexError(row)
        row %= len(self)
        shard = self.shard_names[int(self.shard[row])]
        return ShardClip(id=self.clip_id(row), audio=PurePosixPath(f"{self.folder.rstrip('/')}/{shard}"),
                         split=self.split, meta={"seconds": float(self.seconds[row]), "shard": shard,
                                                 "ordinal": int(self.ordinal[row])})

    def clip_id(self, row: int) -> str:
        if not -len(self) <= row < len(self):
            raise IndexError(row)
        row %= len(self)
        start = int(self.id_ends[row - 1]) if row > 0 else 0
        return bytes(self.id_bytes[start:int(self.id_ends[row])]).decode("utf-8")

    @property
    def ids(self) -> ClipIds:
        return ClipIds(self)

    @property
    def nbytes(self) -> int:
        """Bytes of the columns (what the split costs a rank, besides a few Python objects)."""
        columns = (self.id_bytes, self.id_ends, self.seconds, self.shard, self.ordinal, self.line_start,
                   self.line_length, self.tar_offset, self.tar_size)
        return sum(int(c.nbytes) for c in columns)

    @property
    def line_bytes(self) -> int:
        """Bytes of the split's lines in records.jsonl."""
        return int(self.line_length.sum(dtype=np.int64))

    def rows_by_shard(self) -> dict[str, np.ndarray]:
        """Each shard's rows, ascending."""
        order = np.argsort(self.shard, kind="stable")
        bounds = np.searchsorted(self.shard[order], np.arange(len(self.shard_names) + 1))
        return {name: order[bounds[s]:bounds[s + 1]] for s, name in enumerate(self.shard_names)
                if bounds[s + 1] > bounds[s]}

    def with_captions(self, rows: Sequence[int] | np.ndarray) -> list[ClipRecord]:
        """The :class:`ClipRecord` of each of ``rows`` (in that order), its line of records.jsonl read
        again: the captions in ``languages``, ``meta`` as :class:`ShardClip`'s."""
        rows = np.asarray(rows, dtype=np.int64)
        out: list[ClipRecord | None] = [None] * len(rows)
        for position, line in self._lines(rows):
            row = int(rows[position])
            parsed = json.loads(line)
            clip = self[row]
            if parsed.get("id") != clip.id:
                raise DataError(f"{self.url}: line of clip {clip.id!r} now holds {parsed.get('id')!r}: records.jsonl "
                                "changed during the run")
            captions = {lang: texts for lang, texts in parsed["captions"].items() if lang in self.languages}
            out[position] = ClipRecord(id=clip.id, audio=cast(Path, clip.audio),  # names the shard, as before
                                       captions=captions, split=self.split, meta=clip.meta)
        return [record for record in out if record is not None]

    def texts(self, languages: Sequence[str]) -> Iterator[str]:
        """Every caption of the split in row order, each clip's in ``languages`` order (the tokenizer's
        input), read again a chunk of clips at a time."""
        for first in range(0, len(self), TEXTS_CHUNK):
            for record in self.with_captions(np.arange(first, min(len(self), first + TEXTS_CHUNK))):
                for lang in languages:
                    yield from record.captions.get(lang, [])

    def _lines(self, rows: np.ndarray) -> Iterator[tuple[int, bytes]]:
        """``(position in rows, line)`` for each of ``rows``, read in file order a block at a time."""
        import fsspec

        if not len(rows):
            return
        starts, lengths = self.line_start[rows], self.line_length[rows]
        block, block_start = b"", 0
        with fsspec.open(self.url, "rb") as handle:
            for position in np.argsort(starts, kind="stable").tolist():
                start, length = int(starts[position]), int(lengths[position])
                if not block_start <= start or start + length > block_start + len(block):
                    handle.seek(start)
                    block, block_start = handle.read(max(length, READ_BLOCK)), start
                offset = start - block_start
                yield position, block[offset:offset + length]


class _Columns:
    """One split's columns while records.jsonl is read (module doc)."""

    def __init__(self) -> None:
        self.id_bytes = bytearray()
        self.id_ends, self.line_start = array("q"), array("q")
        self.tar_offset, self.tar_size = array("q"), array("q")
        self.seconds = array("d")
        self.shard, self.ordinal, self.line_length = array("i"), array("i"), array("i")
        self.shard_number: dict[str, int] = {}
        self.pairs = 0
        self.present: set[str] = set()
        self.unusable: list[str] = []

    def records(self, url: str, folder: str, split: str, languages: tuple[str, ...]) -> ShardRecords:
        return ShardRecords(
            url=url, folder=folder, split=split, languages=languages, shard_names=list(self.shard_number),
            id_bytes=np.frombuffer(bytes(self.id_bytes), dtype=np.uint8), id_ends=np.asarray(self.id_ends),
            seconds=np.asarray(self.seconds), shard=np.asarray(self.shard), ordinal=np.asarray(self.ordinal),
            line_start=np.asarray(self.line_start), line_length=np.asarray(self.line_length), pairs=self.pairs,
            languages_present=frozenset(self.present), unusable=self.unusable,
            tar_offset=np.asarray(self.tar_offset, dtype=np.int64), tar_size=np.asarray(self.tar_size, dtype=np.int64))


def _numbered_lines(handle: Any) -> Iterator[tuple[int, bytes]]:
    """``(byte offset, line)`` of each line of a binary file, read a block at a time."""
    offset, rest = 0, b""
    while True:
        block = handle.read(READ_BLOCK)
        if not block:
            break
        lines = (rest + block).split(b"\n")
        rest = lines.pop()
        for line in lines:
            yield offset, line
            offset += len(line) + 1
    if rest:
        yield offset, rest


def read_records(folder: str, *, languages: Sequence[str], drop_other_languages: bool) -> dict[str, ShardRecords]:
    """Per split, the :class:`ShardRecords` of ``folder``'s records.jsonl (read once, line by line).
    A clip with captions outside ``languages`` is refused unless ``drop_other_languages``."""
    import fsspec

    url = f"{folder.rstrip('/')}/records.jsonl"
    wanted = tuple(languages)
    splits: dict[str, _Columns] = {}
    ordinal: dict[str, int] = {}
    with fsspec.open(url, "rb") as handle:
        for start, line in _numbered_lines(handle):
            if not line.strip():
                continue
            row = json.loads(line)
            place = ordinal[row["shard"]] = ordinal.get(row["shard"], -1) + 1  # records.jsonl keeps each shard's order
            captions = {lang: texts for lang, texts in row["captions"].items() if lang in wanted}
            if len(captions) < len(row["captions"]) and not drop_other_languages:
                other = sorted(set(row["captions"]) - set(wanted))
                raise DataError(
                    f"{folder}: clip {row['id']!r} has captions in {other}, not among data.languages; add them "
                    "or set data.drop_other_languages=true")
            columns = splits.setdefault(row["split"], _Columns())
            if not captions:
                columns.unusable.append(row["id"])
                continue
            columns.id_bytes += row["id"].encode("utf-8")
            columns.id_ends.append(len(columns.id_bytes))
            columns.seconds.append(float(row["seconds"]))
            columns.shard.append(columns.shard_number.setdefault(row["shard"], len(columns.shard_number)))
            columns.ordinal.append(place)
            columns.line_start.append(start)
            columns.line_length.append(len(line))
            columns.tar_offset.append(int(row.get("offset", -1)))
            columns.tar_size.append(int(row.get("size", 0)))
            columns.pairs += sum(len(texts) for texts in captions.values())
            columns.present.update(lang for lang, texts in captions.items() if texts)
    return {split: columns.records(url, folder, split, wanted) for split, columns in splits.items()}


def caption_texts(records: Sequence[Any], languages: Sequence[str]) -> Iterator[str]:
    """Every caption of ``records`` in ``languages``, clip by clip (the tokenizer's input): a manifest's
    :class:`ClipRecord` s as they are, a :class:`ShardRecords` read again from records.jsonl."""
    if isinstance(records, ShardRecords):
        yield from records.texts(languages)
        return
    for record in records:
        for lang in languages:
            yield from record.captions.get(lang, [])
