"""GPU at real size: training steps and CUDA encoder throughput of the real-size presets (SPEC §11, issue 21).

Where a GPU is lent (the ``device`` tool), for each preset of configs/real/ (``--presets``):

* **training steps** — one optimizer step of InfoNCE, KCL, DART (IOT + UWD with RAM) and ASK
  (fine + coarse KBs over random pairs on the device) through the real
  :class:`training.loop.TrainStep` (``bench/gpu_check.py``'s ``amp_step``), bf16 autocast, batch
  ``--batch`` (256) of 10-s clips at the preset's sample rate with ``--views`` (8) captions of
  ``--text-length`` tokens each: median step time over 5 steps after 2 warm-ups → samples/s,
  peak GPU memory, final loss. A batch that does not fit is halved until it does (recorded).
* **CUDA encoder throughput** — the bundle's two encoders as the exported modules
  (``text_module()`` / ``audio_module()``: tokens → embedding, waveform → embedding, the
  frontend included), eager PyTorch on CUDA in fp32 and under bf16 autocast, at batch 1, 8
  and 64: items/s and per-call latency. This is what a CUDA server's encoder part does; the
  ONNX service itself cannot run on CUDA there (below).

Models are built at full default size with random weights (tests/real_size_models.py), as in
every real-size test and bench here — speed does not depend on the weights' values.

    python bench/gpu_real_size.py --out gpu_real_size.json            # on the GPU machine
    python bench/gpu_real_size.py --record bench/results/gpu_real_size_h100.json   # here
    python bench/gpu_real_size.py --device cpu --batch 2 --seconds 1 --steps 1 --presets clap  # smoke
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
sys.path.append(str(ROOT / "tests"))  # after ROOT: tests/training must not shadow training/

import gpu_check  # noqa: E402

START, END = "<!-- bench/gpu_real_size.py -->", "<!-- /bench/gpu_real_size.py -->"
OBJECTIVES: dict[str, dict[str, Any]] = {
    "InfoNCE": {"base": {"name": "infonce"}},
    "KCL": {"base": {"name": "infonce"}, "strategy": {"name": "kcl"}},
    "DART": {"base": {"name": "iot"}, "regularizers": [{"name": "uwd", "marginals": "ram"}]},
    "ASK": {"base": {"name": "infonce"}, "knowledge": {"refresh_epochs": None}},
}
"""The objectives issue 21 asks a real-size step of (bench/gpu_check.py runs the same specs on the default model)."""
ENCODER_BATCHES = (1, 8, 64)


def preset_config(preset: str, work: Path) -> tuple[Any, int]:
    """(TrainConfig of configs/real/PRESET.yaml on locally built full-size folders, text vocabulary to draw ids from)."""
    from real_size_models import PRESET_MODELS, PRESETS, real_model_dir
    from transformers import AutoTokenizer

    from training.config import load_train_config

    dirs = {model: real_model_dir(model, work) for model in PRESET_MODELS[preset].values()}
    overrides = [f"{key}={dirs[model]}" for key, model in PRESET_MODELS[preset].items()]
    cfg = load_train_config(PRESETS / f"{preset}.yaml", overrides)
    text_dir = cfg.model.text.path or cfg.model.audio.path
    vocab = len(AutoTokenizer.from_pretrained(text_dir)) if text_dir else 8000
    return cfg, vocab


def training_steps(cfg: Any, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    """Each objective's bf16 step at ``args.batch``, halving the batch after an out-of-memory error."""
    import torch

    out: dict[str, Any] = {}
    for name, spec in OBJECTIVES.items():
        batch = args.batch
        while True:
            try:
                out[name] = {"ran": True, **gpu_check.amp_step(
                    spec, "bf16", batch, cfg=cfg, vocab=vocab, views=args.views, seconds=args.seconds,
                    text_length=args.text_length, timed_steps=args.steps,
                )}
                break
            except torch.OutOfMemoryError:
                out.setdefault("out_of_memory", {})[name] = out.get("out_of_memory", {}).get(name, []) + [batch]
                gc.collect()  # the failed step's model and activations, before the allocator lets go of them
                torch.cuda.empty_cache()
                if batch <= 1:
                    out[name] = {"ran": False, "why": "out of GPU memory at batch 1"}
                    break
                batch //= 2
            except Exception as err:  # a check that cannot run says why, the others go on
                traceback.print_exc()
                out[name] = {"ran": False, "why": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
                break
        print(f"  {name}: {out[name]}", flush=True)
    return out


def encoder_throughput(cfg: Any, vocab: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Items/s of the exported encoder modules on the device, fp32 and bf16 autocast, per batch size."""
    import torch

    from training.models.dual_encoder import build_dual_encoder

    device = torch.device(gpu_check.DEVICE)
    torch.manual_seed(0)
    model = build_dual_encoder(cfg.model, cfg.frontend, vocab_size=vocab).to(device).eval()
    rows = []
    for kind, module in (("text", model.text_module()), ("audio", model.audio_module())):
        for precision in ("fp32", "bf16"):
            for batch in ENCODER_BATCHES:
                if kind == "audio":
                    inputs: tuple[Any, ...] = (
                        0.1 * torch.randn(batch, int(args.seconds * cfg.frontend.sample_rate), device=device),)
                else:
                    ids = torch.randint(3, vocab, (batch, args.text_length), device=device)
                    inputs = (ids, torch.ones_like(ids))
                autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

                def call(inputs: tuple[Any, ...] = inputs, autocast: Any = autocast, module: Any = module) -> None:
                    with torch.inference_mode(), autocast:
                        module(*inputs)

                for _ in range(3):
                    call()
                gpu_check.sync()
                times: list[float] = []
                started = time.perf_counter()
                while time.perf_counter() - started < args.encoder_seconds or len(times) < 5:
                    start = time.perf_counter()
                    call()
                    gpu_check.sync()
                    times.append(time.perf_counter() - start)
                row = {"kind": kind, "precision": precision, "batch": batch,
                       "items_per_s": batch * len(times) / sum(times),
                       "call_ms_p50": 1000 * statistics.median(times)}
                rows.append(row)
                print(f"  {row}", flush=True)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "settings": {k: getattr(args, k) for k in ("batch", "views", "seconds", "text_length", "steps")},
        "presets": args.presets,
    }
    gpu_check.attempt(results, "environment", gpu_check.environment)
    import torch

    if gpu_check.DEVICE == "cuda" and not torch.cuda.is_available():
        results["skipped"] = "no CUDA device: nothing else can run"
        return results
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            print(f"{preset}: building the full-size model folders", flush=True)
            started = time.perf_counter()
            try:
                cfg, vocab = preset_config(preset, Path(tmp))
            except Exception as err:
                traceback.print_exc()
                results[preset] = {"ran": False, "why": f"{type(err).__name__}: {err}"}
                continue
            entry: dict[str, Any] = {"ran": True, "models_s": time.perf_counter() - started, "vocab": vocab}
            entry["steps"] = training_steps(cfg, vocab, args)
            torch.cuda.empty_cache() if gpu_check.DEVICE == "cuda" else None
            try:
                entry["encoders"] = encoder_throughput(cfg, vocab, args)
            except Exception as err:
                traceback.print_exc()
                entry["encoders_error"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            results[preset] = entry
            if args.out:  # each preset's numbers survive a later one running out of time
                gpu_check.write_results(results, args.out, markdown)
    results["load_1min_end"] = round(os.getloadavg()[0], 2)
    env = results.get("environment", {})
    if "CUDAExecutionProvider" not in env.get("ort_providers", []):
        results["not_run"] = {
            "tonearm's ONNX service on CUDA": "the GPU machine's onnxruntime is CPU-only and onnxruntime-gpu "
            "(a wheel of hundreds of MB) exceeds what can be carried there (64 MiB per call); the encoder "
            "throughput above is the same modules in eager PyTorch on CUDA"}
    return results


def markdown(results: dict[str, Any]) -> str:
    env, s = results.get("environment", {}), results.get("settings", {})
    lines = [
        START,
        "## GPU at real size (`bench/gpu_real_size.py`)",
        "",
        f"`python bench/gpu_real_size.py --out gpu_real_size.json` on {env.get('gpu')} (torch {env.get('torch')}, "
        f"CUDA {env.get('cuda')}), {results['date']}; recorded here with `--record` from "
        "bench/results/. Full default sizes, random weights (tests/real_size_models.py). "
        + (f"Load average {env['load_1min']} at the start and {results.get('load_1min_end')} at the end on "
           f"{env.get('cpus')} CPUs; the GPU machine ran nothing but this command."
           if "load_1min" in env else "Load not recorded by this run."),
        "",
        f"**Training step**, bf16 autocast, AdamW, batch {s.get('batch')} clips of {s.get('seconds')} s with "
        f"{s.get('views')} captions of {s.get('text_length')} tokens each (every caption goes through the text "
        f"tower: {s.get('views', 0) * s.get('batch', 0)} texts per step); median of {s.get('steps')} steps after 2 warm-ups.",
        "",
        "| preset | parameters | objective | batch | step (ms) | samples/s | peak GPU memory (GiB) | loss |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    presets = [p for p in results.get("presets", []) if p in results]
    for preset in presets:
        entry = results[preset]
        if not entry.get("ran"):
            lines.append(f"| {preset} | | not run: {entry.get('why')} | | | | | |")
            continue
        for name in OBJECTIVES:
            r = entry["steps"].get(name, {"ran": False, "why": "not reached"})
            if r["ran"]:
                lines.append(f"| {preset} | {r['parameters'] / 1e6:.1f} M | {name} | {r['batch']} | {r['step_ms']:.0f} | "
                             f"{r['samples_per_s']:.0f} | {r['peak_mib'] / 1024:.1f} | {r['loss']:.3f} |")
            else:
                lines.append(f"| {preset} | | {name} | not run: {r['why']} | | | | |")
        oom = entry["steps"].get("out_of_memory")
        if oom:
            lines.append("")
            lines.append(f"{preset}: out of GPU memory at " + "; ".join(
                f"{name} batch {', '.join(map(str, b))}" for name, b in oom.items()) + " — halved until it fitted.")
    lines += ["", "**CUDA encoder throughput** (the exported encoder modules in eager PyTorch; text "
              f"{s.get('text_length')} tokens, audio {s.get('seconds')}-s clips; items/s, per-call p50 ms):", "",
              "| preset | encoder | precision | " + " | ".join(f"batch {b}" for b in ENCODER_BATCHES) + " |",
              "|---|---|---|" + "---:|" * len(ENCODER_BATCHES)]
    for preset in presets:
        rows = results[preset].get("encoders", [])
        for kind in ("text", "audio"):
            for precision in ("fp32", "bf16"):
                cells = []
                for b in ENCODER_BATCHES:
                    r = next((r for r in rows if (r["kind"], r["precision"], r["batch"]) == (kind, precision, b)), None)
                    cells.append(f"{r['items_per_s']:,.0f} ({r['call_ms_p50']:.1f} ms)" if r else "–")
                if any(c != "–" for c in cells):
                    lines.append(f"| {preset} | {kind} | {precision} | " + " | ".join(cells) + " |")
        if "encoders_error" in results[preset]:
            lines.append(f"| {preset} | not run: {results[preset]['encoders_error']} | | " + "| " * len(ENCODER_BATCHES))
    lines.append("")
    return "\n".join(lines + gpu_check.closing_lines(results, END)) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results JSON here (on the GPU machine)")
    parser.add_argument("--record", type=Path, help="write docs/BENCHMARKS.md's section from this results JSON")
    parser.add_argument("--presets", nargs="+", default=["clap", "ast_xlmr"], choices=["clap", "ast_xlmr", "minilm"])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--views", type=int, default=8, help="captions per clip (the corpus's 8 languages)")
    parser.add_argument("--seconds", type=float, default=10.0, help="clip length")
    parser.add_argument("--text-length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per objective")
    parser.add_argument("--encoder-seconds", type=float, default=2.0, help="timing per encoder row")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: smoke test only")
    args = parser.parse_args()
    gpu_check.DEVICE = args.device
    if args.record:
        gpu_check.record(args.record, markdown, start=START, end=END)
        return
    results = run(args)
    if args.out:
        gpu_check.write_results(results, args.out, markdown)
    print(markdown(results))


if __name__ == "__main__":
    main()
