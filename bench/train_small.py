"""Benchmark: synth small → train configs/default.yaml → evaluate on test.

Measures wall time, prints a table and writes (or replaces) the ``train_small``
section of docs/BENCHMARKS.md with the command, machine, date and numbers.

    OMP_NUM_THREADS=2 python bench/train_small.py
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchlib import cpu_model, write_section

ROOT = Path(__file__).resolve().parents[1]
START = "<!-- bench:train_small:start -->"
END = "<!-- bench:train_small:end -->"


def tonearm(*args: str) -> tuple[float, float]:
    """Run `python -m tonearm.cli ARGS` from the repo root; returns (wall, CPU) seconds."""
    started, cpu = time.monotonic(), _children_cpu()
    subprocess.run([sys.executable, "-m", "tonearm.cli", *args], cwd=ROOT, check=True)
    return time.monotonic() - started, _children_cpu() - cpu


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime




def summarize(
    report: dict[str, float], *, train_minutes: float, train_cpu_minutes: float
) -> dict[str, float]:
    """The numbers of the table: per-direction means over languages, MRV, training time."""
    row = {
        f"{d}_{m}": report[f"{d}_{m}_mean"]
        for d in ("t2a", "a2t")
        for m in ("R@1", "R@5", "R@10", "mAP@10")
    }
    row["mrv_t2a"] = report["mrv_t2a"]
    row["train_min"] = train_minutes
    row["train_cpu_min"] = train_cpu_minutes
    return row


def markdown(row: dict[str, float], *, command: str, synth_note: str, load: float) -> str:
    header = "| metric | value |\n|---|---:|\n"
    body = "".join(
        f"| {k} | {v:.2f} |\n"
        if k in ("mrv_t2a", "train_min", "train_cpu_min")
        else f"| {k} | {100 * v:.1f}% |\n"
        for k, v in row.items()
    )
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    return (
        f"{START}\n## train_small — InfoNCE default config on the synthetic `small` corpus\n\n"
        f"- command: `{command}`\n"
        f"- machine: {cpu_model()}, {os.cpu_count()} cores visible, OMP_NUM_THREADS={threads}, "
        f"load average before the run {load:.1f} (train_min is wall time; train_cpu_min is user+sys "
        "CPU time of the training process — compare it with 2 × train_min to see contention)\n"
        f"- date: {dt.date.today().isoformat()}\n"
        f"- {synth_note}\n"
        "- test split, R@k / mAP@10 are means over the 8 languages (text→audio chance R@10 = 10/#clips); "
        "MRV = mean rank variance text→audio (lower is more consistent)\n\n"
        f"{header}{body}{END}\n"
    )




def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", default="data/small", help="corpus directory (synthesized when missing)"
    )
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--out", default="runs/bench-small")
    parser.add_argument("--docs", default="docs/BENCHMARKS.md")
    args = parser.parse_args()

    load = os.getloadavg()[0]
    manifest = ROOT / args.data / "manifest.jsonl"
    synth_note = f"corpus: existing {args.data}"
    if not manifest.is_file():
        seconds, _ = tonearm("synth", "--size", "small", "--seed", "0", "--out", args.data)
        synth_note = f"corpus: `tonearm synth --size small --seed 0` ({seconds / 60:.1f} min)"
    train_seconds, train_cpu = tonearm(
        "train", args.config, f"data.manifest={manifest}", f"out_dir={args.out}", "--overwrite"
    )
    eval_dir = ROOT / args.out / "eval-test"
    tonearm(
        "evaluate",
        f"{args.out}/best",
        "--data",
        str(manifest),
        "--split",
        "test",
        "--out",
        str(eval_dir),
    )
    report = json.loads((eval_dir / "report.json").read_text(encoding="utf-8"))["metrics"]
    row = summarize(report, train_minutes=train_seconds / 60, train_cpu_minutes=train_cpu / 60)

    print(f"{'metric':<14}{'value':>10}")
    for key, value in row.items():
        print(f"{key:<14}{value:>10.4f}")
    command = f"OMP_NUM_THREADS=2 python bench/train_small.py --config {args.config}"
    write_section(
        markdown(row, command=command, synth_note=synth_note, load=load), ROOT / args.docs, start=START, end=END
    )
    print(f"updated {args.docs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
