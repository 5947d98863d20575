"""`tonearm bundle verify DIR` and `tonearm bundle eval DIR` (no torch, no training)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from rich.console import Console

from index.bundle.format import BundleManifest
from index.errors import BundleError
from index.metrics.report import format_report_rich
from index.moments.evaluate import format_moment_comparison, format_moment_report
from index.runtime.evaluate import evaluate_bundle, max_report_difference
from index.runtime.loader import LoadedBundle
from index.runtime.verify import verify_bundle

log = logging.getLogger(__name__)


def cli_verify(args: argparse.Namespace) -> int:
    """Checksums, schema, ONNX interfaces, dimensions, index sizes, held-out set; exit 2 on failure."""
    manifest = verify_bundle(Path(args.dir))
    console = Console()
    console.print(f"[green]OK[/green] {manifest.bundle_id}: {len(manifest.files) + 1} files verified")
    for name, info in (("audio", manifest.audio_index), ("text", manifest.text_index)):
        if info is None:
            console.print(f"  {name}.faiss: absent (index-only bundle: no captions, no audio→text search)")
            continue
        console.print(
            f"  {name}.faiss: {info.factory}, {info.ntotal} x {info.dim}, "
            f"ANN recall@10 {info.ann_recall_at_10:.4f}, params {info.search_params or '-'}"
        )
    if manifest.eval_set is None:
        console.print("  held-out set: absent (index-only bundle: the quality gate cannot compare it)")
    else:
        console.print(f"  held-out set: {manifest.eval_set.n_clips} clips, {manifest.eval_set.n_captions} captions "
                      f"({manifest.eval_set.split})")
    head = manifest.moment_head
    if head is not None:
        console.print(f"  moments: scored by the trained moment head ({head.file}, trained on "
                      f"{head.source_bundle}'s encoders, checked), {head.window_seconds:g}-s windows every "
                      f"{head.hop_seconds:g} s")
    elif manifest.moments is not None:
        console.print("  moments: scored by the sliding windows (no moment head: `tonearm train-moments` adds one)")
    _print_moment_heldout(console, manifest)
    return 0


def _print_moment_heldout(console: Console, manifest: BundleManifest) -> None:
    """The held-out moment report: both scorers side by side per language when the bundle has a head."""
    windows = manifest.moments.heldout if manifest.moments is not None else None
    head = manifest.moment_head.heldout if manifest.moment_head is not None else None
    languages = list(manifest.languages)
    if windows and head:
        table = format_moment_comparison({"windows": windows, "head": head}, languages)
    elif windows or head:
        table = format_moment_report(windows or head or {}, languages)
    else:
        return
    console.print("  held-out moments (%):")
    console.print("\n".join("    " + line for line in table.strip().splitlines()), markup=False, highlight=False,
                  soft_wrap=True)  # a table row is one line, whatever the terminal's width


def cli_eval(args: argparse.Namespace) -> int:
    """Recompute the metrics table (docs/metrics.md) from the bundle's ONNX encoders and print it."""
    bundle = LoadedBundle.open(Path(args.dir), verify=True)
    if bundle.manifest.evaluation is None:
        bundle.close()
        raise BundleError(f"{args.dir}: index-only bundle (no held-out set); nothing to evaluate")
    try:
        report = evaluate_bundle(bundle)
    finally:
        bundle.close()
    Console().print(format_report_rich(report, bundle.languages))
    evaluation = bundle.manifest.evaluation
    difference = max_report_difference(report, evaluation.report) if evaluation is not None else 0.0
    log.info("largest difference to the manifest's recorded evaluation: %.4f points", 100 * difference)
    return 0
