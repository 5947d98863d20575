"""The write-ahead record of items added to or removed from a catalogue (storage layer only).

A directory on the bundles volume that every replica shares::

    items.jsonl                one JSON record a line, append-only: {"op": "put"|"delete", "id", ...}
    items.id                   the log's id (random, written once when the log is created)
    audio/<sha256>.<format>    the stored audio of each put (content-addressed, written before its record)

Every directory and file the log creates is fsynced into its parent directory when it is created.

What is durable when: :meth:`ItemLog.put` writes the audio to a temporary file, fsyncs it, renames it
into ``audio/`` and fsyncs the directory, then appends the record in one ``write`` under an exclusive
``flock`` and fsyncs the log; only then does it return. A record that :meth:`put`/:meth:`delete`
returned survives ``kill -9`` of the process (and, with a disk that honours fsync, power loss). A crash
in the middle of an append leaves a torn last line without its newline: readers ignore it and the
next writer cuts it off before appending. A complete line that is not a record (a block of NULs a
crash left on some file systems, bytes a disk lost) is skipped by every reader alike and listed in
:attr:`ItemLog.corrupt` — never fatal — and a compaction drops it.

Replicas read the same file: :meth:`ItemLog.follow` reads the records appended since its last call
(a ``stat`` when nothing changed), so every process that follows the log reaches the same
:class:`ItemState` (the latest record of an id wins; a delete of an id that is a bundle clip is a
takedown). ``flock`` on ``items.lock`` serializes appends and compactions between processes of one
host and on file systems that support it across hosts (local disks, most CSI volumes; not every NFS
setup).

Compaction (:meth:`ItemLog.compact`) rewrites the log as one record per live item and one delete
per deleted id, and removes the stored audio no live item refers to. Under the lock it writes the
new file beside the log, fsyncs it, renames it over ``items.jsonl`` (atomic) and fsyncs the
directory — only then does it remove audio. A ``kill -9`` at any point leaves either the old log or
the new one, and both hold every acknowledged record's effect. The new file starts with a header
line ``{"op": "compacted", "generation", "base"}``: a *generation* is one file's life, and versions
(:attr:`ItemLog.version`, the number of records a state reflects) continue from ``base`` (the old
version + 1), so a version is never reused with another meaning. A reader keeps its file open, so
the inode it reads cannot be reused: mid-read it finishes the old (complete, unchanged) file, and its
next :meth:`follow` sees that the path names another file and replays the new one from its start.

This module is the storage; :mod:`index.items.overlay` makes the searchable side index of a bundle from
its state, and ``service/items.py`` wires both into the routes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import stat
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from index.engines.filters import MAX_FIELD_CHARS, MAX_STRING_CHARS, MAX_VALUES
from index.errors import DataError
from index.ids import (
    MAX_ID_CHARS as MAX_ID_CHARS,  # re-exported: the id grammar lives in index.ids
)
from index.ids import ItemIdError, check_id

LOG_NAME = "items.jsonl"
AUDIO_DIR = "audio"
ID_NAME = "items.id"
"""The log's identity: a random id written once, when the log is created (never changed by a
compaction). Cached search results carry it with the version (a version means the same only within
one log)."""
LOCK_NAME = "items.lock"
"""Taken (``flock``, exclusive) by every append and compaction: a file that is never replaced, so a
writer that waited for it opens the log that is current when it gets it."""
COMPACT_PREFIX = ".compact-"
STALE_UPLOAD_S = 3600.0
"""A ``.tmp-`` upload in ``audio/`` older than this is a crashed writer's (compaction removes it)."""
MAX_METADATA_FIELDS = 64
"""Most metadata fields a caller may send."""
RECORD_MAX_FIELDS = MAX_METADATA_FIELDS + 1
"""Most fields of a record: the caller's and the ``duration`` the service measures when not given."""
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


def check_item_id(item_id: str, *, new: bool = True) -> str:
    """The id as recorded: the grammar of :mod:`index.ids` (a new id in NFC; a delete names an
    existing id as it is, which may be a bundle clip's decomposed file name)."""
    try:
        return check_id(item_id, new=new)
    except ItemIdError as err:
        raise ItemError(f"item id: {err}") from None


def check_metadata(metadata: Mapping[str, Any], *, max_fields: int = MAX_METADATA_FIELDS) -> dict[str, Any]:
    """A flat JSON object of strings, numbers, booleans and lists of strings (the filterable kinds)."""
    if not isinstance(metadata, Mapping):
        raise ItemError("metadata must be a JSON object")
    if len(metadata) > max_fields:
        raise ItemError(f"metadata has {len(metadata)} fields; the limit is {max_fields}")
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
    """Records applied from the current log file (a compacted file counts its own records only)."""
    delete_records: dict[str, ItemRecord] = field(default_factory=dict, compare=False, repr=False)
    """The latest delete record of each id in ``deleted`` (what a compaction keeps)."""

    def apply(self, record: ItemRecord) -> None:
        self.records += 1
        if record.op == "put":
            self.items[record.id] = record
            self.deleted.discard(record.id)
            self.delete_records.pop(record.id, None)
        elif record.op == "delete":
            self.items.pop(record.id, None)
            self.deleted.add(record.id)
            self.delete_records[record.id] = record

    @property
    def garbage(self) -> int:
        """Records a compaction would drop: puts replaced or deleted since, deletes repeated."""
        return self.records - len(self.items) - len(self.deleted)


@dataclass(frozen=True)
class LogHistory:
    """The records of one log file (a generation) in order, as of one :meth:`ItemLog.history` call:
    ``records[:length]`` of a list that only grows (taking one is O(1), whatever the log's size).
    Record ``i`` brings the log to version ``base + i + 1``."""

    generation: str
    base: int
    records: Sequence[ItemRecord]
    length: int

    @property
    def version(self) -> int:
        return self.base + self.length

    def since(self, version: int) -> list[ItemRecord] | None:
        """The records after ``version`` (None: ``version`` is not of this generation)."""
        if not self.base <= version <= self.version:
            return None
        return list(self.records[version - self.base : self.length])

    def all(self) -> list[ItemRecord]:
        return list(self.records[: self.length])


@dataclass(frozen=True)
class Compaction:
    """What :meth:`ItemLog.compact` did (``compacted`` False: nothing to drop, the log is unchanged)."""

    compacted: bool
    records_before: int
    records_after: int
    bytes_before: int
    bytes_after: int
    audio_removed: int
    audio_bytes_removed: int
    version: int


@dataclass(frozen=True)
class CorruptLine:
    """A complete line of the log (it ends in a newline) that is not a record: skipped by every reader."""

    offset: int
    length: int
    reason: str


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents, fsyncing each parent that gained an entry (a created
    directory survives power loss only once its parent's entry is on disk)."""
    missing = []
    here = path
    while not here.exists():
        missing.append(here)
        here = here.parent
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:  # another replica made it: it fsyncs the parent
            continue
        _fsync_dir(directory.parent)


def _ensure_file(path: Path) -> None:
    """Create an empty file (fsyncing its directory), or open an existing one for writing (the check
    ``touch`` made before: a read-only volume or a file this user cannot write fails here)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        path.touch(exist_ok=True)
        return
    os.close(fd)
    _fsync_dir(path.parent)


def _log_id(root: Path) -> str:
    """The log's id (:data:`ID_NAME`), created on first use: written to a temporary file, fsynced,
    then hard-linked into place (the first replica's link wins; the others read it)."""
    path = root / ID_NAME
    with contextlib.suppress(FileNotFoundError):
        text = path.read_text().strip()
        if text:
            return text
    new_id = uuid.uuid4().hex + "\n"
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".id-")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(new_id)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: an exclusive create (readers below wait for it)
            with contextlib.suppress(FileExistsError), open(path, "x") as handle:
                handle.write(new_id)
                handle.flush()
                os.fsync(handle.fileno())
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    _fsync_dir(root)
    for _ in range(50):
        text = path.read_text().strip()
        if text:
            return text
        time.sleep(0.01)
    raise ItemError(f"{path}: the item log's id file is empty")


class ItemLog:
    """One catalogue's write-ahead record (see the module docstring); thread-safe within a process."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        _make_dirs(self.root / AUDIO_DIR)
        self.path = self.root / LOG_NAME
        _ensure_file(self.path)
        self.lock_path = self.root / LOCK_NAME
        _ensure_file(self.lock_path)
        self.log_id = _log_id(self.root)
        """The log's identity (:data:`ID_NAME`): with :attr:`version`, what a state means everywhere."""
        self.state = ItemState()
        self.corrupt: list[CorruptLine] = []
        """Lines of the current file that are not records (skipped; a compaction drops them)."""
        self.generation = ""
        """The current file's id (its header's; "" for a file that was never compacted)."""
        self.base = 0
        self._records: list[ItemRecord] = []
        self._offset = 0
        self._fd: int | None = None
        self._ident: tuple[int, int] | None = None
        self._closer: weakref.finalize | None = None
        self._lock = threading.Lock()  # the reading side: state, offset, open file
        self._write_lock = threading.Lock()  # appends and compactions of this process (then flock)

    @property
    def version(self) -> int:
        """Records the state reflects, counted across compactions (a cache key of the overlays)."""
        return self.base + len(self._records)

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """This process's write lock, then the lock file's ``flock`` (other processes)."""
        with self._write_lock, open(self.lock_path, "rb") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _store_audio(self, name: str, audio: bytes) -> None:
        target = self.root / AUDIO_DIR / name
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
        item_id = check_item_id(item_id)
        meta = check_metadata(metadata or {}, max_fields=RECORD_MAX_FIELDS)
        if not FORMAT_PATTERN.match(audio_format):
            raise ItemError(f"audio format {audio_format!r} is not a short lowercase name (wav, flac, ...)")
        caps = {check_text(str(lang), "captions"): [check_text(str(t), f"captions[{lang!r}]") for t in texts]
                for lang, texts in (captions or {}).items()}
        name = f"{hashlib.sha256(audio).hexdigest()}.{audio_format}"
        if not (self.root / AUDIO_DIR / name).exists():
            self._store_audio(name, audio)  # outside the lock: writers of several replicas upload at once
        record = ItemRecord("put", item_id, _now(), name, meta, caps)
        self._append(record, audio)
        return record

    def delete(self, item_id: str) -> ItemRecord:
        """Append a delete record (durable when this returns); the stored audio stays until a
        compaction finds no live item that refers to it."""
        record = ItemRecord("delete", check_item_id(item_id, new=False), _now())
        self._append(record)
        return record

    def _append(self, record: ItemRecord, audio: bytes | None = None) -> None:
        data = (record.to_json() + "\n").encode("utf-8")
        with self._exclusive():
            if record.audio is not None and audio is not None and not (self.root / AUDIO_DIR / record.audio).exists():
                self._store_audio(record.audio, audio)  # a compaction removed it since (another id's, deleted)
            self._append_locked(data)
        self.follow()

    def _append_locked(self, data: bytes) -> None:
        # opened under the lock: the current file, never one a compaction has replaced
        with open(self.path, "r+b") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)  # what writers before items.lock took
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
        """Apply the complete records appended since the last call (by any process); return them.
        After a compaction (the path names another file) the state is replayed from the new file,
        and what it returns is all of that file's records."""
        with self._lock:
            ident = _ident(os.stat(self.path))
            if ident != self._ident:
                self._open_current()
            assert self._fd is not None
            size = os.fstat(self._fd).st_size
            if size <= self._offset:
                return []
            data = os.pread(self._fd, size - self._offset, self._offset)
            end = data.rfind(b"\n") + 1  # a torn last line waits (or is cut by the next writer)
            new = self._parse(data[:end], self._offset)
            self._offset += end
            for record in new:
                self.state.apply(record)
            self._records.extend(new)
            return new

    def _parse(self, data: bytes, offset: int) -> list[ItemRecord]:
        """The records of complete lines read at ``offset``; a line that is not a record (a crash's
        block of NULs, bytes a disk lost) is skipped and listed in :attr:`corrupt`, the same way by
        every reader, so every replica reaches the same state and version."""
        records = []
        # split on b"\n" only: str.splitlines() also breaks at U+2028, U+0085, \x1c… inside strings
        for raw in data.split(b"\n")[:-1] if data else ():
            at, offset = offset, offset + len(raw) + 1
            line = raw.strip(b"\x00")  # a NUL run before a record: the tail of a torn write
            if not line:
                if raw:
                    self.corrupt.append(CorruptLine(at, len(raw), f"{len(raw)} NUL bytes"))
                continue
            try:
                body = json.loads(line.decode("utf-8"))
                if at == 0 and isinstance(body, dict) and body.get("op") == "compacted":
                    self.generation, self.base = str(body["generation"]), int(body["base"])
                    continue
                records.append(_record_of(body))
            except (ValueError, KeyError, TypeError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                self.corrupt.append(CorruptLine(at, len(raw), f"not a record: {type(err).__name__}: {err}"[:200]))
        return records

    def _open_current(self) -> None:
        """(Re)open the file the path names now and start its state from nothing."""
        fd = os.open(self.path, os.O_RDONLY)
        if self._closer is not None:
            self._closer()  # closes the previous file
        self._fd, self._ident = fd, _ident(os.fstat(fd))
        self._closer = weakref.finalize(self, os.close, fd)
        self.state, self._records, self._offset = ItemState(), [], 0
        self.generation, self.base = "", 0
        self.corrupt = []

    def close(self) -> None:
        with self._lock:
            if self._closer is not None:
                self._closer()
            self._fd, self._ident, self._closer = None, None, None

    def history(self) -> LogHistory:
        """The current file's records after :meth:`follow` (O(1): a view of a list that only grows)."""
        self.follow()
        with self._lock:
            return LogHistory(self.generation, self.base, self._records, len(self._records))

    def snapshot(self) -> ItemState:
        """A copy of the state after :meth:`follow` (safe to read while other threads append)."""
        self.follow()
        with self._lock:
            return ItemState(dict(self.state.items), set(self.state.deleted), self.state.records,
                             dict(self.state.delete_records))

    # ------------------------------------------------------------------ compaction

    def compact(self, *, min_garbage: int = 1) -> Compaction:
        """Rewrite the log as its live items and deletes and remove audio no live item refers to, when
        at least ``min_garbage`` records would be dropped (module docstring: order and durability)."""
        with self._exclusive():
            self.follow()  # under the lock: every record any process acknowledged is read
            with self._lock:
                state = self.state
                version = self.version
                before = os.fstat(self._fd).st_size if self._fd is not None else 0
                records_before = len(self._records)
                if state.garbage < max(min_garbage, 1):
                    return Compaction(False, records_before, records_before, before, before, 0, 0, version)
                kept = [state.delete_records[i] for i in sorted(state.deleted)] + list(state.items.values())
                referenced = {r.audio for r in state.items.values()}
            for stale in self.root.glob(COMPACT_PREFIX + "*"):  # a compaction killed before its rename
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
            header = {"base": version + 1, "generation": uuid.uuid4().hex, "op": "compacted", "at": _now(),
                      "records_before": records_before}
            body = "".join([json.dumps(header, separators=(",", ":")) + "\n", *(r.to_json() + "\n" for r in kept)])
            data = body.encode("utf-8")
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=COMPACT_PREFIX)
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.chmod(tmp, stat.S_IMODE(os.stat(self.path).st_mode))  # mkstemp's 0600: other replicas read it
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
            _fsync_dir(self.root)  # the new log is the durable one before any audio goes
            removed, removed_bytes = self._remove_unreferenced_audio(referenced)
        self.follow()
        return Compaction(True, records_before, len(kept), before, len(data), removed, removed_bytes,
                          version + 1 + len(kept))

    def _remove_unreferenced_audio(self, referenced: set[str | None]) -> tuple[int, int]:
        """Under the lock: writers store an upload before they take it, and check it is still
        there once they hold it (:meth:`_append`), so no acknowledged record loses its audio."""
        removed = removed_bytes = 0
        now = time.time()
        with os.scandir(self.root / AUDIO_DIR) as entries:
            for entry in entries:
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # a writer's upload renamed into place meanwhile (outside the lock)
                    continue
                unreferenced = STORED_AUDIO.fullmatch(entry.name) is not None and entry.name not in referenced
                stale_upload = entry.name.startswith(".tmp-") and now - info.st_mtime > STALE_UPLOAD_S
                if unreferenced or stale_upload:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                        removed += int(unreferenced)
                        removed_bytes += info.st_size if unreferenced else 0
        _fsync_dir(self.root / AUDIO_DIR)
        return removed, removed_bytes

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


def cli_compact(args: Any) -> int:
    """`tonearm items compact`: compacts the log of ``--items-dir`` (or ``--bundles-dir``/.items) and says what went."""
    from rich.console import Console

    items_dir = Path(args.items_dir) if args.items_dir else Path(args.bundles_dir) / ".items"
    if not (items_dir / LOG_NAME).is_file():
        raise ItemError(f"{items_dir}: no item log ({LOG_NAME}) here")
    done = ItemLog(items_dir).compact()
    console = Console()
    if not done.compacted:
        console.print(f"nothing to drop: {done.records_before} records, each one a live item or a delete", highlight=False)
        return 0
    console.print(f"{items_dir / LOG_NAME}: {done.records_before} records → {done.records_after} "
                  f"({done.bytes_before:,} → {done.bytes_after:,} bytes); {done.audio_removed} stored audio files "
                  f"removed ({done.audio_bytes_removed:,} bytes); replicas replay the new file at their next poll",
                  highlight=False, soft_wrap=True)
    return 0


def _record_of(body: Any) -> ItemRecord:
    """A parsed line as a record; KeyError/TypeError/ValueError when it is not one."""
    if not isinstance(body, dict):
        raise TypeError(f"a JSON {type(body).__name__}, not an object")
    record = ItemRecord(op=body["op"], id=body["id"], at=body["at"], audio=body.get("audio"),
                        metadata=body.get("metadata") or {}, captions=body.get("captions") or {})
    if not isinstance(record.id, str) or not isinstance(record.op, str):
        raise TypeError("op and id must be strings")
    if record.op == "put" and not (isinstance(record.audio, str) and STORED_AUDIO.fullmatch(record.audio)):
        raise ValueError("a put without a stored audio name")
    if not isinstance(record.metadata, dict) or not isinstance(record.captions, dict):
        raise TypeError("metadata and captions must be objects")
    return record


def _ident(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_dev, stat.st_ino


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
