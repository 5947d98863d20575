"""`tonearm data`: its subcommands' parsers and the handler of ``tonearm data convert``.

Above the converters it dispatches to — the caption datasets of :mod:`training.data.formats` and the
moment datasets on top of them in :mod:`training.data.moment_formats` — and beside ``translate``
(:mod:`training.data.translate`) and ``shard`` (:mod:`training.data.shards`), which bring their own
parsers. Every module imported here keeps to the stdlib (+ numpy) at module level, so
``tonearm/cli.py`` builds this parser without torch.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from index.errors import DataError
from training.data.formats import (
    DEFAULT_AUDIOCAPS_PATTERN,
    check_lang_files,
    convert_audiocaps,
    convert_clotho,
    convert_wavcaps,
)
from training.data.manifest import read_manifest, write_manifest
from training.data.moment_formats import convert_castella, convert_clotho_moment
from training.data.shards import add_shard_parser
from training.data.translate import add_translate_parser

log = logging.getLogger(__name__)


def parse_lang_files(values: Sequence[str] | None) -> dict[str, Path]:
    """``["fra=path.csv", ...]`` → ``{"fra": Path("path.csv")}``."""
    result: dict[str, Path] = {}
    for value in values or []:
        lang, sep, path = value.partition("=")
        if not sep or not path:
            raise DataError(f"--lang-file {value!r}: expected LANG=PATH, e.g. fra=captions_fra.csv")
        if lang in result:
            raise DataError(f"--lang-file: language {lang!r} given twice")
        result[lang] = Path(path)
    return check_lang_files(result)


def cli_convert(args: argparse.Namespace) -> int:
    """``tonearm data convert``: one public-format file → the generic JSONL manifest."""
    common = {
        "audio_dir": Path(args.audio_dir),
        "split": args.split,
        "lang_files": parse_lang_files(args.lang_file),
        "skip_missing_audio": args.skip_missing,
    }
    if args.format == "clotho":
        records = convert_clotho(Path(args.input), **common)
    elif args.format == "audiocaps":
        records = convert_audiocaps(Path(args.input), audio_pattern=args.audio_pattern, **common)
    elif args.format == "wavcaps":
        records = convert_wavcaps(Path(args.input), **common)
    elif args.format in ("castella", "clotho-moment"):  # long recordings with moments (SPEC §19)
        convert = convert_castella if args.format == "castella" else convert_clotho_moment
        records = convert(Path(args.input), **common)
    else:  # argparse choices prevent this
        raise DataError(f"unknown format {args.format!r}")
    out = Path(args.out)
    if args.append and out.exists():
        existing = [record for _, record in read_manifest(out, languages=None)]
        records = existing + records
    write_manifest(records, out)
    languages = sorted({lang for r in records for lang in r.captions})
    log.info("wrote %d clips (%s) to %s", len(records), ", ".join(languages), out)
    return 0


def add_convert_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``convert`` to the ``tonearm data`` subcommands (handler: :func:`cli_convert`)."""
    p = subparsers.add_parser(
        "convert", help="convert Clotho / AudioCaps / WavCaps captions, or CASTELLA / Clotho-Moment moments, "
        "to a JSONL manifest")
    p.add_argument("--format", required=True, choices=["clotho", "audiocaps", "wavcaps", "castella", "clotho-moment"])
    p.add_argument("--input", required=True, help="captions CSV (clotho, audiocaps), JSON (wavcaps, castella: "
                   "json/en/<split>.json) or JSONL (clotho-moment: lighthouse's <name>_<split>_release.jsonl)")
    p.add_argument("--audio-dir", required=True, help="directory holding the audio files")
    p.add_argument("--split", required=True, help="split name written for every clip (train, val, test)")
    p.add_argument("--out", required=True, help="JSONL manifest to write (audio paths relative to it)")
    p.add_argument("--lang-file", action="append", metavar="LANG=PATH",
                   help="translated captions in the input's layout, one file per language (repeatable)")
    p.add_argument("--audio-pattern", default=DEFAULT_AUDIOCAPS_PATTERN,
                   help="original AudioCaps CSV: audio file name from {youtube_id}, {start_time}, {audiocap_id}")
    p.add_argument("--skip-missing", action="store_true", help="skip clips whose audio file is missing")
    p.add_argument("--append", action="store_true", help="add to an existing manifest (e.g. one split per call)")
    p.set_defaults(handler=cli_convert)
    return p


def add_data_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``tonearm data`` with its ``convert`` subcommand to the top-level subcommands."""
    p = subparsers.add_parser(
        "data", help="dataset tools (convert public formats to the JSONL manifest, translate captions, write tar shards)")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    add_convert_parser(data_sub)
    add_translate_parser(data_sub)
    add_shard_parser(data_sub)
    return p
