"""Time the first-start demo build (synth small → configs/demo.yaml → export) and report its quality.

    taskset -c 0,1 env OMP_NUM_THREADS=2 python bench/demo_build.py   # two cores, as `make serve`

Runs :func:`tonearm.demo._build` — the path the first `tonearm serve` takes — in a fresh
directory, times each stage from the build's own log records, and writes the section
`demo_build` of docs/BENCHMARKS.md with the bundle's held-out per-language t2a R@10 and MRV.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import tempfile
import time
from pathlib import Path

from benchlib import cpu_model, write_section

START = "<!-- bench:demo_build:start -->"
END = "<!-- bench:demo_build:end -->"


class StageClock(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.marks: list[tuple[int, float]] = []
        self.moment_head: float | None = None
        """When the export stage started training the moment head (its last part)."""

    def emit(self, record: logging.LogRecord) -> None:
        stage = getattr(record, "demo_stage", None)
        if stage is not None:
            self.marks.append((int(stage), time.monotonic()))
        if getattr(record, "demo_moment_head", False):
            self.moment_head = time.monotonic()


def main() -> None:
    from index.bundle.format import read_manifest
    from index.languages import DEFAULT_LANGUAGES
    from tonearm.demo import DEMO_CONFIG, _build

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    clock = StageClock()
    logging.getLogger("tonearm.demo").addHandler(clock)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        bundle = _build(Path(scratch) / "demo")
        total = time.monotonic() - started
        report = read_manifest(bundle).evaluation.report
    bounds = [t for _, t in clock.marks] + [started + total]
    stages = {name: bounds[i + 1] - bounds[i] for i, name in enumerate(("synth", "train", "export"))}
    head_seconds = "—" if clock.moment_head is None else f"{started + total - clock.moment_head:.0f}"
    r10 = {lang: 100 * report[f"t2a_R@10_{lang}"] for lang in DEFAULT_LANGUAGES}
    lines = [
        START,
        "## demo_build — the first `make serve`: synth + train + export of the demo bundle",
        "",
        f"- command: `taskset -c 0,1 env OMP_NUM_THREADS=2 python bench/demo_build.py` ({DEMO_CONFIG.name})",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores visible, 2 used; date: {dt.date.today()}; "
        f"1-min load average at the end {os.getloadavg()[0]:.1f}",
        "",
        "- export includes the moment head: trained on the demo's `synth --moments` train split, measured on its "
        "long recordings, published with the bundle (`tonearm.demo.add_moment_head`)",
        "",
        "| synth s | train s | export s | of which moment head s | total min | t2a R@10 min (lang) | t2a R@10 mean "
        "| MRV t2a |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {stages['synth']:.0f} | {stages['train']:.0f} | {stages['export']:.0f} | {head_seconds} | {total / 60:.1f} "
        f"| {min(r10.values()):.1f} ({min(r10, key=r10.__getitem__)}) | {100 * report['t2a_R@10_mean']:.1f} "
        f"| {report['mrv_t2a']:.1f} |",
        END,
    ]
    write_section("\n".join(lines), start=START, end=END)


if __name__ == "__main__":
    main()
