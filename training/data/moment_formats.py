"""Converters from the moment-retrieval datasets to :class:`ClipRecord` lists with moments (SPEC §19).

Both formats are read as published (docs/corpus.md, "Moment datasets"):

* **CASTELLA** (Munakata et al., 2025; ``github.com/line/CASTELLA``, ``json/{en,ja}/{split}.json``):
  a JSON list of recordings ``{"yid", "global_caption", "duration", "num_moments", "moments":
  [{"local_caption", "timestamps": [[start, end], ...]}]}``. The English and Japanese files list
  the same recordings and moments in the same order; the Japanese one is a side file
  (``lang_files={"jpn": ...}``), matched by ``yid`` and moment position. One local caption with
  several timestamps becomes several moments carrying that caption. Audio: ``{yid}.wav`` (the
  dataset's download script), other audio extensions tried too.
* **Clotho-Moment** (Munakata et al., 2024), as released with ``github.com/line/lighthouse``
  (``data/clotho_moment/clotho_moment_{split}_release.jsonl``): JSON lines in the QVHighlights
  layout ``{"qid", "query", "duration", "vid", "relevant_windows": [[start, end], ...]}`` (plus
  ``fg_dB``). Lines of one ``vid`` are one recording; each window of a line is a moment carrying
  its ``query``. lighthouse's CASTELLA release uses the same layout and reads the same way.
  Translations: side files in the same layout, matched by ``qid``. Audio: ``{vid}`` + extension.

Zero-length spans (``start == end``, 9 in CASTELLA's train split) cannot be a moment (IoU 0 with
anything) and are left out, counted in the log.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from index.errors import DataError
from index.languages import ENGLISH
from training.data.formats import AudioResolver, _records, check_lang_files, read_text
from training.data.manifest import ClipRecord, MomentRecord

log = logging.getLogger(__name__)


def _span(value: Any, *, where: str) -> tuple[float, float] | None:
    """A ``[start, end]`` pair as floats; None for a zero-length one; DataError when malformed."""
    if (not isinstance(value, list | tuple) or len(value) != 2
            or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)):
        raise DataError(f"{where}: a window must be [start, end] in seconds, got {value!r}")
    start, end = float(value[0]), float(value[1])
    if start < 0 or end < start:
        raise DataError(f"{where}: need 0 <= start <= end, got [{start}, {end}]")
    return None if end == start else (start, end)


def _load_json(path: Path) -> Any:
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: invalid JSON ({err.msg} at line {err.lineno})") from None


# --------------------------------------------------------------------------- CASTELLA


def _castella_entries(path: Path) -> dict[str, dict[str, Any]]:
    data = _load_json(path)
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of recordings (CASTELLA json/<lang>/<split>.json)")
    entries: dict[str, dict[str, Any]] = {}
    for i, entry in enumerate(data):
        where = f"{path}: [{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("yid"), str) or not isinstance(
                entry.get("moments"), list):
            raise DataError(f"{where}: expected an object with 'yid' (string) and 'moments' (list)")
        for j, moment in enumerate(entry["moments"]):
            if (not isinstance(moment, dict) or not isinstance(moment.get("local_caption"), str)
                    or not isinstance(moment.get("timestamps"), list)):
                raise DataError(f"{where} ({entry['yid']}): moments[{j}] needs 'local_caption' and 'timestamps'")
        if entry["yid"] in entries:
            raise DataError(f"{where}: duplicate yid {entry['yid']!r}")
        entries[entry["yid"]] = entry
    return entries


def convert_castella(
    json_path: Path,
    *,
    audio_dir: Path,
    split: str,
    lang_files: Mapping[str, Path] | None = None,
    skip_missing_audio: bool = False,
) -> list[ClipRecord]:
    """CASTELLA's English JSON (``--input json/en/test.json``), other languages as side files."""
    json_path = Path(json_path)
    lang_files = check_lang_files(lang_files)
    main = _castella_entries(json_path)
    sides = {lang: _castella_entries(p) for lang, p in lang_files.items()}
    grouped: dict[str, dict[str, list[str]]] = {}
    moments: dict[str, list[MomentRecord]] = {}
    meta: dict[str, dict[str, Any]] = {}
    zero = 0
    for yid, entry in main.items():
        texts = {ENGLISH: entry}
        for lang, side in sides.items():
            other = side.get(yid)
            if other is None or len(other["moments"]) != len(entry["moments"]):
                raise DataError(f"{lang_files[lang]}: recording {yid!r} is missing or has other moments than "
                                f"{json_path}; the files must be the same split of the same release")
            texts[lang] = other
        grouped[yid] = {lang: [e["global_caption"].strip()] for lang, e in texts.items()
                        if isinstance(e.get("global_caption"), str) and e["global_caption"].strip()}
        moments[yid] = []
        for j, moment in enumerate(entry["moments"]):
            captions = {lang: [e["moments"][j]["local_caption"].strip()] for lang, e in texts.items()
                        if e["moments"][j]["local_caption"].strip()}
            for k, window in enumerate(moment["timestamps"]):
                span = _span(window, where=f"{json_path}: {yid} moments[{j}].timestamps[{k}]")
                if span is None:
                    zero += 1
                elif captions:
                    moments[yid].append(MomentRecord(span[0], span[1], captions))
        if not grouped[yid]:  # no global caption: the moments describe the recording
            grouped[yid] = _moment_captions(moments[yid])
        meta[yid] = {"source": "castella", "duration": entry.get("duration")}
    if zero:
        log.info("%s: left out %d zero-length timestamps", json_path, zero)
    resolver = AudioResolver(audio_dir)
    audio = {yid: resolver.resolve(f"{yid}.wav") for yid in grouped}
    records = _records(grouped, audio=audio, split=split, meta=meta, source=json_path,
                       skip_missing_audio=skip_missing_audio)
    return [_with_moments(r, moments[r.id]) for r in records]


# --------------------------------------------------------------------------- Clotho-Moment (lighthouse)


def _lighthouse_lines(path: Path) -> list[dict[str, Any]]:
    lines = []
    for number, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: invalid JSON ({err.msg})") from None
        if (not isinstance(obj, dict) or not isinstance(obj.get("query"), str) or "qid" not in obj
                or not isinstance(obj.get("vid"), str) or not isinstance(obj.get("relevant_windows"), list)):
            raise DataError(f"{where}: expected {{qid, query, vid, duration, relevant_windows}} "
                            "(the lighthouse / QVHighlights layout)")
        obj["_where"] = where
        lines.append(obj)
    if not lines:
        raise DataError(f"{path}: no queries")
    return lines


def convert_clotho_moment(
    jsonl_path: Path,
    *,
    audio_dir: Path,
    split: str,
    lang_files: Mapping[str, Path] | None = None,
    skip_missing_audio: bool = False,
) -> list[ClipRecord]:
    """Clotho-Moment's JSONL (lighthouse release); one recording per ``vid``."""
    jsonl_path = Path(jsonl_path)
    lang_files = check_lang_files(lang_files)
    lines = _lighthouse_lines(jsonl_path)
    translations = {lang: {str(o["qid"]): o["query"].strip() for o in _lighthouse_lines(p)}
                    for lang, p in lang_files.items()}
    moments: dict[str, list[MomentRecord]] = {}
    meta: dict[str, dict[str, Any]] = {}
    zero = 0
    for obj in lines:
        captions = {ENGLISH: [obj["query"].strip()]}
        for lang, by_qid in translations.items():
            if by_qid.get(str(obj["qid"])):
                captions[lang] = [by_qid[str(obj["qid"])]]
        vid = obj["vid"]
        moments.setdefault(vid, [])
        meta.setdefault(vid, {"source": "clotho-moment", "duration": obj.get("duration"), "qids": []})
        meta[vid]["qids"].append(obj["qid"])
        for k, window in enumerate(obj["relevant_windows"]):
            span = _span(window, where=f"{obj['_where']}: relevant_windows[{k}]")
            if span is None:
                zero += 1
            elif captions[ENGLISH][0]:
                moments[vid].append(MomentRecord(span[0], span[1], captions))
    if zero:
        log.info("%s: left out %d zero-length windows", jsonl_path, zero)
    grouped = {vid: _moment_captions(ms) for vid, ms in moments.items()}
    resolver = AudioResolver(audio_dir)
    audio = {vid: resolver.resolve(vid) for vid in grouped}
    records = _records(grouped, audio=audio, split=split, meta=meta, source=jsonl_path,
                       skip_missing_audio=skip_missing_audio)
    return [_with_moments(r, moments[r.id]) for r in records]


# --------------------------------------------------------------------------- shared


def _moment_captions(moments: list[MomentRecord]) -> dict[str, list[str]]:
    """The distinct captions of ``moments`` per language, in order: a recording's own captions."""
    captions: dict[str, list[str]] = {}
    for moment in moments:
        for lang, texts in moment.captions.items():
            for text in texts:
                if text not in captions.setdefault(lang, []):
                    captions[lang].append(text)
    return captions


def _with_moments(record: ClipRecord, moments: list[MomentRecord]) -> ClipRecord:
    record.moments = moments
    return record
