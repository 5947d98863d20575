"""The generic JSONL manifest (SPEC §2): one clip a line, validated with line numbers.

Line format (keys in any order)::

    {"id": "dog-001", "audio": "audio/dog-001.wav", "split": "train",
     "captions": {"eng": ["a dog barks", ".."], "fra": ["un chien aboie", ".."]},
     "meta": {...}}

``audio`` is relative to the manifest's directory (absolute paths are kept).
Captions at the same position in different languages are translations of each
other (a *query group*, SPEC §5). ``meta`` is optional free-form JSON; any other
top-level key is also kept in :attr:`ClipRecord.meta`. ``moments`` (optional, SPEC §19) lists
the captioned spans of a long recording: ``[{"start": s, "end": s, "captions": {lang: [...]}}]``
(docs/corpus.md, "Moments").

Problems the user can fix raise :class:`index.errors.DataError` naming the file
and line: bad JSON, missing or mistyped fields, duplicate ids, captions in a
language outside the configured set (an error rather than a silent drop, so a
typo such as ``"fre"`` is not lost — unless ``drop_other_languages`` asks to drop
them, counted and reported), and missing audio files (reported with the
count and first examples; skipped with a warning only when asked to).
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from index.errors import DataError
from index.languages import validate_language_codes

log = logging.getLogger(__name__)

REQUIRED_FIELDS = ("id", "audio", "captions", "split")
OPTIONAL_FIELDS = ("meta", "moments")
MISSING_EXAMPLES = 5
"""How many missing audio files a report lists by name."""


@dataclass
class ClipRecord:
    """One clip: absolute audio path, captions per language (aligned by position), split, metadata."""

    id: str
    audio: Path
    captions: dict[str, list[str]]
    split: str
    meta: dict[str, Any] = field(default_factory=dict)
    moments: list[MomentRecord] = field(default_factory=list)


@dataclass
class MomentRecord:
    """A captioned span of a clip (seconds from its start); captions as a clip's, by position."""

    start: float
    end: float
    captions: dict[str, list[str]]

    def to_json(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "captions": self.captions}


def _check_code(code: str, where: str) -> None:
    try:
        validate_language_codes([code])
    except ValueError as err:
        raise DataError(f"{where}: {err}") from None


def _parse_captions(value: Any, *, where: str, languages: Sequence[str] | None) -> dict[str, list[str]]:
    """Validate the ``captions`` object; ``languages=None`` accepts any ISO 639-3 code."""
    if not isinstance(value, dict):
        raise DataError(f"{where}: 'captions' must be an object {{lang: [captions]}}, got {type(value).__name__}")
    captions: dict[str, list[str]] = {}
    for lang, texts in value.items():
        _check_code(lang, where)
        if languages is not None and lang not in languages:
            raise DataError(
                f"{where}: captions in language {lang!r}, which is not among the configured "
                f"languages ({', '.join(languages)}); add it to data.languages, or drop such captions "
                "with data.drop_other_languages=true (tonearm train --drop-other-languages)"
            )
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise DataError(f"{where}: captions[{lang!r}] must be a list of strings")
        cleaned = [t.strip() for t in texts]
        if any(not t for t in cleaned):
            raise DataError(f"{where}: captions[{lang!r}] contains an empty caption")
        if cleaned:
            captions[lang] = cleaned
    if not captions:
        raise DataError(f"{where}: clip has no captions")
    return captions


def _parse_moments(value: Any, *, where: str, languages: Sequence[str] | None) -> list[MomentRecord]:
    """Validate ``moments``: a list of ``{start, end, captions}`` with ``0 <= start < end``."""
    if not isinstance(value, list):
        raise DataError(f"{where}: 'moments' must be a list of {{start, end, captions}} objects")
    moments = []
    for i, item in enumerate(value):
        at = f"{where}: moments[{i}]"
        if not isinstance(item, dict) or set(item) != {"start", "end", "captions"}:
            raise DataError(f"{at} must be an object with exactly start, end and captions")
        start, end = item["start"], item["end"]
        if any(isinstance(v, bool) or not isinstance(v, int | float) for v in (start, end)):
            raise DataError(f"{at}: start and end must be numbers (seconds)")
        if not (math.isfinite(start) and math.isfinite(end) and 0 <= start < end):
            raise DataError(f"{at}: need 0 <= start < end, got start={start}, end={end}")
        captions = _parse_captions(item["captions"], where=at, languages=languages)
        moments.append(MomentRecord(float(start), float(end), captions))
    return moments


def _parse_line(
    obj: Any, *, where: str, base: Path, languages: Sequence[str] | None
) -> ClipRecord:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [key for key in REQUIRED_FIELDS if key not in obj]
    if missing:
        raise DataError(f"{where}: missing field(s) {', '.join(missing)}")
    for key in ("id", "audio", "split"):
        if not isinstance(obj[key], str) or not obj[key].strip():
            raise DataError(f"{where}: {key!r} must be a non-empty string")
    meta = obj.get("meta", {})
    if not isinstance(meta, dict):
        raise DataError(f"{where}: 'meta' must be an object")
    extra = {k: v for k, v in obj.items() if k not in (*REQUIRED_FIELDS, *OPTIONAL_FIELDS)}
    return ClipRecord(
        id=obj["id"],
        audio=Path(os.path.normpath(base / obj["audio"])),
        captions=_parse_captions(obj["captions"], where=where, languages=languages),
        split=obj["split"],
        meta={**meta, **extra},
        moments=_parse_moments(obj.get("moments", []), where=where, languages=languages),
    )


def read_manifest(path: Path, *, languages: Sequence[str] | None) -> list[tuple[int, ClipRecord]]:
    """Parse and validate every line (no audio check); returns (line number, record) pairs."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: manifest not found")
    base = path.resolve().parent
    rows: list[tuple[int, ClipRecord]] = []
    first_line: dict[str, int] = {}
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
            record = _parse_line(obj, where=where, base=base, languages=languages)
            if record.id in first_line:
                raise DataError(f"{where}: duplicate id {record.id!r} (first on line {first_line[record.id]})")
            first_line[record.id] = number
            rows.append((number, record))
    if not rows:
        raise DataError(f"{path}: manifest is empty")
    return rows


def drop_missing_audio(
    records: Sequence[ClipRecord], *, source: str, skip_missing_audio: bool, labels: Sequence[str] | None = None
) -> list[ClipRecord]:
    """Report clips whose audio file does not exist; raise, or drop them with a warning.

    ``labels`` (one per record, e.g. ``"line 12"``) locate the examples in the source.
    """
    missing = [i for i, r in enumerate(records) if not r.audio.is_file()]
    if not missing:
        return list(records)
    examples = ", ".join(
        f"{records[i].audio}" + (f" ({labels[i]})" if labels else "") for i in missing[:MISSING_EXAMPLES]
    )
    summary = f"{source}: {len(missing)} of {len(records)} audio files are missing, e.g. {examples}"
    if not skip_missing_audio:
        raise DataError(f"{summary}; fix the paths or skip these clips (skip_missing_audio / --skip-missing)")
    log.warning("%s; skipping them", summary)
    dropped = set(missing)
    return [r for i, r in enumerate(records) if i not in dropped]


def keep_languages(
    rows: list[tuple[int, ClipRecord]], languages: Sequence[str], *, source: str
) -> list[tuple[int, ClipRecord]]:
    """Drop captions outside `languages` and the clips left without any; log what was dropped."""
    dropped: dict[str, int] = {}
    kept: list[tuple[int, ClipRecord]] = []
    for number, record in rows:
        for lang, texts in record.captions.items():
            if lang not in languages:
                dropped[lang] = dropped.get(lang, 0) + len(texts)
        captions = {lang: texts for lang, texts in record.captions.items() if lang in languages}
        moments = [
            MomentRecord(m.start, m.end, {lang: t for lang, t in m.captions.items() if lang in languages})
            for m in record.moments
        ]
        if captions:
            kept.append((number, ClipRecord(record.id, record.audio, captions, record.split, record.meta,
                                            [m for m in moments if m.captions])))
    if dropped:
        per_language = ", ".join(f"{lang} {count}" for lang, count in sorted(dropped.items()))
        log.info(
            "%s: dropped %d captions in languages outside data.languages (%s); %d of %d clips kept",
            source, sum(dropped.values()), per_language, len(kept), len(rows),
        )
    if not kept:
        raise DataError(f"{source}: no captions in data.languages ({', '.join(languages)})")
    return kept


def load_manifest(
    path: Path,
    *,
    languages: Sequence[str],
    skip_missing_audio: bool = False,
    split: str | None = None,
    drop_other_languages: bool = False,
) -> list[ClipRecord]:
    """Load and validate a JSONL manifest; optionally keep one split.

    The whole file is validated; only the selected split's audio files are
    checked for existence. Raises :class:`DataError` when the split is absent.
    Captions in languages outside `languages` are an error, or dropped with
    `drop_other_languages` (with the clips left without captions).
    """
    path = Path(path)
    rows = read_manifest(path, languages=None if drop_other_languages else list(languages))
    if drop_other_languages:
        rows = keep_languages(rows, languages, source=str(path))
    if split is not None:
        present = sorted({r.split for _, r in rows})
        rows = [(n, r) for n, r in rows if r.split == split]
        if not rows:
            raise DataError(f"{path}: no clips in split {split!r} (splits present: {', '.join(present)})")
    return drop_missing_audio(
        [r for _, r in rows],
        source=str(path),
        skip_missing_audio=skip_missing_audio,
        labels=[f"line {n}" for n, _ in rows],
    )


def record_to_json(record: ClipRecord, *, base: Path) -> dict[str, Any]:
    """The JSON object of one line, with ``audio`` relative to ``base`` (POSIX separators).

    A relative ``record.audio`` means relative to the working directory, like any path a
    user passes; it is rewritten relative to the manifest so the manifest can move.
    """
    relative = Path(os.path.relpath(Path(record.audio).resolve(), base.resolve()))
    line: dict[str, Any] = {
        "id": record.id,
        "audio": relative.as_posix(),
        "captions": record.captions,
        "split": record.split,
        "meta": record.meta,
    }
    if record.moments:
        line["moments"] = [moment.to_json() for moment in record.moments]
    return line


def write_manifest(records: Iterable[ClipRecord], path: Path) -> None:
    """Write records as JSONL (sorted keys, UTF-8), atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    base = path.parent
    seen: set[str] = set()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", dir=base)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            for record in records:
                if record.id in seen:
                    raise DataError(f"{path}: duplicate id {record.id!r} while writing")
                seen.add(record.id)
                line = json.dumps(record_to_json(record, base=base), ensure_ascii=False, sort_keys=True)
                handle.write(line + "\n")
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
