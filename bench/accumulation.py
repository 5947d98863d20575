"""Benchmark: gradient accumulation (``optim.accum_steps``) — exactness at 4 × 64 = 256, and its cost.

Exactness (the issue 31 target): for every objective family (InfoNCE, SigLIP, KCL, CACL,
dynamic SVR, distillation, DART = IOT + UWD/RAM, ASK), one step on a batch of 256 in one
pass vs in 4 micro-batches of 64 (training/accumulate.py), with the small MLP encoders of
the distributed equivalence test (no BatchNorm, no dropout), in float32 and float64: the
largest difference of the loss and of any gradient entry relative to that gradient's
largest entry.

Cost: one optimizer step of the real ``tiny`` model (configs/tiny.yaml: audio CNN with
BatchNorm + text transformer, 2-s clips, InfoNCE) on a batch of ``--batch`` with N = 1, 2,
4 micro-batches; median step time over ``--steps`` steps after one warm-up, and the rise
of the process's peak RSS over the steps (each N in a fresh process, one thread).

    python bench/accumulation.py                  # table + docs/BENCHMARKS.md (~1 min)
    python bench/accumulation.py --no-write
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import cpu_model, publish_section, random_train_inputs  # noqa: E402

START, END = "<!-- bench/accumulation.py -->", "<!-- /bench/accumulation.py -->"
FAMILIES = {
    "InfoNCE": "infonce", "SigLIP": "siglip", "KCL": "kcl", "CACL": "cacl-local", "SVR (dynamic)": "svr-dynamic",
    "distillation": "distill", "DART (IOT + UWD/RAM)": "dart", "ASK": "ask",
}


def family_batch(rows: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from tests.training.test_distributed_equivalence import DIM, FEATURES, LANGUAGES, LENGTH, VOCAB

    g = torch.Generator().manual_seed(1)
    views = len(LANGUAGES)
    text_mask = torch.rand(views, rows, generator=g) > 0.2
    text_mask[0] = True
    return {
        "waveform": torch.randn(rows, FEATURES, generator=g, dtype=dtype),
        "input_ids": torch.randint(1, VOCAB, (views, rows, LENGTH), generator=g),
        "attention_mask": torch.ones(views, rows, LENGTH, dtype=torch.long),
        "text_mask": text_mask,
        "clip_index": torch.arange(rows),
        "teacher_audio": F.normalize(torch.randn(2, rows, DIM, generator=g, dtype=dtype), dim=-1),
        "teacher_text": F.normalize(torch.randn(2, views, rows, DIM, generator=g, dtype=dtype), dim=-1)
        * text_mask[None, :, :, None],
    }


def family_step(name: str, rows: int, steps: int, dtype: torch.dtype) -> tuple[float, dict[str, torch.Tensor]]:
    from tests.training.test_distributed_equivalence import (
        CASES,
        DIM,
        LANGUAGES,
        POOL,
        PoolContext,
        TinyEncoders,
    )
    from training.accumulate import accumulated_backward
    from training.config import ObjectiveConfig
    from training.loop import TrainStep
    from training.objectives import build_objective, total_loss
    from training.objectives.base import BuildEnv

    torch.set_default_dtype(dtype)
    spec, _ = CASES[name]
    torch.manual_seed(0)
    model = TinyEncoders()
    objective = build_objective(ObjectiveConfig(**spec), BuildEnv(languages=LANGUAGES, embed_dim=DIM))
    step = TrainStep(model, objective)  # type: ignore[arg-type]
    batch = family_batch(rows, dtype)
    if "distill" not in spec:
        batch = {k: v for k, v in batch.items() if not k.startswith("teacher_")}
    g = torch.Generator().manual_seed(2)
    pool = {
        "waveform": torch.randn(POOL, batch["waveform"].shape[1], generator=g, dtype=dtype),
        "input_ids": batch["input_ids"][0, :POOL].clone(),
        "attention_mask": batch["attention_mask"][0, :POOL].clone(),
    }
    objective.on_step_start(PoolContext(model, pool))
    if steps == 1:
        loss = total_loss(step(**batch))
        loss.backward()
    else:
        _, loss = accumulated_backward(step, dict(batch), steps, autocast=contextlib.nullcontext)
    grads = {n: p.grad.clone() for n, p in step.named_parameters() if p.grad is not None}
    torch.set_default_dtype(torch.float32)
    return float(loss.detach()), grads


def exactness(rows: int, steps: int) -> list[tuple[str, str, float, float]]:
    out = []
    for label, name in FAMILIES.items():
        for dtype in (torch.float32, torch.float64):
            loss_1, grads_1 = family_step(name, rows, 1, dtype)
            loss_n, grads_n = family_step(name, rows, steps, dtype)
            worst = max(
                float((grads_n[k] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for k, g in grads_1.items()
            )
            out.append((label, str(dtype).removeprefix("torch."), abs(loss_n - loss_1), worst))
    return out


def cost_worker(_: int, steps: int, batch: int, repeats: int, out: str) -> None:
    from training.accumulate import accumulated_backward
    from training.config import load_train_config
    from training.loop import TrainStep
    from training.models.dual_encoder import build_dual_encoder
    from training.objectives import build_objective, total_loss
    from training.objectives.base import BuildEnv

    torch.set_num_threads(1)
    cfg = load_train_config(ROOT / "configs" / "tiny.yaml", [])
    torch.manual_seed(0)
    model = build_dual_encoder(cfg.model, cfg.frontend, vocab_size=cfg.model.text.vocab_size)
    objective = build_objective(cfg.objective, BuildEnv(languages=tuple(cfg.data.languages), embed_dim=model.embed_dim))
    step = TrainStep(model, objective).train()
    inputs = random_train_inputs(
        batch, views=1, seconds=2.0, sample_rate=cfg.frontend.sample_rate, vocab=cfg.model.text.vocab_size, device="cpu"
    )
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        if steps == 1:
            total_loss(step(**inputs)).backward()
        else:
            accumulated_backward(step, inputs, steps, autocast=contextlib.nullcontext)
        step.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    rise = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
    Path(out).write_text(f"{statistics.median(times[1:])} {rise}")


def cost(steps: int, batch: int, repeats: int) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result")
        mp.spawn(cost_worker, args=(steps, batch, repeats, out), nprocs=1, join=True)
        seconds, rise = Path(out).read_text().split()
    return float(seconds), int(rise)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256, help="batch of the exactness check")
    parser.add_argument("--micro", type=int, default=4, help="micro-batches of the exactness check")
    parser.add_argument("--batch", type=int, default=64, help="batch of the cost measurement")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    load = open("/proc/loadavg").read().split()[:3]
    exact = exactness(args.rows, args.micro)
    costs: dict[int, tuple[float, int]] = {n: cost(n, args.batch, args.steps) for n in (1, 2, 4)}
    load_after = open("/proc/loadavg").read().split()[:3]
    mib = 2**20
    lines = [
        START,
        "## Gradient accumulation (`bench/accumulation.py`)",
        "",
        f"`python bench/accumulation.py` — {cpu_model()}, {os.cpu_count()} cores shared with other work "
        f"(load average {' '.join(load)} before, {' '.join(load_after)} after), torch {torch.__version__}, "
        f"{dt.date.today().isoformat()}.",
        "",
        f"Exactness: one step on a batch of {args.rows} in one pass vs {args.micro} micro-batches of "
        f"{args.rows // args.micro} (MLP encoders of the equivalence test; largest gradient difference "
        "relative to that gradient's largest entry):",
        "",
        "| objective | dtype | |Δ loss| | max relative Δ gradient |",
        "|---|---|---:|---:|",
    ]
    lines += [f"| {label} | {dtype} | {dl:.1e} | {dg:.1e} |" for label, dtype, dl, dg in exact]
    lines += [
        "",
        f"Cost: one forward + backward of the `tiny` model (audio CNN + text transformer, InfoNCE, 2-s clips) on "
        f"a batch of {args.batch}, one thread, median of {args.steps} steps; peak-RSS rise over the steps "
        "(fresh process per row; includes allocator slack):",
        "",
        "| micro-batches | step (ms) | peak-RSS rise (MiB) |",
        "|---:|---:|---:|",
    ]
    lines += [f"| {n} | {1000 * s:.0f} | {r / mib:.0f} |" for n, (s, r) in costs.items()]
    lines += [
        "",
        "The objective sees the whole batch either way; the towers' forward runs twice with N > 1 "
        "(embedding pass without gradient, then again with it), so time rises while activation memory "
        "falls to that of one micro-batch.",
        END,
    ]
    publish_section("\n".join(lines) + "\n", start=START, end=END, write=not args.no_write)


if __name__ == "__main__":
    main()
