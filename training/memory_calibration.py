"""``python -m training.memory_calibration [--out FILE]``: what a training process and a loader worker
take of their own on this machine, for ``tonearm train CONFIG --plan --process-baseline FILE``.

The plan counts a rank's data item by item (index, shuffle buffers, batches in flight) and its
processes by a baseline (:class:`training.memory_plan.ProcessBaseline`): the training process's own
PSS (the interpreter, torch and its libraries, autograd's and AdamW's working memory at a small model)
and each loader worker's. That baseline depends on the machine and the installation — torch's
libraries above all — and the default was measured on one machine: elsewhere the plan came out at
1.70–2.07× a run's measured PSS (issue 55). So measure it where the run will run (the training
image, on a node of the cluster):

    python -m training.memory_calibration --out /shared/process-baseline.json   # ~1 min, 2 small runs
    tonearm train CONFIG … --plan --process-baseline /shared/process-baseline.json …

It runs a small real training from shards (configs/tiny.yaml's model, the ``tiny`` synthetic corpus,
4-s crops, batch 16, 2 epochs with validation, on the CPU) at 1 and 3 loader workers, samples the PSS of
the whole process tree every 0.2 s (PSS: shared pages split between the processes mapping them, so the
sum counts each page once), and sets each run's peak against the plan of the same run with a zero
baseline: what is left is the processes' own memory, ``main + 2 × workers × worker``. The training
process's figure is the mean of the two runs' (``worker`` from the difference of the two when it is
above the runs' noise, else the default's 16 MiB). bench/plan_pss.py checks a calibrated plan against
other runs of the same machine. A real run's node check at start reads the file named by
``$TONEARM_PROCESS_BASELINE``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from training.config import load_train_config
from training.data.cluster_plan import Cluster, plan_for
from training.data.shards import shard_manifest
from training.data.synth import generate_corpus
from training.memory_plan import WORKER_PSS, ProcessBaseline

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny.yaml"
LAYOUTS = (1, 3)
OVERRIDES = ["data.manifest=null", "optim.epochs=2", "optim.batch_size=16", "data.clip_seconds=4.0",
             "data.languages=[eng,fra]", "data.drop_other_languages=true", "eval.select_metric=t2a_R@10_eng",
             "data.prefetch_factor=4", "threads=1"]
"""The small run measured (bench/plan_pss.py runs the same)."""
WORKER_NOISE = 4 * 2**20
"""Below this a worker's figure from two runs' difference is noise (the training process's own PSS varies
by ~100 MiB from run to run): the default is kept."""


def pss(pid: int) -> int:
    """The PSS of process ``pid`` (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def children(pid: int) -> list[int]:
    """Every descendant of ``pid``."""
    out = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return out + [g for c in out for g in children(c)]


def measure(shards: Path, out: Path, workers: int) -> dict[str, int]:
    """The small run at ``workers`` loader workers: the peak PSS of its process tree, the training process
    alone before any worker started, its largest worker, its own peak."""
    cmd = [sys.executable, "-m", "tonearm.cli", "train", str(CONFIG), *OVERRIDES, f"data.shards={shards}",
           f"data.num_workers={workers}", f"out_dir={out}"]
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
        raise RuntimeError(f"the calibration run failed: {err[-3000:]}")
    return {"peak": peak, "main_alone": main_alone, "worker": worker_max, "main_peak": main_peak}


def planned(shards: Path, out: Path, workers: int, baseline: ProcessBaseline) -> int:
    """What ``--plan`` counts for the small run (1 node, 1 rank of this machine's memory): its host figure
    and the model state it counts on the GPU, which a CPU run keeps in host memory."""
    cfg = load_train_config(CONFIG, [*OVERRIDES, f"data.shards={shards}", f"data.num_workers={workers}",
                                     f"out_dir={out}"])
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    plan = plan_for(cfg, Cluster(nodes=1, gpus_per_node=1, cores_per_node=workers + 1, memory_per_node=memory,
                                 shm_per_node=memory // 2, processes=baseline))
    return plan.node_host_bytes + plan.gpu_bytes


def small_shards(folder: Path) -> Path:
    """The ``tiny`` synthetic corpus sharded as `tonearm data shard` does (shards of 8)."""
    manifest = generate_corpus(size="tiny", seed=0, out_dir=folder / "corpus")
    shard_manifest(manifest, folder / "shards", sample_rate=16_000, shard_size=8, workers=1, progress=False)
    return folder / "shards"


def machine() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} CPUs"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fit(runs: list[dict[str, Any]]) -> tuple[int, int, str]:
    """(main, worker, how the worker's figure was found) from runs with ``workers`` and ``residual``
    (peak − the plan with a zero baseline = main + 2 × workers × worker)."""
    first, last = runs[0], runs[-1]
    worker, how = WORKER_PSS, "default (the runs' difference was within their noise)"
    if last["workers"] != first["workers"]:
        slope = (last["residual"] - first["residual"]) / (2 * (last["workers"] - first["workers"]))
        if slope >= WORKER_NOISE:
            worker, how = int(slope), "from the runs' difference"
    main = round(sum(r["residual"] - 2 * r["workers"] * worker for r in runs) / len(runs))
    return max(0, main), worker, how


def calibrate(layouts: tuple[int, ...] = LAYOUTS) -> dict[str, Any]:
    """Run the small run at each layout and fit the baseline (module doc); the calibration file's content."""
    import torch

    zero = ProcessBaseline(main=0, worker=0, source="zero")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        shards = small_shards(Path(tmp))
        for workers in layouts:
            out = Path(tmp) / f"run{workers}"
            got = measure(shards, out, workers)
            counted = planned(shards, out, workers, zero)
            runs.append({"workers": workers, **got, "plan_without_processes": counted,
                         "residual": got["peak"] - counted})
            sys.stderr.write(json.dumps(runs[-1]) + "\n")
    main, worker, how = fit(runs)
    return {"main_pss": main, "worker_pss": worker, "worker_pss_from": how, "machine": machine(),
            "python": platform.python_version(), "torch": torch.__version__,
            "when": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "load": os.getloadavg()[0],
            "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the calibration here (default: print it)")
    args = parser.parse_args()
    result = calibrate()
    text = json.dumps(result, indent=2) + "\n"
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
        sys.stderr.write(f"process baseline: training process {result['main_pss'] / 2**20:.0f} MiB, loader worker "
                         f"{result['worker_pss'] / 2**20:.0f} MiB ({result['machine']}) -> {args.out}; use "
                         f"`tonearm train … --plan --process-baseline {args.out}`\n")
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
