"""Train every objective's shipped preset on the synthetic `small` corpus and compare test metrics.

    OMP_NUM_THREADS=2 python bench/objectives_small.py            # all entries (about an hour)
    OMP_NUM_THREADS=2 python bench/objectives_small.py --only ask --only dart

Each entry runs `tonearm train PRESET` then `tonearm evaluate best --split test` in a
subprocess, and the table in docs/BENCHMARKS.md is rewritten after every entry, so an
interrupted run keeps what finished. Entries whose report already exists are reused unless
`--fresh`. The distillation student uses the three stage-1 runs of this benchmark as teachers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchlib import ROOT, cpu_model, write_section

START = "<!-- bench:objectives_small:start -->"
END = "<!-- bench:objectives_small:end -->"
METRICS = (
    "t2a_R@1_mean",
    "t2a_R@10_mean",
    "t2a_mAP@10_mean",
    "a2t_R@1_mean",
    "a2t_R@10_mean",
    "mrv_t2a",
)


def entries(runs: Path) -> list[tuple[str, str, list[str]]]:
    """(name, preset, extra overrides) in the order they run; teachers come before the student."""
    teachers = [str(runs / f"distill_stage1_{t}" / "best") for t in "abc"]
    return [
        ("infonce", "configs/default.yaml", []),
        ("siglip", "configs/siglip.yaml", []),
        ("infonce+bi-dynamic-svr", "configs/supclap/infonce_bi_dynamic_svr.yaml", []),
        ("cacl", "configs/atri_cacl.yaml", []),
        ("kcl", "configs/atri_kcl.yaml", []),
        ("dart", "configs/dart/dart_ram.yaml", []),
        ("ask", "configs/ask/ask.yaml", []),
        ("distill_stage1_a", "configs/distill_stage1_a.yaml", []),
        ("distill_stage1_b", "configs/distill_stage1_b.yaml", []),
        ("distill_stage1_c", "configs/distill_stage1_c.yaml", []),
        (
            "distill_stage2",
            "configs/distill_stage2.yaml",
            [
                f"model.init_checkpoint={teachers[0]}",
                f"objective.distill.teachers=[{','.join(teachers)}]",
            ],
        ),
    ]


def run_entry(name: str, preset: str, overrides: list[str], *, runs: Path, manifest: Path) -> dict:
    out_dir = runs / name
    started = time.monotonic()
    tonearm = [sys.executable, "-m", "tonearm.cli"]
    subprocess.run(
        [*tonearm, "train", preset, f"out_dir={out_dir}", f"data.manifest={manifest}", *overrides,
         "--overwrite"],  # a benchmark entry replaces its previous run
        check=True,
        cwd=ROOT,
    )
    minutes = (time.monotonic() - started) / 60
    eval_dir = out_dir / "eval-test"
    subprocess.run(
        [
            *tonearm,
            "evaluate",
            str(out_dir / "best"),
            "--data",
            str(manifest),
            "--split",
            "test",
            "--out",
            str(eval_dir),
        ],
        check=True,
        cwd=ROOT,
    )
    metrics = json.loads((eval_dir / "report.json").read_text(encoding="utf-8"))["metrics"]
    row = {"name": name, "preset": preset, "train_minutes": minutes}
    row.update({key: metrics.get(key) for key in METRICS})
    (out_dir / "bench_row.json").write_text(json.dumps(row), encoding="utf-8")
    return row


def markdown(rows: list[dict], *, command: str) -> str:
    def cell(value: float | None, percent: bool) -> str:
        if value is None:
            return "n/a"
        return f"{100 * value:.1f}" if percent else f"{value:.1f}"

    lines = [
        START,
        "## objectives_small — every objective's preset trained on the synthetic `small` corpus",
        "",
        f"- command: `{command}`",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores; date: {dt.date.today().isoformat()}; "
        f"1-min load average at the end {os.getloadavg()[0]:.1f}",
        "- test split (300 clips, 8 languages × 5 captions); R@k and mAP@10 in %, means over the 8 "
        "languages (text→audio chance R@10 = 3.3%); MRV = text→audio mean rank variance (lower is "
        "more consistent); training minutes are wall time including validation and KB rebuilds, "
        "and contention from other jobs on a shared machine (ASK and distillation ran beside others)",
        "",
        "| objective | preset | train min | t2a R@1 | t2a R@10 | t2a mAP@10 | a2t R@1 | a2t R@10 | MRV t2a |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['name']} | `{row['preset']}` | {row['train_minutes']:.1f} | "
            + " | ".join(cell(row[key], percent=not key.startswith("mrv")) for key in METRICS)
            + " |"
        )
    lines.append(END)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/small/manifest.jsonl")
    parser.add_argument("--runs", default="runs/bench-objectives")
    parser.add_argument("--only", action="append", help="entry name (repeatable)")
    parser.add_argument(
        "--fresh", action="store_true", help="retrain entries that already have a result"
    )
    args = parser.parse_args(argv)
    manifest, runs = (ROOT / args.data).resolve(), (ROOT / args.runs).resolve()
    if not manifest.is_file():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "tonearm.cli",
                "synth",
                "--size",
                "small",
                "--out",
                str(manifest.parent),
            ],
            check=True,
        )
    command = "OMP_NUM_THREADS=2 python bench/objectives_small.py" + "".join(
        f" --only {n}" for n in args.only or []
    )
    rows: list[dict] = []
    for name, preset, overrides in entries(runs):
        done = runs / name / "bench_row.json"
        if args.only and name not in args.only:
            if done.is_file():
                rows.append(json.loads(done.read_text(encoding="utf-8")))
            continue
        if done.is_file() and not args.fresh:
            rows.append(json.loads(done.read_text(encoding="utf-8")))
        else:
            print(f"== {name}: {preset}", flush=True)
            rows.append(run_entry(name, preset, overrides, runs=runs, manifest=manifest))
        write_section(markdown(rows, command=command), start=START, end=END)
        print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
