"""docs/results/ from the finished jobs of `tonearm bench quality`: tables, plots, verdicts, README section.

Everything here reads the jobs' ``result.json`` files only, so it can be rerun at any
time (``tonearm bench quality --report-only``) and after every job while the run goes on.

Verdict of a claim "A beats B on metric m" under one condition: the margin is
``mean_A − mean_B`` (sign flipped for lower-is-better metrics such as MRV); when the
intervals ``mean ± std`` of the two overlap (or a side has one seed) the verdict is *inconclusive*, otherwise
*reproduced* (margin > 0) or *not reproduced* (margin < 0).

A seed whose test embeddings collapsed (bench/quality_diagnostics.py: the spread of its test
similarities is below ``COLLAPSE_SPREAD``) is listed under "Collapsed runs" and left out of every
table, plot and mean; a claim with a collapsed seed on either side is *not scored* — a comparison
with a model that did not train says nothing about the method.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from bench.quality_jobs import ROOT, Job, QualityConfig, stats

README_START = "<!-- results:start -->"
README_END = "<!-- results:end -->"
# (column title, metric key, percent?) of the main table
MAIN_COLUMNS: tuple[tuple[str, str, bool], ...] = (
    ("t2a R@1", "t2a_R@1_mean", True), ("t2a R@5", "t2a_R@5_mean", True), ("t2a R@10", "t2a_R@10_mean", True),
    ("t2a mAP@10", "t2a_mAP@10_mean", True), ("a2t R@1", "a2t_R@1_mean", True), ("a2t R@5", "a2t_R@5_mean", True),
    ("a2t R@10", "a2t_R@10_mean", True), ("a2t mAP@10", "a2t_mAP@10_mean", True),
    ("MRV t2a ↓", "mrv_t2a", False), ("MRV a2t ↓", "mrv_a2t", False), ("Gap ↓", "gap_mean", False),
    ("Dis ↓", "dis_mean", False), ("hubness ↓", "hubness", False), ("sim. spread", "similarity_spread", False),
)
NOT_SCORED = "not scored (collapsed run)"


def derived(metrics: dict[str, float]) -> dict[str, float]:
    """Metrics plus r1 (mean R@1 of both directions) and Gap/Dis averaged over non-English languages."""
    out = dict(metrics)
    if "t2a_R@1_mean" in metrics and "a2t_R@1_mean" in metrics:
        out["r1"] = 0.5 * (metrics["t2a_R@1_mean"] + metrics["a2t_R@1_mean"])
    for name in ("gap", "dis"):
        values = [v for k, v in metrics.items() if re.fullmatch(f"{name}_[a-z]{{3}}", k)]
        if values:
            out[f"{name}_mean"] = float(np.mean(values))
    return out


def is_collapsed(result: dict[str, Any]) -> bool:
    """The run's test embeddings collapsed (flag written at evaluation; older results lack it)."""
    return bool(result["metrics"].get("collapsed", 0.0))


def collect(jobs: list[Job], *, collapsed: dict[tuple[str, str], list[dict[str, Any]]] | None = None,
            ) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(condition, method) → the finished seeds' results (metrics with derived keys).

    Collapsed seeds are left out; pass ``collapsed`` to receive them, by the same keys.
    """
    table: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for job in jobs:
        if job.is_done():
            result = json.loads(job.result_path.read_text(encoding="utf-8"))
            result["metrics"] = derived(result["metrics"])
            if is_collapsed(result):
                if collapsed is not None:
                    collapsed.setdefault((job.condition, job.method), []).append(result)
                continue
            table[(job.condition, job.method)].append(result)
    return table


def best_seed(results: list[dict[str, Any]], key: str, *, lower: bool) -> tuple[float, float, int]:
    """The best single seed as (value, 0, seeds): a claim against "the best model", not the average one."""
    values = [r["metrics"][key] for r in results if key in r["metrics"] and math.isfinite(r["metrics"][key])]
    return (min(values) if lower else max(values)), 0.0, len(values)


def cell(mean: float, std: float, *, percent: bool) -> str:
    if math.isnan(mean):
        return "–"
    scale = 100.0 if percent else 1.0
    digits = 1 if percent or abs(mean) >= 10 else 3
    return f"{scale * mean:.{digits}f} ± {scale * std:.{digits}f}"


def verdict(better: tuple[float, float, int], worse: tuple[float, float, int], *, lower: bool) -> tuple[str, float]:
    (mean_b, std_b, n_b), (mean_w, std_w, n_w) = better, worse
    if not n_b or not n_w:
        return "not run", math.nan
    margin = (mean_w - mean_b) if lower else (mean_b - mean_w)
    if min(n_b, n_w) < 2:  # no spread to compare the margin with
        return "inconclusive (one seed)", margin
    if abs(mean_b - mean_w) <= std_b + std_w:
        return "inconclusive", margin
    return ("reproduced" if margin > 0 else "not reproduced"), margin


def claim_rows(cfg: QualityConfig, table: dict[tuple[str, str], list[dict[str, Any]]],
               collapsed: dict[tuple[str, str], list[dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """One row per claim and condition; a side with a collapsed seed makes the row *not scored*."""
    collapsed = collapsed or {}
    rows = []
    for claim in cfg.claims:
        percent = not claim.metric.startswith(("mrv", "gap", "dis", "mean_rank"))
        for condition in cfg.conditions:
            better = stats(table.get((condition, claim.better), []), claim.metric)
            worse = stats(table.get((condition, claim.worse), []), claim.metric)
            if claim.against_best_seed and worse[2]:
                worse = best_seed(table[(condition, claim.worse)], claim.metric, lower=claim.lower)
            fallen = [side for side in (claim.better, claim.worse) if collapsed.get((condition, side))]
            if not better[2] and not worse[2] and not fallen:
                continue
            outcome, margin = verdict(better, worse, lower=claim.lower)
            if fallen:
                outcome = f"{NOT_SCORED}: {', '.join(fallen)}"
            rows.append({"paper": claim.paper, "claim": claim.claim, "condition": condition, "metric": claim.metric,
                         "better": cell(better[0], better[1], percent=percent),
                         "worse": cell(worse[0], worse[1], percent=percent),
                         "margin": margin * (100 if percent else 1), "verdict": outcome,
                         "seeds": min(better[2], worse[2])})
    return rows


# --- markdown ---------------------------------------------------------------------------------

def main_table(cfg: QualityConfig, table: dict, condition: str, collapsed: dict | None = None) -> list[str]:
    head = "| method | seeds | " + " | ".join(title for title, _, _ in MAIN_COLUMNS) + " | train min |"
    lines = [head, "|---|---:|" + "---:|" * (len(MAIN_COLUMNS) + 1)]
    for name, method in cfg.methods.items():
        results = table.get((condition, name))
        fallen = len((collapsed or {}).get((condition, name), []))
        if not results:
            if fallen:
                lines.append(f"| {method.label} (`{name}`) | 0 (+{fallen} collapsed) | "
                             + " | ".join("–" for _ in MAIN_COLUMNS) + " | – |")
            continue
        cells = [cell(*stats(results, key)[:2], percent=percent) for _, key, percent in MAIN_COLUMNS]
        minutes = np.mean([r["train_seconds"] for r in results]) / 60
        seeds = f"{len(results)}" + (f" (+{fallen} collapsed)" if fallen else "")
        lines.append(f"| {method.label} (`{name}`) | {seeds} | " + " | ".join(cells) + f" | {minutes:.1f} |")
    return lines


def collapsed_lines(cfg: QualityConfig, collapsed: dict[tuple[str, str], list[dict[str, Any]]]) -> list[str]:
    """The runs left out because their test embeddings collapsed, with the evidence."""
    from bench.quality_diagnostics import COLLAPSE_SPREAD

    lines = [f"A run is *collapsed* when the standard deviation of its test audio–caption similarities is below "
             f"{COLLAPSE_SPREAD:g} (every pair scored alike: recall at chance). Collapsed runs are left out of the "
             "tables, plots and means, and a claim with a collapsed run on either side is not scored. Hubness is "
             "the skewness of how often each caption is among the audios' 10 nearest (per language, averaged; "
             "bench/quality_diagnostics.py).", ""]
    if not collapsed:
        return lines + ["No run collapsed."]
    lines += ["| condition | method | seed | similarity spread | r1 |", "|---|---|---:|---:|---:|"]
    for (condition, name), results in sorted(collapsed.items()):
        label = cfg.methods[name].label if name in cfg.methods else name
        for r in results:
            lines.append(f"| {condition} | {label} (`{name}`) | {r['seed']} | "
                         f"{r['metrics'].get('similarity_spread', math.nan):.4f} | {100 * r['metrics'].get('r1', math.nan):.1f} |")
    return lines


def language_table(cfg: QualityConfig, table: dict, condition: str, direction: str, languages: list[str]) -> list[str]:
    lines = [f"| method | {' | '.join(languages)} |", "|---|" + "---:|" * len(languages)]
    for name, method in cfg.methods.items():
        results = table.get((condition, name))
        if not results:
            continue
        cells = [cell(*stats(results, f"{direction}_R@1_{lang}")[:2], percent=True) for lang in languages]
        lines.append(f"| {method.label} | " + " | ".join(cells) + " |")
    return lines


def audit_table(cfg: QualityConfig, table: dict, condition: str) -> list[str]:
    lines = ["| method | noisy pairs fitted ↓ | clean pairs fitted | noisy-pair similarity ↓ | clean-pair similarity |",
             "|---|---:|---:|---:|---:|"]
    for name, method in cfg.methods.items():
        audits = [r["noise_audit"] for r in table.get((condition, name), []) if "noise_audit" in r]
        if not audits or "noisy_fitted" not in audits[0]:
            continue

        def ms(key: str, percent: bool, audits: list[dict[str, float]] = audits) -> str:
            values = [a[key] for a in audits]
            return cell(float(np.mean(values)), float(np.std(values)), percent=percent)

        lines.append(f"| {method.label} | {ms('noisy_fitted', True)} | {ms('clean_fitted', True)} | "
                     f"{ms('noisy_similarity', False)} | {ms('clean_similarity', False)} |")
    return lines


def pair_weight_table(cfg: QualityConfig, table: dict, condition: str) -> list[str]:
    """Mean weight of noisy vs clean pairs under each method's own per-pair signal (bench/noise_weights.py)."""
    lines = ["| method | signal | noisy pairs | clean pairs | noisy pairs below the clean median ↑ |",
             "|---|---|---:|---:|---:|"]
    for name, method in cfg.methods.items():
        audits = [r["pair_weights"] for r in table.get((condition, name), []) if r.get("pair_weights")]
        signals = sorted({key.split("|")[0] for audit in audits for key in audit if "|" in key})
        for signal in signals:
            def ms(part: str, percent: bool, signal: str = signal, audits: list[dict[str, float]] = audits) -> str:
                values = [a[f"{signal}|{part}"] for a in audits if f"{signal}|{part}" in a]
                return cell(float(np.mean(values)), float(np.std(values)), percent=percent)

            lines.append(f"| {method.label} | {signal} | {ms('noisy', False)} | {ms('clean', False)} | "
                         f"{ms('below', True)} |")
    return lines if len(lines) > 2 else ["No method with a per-pair signal has finished on this condition yet."]


def languages_of(table: dict) -> list[str]:
    for results in table.values():
        keys = results[0]["metrics"]
        return [k.removeprefix("t2a_R@1_") for k in keys if k.startswith("t2a_R@1_") and not k.endswith("_mean")]
    return []


def machine_line(machine: str | None) -> str:
    from bench.benchlib import cpu_model

    return machine or f"{cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def write_results(cfg: QualityConfig, jobs: list[Job], *, command: str, machine: str | None, smoke: bool) -> Path:
    """Rewrite the results directory (README.md, results.json, PNGs) and, for a full run, the README section."""
    out = ROOT / cfg.results_dir
    out.mkdir(parents=True, exist_ok=True)
    collapsed: dict[tuple[str, str], list[dict[str, Any]]] = {}
    table = collect(jobs, collapsed=collapsed)
    finished = sum(len(v) for v in table.values()) + sum(len(v) for v in collapsed.values())
    languages = languages_of(table)
    claims = claim_rows(cfg, table, collapsed)
    lines = [
        "# Results: every method, clean and noisy correspondences, ≥ 3 seeds",
        "",
        "Generated by `bench/quality_report.py` from the runs' `result.json`; do not edit by hand "
        "(the analysis of the methods that trail is in [laggards.md](laggards.md)).",
        "",
        f"- command: `{command}`",
        f"- machine: {machine_line(machine)}; date: {dt.date.today().isoformat()}; "
        f"1-min load average when written {os.getloadavg()[0]:.1f}",
        f"- jobs finished: {finished} of {len(jobs)}" + (" — **incomplete run: the missing rows were not run**"
                                                         if finished < len(jobs) else ""),
        "- conditions: " + ", ".join(f"{c} (noise {p:g})" for c, p in cfg.conditions.items())
        + f"; seeds {cfg.seeds}; budget overrides: `{' '.join(cfg.train_overrides)}`",
        "- metrics on the test split, mean ± std over seeds (population std); R@k and mAP@10 in %, "
        "averaged over the languages; MRV = mean rank variance of the target across languages, Gap/Dis "
        "averaged over the non-English languages (docs/metrics.md); r1 = mean of t2a and a2t R@1",
    ]
    if (out / "rerun.md").is_file():
        lines.append("- reproduced? part of these runs trained again on another machine, run by run: [rerun.md](rerun.md)")
    if smoke:
        lines += ["", "**Smoke run on `tiny` (1 epoch): checks the pipeline, not the methods.**"]
    if cfg.not_run:
        lines += ["", "Not run on this manifest (their claims are left out too): "
                  + "; ".join(f"{name} — {why}" for name, why in cfg.not_run.items()) + "."]
    lines += ["", "## Budget", "", *([cfg.budget_note.strip(), ""] if cfg.budget_note.strip() else []),
              *budget_lines(cfg, jobs, table)]
    lines += ["", "## Claims", "",
              "Verdict: *inconclusive* when the mean ± std intervals overlap or a side has a single seed; the margin is better − worse "
              "(percentage points for recall, rank² for MRV; positive = the paper's direction).", "",
              "| paper | claim | condition | metric | better | worse | margin | seeds | verdict |",
              "|---|---|---|---|---:|---:|---:|---:|---|"]
    for row in claims:
        lines.append(f"| {row['paper']} | {row['claim']} | {row['condition']} | {row['metric']} | {row['better']} | "
                     f"{row['worse']} | {row['margin']:+.2f} | {row['seeds']} | **{row['verdict']}** |")
    lines += ["", "## Collapsed runs and hubness", "", *collapsed_lines(cfg, collapsed)]
    for condition in cfg.conditions:
        lines += ["", f"## {condition.capitalize()} ({cfg.conditions[condition]:g} noise)", "",
                  *main_table(cfg, table, condition, collapsed)]
        for direction, title in (("t2a", "text→audio"), ("a2t", "audio→text")):
            lines += ["", f"### {title} R@1 per language ({condition})", "",
                      *language_table(cfg, table, condition, direction, languages)]
        if cfg.conditions[condition] > 0:
            lines += ["", f"### Noisy training pairs after training ({condition})", "",
                      "Among the first training clips, an English caption *fits* when its labelled clip ranks "
                      "first. A method that down-weights noisy pairs (DART's reliability, ASK's Ψ, distillation's "
                      "soft targets) should fit fewer noisy pairs than InfoNCE while still fitting the clean ones.",
                      "", *audit_table(cfg, table, condition),
                      "", f"### How each method weighs the noisy pairs ({condition})", "",
                      "Each method's own per-pair signal on labelled training pairs after training (bench/noise_weights.py): "
                      "IOT/DART's transport plan on the labelled pair (B·Π_ii; 1 = InfoNCE's hard target), the "
                      "distillation teachers' soft target p̂_ii (hard label: 1), ASK's reliability Ψ_i and its "
                      "realignment plan B·Q*_ii. The last column is the share of noisy pairs weighted below the median "
                      "clean pair: 50 % = the signal does not tell noisy from clean, 100 % = every noisy pair is "
                      "down-weighted. InfoNCE, SigLIP, SVR, KCL/CACL and triplet have no such signal. Every signal derives from "
                      "the trained embeddings' similarities and a noisy caption is unrelated to its clip, so a high share "
                      "says the signal *can* single the noisy pairs out by the end of training, not that training with it "
                      "helped: that is what the recall tables measure.",
                      "", *pair_weight_table(cfg, table, condition)]
    lines += ["", "## Plots", "", "![R@1 and R@10 per method](recall.png)", "", "![MRV per method](mrv.png)", "",
              "![per-language R@1](languages.png)", "", "![validation curves](curves.png)", ""]
    (out / "README.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "results.json").write_text(json.dumps({
        "command": command, "conditions": cfg.conditions, "seeds": cfg.seeds, "claims": claims,
        "runs": {f"{c}/{m}": [r["metrics"] | {"seed": r["seed"]} for r in rs] for (c, m), rs in table.items()},
        "collapsed": {f"{c}/{m}": [r["metrics"] | {"seed": r["seed"]} for r in rs] for (c, m), rs in collapsed.items()},
        "pair_weights": {f"{c}/{m}": [r["pair_weights"] | {"seed": r["seed"]} for r in rs if r.get("pair_weights")]
                         for (c, m), rs in table.items() if any(r.get("pair_weights") for r in rs)},
    }, indent=1, default=float) + "\n", encoding="utf-8")
    if table:
        from bench.quality_plots import plot_all

        plot_all(cfg, table, languages, out)
    if not smoke and cfg.results_dir == Path("docs/results"):
        write_readme_section(cfg, table, claims, planned=len(jobs), collapsed=collapsed)
    return out


def job_end_time(job: Job) -> float:
    """When the job finished: recorded in result.json, else its log's last write (result.json's
    mtime moves when the pair-weight audit is added afterwards)."""
    result = json.loads(job.result_path.read_text(encoding="utf-8"))
    if "finished_at" in result:
        return float(result["finished_at"])
    log = job.out_dir.parents[2] / "logs" / (job.key.replace("/", "__") + ".log")
    return log.stat().st_mtime if log.is_file() else job.result_path.stat().st_mtime


def job_wall_seconds(job: Job) -> float | None:
    """Start (job.json written) to finish: training, test evaluation and noise audit of one job."""
    if not (job.spec_path.is_file() and job.is_done()):
        return None
    return job_end_time(job) - job.spec_path.stat().st_mtime


def budget_lines(cfg: QualityConfig, jobs: list[Job], table: dict) -> list[str]:
    """How long the whole run takes: measured per job, and the wall clock of the run itself."""
    walls = {job.key: job_wall_seconds(job) for job in jobs}
    measured = {key: t for key, t in walls.items() if t is not None}
    if not measured:
        return ["No job finished yet."]
    overall = float(np.mean(list(measured.values())))
    per_method: dict[str, list[float]] = defaultdict(list)
    for job in jobs:
        if measured.get(job.key) is not None:
            per_method[job.method].append(measured[job.key])
    total = sum(float(np.mean(per_method[job.method])) if per_method.get(job.method) else overall for job in jobs)
    both = [n for n, m in cfg.methods.items() if m.conditions is None]
    one = {n: m.conditions for n, m in cfg.methods.items() if m.conditions is not None}
    done = [job for job in jobs if job.key in measured]
    first_start = min(job.spec_path.stat().st_mtime for job in done)
    last_end = max(job_end_time(job) for job in done)
    slowest = sorted(per_method.items(), key=lambda kv: -float(np.mean(kv[1])))[:3]
    return [
        f"{len(jobs)} jobs: {len(both)} methods on every condition × {len(cfg.seeds)} seeds, plus "
        + ", ".join(f"{n} ({'/'.join(c)})" for n, c in one.items()) + " on one condition each (ablations).",
        "",
        f"Measured per job (wall, one thread, two jobs side by side; training + test evaluation + noise audit): "
        f"mean {overall / 60:.1f} min over {len(measured)} finished jobs; slowest methods "
        + ", ".join(f"{m} {float(np.mean(v)) / 60:.1f} min" for m, v in slowest)
        + f". All {len(jobs)} jobs: about {total / 3600:.1f} job-hours, {total / 3600 / 2:.1f} h with `--workers 2`.",
        "",
        f"Wall clock of this run, first job started → last job finished: **{(last_end - first_start) / 60:.0f} min** "
        f"for {len(done)} jobs (an interrupted and resumed run counts its pause too).",
    ]


def write_readme_section(cfg: QualityConfig, table: dict, claims: list[dict[str, Any]], *, planned: int = 0,
                         collapsed: dict | None = None) -> None:
    """The README's results section: headline table and verdicts, generated from docs/results/."""
    conditions = list(cfg.conditions)
    collapsed = collapsed or {}
    head = "| method | " + " | ".join(f"r1 {c}" for c in conditions) + " | " + " | ".join(
        f"MRV t2a {c} ↓" for c in conditions) + " | " + " | ".join(f"hubness {c} ↓" for c in conditions) + " |"
    lines = [README_START, "",
             "Generated from [docs/results/](docs/results/README.md) by `tonearm bench quality` "
             f"({', '.join(f'{c}: {p:g} noise' for c, p in cfg.conditions.items())}; {len(cfg.seeds)} seeds, "
             "mean ± std; r1 = mean of text→audio and audio→text R@1 over the 8 languages, in %):", "",
             head, "|---|" + "---:|" * (3 * len(conditions))]
    for name, method in cfg.methods.items():
        if not any(table.get((c, name)) or collapsed.get((c, name)) for c in conditions):
            continue

        def shown(c: str, key: str, percent: bool, name: str = name) -> str:
            fallen = len(collapsed.get((c, name), []))
            text = cell(*stats(table.get((c, name), []), key)[:2], percent=percent)
            return text + (f" ({fallen} collapsed)" if fallen else "")

        r1 = [shown(c, "r1", True) for c in conditions]
        mrv = [shown(c, "mrv_t2a", False) for c in conditions]
        hub = [shown(c, "hubness", False) for c in conditions]
        lines.append(f"| {method.label} | " + " | ".join(r1 + mrv + hub) + " |")
    counts: dict[str, int] = defaultdict(int)
    for row in claims:
        counts[NOT_SCORED if row["verdict"].startswith(NOT_SCORED) else row["verdict"]] += 1
    finished = sum(len(v) for v in table.values())
    if finished < planned:
        lines += ["", f"**Subset: {finished} of the {planned} planned runs are done** (docs/results/README.md says "
                  "which); the missing rows and verdicts are not measured yet."]
    verdicts = ", ".join(f"{n} {v}" for v, n in sorted(counts.items())) or "none evaluated yet"
    rerun = ("; the same runs trained again on another machine: docs/results/rerun.md"
             if (ROOT / cfg.results_dir / "rerun.md").is_file() else "")
    lines += ["", f"Paper claims: {verdicts} (per claim and condition, with margins, in docs/results/README.md; "
              f"the settings behind the methods that trailed and how they were fixed: docs/results/laggards.md{rerun}). Every preset trained once for 12 "
              "epochs: docs/BENCHMARKS.md (objectives_small).", "", README_END]
    readme = ROOT / "README.md"
    text = readme.read_text(encoding="utf-8")
    section = "\n".join(lines)
    if README_START in text and README_END in text:
        before, rest = text.split(README_START, 1)
        text = before + section + rest.split(README_END, 1)[1]
    else:  # first generation: the block replaces the hand-written body of the results section
        heading = "## Results on the synthetic corpus\n"
        if heading in text:
            before, rest = text.split(heading, 1)
            after = rest[rest.index("\n## "):] if "\n## " in rest else ""
            text = before + heading + "\n" + section + "\n" + after
        else:
            text = text.rstrip("\n") + "\n\n" + heading + "\n" + section + "\n"
    readme.write_text(text, encoding="utf-8")
