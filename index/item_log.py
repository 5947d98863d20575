"""The write-ahead record of items added to or removed from a catalogue (storage layer only).

A directory on the bundles volume that every replica shares::

    items.jsonl                one JSON record a line, append-only: {"op": "put"|"delete", "id", ...}
    audio/<sha256>.<format>    the stored audio of each put (content-addressed, written before its record)

What is durable when: :meth:`ItemLog.put` writes the audio to a temporary file, fsyncs it, renames it
into ``audio/`` and fsyncs the directory, then appends the record in one ``write`` under an exclusive
``flock`` and fsyncs the log; only then does it return. A record that :meth:`put`/:meth:`delete`
returned survives ``kill -9`` of the process (and, with a disk that honours fsync, power loss). A crash
in the middle of an append leaves a torn last line without its newline: readers ignore it and the
next writer cuts it off before appending.

Replicas read the same file: :meth:`ItemLog.follow` reads the records appended since its last call
(a ``stat`` when nothing changed), so every process that follows the log reaches the same
:class:`ItemState` (the latest record of an id wins; a delete of an id that is a bundle clip is a
takedown). ``flock`` serializes appends between processes of one host and on file systems that
support it across hosts (local disks, most CSI volumes; not every NFS setup).

This module is the storage; :mod:`index.overlay` makes the searchable side index of a bundle from
its state, and ``service/items.py`` wires both into the routes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from index.errors import DataError
from index.filters import MAX_FIELD_CHARS, MAX_STRING_CHARS, MAX_VALUES

LOG_NAME = "items.jsonl"
AUDIO_DIR = "audio"
MAX_ID_CHARS = 256
MAX_METADATA_FIELDS = 64
ID_PATTERN = re.compile(r"^[^\x00-\x1f\x7f]{1,256}$")
"""Item ids: 1–256 characters, no control characters (slashes are allowed: bundle clips of
`tonearm index` are named by their relative paths, and the routes take ``{id:path}``)."""
FORMAT_PATTERN = re.compile(r"^[a-z0-9]{1,8}$")
STORED_AUDIO = re.compile(r"[0-9a-f]{64}\.[a-z0-9]{1,8}")
"""Names of stored audio files: the content's sha256 and the format (never a path)."""


class ItemError(DataError):
    """An item that cannot be recorded: a bad id, metadata that is not a flat object of filterable values."""


def _encodable(text: str) -> bool:
    """Whether ``text`` is valid Unicode (JSON's ``"\ud800"`` decodes to a lone surrogate, which UTF-8 cannot hold)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_text(text: str, where: str) -> str:
    if not _encodable(text):
        raise ItemError(f"{where}: text holds a lone surrogate (not valid Unicode)")
    return text


def check_item_id(item_id: str) -> str:
    if not isinstance(item_id, str) or not ID_PATTERN.match(item_id) or not _encodable(item_id):
        raise ItemError(f"item id must be 1–{MAX_ID_CHARS} characters without control characters")
    return item_id


def check_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """A flat JSON object of strings, numbers, booleans and lists of strings (the filterable kinds)."""
    if not isinstance(metadata, Mapping):
        raise ItemError("metadata must be a JSON object")
    if len(metadata) > MAX_METADATA_FIELDS:
        raise ItemError(f"metadata has {len(metadata)} fields; the limit is {MAX_METADATA_FIELDS}")
    out: dict[str, Any] = {}
    for key, value in metadata.items():
        if not isinstance(key, str) or not 1 <= len(key) <= MAX_FIELD_CHARS or key in ("and", "or", "not"):
            raise ItemError(f"metadata field {key!r}: names are 1–{MAX_FIELD_CHARS} characters, not and/or/not")
        ok = (
            isinstance(value, bool | int | float)
            or (isinstance(value, str) and len(value) <= MAX_STRING_CHARS)
            or (isinstance(value, list) and len(value) <= MAX_VALUES
                and all(isinstance(v, str) and len(v) <= MAX_STRING_CHARS for v in value))
        )
        if ok and not all(_encodable(v) for v in (key, *(value if isinstance(value, list) else [value]))
                          if isinstance(v, str)):
            raise ItemError(f"metadata field {key!r}: text holds a lone surrogate (not valid Unicode)")
        if not ok or (isinstance(value, float) and value != value):
            raise ItemError(f"metadata field {key!r}: values are strings (≤ {MAX_STRING_CHARS} characters), "
                            f"numbers, booleans or lists of up to {MAX_VALUES} strings")
        out[key] = value
    return out


@dataclass(frozen=True)
class ItemRecord:
    op: str  # "put" | "delete"
    id: str
    at: str  # UTC ISO time the record was written
    audio: str | None = None  # file name under audio/ (put)
    metadata: dict[str, Any] = field(default_factory=dict)
    captions: dict[str, list[str]] = field(default_factory=dict)

    def to_json(self) -> str:
        body: dict[str, Any] = {"op": self.op, "id": self.id, "at": self.at}
        if self.op == "put":
            body.update(audio=self.audio, metadata=self.metadata, captions=self.captions)
        return json.dumps(body, ensure_ascii=False, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> ItemRecord:
        body = json.loads(line)
        return cls(op=body["op"], id=body["id"], at=body["at"], audio=body.get("audio"),
                   metadata=body.get("metadata") or {}, captions=body.get("captions") or {})


@dataclass
class ItemState:
    """What the records say: the items added (latest put of each id) and the ids deleted since."""

    items: dict[str, ItemRecord] = field(default_factory=dict)
    deleted: set[str] = field(default_factory=set)
    records: int = 0

    def apply(self, record: ItemRecord) -> None:
        self.records += 1
        if record.op == "put":
            self.items[record.id] = record
            self.deleted.discard(record.id)
        elif record.op == "delete":
            self.items.pop(record.id, None)
            self.deleted.add(record.id)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ItemLog:
    """One catalogue's write-ahead record (see the module docstring); thread-safe within a process."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / AUDIO_DIR).mkdir(exist_ok=True)
        self.path = self.root / LOG_NAME
        self.path.touch(exist_ok=True)
        self.state = ItemState()
        self._offset = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ writing

    def put(
        self,
        item_id: str,
        audio: bytes,
        *,
        audio_format: str,
        metadata: Mapping[str, Any] | None = None,
        captions: Mapping[str, Sequence[str]] | None = None,
    ) -> ItemRecord:
        """Store the audio, then append the record; durable when this returns (upsert by id)."""
        check_item_id(item_id)
        meta = check_metadata(metadata or {})
        if not FORMAT_PATTERN.match(audio_format):
            raise ItemError(f"audio format {audio_format!r} is not a short lowercase name (wav, flac, ...)")
        caps = {check_text(str(lang), "captions"): [check_text(str(t), f"captions[{lang!r}]") for t in texts]
                for lang, texts in (captions or {}).items()}
        name = f"{hashlib.sha256(audio).hexdigest()}.{audio_format}"
        target = self.root / AUDIO_DIR / name
        if not target.exists():
            fd, tmp = tempfile.mkstemp(dir=self.root / AUDIO_DIR, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(audio)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(tmp, target)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
            _fsync_dir(self.root / AUDIO_DIR)
        record = ItemRecord("put", item_id, _now(), name, meta, caps)
        self._append(record)
        return record

    def delete(self, item_id: str) -> ItemRecord:
        """Append a delete record (durable when this returns); the stored audio stays for other ids."""
        record = ItemRecord("delete", check_item_id(item_id), _now())
        self._append(record)
        return record

    def _append(self, record: ItemRecord) -> None:
        data = (record.to_json() + "\n").encode("utf-8")
        with self._lock, open(self.path, "r+b") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                size = handle.seek(0, os.SEEK_END)
                if size:
                    handle.seek(size - 1)
                    if handle.read(1) != b"\n":  # a torn last line from a crash: cut it off
                        tail = self._last_newline(handle, size)
                        handle.truncate(tail)
                        size = tail
                handle.seek(size)
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        self.follow()

    @staticmethod
    def _last_newline(handle: Any, size: int) -> int:
        """Offset just past the last complete line (0 when none)."""
        pos = size
        while pos > 0:
            step = min(65536, pos)
            handle.seek(pos - step)
            chunk = handle.read(step)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                return pos - step + cut + 1
            pos -= step
        return 0

    # ------------------------------------------------------------------ reading

    def follow(self) -> list[ItemRecord]:
        """Apply the complete records appended since the last call (by any process); return them."""
        with self._lock:
            if self.path.stat().st_size <= self._offset:
                return []
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
            end = data.rfind(b"\n") + 1  # a torn last line waits (or is cut by the next writer)
            # split on b"\n" only: str.splitlines() also breaks at U+2028, U+0085, \x1c… inside strings
            new = [ItemRecord.from_json(line.decode("utf-8")) for line in data[:end].split(b"\n") if line]
            self._offset += end
            for record in new:
                self.state.apply(record)
            return new

    def snapshot(self) -> ItemState:
        """A copy of the state after :meth:`follow` (safe to read while other threads append)."""
        self.follow()
        with self._lock:
            return ItemState(dict(self.state.items), set(self.state.deleted), self.state.records)

    def audio_path(self, record: ItemRecord) -> Path:
        if record.audio is None:
            raise ItemError(f"record of {record.id!r} has no audio")
        return self.root / AUDIO_DIR / record.audio

    def stored_audio(self, name: str) -> Path | None:
        """The file of a stored audio name (``<sha256>.<format>``, as records hold); None for any other name."""
        if not STORED_AUDIO.fullmatch(name):
            return None
        return self.root / AUDIO_DIR / name

    def __iter__(self) -> Iterator[ItemRecord]:
        self.follow()
        return iter(list(self.state.items.values()))


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
