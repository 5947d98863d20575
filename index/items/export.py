"""`tonearm items export`: the item log's current items as a folder `tonearm index` takes (docs/service.md,
"Items and bundles").

Folding added items into a bundle is re-indexing their audio; this writes that audio: for every item
the log holds now (the latest ``put`` of each id not deleted since), its stored upload copied to
``OUT/<id>`` — the path of a file under the folder is the clip id `tonearm index` gives it, and
the format is recognised from the content, so no extension is added — and one row of
``OUT/metadata.jsonl`` (``{"file": <id>, **metadata}``), the per-file metadata `tonearm index`
reads. Captions are not exported (`tonearm index` makes index-only bundles) and deletes are not
either (a takedown stays a record of the log, applied to every bundle).

Ids that cannot be such a path are refused, all of them named, before anything is written: an
empty, ``.`` or ``..`` component, a component starting with ``.`` (`tonearm index` skips hidden
files), surrounding whitespace, the name of the metadata table, or an id that is a folder of
another id (``a`` and ``a/b``). So are metadata fields that are the catalogue's own names
(:data:`index.items.file_metadata.RESERVED`). ``OUT`` must not exist; it is written under a temporary
name and renamed when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from index.errors import DataError
from index.items.file_metadata import NAMES, RESERVED
from index.items.log import LOG_NAME, ItemLog, ItemRecord


class ExportError(DataError):
    """An item log that cannot be exported as a folder (the reasons are listed)."""


@dataclass(frozen=True)
class ExportedItems:
    path: Path
    items: int
    captions_left_out: int
    """Captions of the exported items (not in the folder: `tonearm index` takes none)."""
    deleted: int
    """Delete records in the log (takedowns and deleted items; never exported)."""


def _problem(record: ItemRecord) -> str | None:
    item_id = record.id
    parts = item_id.split("/")
    if item_id != item_id.strip():
        return "has surrounding whitespace"
    if any(part in ("", ".", "..") for part in parts):
        return "has an empty, '.' or '..' path component"
    if any(part.startswith(".") for part in parts):
        return "has a component starting with '.' (a hidden file: `tonearm index` skips it)"
    if item_id in NAMES:
        return "is the name of the metadata table"
    clash = sorted(set(record.metadata) & set(RESERVED))
    if clash:
        return f"has metadata field(s) {', '.join(clash)}: the catalogue's own names"
    return None


def export_items(items_dir: Path, out: Path) -> ExportedItems:
    """Write the current items of the log in ``items_dir`` to the new folder ``out`` (module docstring)."""
    items_dir, out = Path(items_dir), Path(out)
    if not (items_dir / LOG_NAME).is_file():
        raise ExportError(f"{items_dir}: no item log ({LOG_NAME}) here")
    if out.exists():
        raise ExportError(f"{out} already exists; exports go to a new folder")
    log = ItemLog(items_dir)
    state = log.snapshot()
    records = sorted(state.items.values(), key=lambda r: r.id)
    problems = [f"{r.id!r} {why}" for r in records if (why := _problem(r)) is not None]
    ids = {r.id for r in records}
    problems += [f"{r.id!r} is a folder of another item's id"
                 for r in records if any(str(parent) in ids for parent in PurePosixPath(r.id).parents
                                         if str(parent) != ".")]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise ExportError(f"{len(problems)} item(s) cannot be a file of the folder: {shown}")
    staging = out.with_name(f".{out.name}.partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        with (staging / NAMES[0]).open("w", encoding="utf-8") as table:
            for record in records:
                target = staging / record.id
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(log.audio_path(record), target)
                table.write(json.dumps({"file": record.id, **record.metadata}, ensure_ascii=False) + "\n")
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ExportedItems(path=out, items=len(records),
                         captions_left_out=sum(len(t) for r in records for t in r.captions.values()),
                         deleted=len(state.deleted))


def cli_export(args: argparse.Namespace) -> int:
    """`tonearm items export`: prints what was written and the `tonearm index` command that folds it."""
    from rich.console import Console

    items_dir = Path(args.items_dir) if args.items_dir else Path(args.bundles_dir) / ".items"
    done = export_items(items_dir, Path(args.out))
    console = Console()
    console.print(f"{done.items} items exported to {done.path} (audio + {NAMES[0]}); "
                  f"{done.captions_left_out} captions left out, {done.deleted} delete records kept in the log",
                  highlight=False, soft_wrap=True)
    console.print(f"fold them into a bundle: tonearm index {done.path} --bundle BUNDLE --out NEW_BUNDLE "
                  "(or copy the files beside the bundle's own audio first); do not DELETE the folded ids "
                  "afterwards: over the new bundle a delete is a takedown (docs/service.md, \"Items and bundles\")",
                  highlight=False, soft_wrap=True)
    return 0
