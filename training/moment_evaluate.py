"""`tonearm evaluate BUNDLE --data M --moments`: the moment report of a bundle (index/moments/evaluate.py);
both scorers side by side (sliding windows and the trained head) when the bundle carries a moment head:
``moments.json`` is the sliding windows' report, ``moments-head.json`` the head's."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from rich.console import Console

from index.errors import TonearmError
from index.moments.evaluate import (
    evaluate_moment_scorers,
    format_moment_comparison,
    format_moment_report,
)
from index.runtime.loader import LoadedBundle
from training.data.manifest import load_manifest

log = logging.getLogger(__name__)


def cli_evaluate_moments(args: argparse.Namespace) -> int:
    """``tonearm evaluate BUNDLE --data M --moments [--split S] [--out DIR]``."""
    source = Path(args.checkpoint)
    if not (source / "manifest.json").is_file():
        raise TonearmError(f"{source}: --moments evaluates a bundle (a directory with manifest.json); "
                           "export the checkpoint first (`tonearm export`)")
    bundle = LoadedBundle.open(source)
    try:
        languages = list(bundle.languages)
        records = [r for r in load_manifest(Path(args.data), languages=languages, split=args.split,
                                            drop_other_languages=True) if r.moments]
        reports = evaluate_moment_scorers(bundle, records, languages=languages, head=bundle.moment_head)
    finally:
        bundle.close()
    report = reports["windows"]
    table = format_moment_report(report, languages)
    if "head" in reports:  # the bundle carries a trained moment head: both scorers, side by side
        table = format_moment_comparison(reports, languages)
    out = Path(args.out) if args.out else source.parent / f"{source.name}-moments-{args.split}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "moments.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if "head" in reports:
        (out / "moments-head.json").write_text(json.dumps(reports["head"], indent=2, sort_keys=True) + "\n",
                                               encoding="utf-8")
    (out / "moments.md").write_text(table, encoding="utf-8")
    Console().print(table, end="", markup=False, highlight=False)  # the command's output, as `evaluate` prints its report
    log.info("wrote %s and %s", out / "moments.json", out / "moments.md")
    return 0
