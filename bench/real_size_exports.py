"""Real-size presets and the pretrained CLAP export: parameters, ONNX sizes, export wall time (docs/models.md).

Models are built at full default size with random weights (tests/real_size_models.py), each
preset of configs/real/ is trained two steps (batch 2) on six clips of the tiny synthetic
corpus, then exported; ``pretrained`` is `tonearm export --pretrained` of the CLAP folder.
Export time covers the whole command: ONNX export, the parity checks against PyTorch, the
catalogue embedding (6 clips) and the held-out evaluation. One target per call (≤ 10 min):

    quiet-run .venv/bin/python bench/real_size_exports.py clap|ast_xlmr|minilm|pretrained [--work DIR]

Each call prints one markdown row and adds it to ``WORK/rows.json`` (default
``~/.cache/tonearm/real-exports``); ``table`` prints every row.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HEADER = ("| target | audio tower (M params) | text tower (M params) | audio_encoder.onnx fp32 / int8 (MB) | "
          "text_encoder.onnx fp32 / int8 (MB) | export (s) | load at start |\n|---|---|---|---|---|---|---|")


def tower_params(bundle: Path) -> tuple[float, float]:
    """Parameters (millions) of each ONNX encoder, counted from its initializers."""
    import numpy as np
    import onnx

    counts = []
    for name in ("audio_encoder.onnx", "text_encoder.onnx"):
        model = onnx.load(str(bundle / name), load_external_data=False)
        counts.append(sum(int(np.prod(t.dims)) for t in model.graph.initializer) / 1e6)
    return counts[0], counts[1]


def onnx_mb(bundle: Path, name: str) -> float:
    files = [bundle / name, bundle / f"{name}.data"]
    return sum(f.stat().st_size for f in files if f.exists()) / 1e6


def measure(target: str, work: Path) -> dict[str, Any]:
    from tests.real_size_models import PRESET_MODELS, mini_manifest, real_model_dir, train_preset
    from training.data.synth import generate_corpus

    corpus = work / "corpus" / "manifest.jsonl"
    if not corpus.exists():
        generate_corpus(size="tiny", seed=0, out_dir=corpus.parent)
    manifest = mini_manifest(corpus, work / "mini.jsonl")
    load = os.getloadavg()[0]
    if target == "pretrained":
        from training.bundle.pretrained import export_pretrained_bundle

        folder = real_model_dir("clap", work)
        started = time.perf_counter()
        bundle = export_pretrained_bundle(folder, manifest=manifest, out_dir=work / "bundles" / target, progress=False)
    else:
        from training.bundle.export import export_bundle

        dirs = {m: real_model_dir(m, work) for m in PRESET_MODELS[target].values()}
        run = train_preset(target, dirs, manifest, work / "runs" / f"{target}-{int(time.time())}")
        started = time.perf_counter()
        bundle = export_bundle(run / "last", manifest=manifest, out_dir=work / "bundles" / target, progress=False)
    export_s = time.perf_counter() - started
    audio_m, text_m = tower_params(bundle)
    int8 = int8_sizes(bundle)
    return {
        "target": target, "audio_m": round(audio_m, 1), "text_m": round(text_m, 1),
        "audio_mb": round(onnx_mb(bundle, "audio_encoder.onnx"), 1),
        "text_mb": round(onnx_mb(bundle, "text_encoder.onnx"), 1), "export_s": round(export_s, 1),
        "audio_int8_mb": int8["audio"], "text_int8_mb": int8["text"],
        "load": round(load, 2), "date": dt.date.today().isoformat(),
    }


def int8_sizes(bundle: Path) -> dict[str, float]:
    """MB of each encoder after `--quantize`'s dynamic int8 (training.bundle.quantize.quantize_model), after the timing."""
    import tempfile

    from training.bundle.quantize import quantize_model

    sizes = {}
    with tempfile.TemporaryDirectory() as scratch:
        for modality in ("audio", "text"):
            out = quantize_model(bundle / f"{modality}_encoder.onnx", Path(scratch) / f"{modality}.onnx")
            sizes[modality] = round(onnx_mb(out.parent, out.name), 1)
    return sizes


def row(r: dict[str, Any]) -> str:
    return (f"| {r['target']} | {r['audio_m']} | {r['text_m']} | {r['audio_mb']} / {r.get('audio_int8_mb', '?')} | "
            f"{r['text_mb']} / {r.get('text_int8_mb', '?')} | {r['export_s']} | {r['load']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", choices=["clap", "ast_xlmr", "minilm", "pretrained", "table"])
    parser.add_argument("--work", default="~/.cache/tonearm/real-exports")
    args = parser.parse_args()
    work = Path(args.work).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    store = work / "rows.json"
    rows = json.loads(store.read_text()) if store.exists() else {}
    if args.target != "table":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        rows[args.target] = measure(args.target, work)
        store.write_text(json.dumps(rows, indent=2) + "\n")
    print(HEADER)
    for name in ("clap", "ast_xlmr", "minilm", "pretrained"):
        if name in rows:
            print(row(rows[name]))


if __name__ == "__main__":
    main()
