"""`tonearm bench quality [CONFIG]`: every method on the same data, budget and seeds, clean and noisy.

    tonearm bench quality                        # bench/quality.yaml: the full run (about 2 h on 2 cores)
    tonearm bench quality --smoke                # the whole pipeline on `tiny` (a few minutes)
    tonearm bench quality --manifest clotho.jsonl --results docs/results-clotho
    tonearm bench quality bench/laggards.yaml --only siglip_2x --seeds 0 1   # part of a sweep

Each (condition, method, seed) is one job: train with the method's preset plus the
config's budget overrides, evaluate `best/` on the test split, and (noisy condition) audit
how well the model fits the noisy training pairs. A job writes `job.json` (its preset and
overrides) when it starts and `result.json` when it is done; a rerun skips finished jobs
whose `job.json` still matches (a changed budget or preset reruns them rather than
reporting a stale number) and resumes an interrupted training from its `last/`.
Jobs run in parallel (``--workers``, default: the cores) with one thread each; the
distillation students start when their stage-1 teachers are done. Once the jobs are done,
the noisy jobs' per-pair weights are audited (bench/noise_weights.py: how each method's own
signal weighs the noisy pairs). After every job the tables, plots and verdicts under the
results directory are rewritten (bench/quality_report.py). The config's schema and the job record
are bench/quality_jobs.py's, below this runner and its report.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.context
import os
import shutil
import sys
import time
from collections import defaultdict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

_CHECKOUT = str(Path(__file__).resolve().parents[1])
if _CHECKOUT not in sys.path:  # run as a script: the repository's packages are importable
    sys.path.insert(0, _CHECKOUT)

from bench.quality_jobs import (  # noqa: E402
    DEFAULT_CONFIG,
    ROOT,
    CorpusSpec,
    Job,
    QualityConfig,
    load_quality_config,
)
from bench.quality_report import write_results  # noqa: E402
from index.errors import TonearmError  # noqa: E402

SMOKE_METHODS = ("infonce", "svr_bi_dynamic", "stage1", "distill_m1", "dart_ram", "ask")
"""A method of each kind the pipeline treats differently (plain, regularized, teacher → student, OT,
knowledge bases)."""


def smoke_config(cfg: QualityConfig) -> QualityConfig:
    """A few methods on `tiny`, 1 epoch, 2 seeds, both conditions: the whole pipeline in CI (~1 min)."""
    methods = {name: spec for name, spec in cfg.methods.items() if name in SMOKE_METHODS}
    claims = [c for c in cfg.claims if c.better in methods and c.worse in methods]
    return cfg.model_copy(update={
        "methods": methods,
        "claims": claims,
        "corpus": CorpusSpec(size="tiny", seed=0, dir=Path("data/tiny")),
        "seeds": cfg.seeds[:2],
        "runs_dir": Path("runs/bench-quality-smoke"),
        "train_overrides": [
            *cfg.train_overrides, "data.clip_seconds=2.0", "model.embed_dim=32", "model.audio.channels=[8,16]",
            "model.text.width=32", "model.text.layers=1", "model.text.heads=2", "model.text.vocab_size=300",
            "optim.epochs=1", "optim.batch_size=8", "optim.warmup_steps=1", "eval.every_epochs=1",
            "eval.batch_size=32",
        ],
    })


# --- data -------------------------------------------------------------------------------------

def prepare_manifests(cfg: QualityConfig, *, workers: int) -> dict[str, Path]:
    """The clean manifest (synthesised once when absent) and one noisy copy per noisy condition."""
    from training.data.manifest import read_manifest, write_manifest
    from training.data.noise import inject_caption_noise

    if cfg.manifest is not None:
        clean = (ROOT / cfg.manifest) if not cfg.manifest.is_absolute() else cfg.manifest
        if not clean.is_file():
            raise TonearmError(f"manifest {clean} not found")
    else:
        corpus_dir = ROOT / cfg.corpus.dir
        clean = corpus_dir / "manifest.jsonl"
        if not clean.is_file():
            from training.data.synth import generate_corpus

            print(f"== synthesising the {cfg.corpus.size} corpus into {corpus_dir}", flush=True)
            generate_corpus(size=cfg.corpus.size, seed=cfg.corpus.seed, out_dir=corpus_dir,
                            workers=workers, progress=False)
    manifests: dict[str, Path] = {}
    for condition, fraction in cfg.conditions.items():
        if fraction == 0:
            manifests[condition] = clean
            continue
        noisy = clean.with_name(f"{clean.stem}-noise{fraction:g}.jsonl")
        if not noisy.is_file() or noisy.stat().st_mtime < clean.stat().st_mtime:
            records = [record for _, record in read_manifest(clean, languages=None)]
            count = inject_caption_noise(records, fraction, seed=cfg.corpus.seed)
            write_manifest(records, noisy)
            print(f"== {condition}: {count} training caption slots swapped → {noisy}", flush=True)
        manifests[condition] = noisy
    return manifests


def manifest_languages(manifest: Path) -> list[str]:
    """The caption languages every split of `manifest` has, in the project's language order."""
    from index.languages import DEFAULT_LANGUAGES
    from training.data.manifest import read_manifest

    per_split: dict[str, set[str]] = defaultdict(set)
    for _, record in read_manifest(manifest, languages=None):
        per_split[record.split].update(lang for lang, captions in record.captions.items() if captions)
    missing = {"train", "test"} - set(per_split)
    if missing:
        raise TonearmError(f"{manifest}: no {' or '.join(sorted(missing))} split; the benchmark trains on 'train' "
                           "and reports on 'test'")
    common = set.intersection(*per_split.values())
    if not common:
        raise TonearmError(f"{manifest}: no caption language is present in every split "
                           f"({', '.join(f'{s}: {sorted(langs)}' for s, langs in sorted(per_split.items()))})")
    return [lang for lang in DEFAULT_LANGUAGES if lang in common] + sorted(common - set(DEFAULT_LANGUAGES))


def fit_to_manifest(cfg: QualityConfig, languages: list[str]) -> QualityConfig:
    """A user's manifest (Clotho, AudioCaps …): train on its languages, leave out what needs more.

    English-only Clotho has one caption language, so the cross-lingual methods (KCL, CACL) and
    the claims that compare them are not run; the report says so rather than failing 24 jobs.
    """
    not_run = {name: f"needs ≥ {spec.min_languages} caption languages; the manifest has {', '.join(languages)}"
               for name, spec in cfg.methods.items() if spec.min_languages > len(languages)}
    if cfg.teacher_method in not_run:
        not_run.update({name: f"its teacher {cfg.teacher_method} is not run"
                        for name, spec in cfg.methods.items() if spec.teachers})
    methods = {name: spec for name, spec in cfg.methods.items() if name not in not_run}
    claims = [c for c in cfg.claims if c.better in methods and c.worse in methods]
    return cfg.model_copy(update={
        "methods": methods, "claims": claims, "not_run": not_run,
        "train_overrides": [*cfg.train_overrides, f"data.languages=[{','.join(languages)}]"],
    })


# --- jobs -------------------------------------------------------------------------------------

def plan_jobs(cfg: QualityConfig, manifests: dict[str, Path]) -> list[Job]:
    """Every (condition, method, seed), seed by seed, teachers before their students."""
    jobs: list[Job] = []
    runs = ROOT / cfg.runs_dir
    for condition in cfg.conditions:
        for name, method in cfg.methods.items():
            if method.conditions is not None and condition not in method.conditions:
                continue
            for seed in cfg.seeds:
                out_dir = runs / condition / name / f"seed{seed}"
                overrides = [*cfg.train_overrides, *method.overrides, f"seed={seed}", f"out_dir={out_dir}",
                             f"data.manifest={manifests[condition]}", f"threads={cfg.threads_per_job}"]
                depends: list[str] = []
                if method.teachers:
                    teacher_seeds = [seed] if method.teachers == "same_seed" else list(cfg.seeds)
                    teachers = [runs / condition / cfg.teacher_method / f"seed{s}" / "best" for s in teacher_seeds]
                    overrides += [f"model.init_checkpoint={runs / condition / cfg.teacher_method / f'seed{seed}' / 'best'}",
                                  f"objective.distill.teachers=[{','.join(map(str, teachers))}]"]
                    depends = [f"{condition}/{cfg.teacher_method}/seed{s}" for s in teacher_seeds]
                jobs.append(Job(condition, name, seed, out_dir, overrides, method.preset, manifests[condition],
                                noisy=cfg.conditions[condition] > 0, depends=depends))
    # Seed-major order: an interrupted or time-boxed run has every method on the first seeds
    # rather than some methods on all seeds; students wait for their teachers anyway.
    return sorted(jobs, key=lambda job: (bool(job.depends), job.seed))


def run_job(job: Job) -> dict[str, Any]:
    """Train (resuming from `last/`), evaluate on test, audit the noisy pairs; write result.json."""
    from training.config import load_train_config
    from training.loop import train

    overrides = list(job.overrides)
    fingerprint = job.fingerprint()
    same_job = job.spec_path.is_file() and json.loads(job.spec_path.read_text(encoding="utf-8")) == fingerprint
    if same_job and (job.out_dir / "last").is_dir():
        overrides.append("resume=true")
    elif job.out_dir.exists():
        # died before its first checkpoint, or left by another budget/preset: start clean
        shutil.rmtree(job.out_dir)
    job.out_dir.mkdir(parents=True, exist_ok=True)
    job.spec_path.write_text(json.dumps(fingerprint, indent=1) + "\n", encoding="utf-8")
    cfg = load_train_config(ROOT / job.preset, overrides)
    started_at = time.time()
    started = time.monotonic()
    train(cfg)
    train_seconds = time.monotonic() - started
    metrics = evaluate_best(job.out_dir / "best", job.manifest, split="test")
    result: dict[str, Any] = {
        "condition": job.condition, "method": job.method, "seed": job.seed, "job": fingerprint,
        "train_seconds": train_seconds,
        "metrics": metrics, "curve": validation_curve(job.out_dir / "metrics.jsonl"),
    }
    if job.noisy:
        result["noise_audit"] = audit_noisy_pairs(job.out_dir / "best", job.manifest)
    result["started_at"], result["finished_at"] = started_at, time.time()
    job.result_path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


def evaluate_best(checkpoint: Path, manifest: Path, *, split: str) -> dict[str, float]:
    """The retrieval report of `checkpoint` on `split`, plus the collapse and hubness diagnostics
    (bench/quality_diagnostics.py) of the same test embeddings."""
    import math

    import numpy as np
    import torch

    from bench.quality_diagnostics import embedding_diagnostics
    from index.metrics.retrieval import retrieval_report
    from training.checkpoint import load_checkpoint
    from training.evaluate import embed_clips, embed_texts, load_split, prepare_eval_set

    loaded = load_checkpoint(checkpoint, device="cpu")
    records = load_split(manifest, data_cfg=loaded.config.data, split=split)
    eval_set = prepare_eval_set(records, data_cfg=loaded.config.data, frontend_cfg=loaded.config.frontend)
    device, batch = torch.device("cpu"), loaded.config.eval.batch_size
    audio = embed_clips(loaded.model, eval_set.records, data_cfg=loaded.config.data,
                        frontend_cfg=loaded.config.frontend, batch_size=batch, device=device).numpy()
    captions = eval_set.captions
    text = embed_texts(loaded.model, loaded.tokenizer, captions.texts, batch_size=batch, device=device).numpy()
    report = retrieval_report(audio_emb=audio, text_emb=text, caption_clip=np.asarray(captions.clip),
                              caption_lang=np.asarray(captions.lang), caption_group=np.asarray(captions.group),
                              languages=list(eval_set.languages))
    report.update(embedding_diagnostics(audio, text, list(captions.lang)))
    return {key: float(value) for key, value in report.items() if math.isfinite(float(value))}


def validation_curve(metrics_jsonl: Path) -> list[dict[str, float]]:
    """(epoch, mean R@1 of both directions, mean loss) per validation of the run."""
    rows = [json.loads(line) for line in metrics_jsonl.read_text(encoding="utf-8").splitlines() if line.strip()]
    losses = {row["epoch"]: row["loss"] for row in rows if row.get("kind") == "epoch"}
    return [
        {"epoch": row["epoch"], "r1": 0.5 * (row["t2a_R@1_mean"] + row["a2t_R@1_mean"]),
         "loss": losses.get(row["epoch"], float("nan"))}
        for row in rows if row.get("kind") == "eval"
    ]


def audit_noisy_pairs(checkpoint: Path, manifest: Path) -> dict[str, float]:
    """How much the trained model still believes the noisy training pairs, against the clean ones.

    Among the first ``AUDIT_CLIPS`` training clips, each English caption ranks the clips; a
    noisy caption "fitted" means its (wrong) labelled clip is ranked first — the model
    memorised the mismatch. A method that down-weights noisy pairs fits fewer of them.
    Also reported: mean similarity of noisy vs clean labelled pairs.
    """
    import numpy as np
    import torch

    from bench.noise_weights import AUDIT_CLIPS, english_training_pairs
    from training.checkpoint import load_checkpoint
    from training.evaluate import embed_clips, embed_texts, load_split, prepare_eval_set

    loaded = load_checkpoint(checkpoint, device="cpu")
    records = load_split(manifest, data_cfg=loaded.config.data, split="train")[:AUDIT_CLIPS]
    eval_set = prepare_eval_set(records, data_cfg=loaded.config.data, frontend_cfg=loaded.config.frontend)
    device = torch.device("cpu")
    audio = embed_clips(loaded.model, eval_set.records, data_cfg=loaded.config.data,
                        frontend_cfg=loaded.config.frontend, batch_size=loaded.config.eval.batch_size, device=device)
    texts, owners, noisy, _ = english_training_pairs(records)
    text = embed_texts(loaded.model, loaded.tokenizer, texts, batch_size=loaded.config.eval.batch_size, device=device)
    similarity = (text @ audio.t()).numpy()
    owner = np.asarray(owners)
    is_noisy = np.asarray(noisy)
    labelled = similarity[np.arange(len(owner)), owner]
    fitted = similarity.argmax(axis=1) == owner
    out = {"noisy_captions": float(is_noisy.sum()), "clean_captions": float((~is_noisy).sum())}
    if is_noisy.any():
        out["noisy_fitted"] = float(fitted[is_noisy].mean())
        out["noisy_similarity"] = float(labelled[is_noisy].mean())
    out["clean_fitted"] = float(fitted[~is_noisy].mean())
    out["clean_similarity"] = float(labelled[~is_noisy].mean())
    return out


def backfill_pair_weights(jobs: list[Job]) -> int:
    """The per-pair weight audit (bench/noise_weights.py) of finished noisy jobs that lack it.

    A separate pass over the `best/` checkpoints, so that the audit can change without
    retraining; ``pair_weights`` is null for a method without such a signal. Returns how
    many jobs it audited.
    """
    from bench.noise_weights import pair_weight_audit

    todo, no_checkpoint = [], []
    for job in jobs:
        if job.noisy and job.is_done():
            result = json.loads(job.result_path.read_text(encoding="utf-8"))
            if "pair_weights" in result:
                continue
            # a result.json copied without its checkpoints (docs/results/runs): the audit needs the model
            (todo if (job.out_dir / "best").is_dir() else no_checkpoint).append((job, result))
    if no_checkpoint:
        print(f"   pair weights not audited for {len(no_checkpoint)} job(s) without a best/ checkpoint "
              f"(delete their result.json to retrain them): {', '.join(job.key for job, _ in no_checkpoint)}",
              flush=True)
    for count, (job, result) in enumerate(todo, 1):
        result["pair_weights"] = pair_weight_audit(job.out_dir / "best", job.manifest)
        job.result_path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"   pair weights {count}/{len(todo)}: {job.key}"
              + ("" if result["pair_weights"] else " (no per-pair signal)"), flush=True)
    return len(todo)


def _job_context() -> multiprocessing.context.ForkServerContext:
    """The forkserver the jobs are forked from: it imports torch, torch._dynamo, matplotlib and the
    training loop once (training/warm_imports.py), where a fresh process paid ~8 s per job."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["training.warm_imports"])
    return ctx


def _job_main(spec: str, log_path: str) -> None:
    """A job process's body: output into its log, one thread, the job run from ``spec``."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115 (the process's own stream)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
    os.chdir(ROOT)
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # one core per job, its loader workers too
    import torch

    torch.set_num_threads(1)
    fields = json.loads(spec)
    try:
        run_job(Job(**{**fields, "out_dir": Path(fields["out_dir"]), "preset": Path(fields["preset"]),
                       "manifest": Path(fields["manifest"])}))
    except BaseException:
        import traceback

        traceback.print_exc()  # its last line, the error, is what the lead process reports
        sys.stderr.flush()
        raise SystemExit(1) from None


def _job_process(job: Job, log_dir: Path) -> dict[str, Any]:
    """Run one job in its own process (one thread, forked from the jobs' forkserver), its output in a log file."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / (job.key.replace("/", "__") + ".log")
    spec = json.dumps({**job.__dict__, "out_dir": str(job.out_dir), "preset": str(job.preset),
                       "manifest": str(job.manifest)})
    process = _job_context().Process(target=_job_main, args=(spec, str(log_path)), name=job.key)
    process.start()
    process.join()
    code = process.exitcode
    if code != 0:
        lines = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines() if log_path.is_file() else []
        tail = lines[-1:] or [""]
        raise TonearmError(f"{job.key} failed (exit {code}): {tail[0]} — full log {log_path}")
    return json.loads(job.result_path.read_text(encoding="utf-8"))


def run_all(cfg: QualityConfig, jobs: list[Job], *, workers: int, on_result: Any) -> list[str]:
    """Run the unfinished jobs, at most `workers` at a time; returns the keys that failed."""
    done = {job.key for job in jobs if job.is_done()}
    pending = [job for job in jobs if job.key not in done]
    total, failed = len(jobs), []
    stale = [job.key for job in pending if job.result_path.is_file()]
    if stale:
        print(f"== {len(stale)} finished job(s) were run with another preset or budget and run again: "
              f"{', '.join(stale[:3])}{' …' if len(stale) > 3 else ''}", flush=True)
    print(f"== {len(done)} of {total} jobs already done; {len(pending)} to run on {workers} workers", flush=True)
    started = time.monotonic()
    finished_now = 0
    running: dict[Future[dict[str, Any]], Job] = {}
    log_dir = ROOT / cfg.runs_dir / "logs"
    with ThreadPoolExecutor(max_workers=workers) as pool:
        while pending or running:
            for job in [j for j in pending if set(j.depends) & set(failed)]:
                pending.remove(job)
                failed.append(job.key)
                print(f"   skipped {job.key}: a teacher failed", flush=True)
            for job in [j for j in pending if set(j.depends) <= done]:
                if len(running) >= workers:
                    break
                pending.remove(job)
                running[pool.submit(_job_process, job, log_dir)] = job
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                job = running.pop(future)
                try:
                    result = future.result()
                except TonearmError as err:
                    failed.append(job.key)
                    print(f"   FAILED {err}", flush=True)
                    continue
                done.add(job.key)
                finished_now += 1
                elapsed = time.monotonic() - started
                left = len(pending) + len(running)
                eta = elapsed / finished_now * left
                print(f"[{len(done)}/{total}] {job.key}: r1 {100 * _r1(result['metrics']):.1f}% "
                      f"({result['train_seconds'] / 60:.1f} min) — elapsed {elapsed / 60:.1f} min, "
                      f"about {eta / 60:.0f} min left", flush=True)
                on_result()
    return failed


def _r1(metrics: dict[str, float]) -> float:
    return 0.5 * (metrics.get("t2a_R@1_mean", 0.0) + metrics.get("a2t_R@1_mean", 0.0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tonearm bench quality", description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG), help="benchmark YAML (default bench/quality.yaml)")
    parser.add_argument("--smoke", action="store_true", help="the whole pipeline on `tiny`, 1 epoch, 2 seeds (CI)")
    parser.add_argument("--manifest", help="run on this manifest instead of the synthetic corpus")
    parser.add_argument("--results", help="results directory (default: the config's results_dir)")
    parser.add_argument("--runs", help="runs directory (default: the config's runs_dir)")
    parser.add_argument("--corpus-dir", help="where the synthetic corpus is (written when absent)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="parallel jobs (default: the cores)")
    parser.add_argument("--only", action="append", help="method name (repeatable); others keep their results")
    parser.add_argument("--conditions", nargs="+", help="run only these conditions (e.g. clean); others keep their results")
    parser.add_argument("--seeds", nargs="+", type=int, help="run and report only these of the config's seeds (distillation M=3 then uses their teachers only)")
    parser.add_argument("--report-only", action="store_true", help="rewrite docs/results from finished jobs")
    parser.add_argument("--machine", help="machine description written into the results (default: this CPU)")
    parser.add_argument("--run-job", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_job:
        spec = json.loads(args.run_job)
        run_job(Job(**{**spec, "out_dir": Path(spec["out_dir"]), "preset": Path(spec["preset"]),
                       "manifest": Path(spec["manifest"])}))
        return 0
    cfg = load_quality_config(Path(args.config))
    if args.smoke:
        cfg = smoke_config(cfg)
    updates: dict[str, Any] = {}
    if args.manifest:
        updates["manifest"] = Path(args.manifest).resolve()
    if args.results:
        updates["results_dir"] = Path(args.results)
    if args.runs:
        updates["runs_dir"] = Path(args.runs)
    if args.corpus_dir:
        updates["corpus"] = cfg.corpus.model_copy(update={"dir": Path(args.corpus_dir)})
    if args.seeds:
        unknown_seeds = set(args.seeds) - set(cfg.seeds)
        if unknown_seeds:
            raise TonearmError(f"--seeds: {sorted(unknown_seeds)} not in the config's seeds {cfg.seeds}")
        updates["seeds"] = [seed for seed in cfg.seeds if seed in args.seeds]
    if args.only:
        unknown = set(args.only) - set(cfg.methods)
        if unknown:
            raise TonearmError(f"--only: unknown method(s) {sorted(unknown)}; known: {', '.join(cfg.methods)}")
    cfg = cfg.model_copy(update=updates)
    workers = max(1, args.workers)
    command = "tonearm bench quality" + (f" {args.config}" if args.config != str(DEFAULT_CONFIG) else "") + (
        " --smoke" if args.smoke else "") + (f" --manifest {args.manifest}" if args.manifest else "") + (
        f" --workers {args.workers}") + "".join(f" --only {m}" for m in args.only or []) + (
        f" --conditions {' '.join(args.conditions)}" if args.conditions else "") + (
        f" --seeds {' '.join(map(str, args.seeds))}" if args.seeds else "") + (
        f" --runs {args.runs}" if args.runs else "")
    manifests = prepare_manifests(cfg, workers=workers)
    if cfg.manifest is not None:
        languages = manifest_languages(manifests[next(iter(cfg.conditions))])
        cfg = fit_to_manifest(cfg, languages)
        print(f"== manifest languages: {', '.join(languages)}", flush=True)
        for name, why in cfg.not_run.items():
            print(f"   not run: {name} ({why})", flush=True)
        if args.only and not set(args.only) & set(cfg.methods):
            raise TonearmError(f"--only: none of {sorted(args.only)} can run on this manifest")
    jobs = plan_jobs(cfg, manifests)

    def report() -> None:
        write_results(cfg, jobs, command=command, machine=args.machine, smoke=args.smoke)

    if args.report_only:
        report()
        return 0
    selected = jobs
    if args.conditions:
        unknown = set(args.conditions) - set(cfg.conditions)
        if unknown:
            raise TonearmError(f"--conditions: unknown {sorted(unknown)}; known: {', '.join(cfg.conditions)}")
        selected = [j for j in jobs if j.condition in args.conditions]
    if args.only:  # the chosen methods and the teachers they need
        wanted = {j.key for j in jobs if j.method in args.only}
        wanted |= {d for j in jobs if j.key in wanted for d in j.depends}
        selected = [j for j in selected if j.key in wanted]
    failed = run_all(cfg, selected, workers=workers, on_result=report)
    if backfill_pair_weights(selected):
        print("== noisy pairs' weights audited (bench/noise_weights.py)", flush=True)
    report()
    print(f"== results in {ROOT / cfg.results_dir}", flush=True)
    if failed:
        raise TonearmError(f"{len(failed)} job(s) failed: {', '.join(failed[:5])}; rerun the same command to retry them")
    return 0


def cli_quality(argv: list[str]) -> int:
    return main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
