"""Per-file metadata for `tonearm index AUDIO_DIR` (docs/bundle.md, "Per-file metadata").

A table beside the audio — ``AUDIO_DIR/metadata.jsonl`` or ``AUDIO_DIR/metadata.csv`` (not both),
or any file named by ``--metadata PATH`` — gives each file's metadata; it lands in the bundle's
``audio_ids.jsonl`` (``metadata``) where the service's filters and the Milvus publish read it.

* **JSONL**: one JSON object a line, ``{"file": "birds/night.ogg", "license": "cc0", "duration": 4.2,
  "tags": ["bird", "night"]}``; ``null`` is no value.
* **CSV** (a header row): a ``file`` column; an empty cell is no value; a column named ``NAME[]``
  holds lists of strings separated by ``|`` (the field is ``NAME``); a column whose every non-empty
  cell is ``true``/``false`` is booleans, one whose every non-empty cell is a number is numbers,
  any other column strings.

``file`` is the path relative to ``AUDIO_DIR`` (``/``-separated, as the clip ids are). Values are
checked as the item routes check metadata (:func:`index.items.log.check_metadata`: strings, numbers,
booleans, lists of strings; limits on names, sizes and counts); the names ``id``, ``uri``,
``captions`` and ``metadata`` are the catalogue's own and refused. A row naming a file that is not
under ``AUDIO_DIR``, or a file named twice, is an error (a typo would otherwise go unnoticed); a
file without a row has no metadata; a row of a file that is skipped (it does not decode) is unused.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from index.errors import DataError
from index.items.log import ItemError, check_metadata

NAMES = ("metadata.jsonl", "metadata.csv")
"""The file names looked for at the top of ``AUDIO_DIR`` when ``--metadata`` is not given."""
KEY = "file"
RESERVED = ("id", "uri", "captions", "metadata")
LIST_SUFFIX = "[]"
LIST_SEPARATOR = "|"


class MetadataFileError(DataError):
    """A per-file metadata table that cannot be used (its path and line are named)."""


def find_metadata_file(audio_dir: Path, explicit: Path | None = None) -> Path | None:
    """``explicit`` (which must exist), else the one of :data:`NAMES` at the top of ``audio_dir``, else None."""
    if explicit is not None:
        if not explicit.is_file():
            raise MetadataFileError(f"--metadata {explicit}: no such file")
        return explicit
    present = [audio_dir / name for name in NAMES if (audio_dir / name).is_file()]
    if len(present) > 1:
        raise MetadataFileError(f"{audio_dir}: both {' and '.join(NAMES)}; keep one, or name it with --metadata")
    return present[0] if present else None


def read_file_metadata(path: Path, files: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Relative path → checked metadata, for the rows of ``path`` (``.csv``: CSV; else JSONL);
    ``files`` are the relative paths of the files under ``AUDIO_DIR``."""
    known = set(files)
    rows = _csv_rows(path) if path.suffix.lower() == ".csv" else _jsonl_rows(path)
    out: dict[str, dict[str, Any]] = {}
    unknown: list[str] = []
    for where, row in rows:
        name = row.pop(KEY, None)
        if not isinstance(name, str) or not name.strip():
            raise MetadataFileError(f"{where}: every row needs a '{KEY}' (the path relative to the audio folder)")
        rel = PurePosixPath(name.strip()).as_posix().removeprefix("./")
        if rel in out:
            raise MetadataFileError(f"{where}: {rel!r} is named twice")
        if rel not in known:
            unknown.append(rel)
            continue
        clash = sorted(set(row) & set(RESERVED))
        if clash:
            raise MetadataFileError(f"{where}: {', '.join(clash)} are the catalogue's own fields; rename them")
        try:
            out[rel] = check_metadata({k: v for k, v in row.items() if v is not None})
        except ItemError as err:
            raise MetadataFileError(f"{where}: {err}") from None
    if unknown:
        shown = ", ".join(repr(u) for u in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise MetadataFileError(f"{path}: {len(unknown)} row(s) name files that are not in the audio folder: {shown}")
    return out


def _jsonl_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise MetadataFileError(f"{path}:{number}: not JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise MetadataFileError(f"{path}:{number}: a line is a JSON object")
            rows.append((f"{path}:{number}", row))
    return rows


def _csv_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    with path.open(encoding="utf-8-sig", newline="") as handle:
        reader = csv.DictReader(handle)
        header = reader.fieldnames or []
        if KEY not in header:
            raise MetadataFileError(f"{path}: the header needs a '{KEY}' column, has {header}")
        if len(set(header)) != len(header) or any(not h for h in header):
            raise MetadataFileError(f"{path}: column names must be unique and non-empty")
        raw = [(f"{path}:{reader.line_num}", dict(row)) for row in reader]
    for where, row in raw:
        if None in row:
            raise MetadataFileError(f"{where}: more cells than columns")
    kinds = {column: _column_kind([row.get(column) or "" for _, row in raw]) for column in header if column != KEY}
    rows = []
    for where, row in raw:
        out: dict[str, Any] = {KEY: row.get(KEY)}
        for column, kind in kinds.items():
            cell = (row.get(column) or "").strip()
            name = column.removesuffix(LIST_SUFFIX) if column.endswith(LIST_SUFFIX) else column
            if name in out:
                raise MetadataFileError(f"{path}: columns {name!r} and {column!r} name one field")
            if column.endswith(LIST_SUFFIX):
                out[name] = [part.strip() for part in cell.split(LIST_SEPARATOR) if part.strip()] if cell else None
            elif cell == "":
                out[name] = None
            elif kind == "boolean":
                out[name] = cell.strip().lower() == "true"
            elif kind == "number":
                out[name] = _number(cell)
            else:
                out[name] = cell
        rows.append((where, out))
    return rows


def _number(cell: str) -> int | float:
    text = cell.strip()
    try:
        return int(text)
    except ValueError:
        return float(text)


def _column_kind(cells: list[str]) -> str:
    present = [c.strip() for c in cells if c.strip()]
    if not present:
        return "string"
    if all(c.lower() in ("true", "false") for c in present):
        return "boolean"
    try:
        if all(math.isfinite(float(c)) for c in present):
            return "number"
    except ValueError:
        pass
    return "string"
