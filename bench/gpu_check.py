"""GPU check: the CUDA paths of training and export, run where a GPU is lent, with numbers.

What it runs (each part records what it could not run and why, and never stops the rest):

* **AMP steps** — one optimizer step of KCL (8 languages), of DART (IOT + UWD with
  RAM) and of ASK (fine + coarse KBs over 20k random pairs on the device) through the real :class:`training.loop.TrainStep` with the default model (random
  weights, 4-s waveforms, batch ``--batch``), under bf16 autocast and under fp16 with a
  grad scaler (``training.runtime``): median step time over 5 steps after 2 warm-ups,
  peak GPU memory, final loss (must be finite).
* **Training loop on CUDA** — ``tonearm train configs/tiny.yaml device=cuda`` for one
  epoch on the synthetic tiny corpus (AMP on), when the corpus can be generated.
* **ONNX export and parity on CUDA** — both towers exported from the CUDA module and run
  with onnxruntime (CUDA provider when this onnxruntime has it, else CPU); minimum
  per-item cosine against the torch CUDA output.
* **Knowledge-base build** — ASK's fine and coarse KBs (``training.knowledge``) over
  ``--kb-pairs`` random unit pairs: FAISS K-Means on the GPU when faiss-gpu is importable
  (else on the CPU, recorded), and the top-10 search of a batch on the CUDA device.

    python bench/gpu_check.py --out gpu_check.json          # on the GPU machine
    python bench/gpu_check.py --record gpu_check.json       # here: docs/BENCHMARKS.md section
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import random_train_inputs, write_section  # noqa: E402

START, END = "<!-- bench/gpu_check.py -->", "<!-- /bench/gpu_check.py -->"
LANGUAGES = ("en", "de", "fr", "es", "it", "pt", "ja", "zh")
DEVICE = "cuda"
"""``--device cpu`` smoke-tests this script where there is no GPU (no AMP, no memory numbers)."""


def sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def peak_mib() -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if DEVICE == "cuda" else math.nan


def attempt(results: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    """Run one check; a failure is recorded (one line) instead of stopping the others."""
    try:
        results[name] = {"ran": True, **fn()}
    except Exception as err:  # a check that cannot run here says why
        results[name] = {"ran": False, "why": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
        traceback.print_exc()


def environment() -> dict[str, Any]:
    import onnxruntime as ort
    import torch

    info: dict[str, Any] = {
        "load_1min": round(os.getloadavg()[0], 2),  # at the start: the GPU machine runs nothing else
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "bf16": torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        "onnxruntime": ort.__version__,
        "ort_providers": ort.get_available_providers(),
    }
    try:
        import faiss

        from index.engines.faiss_index import faiss_gpu_count

        info["faiss"] = faiss.__version__
        info["faiss_gpus"] = faiss_gpu_count()
    except ImportError as err:
        info["faiss"] = f"not importable ({err})"
        info["faiss_gpus"] = 0
    return info


class RandomKnowledge:
    """ASK's training context with random unit "training-set" pairs on the device (no audio files here)."""

    def __init__(self, device: Any, dim: int, pairs: int = 20_000) -> None:
        import torch
        import torch.nn.functional as F

        self.epoch, self.step, self.device = 0, 0, device
        generator = torch.Generator(device=device).manual_seed(1)
        self.audio = F.normalize(torch.randn(pairs, dim, device=device, generator=generator), dim=-1)
        self.text = F.normalize(self.audio + 0.5 * torch.randn(pairs, dim, device=device, generator=generator), dim=-1)
        self.clip = torch.arange(pairs, device=device) + 1_000_000  # never a batch clip: nothing excluded

    def embed_training_pairs(self) -> tuple[Any, Any, Any]:
        return self.audio, self.text, self.clip


def amp_step(objective_spec: dict[str, Any], amp_dtype: str, batch: int, *, cfg: Any = None, vocab: int = 8000,
             views: int = len(LANGUAGES), seconds: float = 4.0, text_length: int = 24,
             timed_steps: int = 5) -> dict[str, Any]:
    """One optimizer step of ``objective_spec`` under AMP: median time over ``timed_steps`` after two
    warm-ups, peak memory, last loss. ``cfg`` (a TrainConfig; default: the default model) picks the
    model — bench/gpu_real_size.py passes the real-size presets; token ids are drawn below ``vocab``."""
    import torch

    from training.config import ObjectiveConfig, TrainConfig
    from training.loop import TrainStep
    from training.models.dual_encoder import build_dual_encoder
    from training.objectives import build_objective, total_loss
    from training.objectives.base import BuildEnv
    from training.runtime import Runtime, amp_dtype_for, autocast, make_grad_scaler

    device = torch.device(DEVICE)
    cfg = cfg or TrainConfig()
    torch.manual_seed(0)
    model = build_dual_encoder(cfg.model, cfg.frontend, vocab_size=vocab).to(device).train()
    objective = build_objective(
        ObjectiveConfig(**objective_spec), BuildEnv(languages=LANGUAGES, embed_dim=model.embed_dim)
    ).to(device)
    step = TrainStep(model, objective)
    runtime = Runtime(device=device, amp_dtype=amp_dtype_for(device, enabled=True, choice=amp_dtype))  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(step.parameters(), lr=1e-4)
    scaler = make_grad_scaler(runtime)
    inputs = random_train_inputs(
        batch, views=views, seconds=seconds, sample_rate=cfg.frontend.sample_rate, vocab=vocab, device=device,
        length=text_length,
    )

    context = RandomKnowledge(device, model.embed_dim)

    def one_step() -> float:
        objective.on_step_start(context)  # type: ignore[arg-type]  # builds ASK's KBs at the first step
        with autocast(runtime):
            loss = total_loss(step(**inputs))
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(step.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        return float(loss.detach())

    for _ in range(2):
        one_step()
    sync()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, loss = [], math.nan
    for _ in range(timed_steps):
        start = time.perf_counter()
        loss = one_step()
        sync()
        times.append(time.perf_counter() - start)
    if not math.isfinite(loss):
        raise FloatingPointError(f"loss {loss} under {amp_dtype}")
    return {
        "autocast": str(runtime.amp_dtype).removeprefix("torch."),
        "grad_scaler": scaler.is_enabled(),
        "batch": batch,
        "views": views,
        "parameters": sum(p.numel() for p in model.parameters()),
        "step_ms": 1000 * statistics.median(times),
        "samples_per_s": batch / statistics.median(times),
        "peak_mib": peak_mib(),
        "loss": loss,
    }


def cuda_training_loop(work: Path) -> dict[str, Any]:
    from training.config import load_train_config
    from training.data.synth import generate_corpus
    from training.loop import train

    manifest = generate_corpus(size="tiny", seed=0, out_dir=work / "tiny")
    start = time.perf_counter()
    cfg = load_train_config(
        ROOT / "configs" / "tiny.yaml",
        [f"data.manifest={manifest}", f"out_dir={work / 'run'}", f"device={DEVICE}", "optim.epochs=1"],
    )
    train(cfg)
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    report = next(r for r in records if r["kind"] == "eval")
    return {"seconds": time.perf_counter() - start, "t2a_R@10_mean": report["t2a_R@10_mean"]}


def onnx_parity(work: Path) -> dict[str, Any]:
    import numpy as np
    import onnxruntime as ort
    import torch

    from training.bundle.onnx_export import _export
    from training.config import TrainConfig
    from training.models.dual_encoder import build_dual_encoder

    device = torch.device(DEVICE)
    cfg = TrainConfig()
    torch.manual_seed(0)
    model = build_dual_encoder(cfg.model, cfg.frontend, vocab_size=8000).to(device).eval()
    provider = "CUDAExecutionProvider" if "CUDAExecutionProvider" in ort.get_available_providers() else "CPUExecutionProvider"
    waveform = 0.1 * torch.randn(4, 5 * cfg.frontend.sample_rate, device=device)
    ids = torch.randint(1, 8000, (4, 32), device=device)
    mask = torch.ones_like(ids)
    out: dict[str, Any] = {"ort_provider": provider}
    for name, module, args, names in (
        ("audio", model.audio_module(), (waveform,), ["waveform"]),
        ("text", model.text_module(), (ids, mask), ["input_ids", "attention_mask"]),
    ):
        path = work / f"{name}.onnx"
        start = time.perf_counter()
        _export(module, args, path, input_names=names, opset=18)
        out[f"{name}_export_s"] = time.perf_counter() - start
        with torch.no_grad():
            expected = module(*args).float().cpu().numpy()
        session = ort.InferenceSession(str(path), providers=list(dict.fromkeys([provider, "CPUExecutionProvider"])))
        got = session.run(["embedding"], {n: a.cpu().numpy() for n, a in zip(names, args, strict=True)})[0]
        cosine = (expected * got).sum(-1) / (np.linalg.norm(expected, axis=-1) * np.linalg.norm(got, axis=-1))
        out[f"{name}_min_cosine"] = float(cosine.min())
    return out


def kb_build(pairs: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from index.engines.faiss_index import faiss_gpu_count
    from training.knowledge import build_coarse_kb, build_fine_kb

    device = torch.device(DEVICE)
    generator = torch.Generator(device=device).manual_seed(0)
    audio = F.normalize(torch.randn(pairs, 256, device=device, generator=generator), dim=-1)
    text = F.normalize(audio + 0.5 * torch.randn(pairs, 256, device=device, generator=generator), dim=-1)
    clip = torch.arange(pairs, device=device)
    start = time.perf_counter()
    fine = build_fine_kb(audio, text, clip)
    fine_s = time.perf_counter() - start
    start = time.perf_counter()
    build_coarse_kb(audio, text, n_clusters=512)
    coarse_s = time.perf_counter() - start
    queries = audio[:64]
    fine.retrieve(queries, text[:64], k=10, exclude_clip=clip[:64])
    sync()
    start = time.perf_counter()
    for _ in range(10):
        fine.retrieve(queries, text[:64], k=10, exclude_clip=clip[:64])
    sync()
    return {
        "pairs": pairs,
        "kmeans_on": "GPU (faiss-gpu)" if faiss_gpu_count() > 0 else "CPU (faiss without GPU support here)",
        "fine_build_s": fine_s,
        "coarse_build_s": coarse_s,
        "search_batch64_ms": 100 * (time.perf_counter() - start),
    }


def run_checks(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")}
    attempt(results, "environment", environment)
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        results["skipped"] = "no CUDA device: nothing else can run"
        return results
    kcl = {"base": {"name": "infonce"}, "strategy": {"name": "kcl"}}
    dart = {"base": {"name": "iot"}, "regularizers": [{"name": "uwd", "marginals": "ram"}]}
    ask = {"base": {"name": "infonce"}, "knowledge": {"refresh_epochs": None}}
    for name, spec in (("kcl", kcl), ("dart", dart), ("ask", ask)):
        for dtype in ("bf16", "fp16"):
            attempt(results, f"{name}_{dtype}", lambda spec=spec, dtype=dtype: amp_step(spec, dtype, args.batch))
    with tempfile.TemporaryDirectory() as tmp:
        attempt(results, "training_loop", lambda: cuda_training_loop(Path(tmp)))
        attempt(results, "onnx", lambda: onnx_parity(Path(tmp)))
    attempt(results, "kb", lambda: kb_build(args.kb_pairs))
    env = results.get("environment", {})
    results["not_run"] = {
        **(
            {}
            if env.get("faiss_gpus")
            else {"faiss-gpu": "faiss here has no GPU support (the faiss-gpu-cu12 wheel, 66 MB plus CUDA 12 "
                  "libraries this CUDA 13 image lacks, exceeds what can be carried to the lent GPU machine, "
                  "64 MiB per call); K-Means ran on the CPU"}
        ),
        "nccl": "one GPU per machine here: NCCL between ranks needs two GPUs (gloo ran on CPU in the tests)",
        **(
            {}
            if "CUDAExecutionProvider" in env.get("ort_providers", [])
            else {"onnxruntime CUDA provider": "this onnxruntime is CPU-only (onnxruntime-gpu wheels are "
                  "hundreds of MB); parity ran torch-CUDA vs onnxruntime-CPU"}
        ),
    }
    return results


def markdown(results: dict[str, Any]) -> str:
    env = results.get("environment", {})
    lines = [
        START,
        "## GPU check (`bench/gpu_check.py`)",
        "",
        f"`python bench/gpu_check.py --out bench/results/gpu_check_h100.json` on {env.get('gpu')} (torch {env.get('torch')}, "
        f"CUDA {env.get('cuda')}, onnxruntime {env.get('onnxruntime')}, faiss {env.get('faiss')}), "
        f"{results['date']}; recorded here with `--record`. Default model, random weights, 4-s clips.",
        "",
        "| check | autocast | grad scaler | batch | step (ms) | peak GPU memory (MiB) | loss |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for name in ("kcl_bf16", "kcl_fp16", "dart_bf16", "dart_fp16", "ask_bf16", "ask_fp16"):
        if name not in results:  # a check this version of the script did not have
            continue
        r = results[name]
        if r["ran"]:
            lines.append(
                f"| {name.split('_')[0].upper()} step | {r['autocast']} | {'yes' if r['grad_scaler'] else 'no'} | "
                f"{r['batch']} | {r['step_ms']:.1f} | {r['peak_mib']:.0f} | {r['loss']:.4f} |"
            )
        else:
            lines.append(f"| {name} | not run: {r['why']} | | | | | |")
    lines.append("")
    loop, onnx, kb = (results.get(k, {"ran": False, "why": "not reached"}) for k in ("training_loop", "onnx", "kb"))
    lines.append(
        "- Training loop on CUDA (`configs/tiny.yaml device=cuda`, 1 epoch, AMP): "
        + (f"{loop['seconds']:.1f} s for training and validation, finite metrics (t2a R@10 {loop['t2a_R@10_mean']:.3f} "
           "on the 8 validation clips of `tiny`, where that is easy)" if loop["ran"] else f"not run: {loop['why']}")
    )
    lines.append(
        "- ONNX export from the CUDA module and parity: "
        + (
            f"audio min cosine {onnx['audio_min_cosine']:.6f} (export {onnx['audio_export_s']:.1f} s), "
            f"text {onnx['text_min_cosine']:.6f} (export {onnx['text_export_s']:.1f} s), onnxruntime on {onnx['ort_provider']}"
            if onnx["ran"] else f"not run: {onnx['why']}"
        )
    )
    lines.append(
        "- ASK knowledge bases: "
        + (
            f"{kb['pairs']:,} pairs, fine KB {kb['fine_build_s']:.2f} s, coarse KB (512 clusters, K-Means on "
            f"{kb['kmeans_on']}) {kb['coarse_build_s']:.2f} s, top-10 search of 64 queries on CUDA "
            f"{kb['search_batch64_ms']:.2f} ms"
            if kb["ran"] else f"not run: {kb['why']}"
        )
    )
    return "\n".join(lines + closing_lines(results, END)) + "\n"


def closing_lines(results: dict[str, Any], end: str) -> list[str]:
    """What could not run and why, then the section's end marker (this script's and gpu_real_size's)."""
    lines = [f"- Not run — {what}: {why}." for what, why in results.get("not_run", {}).items()]
    if "skipped" in results:
        lines.append(f"- {results['skipped']}")
    return [*lines, end]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results JSON here (on the GPU machine)")
    parser.add_argument("--record", type=Path, help="write docs/BENCHMARKS.md's section from this results JSON")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--kb-pairs", type=int, default=100_000)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: smoke test only")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.record:
        record(args.record, markdown, start=START, end=END)
        return
    results = run_checks(args)
    print(json.dumps(results, indent=2))
    if args.out:
        write_results(results, args.out, markdown)


def record(path: Path, render: Callable[[dict[str, Any]], str], *, start: str, end: str) -> None:
    """docs/BENCHMARKS.md's section between ``start`` and ``end``, rendered from a results JSON."""
    text = render(json.loads(path.read_text()))
    write_section(text, start=start, end=end)
    print(text)


def write_results(results: dict[str, Any], out: Path, render: Callable[[dict[str, Any]], str]) -> None:
    """The results JSON at ``out`` and its rendered section beside it (``.md``)."""
    out.write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(render(results))


if __name__ == "__main__":
    main()
