"""Moment retrieval: the sliding-window baseline against the trained temporal head (issue 50, SPEC §19).

    flock /tmp/tonearm-heavy.lock python bench/moments_head.py [--bundle DIR] [--size small] [--seeds 0 1 2]
    flock /tmp/tonearm-heavy.lock python bench/moments_head.py --heldout beds [--recordings 20 --long 8 --bed-seed 54]

1. renders a moment corpus (`tonearm synth --moments --size SIZE --seed 100`: the ``train`` split trains
   the head, the ``test`` split is the held-out set — other recordings, other scenes);
2. embeds every recording's windows and every moment caption once with the bundle's frozen ONNX
   encoders (default: the demo bundle), exactly as `tonearm evaluate --moments` does;
3. scores the baseline (window scores → merge, refine, NMS: :func:`index.moments.postprocess.moments_from_scores`)
   and, for each seed, a head trained by `tonearm train-moments`' code, exported to ONNX and run
   through onnxruntime (:mod:`index.moments.head`);
4. reports Recall1@0.5, Recall1@0.7 and mAP@[0.5:0.95] per language (index/metrics/moments.py) with
   docs/results' verdict rule: *inconclusive* when the mean ± std intervals overlap or a side has one
   seed, else *reproduced* (head better) or *not reproduced*; writes the `moments_head` section of
   docs/BENCHMARKS.md (``--no-write`` prints it only).

``--heldout beds`` (issue 54) keeps step 1's training but holds out a set that is **not the generator's**:
bench/moments_baseline.py's recordings (the demo corpus's test clips laid at random times on noise beds,
some repeated over most of a recording), every caption of a placed clip asked of its recording; it
compares the head (each seed), the sliding windows (the service's scorer without a head) and the best
single window, for short and long events, and writes the ``moments_head_beds`` section.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from index.audio.decode import decode_audio
from index.languages import DEFAULT_LANGUAGES
from index.metrics.moments import MomentQuery, moment_report
from index.moments.head import LONGER_THAN, MomentHeadModel
from index.moments.postprocess import moments_from_scores
from index.runtime.loader import LoadedBundle
from training.data.manifest import load_manifest
from training.data.synth_moments import generate_moment_corpus
from training.moment_head import (
    MomentExample,
    bundle_examples,
    export_head,
    longest_moment,
    span_reach,
    train_head,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moments_baseline import SR, ask_recording, best_window, build_recordings, clip_source  # noqa: E402

from benchlib import bundle_or_demo, cpu_model, publish_section  # noqa: E402

START = "<!-- bench:moments_head:start -->"
END = "<!-- bench:moments_head:end -->"
METRICS = (("R1@0.5", "Recall1@0.5"), ("R1@0.7", "Recall1@0.7"), ("mAP", "mAP@[0.5:0.95]"))


def verdict(head: tuple[float, float, int], base: tuple[float, float, int]) -> str:
    """docs/results' rule (bench/quality_report.py ``verdict``), higher is better."""
    if min(head[2], base[2]) < 2:
        return "inconclusive (one seed)"
    if abs(head[0] - base[0]) <= head[1] + base[1]:
        return "inconclusive"
    return "reproduced" if head[0] > base[0] else "not reproduced"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", help="bundle whose encoders embed windows and captions (default: the demo)")
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--heldout", choices=["synth", "beds"], default="synth",
                        help="synth: the corpus's test split; beds: bench/moments_baseline.py's set (not the generator's)")
    parser.add_argument("--recordings", type=int, default=20, help="--heldout beds: recordings of 2-4 short clips")
    parser.add_argument("--long", type=int, default=8, help="--heldout beds: recordings with one clip repeated")
    parser.add_argument("--bed-seed", type=int, default=54, help="--heldout beds: seed of the recordings")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.heldout == "beds":
        beds_main(args)
        return


    languages = list(DEFAULT_LANGUAGES)
    bundle_dir = bundle_or_demo(args.bundle)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="moments-head-") as tmp:
        t0 = time.monotonic()
        manifest = generate_moment_corpus(size=args.size, seed=100, out_dir=Path(tmp) / "corpus", progress=False)
        t_synth = time.monotonic() - t0
        records = load_manifest(manifest, languages=languages)
        bundle = LoadedBundle.open(bundle_dir)
        try:
            train = bundle_examples(bundle, [r for r in records if r.split == "train"], languages)
            test = bundle_examples(bundle, [r for r in records if r.split == "test"], languages)
            window, hop = bundle.clip_samples / bundle.sample_rate, None
        finally:
            bundle.close()
        t_embed = time.monotonic() - t0 - t_synth
        hop = float(test[0].spans[1, 0] - test[0].spans[0, 0])
        base = moment_report([MomentQuery(e.language, e.truth, [tuple(m) for m in moments_from_scores(
            e.spans, e.windows @ e.text)]) for e in test], languages)
        heads = []
        controls: list[dict[str, float]] = []
        train_seconds = []
        for seed in args.seeds:
            t1 = time.monotonic()
            head = train_head(train, seed=seed, steps=args.steps)
            train_seconds.append(time.monotonic() - t1)
            folder = Path(tmp) / f"head-{seed}"
            export_head(head, folder, window_seconds=window, hop_seconds=hop)
            model = MomentHeadModel.load(folder)
            heads.append(moment_report([MomentQuery(e.language, e.truth, [tuple(m) for m in model.moments(
                e.spans, e.windows, e.text)]) for e in test], languages))
            # control: the same head given another query's text (a head that only learned where and how
            # long moments tend to be keeps its score; one that reads the text loses it)
            shuffled = np.random.default_rng(seed).permutation(len(test))
            controls.append(moment_report([MomentQuery(e.language, e.truth, [tuple(m) for m in model.moments(
                e.spans, e.windows, test[j].text)]) for e, j in zip(test, shuffled, strict=True)], languages))
        recordings = {s: len([r for r in records if r.split == s]) for s in ("train", "test")}
        hours = {s: sum(r.meta["duration"] for r in records if r.split == s) / 3600 for s in ("train", "test")}

    def stat(reports: list[dict[str, float]], key: str) -> tuple[float, float, int]:
        values = np.array([r[key] for r in reports])
        return float(values.mean()), float(values.std()), len(values)

    def cell(s: tuple[float, float, int]) -> str:
        return f"{100 * s[0]:.1f} ± {100 * s[1]:.1f}"

    lines = [START, "## moments_head: sliding-window baseline vs the trained temporal head (issue 50)", "",
             f"`flock /tmp/tonearm-heavy.lock python bench/moments_head.py --size {args.size} --seeds "
             f"{' '.join(map(str, args.seeds))} --steps {args.steps}` on {cpu_model()}, "
             f"1-min load {load:.1f} at the start; {dt.date.today().isoformat()}.", "",
             f"- encoders: `{bundle_dir.name}` (frozen; window {window:g} s, hop {hop:g} s — the evaluator's)",
             f"- moment corpus `synth --moments --size {args.size} --seed 100`: head trained on the train split "
             f"({recordings['train']} recordings, {hours['train']:.2f} h, {len(train)} (recording, language, caption) "
             f"examples); held out: the test split ({recordings['test']} recordings, {hours['test']:.2f} h, "
             f"{len(test)} queries over 8 languages)",
             f"- time: synth {t_synth:.0f} s, window + caption embedding {t_embed:.0f} s, head training "
             f"{np.mean(train_seconds):.0f} s a seed ({args.steps} steps)",
             "- baseline: deterministic (the same for every seed: std 0); head: mean ± std (population) over seeds",
             "- verdict (docs/results): *inconclusive* when the mean ± std intervals overlap or a side has one seed", "",
             "| metric (%) | baseline | head | margin | verdict |", "|---|---:|---:|---:|---|"]
    for key, name in METRICS:
        b = (base[f"moment_{key}_mean"], 0.0, len(args.seeds))
        h = stat(heads, f"moment_{key}_mean")
        lines.append(f"| {name} (mean of 8 languages) | {cell(b)} | {cell(h)} | {100 * (h[0] - b[0]):+.1f} | "
                     f"**{verdict(h, b)}** |")
    lines += ["", "Control — the trained head given another query's text (shuffled): "
              + ", ".join(f"{name} {cell(stat(controls, f'moment_{key}_mean'))}" for key, name in METRICS)
              + " (what the head gets from where moments tend to be, without reading the query)."]
    lines += ["", "Per language (baseline → head, %):", "",
              "| language | " + " | ".join(name for _, name in METRICS) + " |", "|---|" + "---:|" * len(METRICS)]
    for lang in languages:
        cells = [f"{100 * base[f'moment_{k}_{lang}']:.1f} → {cell(stat(heads, f'moment_{k}_{lang}'))}" for k, _ in METRICS]
        lines.append(f"| {lang} | " + " | ".join(cells) + " |")
    lines.append(END)
    publish_section("\n".join(lines) + "\n", start=START, end=END, write=not args.no_write)


BEDS_START = "<!-- bench:moments_head_beds:start -->"
BEDS_END = "<!-- bench:moments_head_beds:end -->"


def beds_main(args: argparse.Namespace) -> None:
    """``--heldout beds``: heads trained on `synth --moments`, judged on recordings the generator did not make."""


    languages = list(DEFAULT_LANGUAGES)
    bundle_dir = bundle_or_demo(args.bundle)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="moments-head-beds-") as tmp:
        t0 = time.monotonic()
        manifest = generate_moment_corpus(size=args.size, seed=100, out_dir=Path(tmp) / "corpus", progress=False)
        clips, where = clip_source(Path(tmp))
        recordings = build_recordings(clips, seed=args.bed_seed, n_short=args.recordings, n_long=args.long,
                                      decode=lambda path: decode_audio(path, sample_rate=SR))
        t_build = time.monotonic() - t0
        records = [r for r in load_manifest(manifest, languages=languages) if r.split == "train"]
        bundle = LoadedBundle.open(bundle_dir)
        try:
            if bundle.sample_rate != SR:
                raise SystemExit(f"{bundle_dir}: --heldout beds needs a {SR}-Hz bundle (the beds' rate)")
            train = bundle_examples(bundle, records, languages)
            test, kinds = bed_examples(bundle, recordings, languages)
            window, bundle_id = bundle.clip_samples / bundle.sample_rate, bundle.bundle_id
        finally:
            bundle.close()
        t_embed = time.monotonic() - t0 - t_build
        hop = float(test[0].spans[1, 0] - test[0].spans[0, 0])
        answers: dict[str, list[list[list[tuple[float, float, float]]]]] = {
            "sliding windows (the service without a head)": [[
                [tuple(m) for m in moments_from_scores(e.spans, e.windows @ e.text)] for e in test]],
            "best single window": [[best_window(e.spans, e.windows @ e.text) for e in test]],
            "trained head, its own spans only": [], "trained head": []}
        train_seconds = []
        for seed in args.seeds:
            t1 = time.monotonic()
            head = train_head(train, seed=seed, steps=args.steps)
            train_seconds.append(time.monotonic() - t1)
            reach = span_reach(head, hop)
            longest = longest_moment(train, reach)  # as train-moments writes it
            folder = Path(tmp) / f"head-{seed}"
            export_head(head, folder, window_seconds=window, hop_seconds=hop,
                        extra={"longest_moment_seconds": longest})
            model = MomentHeadModel.load(folder)  # as served: stretches longer than it learned from its curve
            spans_only = MomentHeadModel(model.session, {**model.info, "longest_moment_seconds": None})
            for name, scorer in (("trained head", model), ("trained head, its own spans only", spans_only)):
                answers[name].append([[tuple(m) for m in scorer.moments(e.spans, e.windows, e.text)]
                                      for e in test])
        train_hours = sum(r.meta["duration"] for r in records) / 3600
        long_train = sum(any(e.get("long") for e in r.meta.get("moment_events", [])) for r in records)
    bed_hours = sum(len(w) for w, _ in recordings) / SR / 3600

    def reports(kind: str) -> dict[str, list[dict[str, float]]]:
        picked = [i for i, k in enumerate(kinds) if kind in (k, "all")]
        return {name: [moment_report([MomentQuery(test[i].language, test[i].truth, list(run[i])) for i in picked],
                                     languages) for run in runs] for name, runs in answers.items()}

    def stat(values: list[dict[str, float]], key: str) -> tuple[float, float, int]:
        got = np.array([v[key] for v in values])
        return float(got.mean()), float(got.std()), len(got)

    def cell(s: tuple[float, float, int]) -> str:
        return f"{100 * s[0]:.1f}" if s[2] == 1 else f"{100 * s[0]:.1f} ± {100 * s[1]:.1f}"

    by_kind = {kind: reports(kind) for kind in ("short", "long", "all")}
    counts = {kind: sum(1 for k in kinds if kind in (k, "all")) for kind in ("short", "long", "all")}
    lines = [BEDS_START, "## moments_head_beds: head vs baseline on a held-out set that is not the generator's "
             "(issue 54)", "",
             f"`flock /tmp/tonearm-heavy.lock python bench/moments_head.py --heldout beds "
             f"{'' if args.bundle is None else f'--bundle {args.bundle} '}--size {args.size} --seeds "
             f"{' '.join(map(str, args.seeds))} --steps {args.steps} --recordings {args.recordings} --long {args.long} "
             f"--bed-seed {args.bed_seed}` on {cpu_model()}, {os.cpu_count()} cores, 1-min load {load:.1f} at the "
             f"start; {dt.date.today().isoformat()}.", "",
             f"- encoders: `{bundle_id}` (frozen; window {window:g} s, hop {hop:g} s — the service's)",
             f"- head: `tonearm train-moments`' code on the train split of `synth --moments --size {args.size} "
             f"--seed 100` ({len(records)} recordings, {train_hours:.2f} h, {len(train)} examples; {long_train} of "
             f"the recordings hold a long moment, one scene over 40–85 % of the recording), {args.steps} "
             f"steps, seeds {', '.join(map(str, args.seeds))}; exported to ONNX and run by onnxruntime; every "
             f"moment trains its relevance, those within its reach ({reach:g} s: window + its convolutions' "
             f"context) its spans too, the longest {longest:g} s. *trained head*: as served (index/moments/head.py: a "
             f"stretch of its relevance curve longer than {LONGER_THAN:g} × that is a moment too); *its own spans "
             "only*: without that",
             f"- held out (not the generator's, bench/moments_baseline.py's set at `--seed {args.bed_seed}`): clips "
             f"of {where} laid on noise beds — {len(recordings)} recordings ({bed_hours:.2f} h, 60–180 s): "
             f"{args.recordings} with 2–4 clips (*short* events), {args.long} with one clip repeated over 55–85 % of "
             f"the recording (*long* events) beside a short one; every caption of a placed clip asked of its "
             f"recording ({counts['all']} queries, 8 languages)",
             f"- time: synth + beds {t_build:.0f} s, embedding {t_embed:.0f} s, head training "
             f"{np.mean(train_seconds):.0f} s a seed",
             "- metrics: mean of the 8 languages (%); the windows and the best window are deterministic, the "
             "head is mean ± std (population) over seeds; verdict (docs/results) of the head against the "
             "sliding windows: *inconclusive* when the mean ± std intervals overlap", "",
             "| answer | events | queries | " + " | ".join(name for _, name in METRICS) + " |",
             "|---|---|---:|" + "---:|" * len(METRICS)]
    for name in answers:
        for kind in ("short", "long", "all"):
            cells = " | ".join(cell(stat(by_kind[kind][name], f"moment_{key}_mean")) for key, _ in METRICS)
            lines.append(f"| {name} | {kind} | {counts[kind]} | {cells} |")
    windows_name, head_name = next(iter(answers)), "trained head"
    lines += ["", "| metric (all events) | sliding windows | head | margin | verdict |", "|---|---:|---:|---:|---|"]
    for key, name in METRICS:
        w = stat(by_kind["all"][windows_name], f"moment_{key}_mean")
        h = stat(by_kind["all"][head_name], f"moment_{key}_mean")
        lines.append(f"| {name} | {cell(w)} | {cell(h)} | {100 * (h[0] - w[0]):+.1f} | "
                     f"**{verdict(h, (w[0], 0.0, h[2]))}** |")
    lines += ["", "Per language, all events (sliding windows → head, %):", "",
              "| language | " + " | ".join(name for _, name in METRICS) + " |", "|---|" + "---:|" * len(METRICS)]
    for lang in languages:
        cells = [f"{cell(stat(by_kind['all'][windows_name], f'moment_{k}_{lang}'))} → "
                 f"{cell(stat(by_kind['all'][head_name], f'moment_{k}_{lang}'))}" for k, _ in METRICS]
        lines.append(f"| {lang} | " + " | ".join(cells) + " |")
    lines.append(BEDS_END)
    publish_section("\n".join(lines) + "\n", start=BEDS_START, end=BEDS_END, write=not args.no_write)


def bed_examples(bundle: Any, recordings: list[tuple[np.ndarray, list[Any]]],
                 languages: list[str]) -> tuple[list[Any], list[str]]:
    """Every caption of every placed clip, asked of its recording, as the head's examples; and each one's kind
    (``long`` when a placed clip repeated over most of the recording carries the caption)."""
    examples, kinds = [], []
    for r, (wave, placed) in enumerate(recordings):
        spans, vectors, asked, texts = ask_recording(bundle, wave, placed, languages)
        for key, text in zip(asked, texts, strict=True):
            truth = asked[key]
            examples.append(MomentExample(spans, vectors, text, [(p.start, p.end) for p in truth], key[0],
                                          f"bed-{r}"))
            kinds.append("long" if any(p.long for p in truth) else "short")
    return examples, kinds


if __name__ == "__main__":
    main()
