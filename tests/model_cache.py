"""A per-machine cache of the test suite's expensive, deterministic build products (issue 56).

The real-size test models (tests/real_size_models.py: random weights at full default size) and
their exports are the same bytes on every run of the same code, yet cost minutes to make. Each
is built once per machine here and reused by later pytest runs while its inputs are unchanged.

Where: ``$TONEARM_TEST_CACHE``, default ``~/.cache/tonearm/test-models``. ``TONEARM_TEST_CACHE=off``
builds everything once per session under pytest's base temp dir instead (no reuse between runs).
Put the cache on the filesystem of pytest's temp dir: a test's view of an entry hard-links the
large files (a copy across filesystems costs seconds per GB).

Layout: ``ROOT/NAME-KEY/`` (the entry) and ``ROOT/NAME-KEY.done`` (a JSON marker written last:
the key's inputs and every file's size and mtime). ``KEY`` is a sha256 over everything that decides
the bytes (:func:`key_of`: the builder's source, seeds, library versions, input data, the keys of
entries it is built from), so a change to any of them builds a new entry; the entry of the same
NAME with another key is deleted then (one entry per NAME: the cache cannot grow without bound, at
the cost of rebuilding when two checkouts with different code take turns).

Safety:

* built once: a ``flock`` per NAME (``ROOT/NAME.lock``) serialises concurrent pytest processes; the
  loser of the race finds the winner's done marker;
* atomic: built into ``ROOT/.NAME-KEY.*.tmp`` and renamed into place, the done marker after it; a
  build that raises (or a killed one) leaves no marker, and its leftovers are removed by the next build;
* not corruptible by tests: entries are read-only (files 0444, directories 0555), tests get a *view*
  (:func:`materialize`: small files copied, large ones hard-linked), and the sizes and mtimes recorded
  in the marker are checked when an entry is handed out (a changed entry is rebuilt) and again at
  the end of the session (:func:`changed_entries`: the run fails, naming it). Root ignores the
  permission bits; the check does not.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import inspect
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

CACHE_ENV = "TONEARM_TEST_CACHE"
DEFAULT_ROOT = Path("~/.cache/tonearm/test-models")
LINK_MIN_BYTES = 4 << 20
"""Files from this size up are hard-linked into a view (weights, ONNX graphs); smaller ones (configs,
tokenizers, vocabularies, indices) are copied, so a test may rewrite them in its view freely."""
KEY_CHARS = 16
"""Hex digits of the sha256 in an entry's name (64 bits: no accidental collision in one cache)."""

_NAME = re.compile(r"[a-z0-9_]+")


def cache_root(session_fallback: Path) -> Path:
    """``$TONEARM_TEST_CACHE`` (default ``~/.cache/tonearm/test-models``); ``off``: ``session_fallback``
    (a directory of this session only, e.g. under pytest's base temp dir)."""
    given = os.environ.get(CACHE_ENV, "").strip()
    if given.lower() in ("off", "0", "no", "false"):
        return session_fallback
    return Path(given or DEFAULT_ROOT).expanduser()


# ------------------------------------------------------------------------------------------- keys


def _canonical(part: Any) -> Any:
    """A JSON-able, deterministic form of a key input: functions and classes by their source (a
    change to the code that builds is a change to the key), mappings with sorted keys, paths as text."""
    if inspect.isfunction(part) or inspect.isclass(part) or inspect.ismethod(part):
        return {"source": inspect.getsource(part)}
    if isinstance(part, dict):
        return {str(k): _canonical(v) for k, v in sorted(part.items(), key=lambda kv: str(kv[0]))}
    if isinstance(part, list | tuple):
        return [_canonical(v) for v in part]
    if isinstance(part, Path):
        return str(part)
    if part is None or isinstance(part, str | int | float | bool):
        return part
    raise TypeError(f"not a key input: {part!r} ({type(part).__name__})")


def key_of(**inputs: Any) -> str:
    """The sha256 (first :data:`KEY_CHARS` hex digits) of ``inputs`` in canonical JSON."""
    text = json.dumps(_canonical(inputs), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:KEY_CHARS]


def versions(*distributions: str) -> dict[str, str]:
    """The installed versions of ``distributions`` (``absent`` for one not installed) and Python's."""
    found = {"python": ".".join(map(str, sys.version_info[:3]))}
    for name in distributions:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tree_digest(root: Path, patterns: Iterable[str]) -> str:
    """sha256 over the relative paths and bytes of the files under ``root`` matching ``patterns``
    (globs relative to ``root``, e.g. ``training/**/*.py``)."""
    files = sorted({p for pattern in patterns for p in root.glob(pattern) if p.is_file() and "__pycache__" not in p.parts})
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + file_digest(path).encode() + b"\n")
    return digest.hexdigest()


def manifest_digest(manifest: Path) -> str:
    """sha256 of a JSONL manifest's records with each ``audio`` path replaced by its file's sha256:
    the same clips and captions give the same digest wherever this session's temp dir put them."""
    records = []
    for line in manifest.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        audio = Path(record["audio"])
        record["audio"] = file_digest(audio if audio.is_absolute() else manifest.parent / audio)
        records.append(record)
    return hashlib.sha256(json.dumps(records, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


# ---------------------------------------------------------------------------------------- entries


def _listing(directory: Path) -> dict[str, list[int]]:
    """Every file under ``directory`` → [size, mtime_ns] (what a write into it would change)."""
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not path.is_symlink():
            info = path.stat()
            out[path.relative_to(directory).as_posix()] = [info.st_size, info.st_mtime_ns]
    return out


def _set_writable(root: Path, writable: bool) -> None:
    """Files 0444 / 0644, directories 0555 / 0755 (for a user other than root, read-only is enforced)."""
    for path in [*root.rglob("*"), root]:
        if path.is_symlink():
            continue
        mode = (0o755 if writable else 0o555) if path.is_dir() else (0o644 if writable else 0o444)
        path.chmod(mode)


def remove_tree(path: Path) -> None:
    """``rm -rf`` that also works on a read-only entry (its directories must be writable to empty them)."""
    if path.is_dir() and not path.is_symlink():
        with contextlib.suppress(OSError):
            _set_writable(path, True)
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


_handed_out: dict[Path, dict[str, list[int]]] = {}
"""Entries this process handed out → their recorded listing (checked again by :func:`changed_entries`)."""


def _valid(entry: Path, done: Path) -> dict[str, list[int]] | None:
    """The done marker's listing when ``entry`` is complete and unchanged since it was built, else None."""
    try:
        recorded = json.loads(done.read_text())["files"]
    except (OSError, ValueError, KeyError):
        return None
    return recorded if entry.is_dir() and _listing(entry) == recorded else None


def cached(name: str, key: str, build: Callable[[Path], None], *, root: Path,
           inputs: dict[str, Any] | None = None, view: Path | None = None) -> Path:
    """The entry ``root/NAME-KEY``: built by ``build(directory)`` unless a complete, unchanged one is
    there. Built at most once across processes (a lock per NAME), atomically (a temp dir renamed into
    place, then the done marker), read-only; other entries of NAME are deleted after a build.
    ``inputs``: what the key was made of, recorded in the marker for whoever wonders why it rebuilt.
    ``view``: returns :func:`materialize` (entry, view) instead, made under the lock (so that no other
    process prunes the entry while its files are being linked)."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"cache entry name {name!r}: lowercase letters, digits and _ only ('-' ends the name)")
    entry, done = root / f"{name}-{key}", root / f"{name}-{key}.done"
    with _locked(root / f"{name}.lock"):
        recorded = _valid(entry, done)
        if recorded is None:
            recorded = _build(name, key, build, entry, done, inputs or {})
            _prune(root, name, keep=key)
        _handed_out[entry] = recorded
        return entry if view is None else materialize(entry, view)


def _build(name: str, key: str, build: Callable[[Path], None], entry: Path, done: Path,
           inputs: dict[str, Any]) -> dict[str, list[int]]:
    # Under the NAME lock: nobody else is building NAME, so whatever is here of this key (a changed
    # entry, a marker without its folder, a killed build's temp dir) is garbage.
    done.unlink(missing_ok=True)
    remove_tree(entry)
    for leftover in entry.parent.glob(f".{name}-*.tmp"):
        remove_tree(leftover)
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}-{key}.", suffix=".tmp", dir=entry.parent))
    started = time.monotonic()
    try:
        build(scratch)
        os.rename(scratch, entry)
    except BaseException:
        remove_tree(scratch)
        raise
    _set_writable(entry, False)
    listing = _listing(entry)
    marker = {"name": name, "key": key, "inputs": _canonical(inputs), "built_s": round(time.monotonic() - started, 1),
              "files": listing}
    partial = done.with_suffix(".done.tmp")
    partial.write_text(json.dumps(marker, indent=1, ensure_ascii=False))
    os.replace(partial, done)  # the entry counts as built from here on
    return listing


def _prune(root: Path, name: str, *, keep: str) -> None:
    """Delete NAME's entries of other keys (with the NAME lock held). A view made from one earlier
    keeps its files: hard links outlive the entry."""
    for path in root.glob(f"{name}-*"):
        stem = path.name.removesuffix(".done")
        if stem.rsplit("-", 1)[0] == name and stem != f"{name}-{keep}":
            remove_tree(path)


def materialize(entry: Path, view: Path) -> Path:
    """``view``: a copy of ``entry`` for one session to use as its own — files under
    :data:`LINK_MIN_BYTES` copied (writable), larger ones hard-linked (read-only: the same inode as
    the entry's, so an in-place write would reach the cache, which :func:`changed_entries` reports).
    Across filesystems (no hard links) the large files are copied too."""
    if view.exists():
        remove_tree(view)
    view.mkdir(parents=True)
    for path in sorted(entry.rglob("*")):
        target = view / path.relative_to(entry)
        if path.is_dir():
            target.mkdir()
        elif path.stat().st_size < LINK_MIN_BYTES:
            shutil.copyfile(path, target)
        else:
            try:
                os.link(path, target)
            except OSError:
                shutil.copyfile(path, target)
                target.chmod(0o444)
    return view


def changed_entries() -> list[Path]:
    """Entries handed out in this process whose files changed since (a test wrote into its view's
    hard-linked file, or into the cache directly). Their done markers are deleted: the next run rebuilds."""
    changed = []
    for entry, recorded in _handed_out.items():
        # gone: pruned by a process of other code (another key); views made earlier keep their files
        if entry.exists() and _listing(entry) != recorded:
            changed.append(entry)
            entry.with_name(entry.name + ".done").unlink(missing_ok=True)
    return changed


def is_read_only(path: Path) -> bool:
    return not path.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
