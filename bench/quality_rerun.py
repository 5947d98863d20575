"""`tonearm bench quality_rerun RERUN_RESULTS`: do the published quality numbers reproduce?

Compares a rerun of `tonearm bench quality` (its results.json, e.g. after
``tonearm bench quality --seeds 0 --conditions clean --results /tmp/rerun``) with the published
docs/results/results.json, run by run: the same (condition, method, seed) trained again, on this
machine. For r1 (mean R@1 of both directions), text→audio R@10 and MRV it reports the published
and rerun values, the difference, and the difference in units of the published spread over
seeds — CPU training is not bit-identical across CPUs (kernel choice and summation order), so
the question is whether a rerun stays inside the seed spread the verdicts already account for.

    tonearm bench quality_rerun /tmp/rerun/results.json              # → docs/results/rerun.md
    tonearm bench quality_rerun /tmp/rerun/results.json --out -       # print only

Runs the rerun has and the published results lack are listed, not compared; so are the methods
whose teachers are every seed's stage-1 model (distillation M=3, ``teachers: all_seeds`` in the
benchmark config) when the rerun ran other seeds: `--seeds 0` trains that student from one teacher.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shlex
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.quality_jobs import QualityConfig, load_quality_config  # noqa: E402

PUBLISHED = ROOT / "docs" / "results" / "results.json"
METRICS = (("r1", "r1 (%)", 100.0), ("t2a_R@10_mean", "t2a R@10 (%)", 100.0), ("mrv_t2a", "MRV t2a", 1.0))


Runs = dict[str, dict[int, dict[str, float]]]


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: {path}: not a results.json of `tonearm bench quality` ({err})") from None
    if "runs" not in data:
        raise SystemExit(f"error: {path}: no 'runs' (is it a results.json of `tonearm bench quality`?)")
    return data


def _runs(data: dict[str, Any]) -> Runs:
    return {key: {int(run["seed"]): run for run in runs} for key, runs in data["runs"].items()}


def all_seed_students(cfg: QualityConfig) -> set[str]:
    """Methods whose teachers are every seed's stage-1 run: a rerun of fewer seeds trains another student."""
    return {name for name, spec in cfg.methods.items() if spec.teachers == "all_seeds"}


def _spread(runs: dict[int, dict[str, float]], key: str) -> float:
    values = [run[key] for run in runs.values() if key in run]
    if len(values) < 2:
        return math.nan
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))  # population std, as the tables


def compare(published: Runs, rerun: Runs, *, not_comparable: Collection[str] = ()) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per run of the rerun that the published results hold, and metric; the runs left out."""
    rows: list[dict[str, Any]] = []
    left_out = sorted(f"{key}/seed{seed}" for key in rerun for seed in rerun[key]
                      if seed not in published.get(key, {}) or key.split("/", 1)[1] in not_comparable)
    for key in sorted(set(published) & set(rerun)):
        if key.split("/", 1)[1] in not_comparable:
            continue
        for seed in sorted(set(published[key]) & set(rerun[key])):
            for metric, label, scale in METRICS:
                before, after = published[key][seed].get(metric), rerun[key][seed].get(metric)
                if before is None or after is None:
                    continue
                spread = _spread(published[key], metric)
                rows.append({"run": f"{key}/seed{seed}", "metric": label, "published": before * scale,
                             "rerun": after * scale, "difference": (after - before) * scale,
                             "in_spreads": abs(after - before) / spread if spread > 0 else math.nan})
    return rows, left_out


def verdict_changes(cfg: QualityConfig, published: Runs, rerun: Runs, *, not_comparable: Collection[str],
                    published_claims: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """The paper claims judged again with each rerun run in place of its published seed: (claims, changes)."""
    from bench.quality_report import claim_rows

    mixed = {key: dict(seeds) for key, seeds in published.items()}
    for key, seeds in rerun.items():
        if key.split("/", 1)[1] not in not_comparable and key in mixed:
            mixed[key].update({seed: run for seed, run in seeds.items() if seed in mixed[key]})
    table = {tuple(key.split("/", 1)): [{"metrics": run, "seed": seed} for seed, run in seeds.items()]
             for key, seeds in mixed.items()}
    before = {(c["claim"], c["condition"]): c["verdict"] for c in published_claims}
    after = claim_rows(cfg, table)  # type: ignore[arg-type]
    changes = [f"{row['claim']} ({row['condition']}): {before.get((row['claim'], row['condition']))} → "
               f"{row['verdict']} (margin {row['margin']:+.2f})"
               for row in after if before.get((row["claim"], row["condition"])) != row["verdict"]]
    return len(after), changes


def report(rows: list[dict[str, Any]], left_out: list[str], *, command: str,
           verdicts: tuple[int, list[str]] | None = None, compared_by: str = "") -> str:
    from bench.benchlib import cpu_model

    r1 = [row for row in rows if row["metric"] == "r1 (%)"]
    within = [row for row in r1 if row["in_spreads"] <= 2]
    lines = [
        "# Rerun of the published quality runs",
        "",
        "Generated by `bench/quality_rerun.py`; do not edit by hand. The same (condition, method, seed) "
        "trained again and compared with docs/results/results.json. *in spreads* = |difference| / the "
        "published std over seeds for that method and condition.",
        "",
        f"- command: `{command}`" + (f"; compared by `{compared_by}`" if compared_by else ""),
        f"- machine: {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"date: {dt.date.today().isoformat()}",
        f"- runs compared: {len(r1)}; r1 within 2 published spreads: {len(within)} of {len(r1)}; "
        + (f"largest r1 difference {max(abs(r['difference']) for r in r1):.2f} points; "
           f"mean r1 difference {sum(r['difference'] for r in r1) / len(r1):+.2f} points" if r1 else "none"),
    ]
    if left_out:
        lines.append(f"- rerun but not compared (not published, or a student of every seed's teachers): "
                     f"{', '.join(left_out)}")
    if verdicts is not None:
        claims, changes = verdicts
        lines.append(f"- paper claims judged again with the rerun runs in place of the published ones: "
                     f"{claims - len(changes)} of {claims} keep their verdict"
                     + (": changed — " + "; ".join(changes) if changes else ""))
    lines += ["", "| run | metric | published | rerun | difference | in spreads |", "|---|---|---:|---:|---:|---:|"]
    for row in rows:
        spreads = "–" if math.isnan(row["in_spreads"]) else f"{row['in_spreads']:.1f}"
        lines.append(f"| {row['run']} | {row['metric']} | {row['published']:.2f} | {row['rerun']:.2f} | "
                     f"{row['difference']:+.2f} | {spreads} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tonearm bench quality_rerun", description=__doc__.splitlines()[0])
    parser.add_argument("rerun", type=Path, help="results.json of the rerun")
    parser.add_argument("--published", type=Path, default=PUBLISHED, help="default docs/results/results.json")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "rerun.md"), help="markdown to write, - to print")
    parser.add_argument("--command", help="the rerun's command, written into the report (default: the rerun's own)")
    parser.add_argument("--config", type=Path, default=ROOT / "bench" / "quality.yaml",
                        help="the benchmark config both ran (default bench/quality.yaml)")
    args = parser.parse_args(argv)
    published, rerun = _load(args.published), _load(args.rerun)
    published_runs, rerun_runs = _runs(published), _runs(rerun)
    cfg = load_quality_config(args.config)
    not_comparable = all_seed_students(cfg) if rerun.get("seeds") != published.get("seeds") else set()
    rows, left_out = compare(published_runs, rerun_runs, not_comparable=not_comparable)
    if not rows:
        raise SystemExit(f"error: {args.rerun} and {args.published} have no run in common")
    verdicts = verdict_changes(cfg, published_runs, rerun_runs, not_comparable=not_comparable,
                               published_claims=published.get("claims", []))
    compared_by = "tonearm bench quality_rerun " + shlex.join(sys.argv[1:] if argv is None else argv)
    text = report(rows, left_out, command=args.command or rerun.get("command", ""), verdicts=verdicts,
                  compared_by=compared_by)
    if args.out == "-":
        print(text, end="")
    else:
        Path(args.out).write_text(text, encoding="utf-8")
        print(text.split("\n\n| run")[0])
        print(f"== written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
