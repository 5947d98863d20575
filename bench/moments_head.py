"""Moment retrieval: the sliding-window baseline against the trained temporal head (issue 50, SPEC §19).

    flock /tmp/tonearm-heavy.lock python bench/moments_head.py [--bundle DIR] [--size small] [--seeds 0 1 2]

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
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
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
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    from index.languages import DEFAULT_LANGUAGES
    from index.metrics.moments import MomentQuery, moment_report
    from index.moments.head import MomentHeadModel
    from index.moments.postprocess import moments_from_scores
    from index.runtime.loader import LoadedBundle
    from training.data.manifest import load_manifest
    from training.data.synth_moments import generate_moment_corpus
    from training.moment_head import bundle_examples, export_head, train_head

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


if __name__ == "__main__":
    main()
