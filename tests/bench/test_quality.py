"""`tonearm bench quality`: verdict rule, and the whole pipeline on `tiny` (--smoke) with resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.quality import SMOKE_METHODS
from bench.quality_jobs import DEFAULT_CONFIG, load_quality_config
from bench.quality_report import verdict
from tonearm.cli import main
from tonearm.errors import TonearmError


def test_verdict_is_inconclusive_when_the_std_intervals_overlap() -> None:
    assert verdict((0.50, 0.01, 3), (0.40, 0.01, 3), lower=False) == ("reproduced", pytest.approx(0.10))
    assert verdict((0.40, 0.01, 3), (0.50, 0.01, 3), lower=False)[0] == "not reproduced"
    assert verdict((0.50, 0.06, 3), (0.40, 0.05, 3), lower=False)[0] == "inconclusive"
    assert verdict((2.0, 0.1, 3), (9.0, 0.5, 3), lower=True) == ("reproduced", pytest.approx(7.0))  # MRV: lower wins
    assert verdict((0.50, 0.0, 1), (0.40, 0.01, 3), lower=False)[0] == "inconclusive (one seed)"
    outcome, margin = verdict((0.5, 0.0, 3), (math.nan, math.nan, 0), lower=False)
    assert outcome == "not run" and math.isnan(margin)


def test_a_claim_against_the_best_seed_takes_that_seed_not_the_mean() -> None:
    from bench.quality_report import best_seed

    runs = [{"metrics": {"r1": value, "mrv_t2a": 10 * value}} for value in (0.30, 0.36, 0.33)]
    assert best_seed(runs, "r1", lower=False) == (0.36, 0.0, 3)
    assert best_seed(runs, "mrv_t2a", lower=True) == (pytest.approx(3.0), 0.0, 3)
    # a student at 0.35 ± 0.02 beats the teachers' mean (0.33) but not the best teacher (0.36)
    assert verdict((0.35, 0.02, 3), best_seed(runs, "r1", lower=False), lower=False)[0] == "inconclusive"


def test_the_shipped_config_lists_every_method_of_the_issue_and_valid_claims() -> None:
    cfg = load_quality_config(DEFAULT_CONFIG)
    assert len(cfg.seeds) >= 3 and set(cfg.conditions) == {"clean", "noisy"}
    assert set(SMOKE_METHODS) <= set(cfg.methods)
    for name in ("infonce", "siglip", "svr_bi_static", "svr_bi_dynamic", "simple_reweight", "kcl", "cacl",
                 "cacl_svr", "stage1", "distill_m1", "distill_m3", "iot", "dart_uniform", "dart_ram",
                 "dart_l2norm", "dart_variance", "triplet", "ask", "ask_no_fine"):
        assert name in cfg.methods, name


def test_the_laggards_sweep_reuses_the_main_runs_jobs_rather_than_overwriting_them() -> None:
    # bench/laggards.yaml shares the main runs folder; a shared row whose budget drifted from
    # quality.yaml's would be retrained there and replace the main run's result.
    from bench.quality import plan_jobs
    from bench.quality_jobs import ROOT

    main_cfg = load_quality_config(DEFAULT_CONFIG)
    sweep_cfg = load_quality_config(ROOT / "bench" / "laggards.yaml")
    assert sweep_cfg.runs_dir == main_cfg.runs_dir and sweep_cfg.corpus == main_cfg.corpus
    manifests = {condition: Path(f"/data/{condition}.jsonl") for condition in main_cfg.conditions}
    main_jobs = {job.key: job.fingerprint() for job in plan_jobs(main_cfg, manifests)}
    sweep_jobs = {job.key: job.fingerprint() for job in plan_jobs(sweep_cfg, manifests)}
    shared = sweep_jobs.keys() & main_jobs.keys()
    assert {key.split("/")[1] for key in shared} >= {"infonce", "siglip", "iot", "dart_ram", "ask", "triplet"}
    assert {key: sweep_jobs[key] for key in shared} == {key: main_jobs[key] for key in shared}


def test_a_bad_config_names_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "q.yaml"
    bad.write_text("methods: {a: {preset: configs/default.yaml, label: A}}\nclaims: [{paper: x, claim: y, "
                   "better: a, worse: nope, metric: r1}]\n")
    with pytest.raises(TonearmError, match=r"claims\[0\]: unknown method 'nope'"):
        load_quality_config(bad)


def test_a_claim_against_a_collapsed_run_is_not_scored_and_the_run_is_left_out(tmp_path: Path) -> None:
    from bench.quality_jobs import Job
    from bench.quality_report import NOT_SCORED, claim_rows, collapsed_lines, collect, main_table

    cfg = load_quality_config(DEFAULT_CONFIG)
    jobs = []
    for method, r1s, spread in (("iot", (0.12, 0.11, 0.13), 0.2), ("triplet", (0.01, 0.01, 0.01), 0.0)):
        for seed, r1 in enumerate(r1s):
            out = tmp_path / "clean" / method / f"seed{seed}"
            job = Job("clean", method, seed, out, [f"seed={seed}"], Path("configs/default.yaml"), tmp_path / "m.jsonl",
                      noisy=False)
            out.mkdir(parents=True)
            collapsed = float(spread < 0.01)
            metrics = {"t2a_R@1_mean": r1, "a2t_R@1_mean": r1, "similarity_spread": spread, "hubness": 2.0,
                       "collapsed": collapsed}
            job.result_path.write_text(json.dumps({"job": job.fingerprint(), "seed": seed, "metrics": metrics,
                                                   "train_seconds": 60.0}), encoding="utf-8")
            jobs.append(job)
    fallen: dict = {}
    table = collect(jobs, collapsed=fallen)
    assert len(table[("clean", "iot")]) == 3 and ("clean", "triplet") not in table
    assert len(fallen[("clean", "triplet")]) == 3
    rows = {row["claim"]: row for row in claim_rows(cfg, table, fallen) if row["condition"] == "clean"}
    assert rows["IOT > triplet"]["verdict"] == f"{NOT_SCORED}: triplet"
    # without the collapse flag the same numbers would have "reproduced" the claim
    assert verdict((0.12, 0.008, 3), (0.01, 0.0, 3), lower=False)[0] == "reproduced"
    assert any("0 (+3 collapsed)" in line for line in main_table(cfg, table, "clean", fallen))
    label = cfg.methods["triplet"].label
    assert any(f"| clean | {label} (`triplet`) | 0 | 0.0000 |" in line for line in collapsed_lines(cfg, fallen))


@pytest.mark.timeout(1500)  # 24 tiny jobs and a resume: ~4 min idle on 2 cores, far longer beside other work
def test_smoke_runs_the_whole_pipeline_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "quality", "--smoke", "--workers", "2", "--runs", str(tmp_path / "runs"),
            "--results", str(tmp_path / "results"), "--corpus-dir", str(tmp_path / "tiny")]
    assert main(args) == 0
    results = tmp_path / "results"
    report = (results / "README.md").read_text(encoding="utf-8")
    assert "jobs finished: 24 of 24" in report and "incomplete" not in report
    data = json.loads((results / "results.json").read_text(encoding="utf-8"))
    assert {c["claim"] for c in data["claims"]} >= {"SVR > InfoNCE (bi-dynamic)", "self-distillation M=1 > stage 1"}
    assert all(c["verdict"] in {"reproduced", "not reproduced", "inconclusive"} and c["seeds"] == 2
               for c in data["claims"])
    assert len(data["runs"]["noisy/distill_m1"]) == 2
    # every run carries the collapse and hubness diagnostics of its test embeddings
    for runs in data["runs"].values():
        for run in runs:
            assert {"similarity_spread", "hubness", "collapsed"} <= set(run), run
    assert "## Collapsed runs and hubness" in report
    assert "noisy pairs fitted" in report and "| DART (RAM) |" in report
    # each method's own per-pair signal on the noisy pairs (bench/noise_weights.py); none for InfoNCE
    weights = data["pair_weights"]
    assert "noisy/infonce" not in weights and "clean/dart_ram" not in weights
    for key, signal in (("noisy/dart_ram", "B·Π_ii (IOT plan)"), ("noisy/distill_m1", "p̂_ii (teacher target)"),
                        ("noisy/ask", "Ψ_i (ASK reliability)"), ("noisy/ask", "B·Q*_ii (ASK realignment)")):
        assert len(weights[key]) == 2, key
        for audit in weights[key]:
            assert audit["noisy_pairs"] > 0 and 0.0 <= audit[f"{signal}|below"] <= 1.0, (key, audit)
            assert math.isfinite(audit[f"{signal}|noisy"]) and audit[f"{signal}|clean"] > 0, (key, audit)
    assert "| DART (RAM) | B·Π_ii (IOT plan) |" in report and "| ASK | Ψ_i (ASK reliability) |" in report
    for plot in ("recall.png", "mrv.png", "languages.png", "curves.png"):
        assert (results / plot).stat().st_size > 10_000, plot
    # resume: a finished run does nothing; a lost result is recomputed alone, and so is a
    # result produced by another budget (never reused silently)
    (tmp_path / "runs" / "noisy" / "dart_ram" / "seed1" / "result.json").unlink()
    stale = tmp_path / "runs" / "clean" / "infonce" / "seed0" / "result.json"
    edited = json.loads(stale.read_text(encoding="utf-8"))
    edited["job"]["overrides"] = [o.replace("optim.epochs=1", "optim.epochs=9") for o in edited["job"]["overrides"]]
    stale.write_text(json.dumps(edited), encoding="utf-8")
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "1 finished job(s) were run with another preset or budget and run again: clean/infonce/seed0" in out
    assert "22 of 24 jobs already done; 2 to run" in out and "noisy/dart_ram/seed1: r1" in out
    assert "pair weights 1/1: noisy/dart_ram/seed1" in out  # only the rerun noisy job is audited again
    assert json.loads(stale.read_text(encoding="utf-8"))["job"]["overrides"] != edited["job"]["overrides"]


def test_a_failing_job_names_itself_its_exit_and_its_log(tmp_path: Path) -> None:
    # a job runs in its own process (bench/quality.py _job_process): its error is the last line
    # of its log, and the log keeps the traceback. ~4 s: the job's process imports torch.
    from bench.quality import _job_process
    from bench.quality_jobs import Job

    job = Job("clean", "infonce", 0, tmp_path / "out", [], Path("configs/nope.yaml"), tmp_path / "m.jsonl",
              noisy=False)
    with pytest.raises(TonearmError, match=r"^clean/infonce/seed0 failed \(exit 1\): .*nope\.yaml.* — full log .*\.log$"):
        _job_process(job, tmp_path / "logs")
    (log,) = (tmp_path / "logs").iterdir()
    assert "nope.yaml" in log.read_text(encoding="utf-8")


def test_a_job_fingerprint_ignores_where_the_runs_folder_lives(tmp_path: Path) -> None:
    from bench.quality_jobs import Job

    def job(runs: Path, epochs: int) -> Job:
        out = runs / "clean" / "infonce" / "seed0"
        return Job("clean", "infonce", 0, out, [f"optim.epochs={epochs}", f"out_dir={out}"],
                   Path("configs/default.yaml"), tmp_path / "m.jsonl", noisy=False)

    assert job(tmp_path / "a", 6).fingerprint() == job(tmp_path / "b" / "c", 6).fingerprint()
    assert job(tmp_path / "a", 6).fingerprint() != job(tmp_path / "a", 5).fingerprint()


@pytest.mark.parametrize("config", ["quality.yaml", "laggards.yaml"])
def test_every_method_of_the_shipped_configs_builds(config: str) -> None:
    from training.config import load_train_config
    from training.objectives.base import BuildEnv
    from training.objectives.registry import build_objective

    cfg = load_quality_config(DEFAULT_CONFIG.parent / config)
    for name, method in cfg.methods.items():
        overrides = [*cfg.train_overrides, *method.overrides]
        if method.teachers:  # the teachers exist only once their runs are done
            overrides.append("objective.distill.teachers=[t]")
        train_cfg = load_train_config(method.preset, overrides)
        env = BuildEnv(languages=tuple(train_cfg.data.languages), embed_dim=train_cfg.model.embed_dim)
        assert build_objective(train_cfg.objective, env) is not None, name


def test_a_foreign_manifest_gets_its_noisy_copy_and_jobs(tiny_corpus: Path, tmp_path: Path) -> None:
    """What `--manifest clotho.jsonl` does before training: no synthesis, a noisy copy beside it."""
    from bench.quality import plan_jobs, prepare_manifests
    from training.data.manifest import read_manifest, write_manifest
    from training.data.noise import noisy_positions

    records = [r for _, r in read_manifest(tiny_corpus, languages=None)]
    for record in records:
        record.meta = {}  # a converted public dataset has no scene families
    foreign = tmp_path / "clotho" / "manifest.jsonl"
    write_manifest(records, foreign)
    cfg = load_quality_config(DEFAULT_CONFIG).model_copy(update={"manifest": foreign, "runs_dir": tmp_path / "runs"})
    manifests = prepare_manifests(cfg, workers=1)
    assert manifests["clean"] == foreign and manifests["noisy"].parent == foreign.parent
    noisy = [r for _, r in read_manifest(manifests["noisy"], languages=None)]
    assert sum(len(noisy_positions(r)) for r in noisy) == round(0.2 * 32 * 3)
    jobs = plan_jobs(cfg, manifests)
    assert {j.manifest for j in jobs} == {foreign, manifests["noisy"]}
    assert all(set(j.depends) <= {k.key for k in jobs} for j in jobs)


def _english_only_clotho(tiny_corpus: Path, out: Path) -> Path:
    """The tiny corpus as Clotho ships it (one CSV per split, English captions), converted by `convert_clotho`."""
    import csv

    from training.data.formats import convert_clotho
    from training.data.manifest import read_manifest, write_manifest

    records = [r for _, r in read_manifest(tiny_corpus, languages=None)]
    converted = []
    for split in ("train", "val", "test"):
        rows = [r for r in records if r.split == split]
        table = out / f"clotho_{split}.csv"
        table.parent.mkdir(parents=True, exist_ok=True)
        with table.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(["file_name", "caption_1", "caption_2", "caption_3"])
            for r in rows:
                writer.writerow([Path(r.audio).name, *r.captions["eng"][:3]])
        converted += convert_clotho(table, audio_dir=tiny_corpus.parent / "audio" / split, split=split)
    manifest = out / "manifest.jsonl"
    write_manifest(converted, manifest)
    return manifest


@pytest.mark.timeout(600)
def test_an_english_only_clotho_manifest_runs_unchanged_and_leaves_out_the_cross_lingual_methods(
        tiny_corpus: Path, tmp_path: Path) -> None:
    from bench.quality import manifest_languages

    manifest = _english_only_clotho(tiny_corpus, tmp_path / "clotho")
    assert manifest_languages(manifest) == ["eng"]
    config = tmp_path / "q.yaml"
    config.write_text(
        "conditions: {clean: 0.0}\nseeds: [0]\n"
        "train_overrides: [data.clip_seconds=2.0, model.embed_dim=32, 'model.audio.channels=[8,16]', "
        "model.text.width=32, model.text.layers=1, model.text.heads=2, model.text.vocab_size=300, optim.epochs=1, "
        "optim.batch_size=8, optim.warmup_steps=1, eval.every_epochs=1, device=cpu]\n"
        "methods:\n  infonce: {preset: configs/default.yaml, label: InfoNCE}\n"
        "  kcl: {preset: configs/atri_kcl.yaml, label: KCL, min_languages: 2}\n"
        "claims: [{paper: ATRI, claim: 'KCL > InfoNCE', better: kcl, worse: infonce, metric: r1}]\n",
        encoding="utf-8")
    results = tmp_path / "results"
    assert main(["bench", "quality", str(config), "--manifest", str(manifest), "--workers", "1",
                 "--runs", str(tmp_path / "runs"), "--results", str(results)]) == 0
    report = (results / "README.md").read_text(encoding="utf-8")
    assert "jobs finished: 1 of 1" in report
    assert "Not run on this manifest" in report and "kcl — needs ≥ 2 caption languages; the manifest has eng" in report
    data = json.loads((results / "results.json").read_text(encoding="utf-8"))
    assert data["claims"] == [] and list(data["runs"]) == ["clean/infonce"]
    per_language = {k for k in data["runs"]["clean/infonce"][0] if k.startswith("t2a_R@1_")}
    assert per_language == {"t2a_R@1_eng", "t2a_R@1_mean"}


def test_a_manifest_without_a_test_split_is_refused_by_name(tiny_corpus: Path, tmp_path: Path) -> None:
    from bench.quality import manifest_languages
    from training.data.manifest import read_manifest, write_manifest

    records = [r for _, r in read_manifest(tiny_corpus, languages=None) if r.split != "test"]
    partial = tmp_path / "m.jsonl"
    write_manifest(records, partial)
    with pytest.raises(TonearmError, match="no test split"):
        manifest_languages(partial)


def test_the_pair_weight_audit_skips_a_result_copied_without_its_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # docs/results/runs keeps result.json files but no checkpoints: resuming from them must not crash
    from bench.quality import backfill_pair_weights
    from bench.quality_jobs import Job

    job = Job(condition="noisy", method="dart_ram", seed=0, out_dir=tmp_path / "noisy" / "dart_ram" / "seed0",
              overrides=["seed=0"], preset=Path("configs/dart/dart_ram.yaml"), manifest=tmp_path / "m.jsonl",
              noisy=True)
    job.out_dir.mkdir(parents=True)
    job.result_path.write_text(json.dumps({"job": job.fingerprint(), "r1": 0.1}), encoding="utf-8")
    assert job.is_done()
    assert backfill_pair_weights([job]) == 0
    assert "not audited for 1 job(s) without a best/ checkpoint" in capsys.readouterr().out
    assert "pair_weights" not in json.loads(job.result_path.read_text(encoding="utf-8"))
