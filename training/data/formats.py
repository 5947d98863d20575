"""Converters from the public caption datasets to :class:`ClipRecord` lists (SPEC §2).

Supported inputs and the facts about them that bite:

* **Clotho v2** CSV ``file_name, caption_1..caption_5``. Clotho's CSVs are
  ISO-8859-1, not UTF-8: every CSV here is read as UTF-8 when it is valid UTF-8
  and as ISO-8859-1 otherwise (a Latin-1 file with accents is never valid UTF-8,
  so the two cannot be confused; the fallback is logged).
* **AudioCaps** CSV, both layouts: the original ``audiocap_id, youtube_id,
  start_time, caption`` (one row per caption, several rows per clip; the audio
  file name depends on the user's download, hence ``audio_pattern``), and the
  converted ``file_name, caption`` (train, rows grouped by file) /
  ``file_name, caption_1..caption_5`` (val/test).
* **WavCaps** JSON ``{"data": [{"id", "caption", "duration", ...}]}``; the extra
  source-specific fields are kept in ``meta``. AudioSet ids end in ``.wav`` while
  the archive holds ``.flac`` files, so audio is resolved by trying extensions;
  some sources list clips missing from their archives (reported as missing audio).
* **Translations**: extra columns / keys named like the English one plus a
  language suffix (``caption_1_fra``, ``caption_fra``), or side files per language
  in the same layout as the main file (``lang_files={"fra": path}``), matched by
  clip. Position ``i`` of a translation is the translation of English caption ``i``.

Every converter returns ``list[ClipRecord]`` with absolute audio paths; missing
audio is an error unless ``skip_missing_audio`` (then a warning and the clips
are dropped). ``tonearm data convert`` (:mod:`training.data.cli`) writes the generic JSONL manifest;
the moment datasets' converters sit on top of this module in :mod:`training.data.moment_formats`.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from index.errors import DataError
from index.languages import ENGLISH, validate_language_codes
from training.data.manifest import ClipRecord, drop_missing_audio

log = logging.getLogger(__name__)

AUDIO_EXTENSIONS = (".flac", ".wav", ".mp3", ".ogg")
"""Tried in this order when a listed file name does not exist as is."""
DEFAULT_AUDIOCAPS_PATTERN = "{youtube_id}_{start_time}.wav"
_CAPTION_COLUMN = re.compile(r"^caption(?:_(\d+))?(?:_([a-z]{3}))?$")

Captions = dict[str, list[str]]


# --------------------------------------------------------------------------- reading


def read_text(path: Path) -> str:
    """File content as text: UTF-8 (BOM allowed) when valid, else ISO-8859-1 (Clotho)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        log.info("%s is not UTF-8; reading it as ISO-8859-1 (Clotho's encoding)", path)
        return raw.decode("iso-8859-1")


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """Header (stripped) and rows of a CSV file."""
    reader = csv.reader(io.StringIO(read_text(path), newline=""))
    try:
        header = [name.strip() for name in next(reader)]
    except StopIteration:
        raise DataError(f"{path}: empty CSV file") from None
    rows = []
    for number, values in enumerate(reader, start=2):
        if not any(v.strip() for v in values):
            continue
        if len(values) != len(header):
            raise DataError(f"{path}:{number}: {len(values)} fields, the header has {len(header)}")
        rows.append(dict(zip(header, values, strict=True)))
    return header, rows


def caption_columns(header: Sequence[str], *, default_lang: str) -> dict[str, list[str]]:
    """Caption column names per language, ordered by caption number.

    ``caption``/``caption_3`` belong to ``default_lang``; ``caption_fra``/
    ``caption_3_fra`` to the suffix language.
    """
    found: dict[str, list[tuple[int, str]]] = {}
    for name in header:
        match = _CAPTION_COLUMN.match(name)
        if match:
            number, lang = match.groups()
            found.setdefault(lang or default_lang, []).append((int(number or 0), name))
    return {lang: [name for _, name in sorted(cols)] for lang, cols in found.items()}


def _require(header: Sequence[str], columns: Sequence[str], path: Path) -> None:
    missing = [c for c in columns if c not in header]
    if missing:
        raise DataError(f"{path}: missing column(s) {', '.join(missing)}; found: {', '.join(header)}")


def group_rows(
    rows: Sequence[Mapping[str, str]], *, key: Callable[[Mapping[str, str]], str], columns: Mapping[str, list[str]]
) -> dict[str, Captions]:
    """Captions per clip key (first-appearance order), rows of one clip appended in file order."""
    grouped: dict[str, Captions] = {}
    for row in rows:
        captions = grouped.setdefault(key(row), {})
        for lang, names in columns.items():
            texts = [row[name].strip() for name in names if row[name].strip()]
            if texts:
                captions.setdefault(lang, []).extend(texts)
    return grouped


def merge_side_files(
    main: dict[str, Captions], sides: Mapping[str, dict[str, Captions]], *, lang_files: Mapping[str, Path]
) -> None:
    """Add each side file's captions (its default-language captions) under its language."""
    for lang, side in sides.items():
        unmatched = [k for k in side if k not in main]
        if unmatched:
            log.warning("%s: %d clips not in the main file are ignored, e.g. %s",
                        lang_files[lang], len(unmatched), ", ".join(unmatched[:5]))
        for clip_key, captions in main.items():
            texts = side.get(clip_key, {}).get(lang)
            if not texts:
                continue
            if lang in captions:
                raise DataError(f"{lang_files[lang]}: {lang} captions for {clip_key!r} also come from a column")
            captions[lang] = texts


def check_lang_files(lang_files: Mapping[str, Path] | None) -> dict[str, Path]:
    checked = {}
    for lang, path in (lang_files or {}).items():
        try:
            validate_language_codes([lang])
        except ValueError as err:
            raise DataError(f"--lang-file {lang}={path}: {err}") from None
        checked[lang] = Path(path)
    return checked


# --------------------------------------------------------------------------- audio files


class AudioResolver:
    """Finds a listed file in ``audio_dir``, trying other audio extensions (WavCaps .wav → .flac)."""

    def __init__(self, audio_dir: Path) -> None:
        self.audio_dir = Path(audio_dir).resolve()
        if not self.audio_dir.is_dir():
            raise DataError(f"{audio_dir}: audio directory not found")
        self._names = {entry.name for entry in os.scandir(self.audio_dir) if entry.is_file()}

    def _exists(self, name: str) -> bool:
        return name in self._names if "/" not in name else (self.audio_dir / name).is_file()

    def resolve(self, name: str) -> Path:
        """Existing path for ``name`` (as is, then stem + each extension), else the path as listed."""
        if self._exists(name):
            return self.audio_dir / name
        stem = name[: -len(Path(name).suffix)] if Path(name).suffix.lower() in AUDIO_EXTENSIONS else name
        for ext in AUDIO_EXTENSIONS:
            if self._exists(stem + ext):
                return self.audio_dir / (stem + ext)
        return self.audio_dir / name


def _records(
    grouped: Mapping[str, Captions],
    *,
    audio: Mapping[str, Path],
    split: str,
    meta: Mapping[str, dict[str, Any]] | None = None,
    source: Path,
    skip_missing_audio: bool,
) -> list[ClipRecord]:
    records = []
    for clip_id, captions in grouped.items():
        if not captions:
            log.warning("%s: clip %r has no caption; skipped", source, clip_id)
            continue
        records.append(ClipRecord(
            id=clip_id, audio=audio[clip_id], captions=captions, split=split,
            meta=dict((meta or {}).get(clip_id, {})),
        ))
    if not records:
        raise DataError(f"{source}: no captioned clips found")
    return drop_missing_audio(records, source=str(source), skip_missing_audio=skip_missing_audio)


# --------------------------------------------------------------------------- Clotho


def _read_keyed_csv(path: Path, *, key_column: str, lang: str) -> dict[str, Captions]:
    header, rows = read_csv(path)
    _require(header, [key_column], path)
    columns = caption_columns(header, default_lang=lang)
    if lang not in columns:
        raise DataError(f"{path}: no caption column (caption or caption_1..caption_N); found: {', '.join(header)}")
    return group_rows(rows, key=lambda row: row[key_column].strip(), columns=columns)


def convert_clotho(
    csv_path: Path,
    *,
    audio_dir: Path,
    split: str,
    lang_files: Mapping[str, Path] | None = None,
    skip_missing_audio: bool = False,
) -> list[ClipRecord]:
    """Clotho v2 captions CSV (``file_name, caption_1..caption_5``); the id is the file name."""
    csv_path = Path(csv_path)
    lang_files = check_lang_files(lang_files)
    grouped = _read_keyed_csv(csv_path, key_column="file_name", lang=ENGLISH)
    sides = {lang: _read_keyed_csv(p, key_column="file_name", lang=lang) for lang, p in lang_files.items()}
    merge_side_files(grouped, sides, lang_files=lang_files)
    resolver = AudioResolver(audio_dir)
    audio = {name: resolver.resolve(name) for name in grouped}
    return _records(grouped, audio=audio, split=split, source=csv_path, skip_missing_audio=skip_missing_audio)


# --------------------------------------------------------------------------- AudioCaps


def _start_time(value: str) -> str:
    """``"30.0"`` → ``"30"``; other values unchanged (file names use the integer form)."""
    try:
        number = float(value)
    except ValueError:
        return value.strip()
    return str(int(number)) if number.is_integer() else str(number)


def _audiocaps_original(path: Path, *, lang: str) -> tuple[dict[str, Captions], dict[str, dict[str, str]]]:
    """Captions per clip ``{youtube_id}_{start_time}`` and the fields for the audio file pattern."""
    header, rows = read_csv(path)
    _require(header, ["audiocap_id", "youtube_id", "start_time"], path)
    columns = caption_columns(header, default_lang=lang)
    if lang not in columns:
        raise DataError(f"{path}: no 'caption' column; found: {', '.join(header)}")

    def key(row: Mapping[str, str]) -> str:
        return f"{row['youtube_id'].strip()}_{_start_time(row['start_time'])}"

    fields: dict[str, dict[str, str]] = {}
    for row in rows:
        fields.setdefault(key(row), {
            "youtube_id": row["youtube_id"].strip(),
            "start_time": _start_time(row["start_time"]),
            "audiocap_id": row["audiocap_id"].strip(),
        })
    return group_rows(rows, key=key, columns=columns), fields


def _audio_name(pattern: str, fields: Mapping[str, str]) -> str:
    try:
        return pattern.format(**fields)
    except (KeyError, IndexError, ValueError) as err:
        raise DataError(
            f"--audio-pattern {pattern!r}: {err!r}; available fields: {', '.join('{' + k + '}' for k in fields)}"
        ) from None


def convert_audiocaps(
    csv_path: Path,
    *,
    audio_dir: Path,
    split: str,
    lang_files: Mapping[str, Path] | None = None,
    audio_pattern: str = DEFAULT_AUDIOCAPS_PATTERN,
    skip_missing_audio: bool = False,
) -> list[ClipRecord]:
    """AudioCaps CSV in the original or the converted layout (detected from the header).

    Original layout: the clip id is ``{youtube_id}_{start_time}`` and the audio
    file name comes from ``audio_pattern`` (fields ``youtube_id``, ``start_time``,
    ``audiocap_id`` of the clip's first row). Converted layout: the id is
    ``file_name``. Side files use the same layout as the main file.
    """
    csv_path = Path(csv_path)
    lang_files = check_lang_files(lang_files)
    header, _ = read_csv(csv_path)
    resolver = AudioResolver(audio_dir)
    if "youtube_id" in header:
        grouped, fields = _audiocaps_original(csv_path, lang=ENGLISH)
        sides = {lang: _audiocaps_original(p, lang=lang)[0] for lang, p in lang_files.items()}
        audio = {k: resolver.resolve(_audio_name(audio_pattern, fields[k])) for k in grouped}
        meta = {k: {"youtube_id": f["youtube_id"], "start_time": f["start_time"]} for k, f in fields.items()}
    else:
        grouped = _read_keyed_csv(csv_path, key_column="file_name", lang=ENGLISH)
        sides = {lang: _read_keyed_csv(p, key_column="file_name", lang=lang) for lang, p in lang_files.items()}
        audio = {name: resolver.resolve(name) for name in grouped}
        meta = {}
    merge_side_files(grouped, sides, lang_files=lang_files)
    return _records(grouped, audio=audio, split=split, meta=meta, source=csv_path,
                    skip_missing_audio=skip_missing_audio)


# --------------------------------------------------------------------------- WavCaps


def _wavcaps_entries(path: Path) -> list[dict[str, Any]]:
    try:
        doc = json.loads(read_text(path))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: invalid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise DataError(f'{path}: expected a WavCaps JSON object {{"data": [...]}}')
    entries = doc["data"]
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str | int):
            raise DataError(f"{path}: data[{i}] has no 'id'")
    return entries


def _wavcaps_captions(path: Path, *, lang: str) -> tuple[dict[str, Captions], dict[str, dict[str, Any]]]:
    """Captions per id (``caption`` → ``lang``, ``caption_fra`` → fra) and the remaining fields."""
    grouped: dict[str, Captions] = {}
    meta: dict[str, dict[str, Any]] = {}
    for i, entry in enumerate(_wavcaps_entries(path)):
        clip_id = str(entry["id"])
        if clip_id in grouped:
            raise DataError(f"{path}: data[{i}]: duplicate id {clip_id!r}")
        captions: Captions = {}
        for column, lang_texts in caption_columns(list(entry), default_lang=lang).items():
            for name in lang_texts:
                value = entry[name]
                if not isinstance(value, str):
                    raise DataError(f"{path}: data[{i}] ({clip_id}): {name!r} must be a string")
                if value.strip():
                    captions.setdefault(column, []).append(value.strip())
        grouped[clip_id] = captions
        meta[clip_id] = {k: v for k, v in entry.items() if k != "id" and not _CAPTION_COLUMN.match(k)}
    return grouped, meta


def convert_wavcaps(
    json_path: Path,
    *,
    audio_dir: Path,
    split: str,
    lang_files: Mapping[str, Path] | None = None,
    skip_missing_audio: bool = False,
) -> list[ClipRecord]:
    """WavCaps JSON; the audio file is ``id`` as is or with another audio extension."""
    json_path = Path(json_path)
    lang_files = check_lang_files(lang_files)
    grouped, meta = _wavcaps_captions(json_path, lang=ENGLISH)
    sides = {lang: _wavcaps_captions(p, lang=lang)[0] for lang, p in lang_files.items()}
    merge_side_files(grouped, sides, lang_files=lang_files)
    resolver = AudioResolver(audio_dir)
    audio = {clip_id: resolver.resolve(clip_id) for clip_id in grouped}
    return _records(grouped, audio=audio, split=split, meta=meta, source=json_path,
                    skip_missing_audio=skip_missing_audio)

