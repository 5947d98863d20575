"""Benchmark: what `tonearm train --plan` counts per rank against the memory a real run takes (PSS).

A small real run from shards (configs/tiny.yaml's model, the `tiny` synthetic corpus sharded by
`tonearm data shard`, a longer crop and a bigger batch so the data terms show) is started at two
layouts (data.num_workers 1 and 3, one process, CPU); the PSS (proportional set size: shared pages
split between the processes that map them, so the sum over the process tree counts each page once)
of the training process and of every loader worker is sampled from /proc/PID/smaps_rollup every
0.2 s; the peak of the sum is set against the plan of the same run (`plan_for` on a 1-node, 1-rank
cluster of this machine's memory, the layout's workers; GPU items live in host memory on a CPU run,
so plan = its host figure + its "GPU" figure). Also printed: the training process alone before any
worker starts and a worker's PSS (the baselines `training.memory_plan` counts:
MAIN_PROCESS_PSS, WORKER_PSS). Target (issue 48): plan within 25 % of the measured peak at both
layouts. Writes the ``plan_pss`` section of docs/BENCHMARKS.md.

    PYTHONPATH=. flock /tmp/tonearm-heavy.lock python bench/plan_pss.py [--no-write]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.benchlib import cpu_model, publish_section  # noqa: E402

START = "<!-- bench:plan_pss:start -->"
END = "<!-- bench:plan_pss:end -->"
LAYOUTS = (1, 3)
OVERRIDES = ["data.manifest=null", "optim.epochs=2", "optim.batch_size=16", "data.clip_seconds=4.0",
             "data.languages=[eng,fra]", "data.drop_other_languages=true", "eval.select_metric=t2a_R@10_eng",
             "data.prefetch_factor=4", "threads=1"]


def pss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def children(pid: int) -> list[int]:
    out = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            text = (task / "children").read_text().split()
            out += [int(c) for c in text]
    except OSError:
        pass
    return out + [g for c in out for g in children(c)]


def measure(shards: Path, out: Path, workers: int) -> dict[str, float]:
    cmd = [sys.executable, "-m", "tonearm.cli", "train", str(ROOT / "configs" / "tiny.yaml"), *OVERRIDES,
           f"data.shards={shards}", f"data.num_workers={workers}", f"out_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak, main_alone, worker_max, main_peak = 0, 0, 0, 0
    while proc.poll() is None:
        kids = [k for k in children(proc.pid) if pss(k)]
        main = pss(proc.pid)
        total = main + sum(pss(k) for k in kids)
        if not kids:
            main_alone = max(main_alone, main)
        else:
            worker_max = max([worker_max, *(pss(k) for k in kids)])
        main_peak = max(main_peak, main)
        peak = max(peak, total)
        time.sleep(0.2)
    _, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(err[-3000:])
    return {"peak": peak, "main_alone": main_alone, "worker": worker_max, "main_peak": main_peak}


def plan_figure(shards: Path, out: Path, workers: int) -> tuple[int, int, int]:
    from training.config import load_train_config
    from training.data.cluster_plan import Cluster, plan_for

    cfg = load_train_config(ROOT / "configs" / "tiny.yaml", [*OVERRIDES, f"data.shards={shards}",
                                                             f"data.num_workers={workers}", f"out_dir={out}"])
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    plan = plan_for(cfg, Cluster(nodes=1, gpus_per_node=1, cores_per_node=workers + 1, memory_per_node=memory,
                                 shm_per_node=memory // 2))
    return plan.node_host_bytes + plan.gpu_bytes, plan.node_host_bytes, plan.gpu_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    from training.data.shards import shard_manifest
    from training.data.synth import generate_corpus

    load_before = os.getloadavg()[0]
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        manifest = generate_corpus(size="tiny", seed=0, out_dir=Path(tmp) / "corpus")
        shards = Path(tmp) / "shards"
        shard_manifest(manifest, shards, sample_rate=16_000, shard_size=8, workers=1, progress=False)
        for workers in LAYOUTS:
            got = measure(shards, Path(tmp) / f"run{workers}", workers)
            planned, host, gpu = plan_figure(shards, Path(tmp) / f"run{workers}", workers)
            rows.append((workers, got, planned, host, gpu))
            print(workers, got, planned, host, gpu, flush=True)
    load_after = os.getloadavg()[0]
    mib = 2**20
    table = ["| data.num_workers | processes at the peak (training + validation workers) | measured peak PSS, "
             "process tree | `--plan` (host + model state) | plan / measured | training process alone | "
             "one worker (max) |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for workers, got, planned, _, _ in rows:
        table.append(f"| {workers} | 1 + 2 × {workers} | {got['peak'] / mib:.0f} MiB | {planned / mib:.0f} MiB | "
                     f"{planned / got['peak']:.2f} | {got['main_alone'] / mib:.0f} MiB | {got['worker'] / mib:.0f} MiB |")
    section = "\n".join([
        START,
        "## plan_pss — `tonearm train --plan` against the PSS of a real run (issue 48)",
        "",
        f"`PYTHONPATH=. flock /tmp/tonearm-heavy.lock python bench/plan_pss.py` · {cpu_model()} · {when} · "
        f"load average {load_before:.2f} → {load_after:.2f} (1-min)",
        "",
        "configs/tiny.yaml from the `tiny` synthetic corpus in shards of 8, batch 16, 4-s crops, prefetch 4, "
        "2 epochs with validation, one process on the CPU; PSS of the training process and every loader worker "
        "(training and validation) summed, sampled every 0.2 s; the plan is `plan_for` of the same config on "
        "a 1-node, 1-rank cluster (host figure + the model state it counts on the GPU, which a CPU run keeps in "
        "host memory).",
        "",
        *table,
        "",
        "The plan's baselines (`MAIN_PROCESS_PSS`, `WORKER_PSS` in training/memory_plan.py) come from these "
        "runs: the training process alone before its workers start (torch, the model, the corpus metadata; "
        "it varies by ~100 MiB from run to run), and what the tree's sum grows by per worker process (a "
        "worker's own PSS also holds its share of the pages it shares with the training process, so the "
        "last column overstates it). Validation starts as many workers again beside the persistent training "
        "workers, and the plan counts both. The plan counts a shuffle buffer only up to a worker's share of "
        "the epoch (here a few clips).",
        *(["The machine was loaded during the runs (see the load average): that slows them, not their memory, "
           "but the training process's own PSS varies by ~100 MiB between runs."] if load_before > 2 else []),
        END,
    ])
    publish_section(section, start=START, end=END, write=not args.no_write)


if __name__ == "__main__":
    main()
