"""Benchmark: what `tonearm train --plan` counts per rank against the memory a real run takes (PSS).

A small real run from shards (configs/tiny.yaml's model, the `tiny` synthetic corpus sharded by
`tonearm data shard`, a longer crop and a bigger batch so the data terms show) is started at two
layouts (data.num_workers 1 and 3, one process, CPU); the PSS (proportional set size: shared pages
split between the processes that map them, so the sum over the process tree counts each page once)
of the training process and of every loader worker is sampled from /proc/PID/smaps_rollup every
0.2 s; the peak of the sum is set against the plan of the same run (`plan_for` on a 1-node, 1-rank
cluster of this machine's memory, the layout's workers; GPU items live in host memory on a CPU run,
so plan = its host figure + its "GPU" figure) — with the default process baseline
(training.memory_plan: MAIN_PROCESS_PSS, WORKER_PSS, measured on one machine) and with a calibration of
this machine (`python -m training.memory_calibration`, its own runs: ``--calibrate`` makes one first,
``--baseline FILE`` reads one). Target (issues 48, 55): the calibrated plan within 25 % of the
measured peak at both layouts. Writes the ``plan_pss`` section of docs/BENCHMARKS.md.

    PYTHONPATH=. flock /tmp/tonearm-heavy.lock python bench/plan_pss.py [--calibrate | --baseline FILE] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.benchlib import cpu_model, publish_section  # noqa: E402
from training.memory_calibration import calibrate, measure, planned, small_shards  # noqa: E402
from training.memory_plan import ProcessBaseline, read_process_baseline  # noqa: E402

START = "<!-- bench:plan_pss:start -->"
END = "<!-- bench:plan_pss:end -->"
LAYOUTS = (1, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calibrate", action="store_true", help="calibrate this machine first (its own runs)")
    parser.add_argument("--baseline", help="a calibration file of `python -m training.memory_calibration`")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    calibration = None
    if args.calibrate:
        calibration = calibrate()
        print(json.dumps({k: v for k, v in calibration.items() if k != "runs"}), flush=True)
        calibrated = ProcessBaseline(calibration["main_pss"], calibration["worker_pss"], "calibrated here")
    elif args.baseline:
        calibrated = read_process_baseline(args.baseline)
    else:
        calibrated = None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shards = small_shards(Path(tmp))
        for workers in LAYOUTS:
            out = Path(tmp) / f"run{workers}"
            got = measure(shards, out, workers)
            default = planned(shards, out, workers, ProcessBaseline())
            mine = planned(shards, out, workers, calibrated) if calibrated else None
            rows.append((workers, got, default, mine))
            print(workers, got, default, mine, flush=True)
    load_after = os.getloadavg()[0]
    mib = 2**20
    table = ["| data.num_workers | processes at the peak (training + validation workers) | measured peak PSS, "
             "process tree | `--plan`, default baseline | plan / measured | `--plan`, calibrated | plan / measured | "
             "training process alone | one worker (max) |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for workers, got, default, mine in rows:
        calibrated_cells = f"{mine / mib:.0f} MiB | {mine / got['peak']:.2f}" if mine else "— | —"
        table.append(f"| {workers} | 1 + 2 × {workers} | {got['peak'] / mib:.0f} MiB | {default / mib:.0f} MiB | "
                     f"{default / got['peak']:.2f} | {calibrated_cells} | {got['main_alone'] / mib:.0f} MiB | "
                     f"{got['worker'] / mib:.0f} MiB |")
    calibration_line = []
    if calibrated is not None:
        source = ("`--calibrate`: `python -m training.memory_calibration`'s two runs, made first"
                  if calibration else f"`--baseline {args.baseline}`")
        calibration_line = [f"Calibrated baseline ({source}, runs other than the ones measured here): training process "
                            f"{calibrated.main / mib:.0f} MiB, loader worker {calibrated.worker / mib:.0f} MiB "
                            f"(default: {ProcessBaseline().main / mib:.0f} and {ProcessBaseline().worker / mib:.0f} MiB)"
                            + (f"; worker figure {calibration['worker_pss_from']}" if calibration else "") + ".", ""]
    flags = " --calibrate" if args.calibrate else f" --baseline {args.baseline}" if args.baseline else ""
    section = "\n".join([
        START,
        "## plan_pss — `tonearm train --plan` against the PSS of a real run (issues 48, 55)",
        "",
        f"`PYTHONPATH=. flock /tmp/tonearm-heavy.lock python bench/plan_pss.py{flags}` · {cpu_model()} · {when} · "
        f"load average {load_before:.2f} → {load_after:.2f} (1-min)",
        "",
        "configs/tiny.yaml from the `tiny` synthetic corpus in shards of 8, batch 16, 4-s crops, prefetch 4, "
        "2 epochs with validation, one process on the CPU; PSS of the training process and every loader worker "
        "(training and validation) summed, sampled every 0.2 s; the plan is `plan_for` of the same config on "
        "a 1-node, 1-rank cluster (host figure + the model state it counts on the GPU, which a CPU run keeps in "
        "host memory).",
        "",
        *calibration_line,
        *table,
        "",
        "The default baseline (`MAIN_PROCESS_PSS`, `WORKER_PSS` in training/memory_plan.py) was measured on one "
        "machine; a process's own memory depends on the machine and the installation (torch's libraries above "
        "all: the review found the default plan 1.70–2.07× the measured PSS on another machine), hence the "
        "calibration, run where the training runs (`python -m training.memory_calibration --out FILE`, then "
        "`--plan --process-baseline FILE`). The training process alone varies by ~100 MiB from run to run; "
        "validation starts as many workers again beside the persistent training workers, and the plan counts "
        "both; a worker's own PSS also holds its share of the pages it shares with the training process, so the "
        "last column overstates it. The plan counts a shuffle buffer only up to a worker's share of the epoch "
        "(here a few clips).",
        *(["The machine was loaded during the runs (see the load average): that slows them, not their memory, "
           "but the training process's own PSS varies by ~100 MiB between runs."] if load_before > 2 else []),
        END,
    ])
    publish_section(section, start=START, end=END, write=not args.no_write)


if __name__ == "__main__":
    main()
