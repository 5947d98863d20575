"""`tonearm export`: the one entry point of both bundle pipelines — a checkpoint
(:mod:`training.bundle.export`) or ``--pretrained MODEL_DIR`` (:mod:`training.bundle.pretrained`); what they
share is :mod:`training.bundle.parts`."""

from __future__ import annotations

import argparse

from index.bundle import format as fmt
from index.catalogue.embed_pass import pass_options_from_args
from index.catalogue.half_precision import check_precision_options
from index.catalogue.ray_embed import ray_options_from_args
from index.errors import BundleError
from index.runtime.loader import device_providers
from training.bundle.parts import quantize_config


def cli_export(args: argparse.Namespace) -> int:
    """`tonearm export CHECKPOINT --data MANIFEST --out BUNDLES_DIR [--split S ...] [--index F] [--quantize-text]`,
    or `tonearm export --pretrained MODEL_DIR ...` (training.bundle.pretrained)."""
    from rich.console import Console

    from index.metrics.report import format_report_rich

    if (args.checkpoint is None) == (getattr(args, "pretrained", None) is None):
        raise BundleError("tonearm export: give a CHECKPOINT directory or --pretrained MODEL_DIR (one of them)")
    device = args.device
    providers = device_providers(device)  # before any work: one line without CUDA
    quantize = quantize_config(args)
    check_precision_options(args.precision, device, ray=args.ray is not None,
                            quantized=quantize.encoders)
    if args.pretrained is not None:
        from training.bundle.pretrained import cli_export_pretrained

        return cli_export_pretrained(args)
    from training.bundle.export import export_bundle

    path = export_bundle(
        args.checkpoint, manifest=args.data, out_dir=args.out, index_factory=args.index,
        quantize=quantize, progress=True, splits=args.split, precision=args.precision,
        ray=None if args.ray is None else ray_options_from_args(args),
        providers=providers, pass_options=pass_options_from_args(args),
    )
    manifest = fmt.read_manifest(path)
    assert manifest.evaluation is not None  # a trained bundle always has its held-out report
    console = Console()
    console.print(format_report_rich(manifest.evaluation.report, manifest.languages))
    console.print(f"bundle written: {path}")
    return 0
