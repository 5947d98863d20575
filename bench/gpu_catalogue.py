"""GPU catalogue pass and one-GPU training from shards (issues 39 and 41), where a GPU is lent.

One prepared command on the GPU machine (``device`` tool), each step timed and recorded in
``--out`` as it ends, so a step that fails still leaves the others' figures:

* **Catalogue pass on ONNX Runtime's CUDA provider** (``--device cuda``; onnxruntime-gpu carried
  as a wheel), for a full-size random-weight ``ClapModel`` and ``PeAudioModel`` folder
  (tests/real_size_models.py):
  1. ``tonearm export --pretrained FOLDER --device cuda`` on the tiny synthetic corpus — the
     export's own parity checks (ONNX on CUDA vs the transformers model, cos ≥ 0.999) run on CUDA;
  2. ``tonearm index FOLDER_OF_WAVS --bundle B --device cuda`` over ``--files`` 10-s clips at the
     model's rate: clips/s from the pass's own progress line, wall time;
  3. the same first ``--parity-files`` clips embedded on the CPU provider (the reference): min
     cosine CUDA vs CPU, and the CPU pass's clips/s on this machine's cores for comparison;
  4. fp16 (issue 41, :mod:`index.catalogue.half_precision`): ``tonearm index --device cuda --precision fp16``
     runs the same clips as step 2: clips/s, its parity gate's centred cosine, and fp16 vs fp32 (CUDA)
     over every clip: min cosine, min and mean centred cosine. For the families in ``--fp16-export``
     (default CLAP only: PE-Audio's export is 100 s, twice that if its gate refused) the export in step 1
     runs with ``--precision fp16`` too (captions and clips on fp16 copies: both gates recorded; when a
     gate refuses, the refusal line is recorded and the export reruns in fp32). The encoder files stay
     fp32 either way, so the same bundle is the source of both index passes.
* **CLAP-size bf16 epoch from shards on one GPU under NCCL** (``distributed.force_process_group``
  under a one-process ``torchrun``): the tiny corpus's train clips repeated to ``--train-clips``
  under distinct ids, ``tonearm data shard`` at 48 kHz, ``configs/real/clap.yaml`` for one
  epoch with validation: exit status, samples/s, data-wait fraction, coverage (``data_plan``).
* **ASK from shards under NCCL** (``configs/ask/ask.yaml`` on the tiny model): the knowledge-base
  pass from shards and every collective of the loop on the GPU's group.
* **A failing rank under NCCL**: a corrupted shard with ``data.max_bad_fraction=0``: seconds from
  start to exit and the exit status (must be non-zero, with the rank's own error).

    python bench/gpu_catalogue.py --out $OUT/gpu_catalogue.json          # on the GPU machine
    python bench/gpu_catalogue.py --out $OUT/x.json --work /tmp/gc --files 128 --train-clips 1024 --skip-train  # fp32+fp16 catalogue only
    python bench/gpu_catalogue.py --record bench/results/gpu_catalogue_h100.json   # here: BENCHMARKS.md
    python bench/gpu_catalogue.py --device cpu --steps catalogue:clap clap_epoch ask fail --files 4 --train-clips 32 --batch 4 --out /tmp/g.json  # smoke
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
sys.path.append(str(ROOT / "tests"))  # after ROOT: tests/training must not shadow training/

START, END = "<!-- bench/gpu_catalogue.py -->", "<!-- /bench/gpu_catalogue.py -->"
RESULTS: dict[str, Any] = {}
PARTIAL: dict[str, Any] = {}
"""What the running step has measured so far (kept in RESULTS when a later part of it breaks)."""
TRAIN_STEPS = ("clap_epoch", "ask", "export_trained", "fail")


def save(out: Path) -> None:
    out.write_text(json.dumps(RESULTS, indent=2, default=str))


def step(name: str, out: Path):
    """Decorator-free step runner: ``with step(...)`` is not used so that a failure is recorded, not raised."""

    def run(fn, *args: Any, **kwargs: Any) -> Any:
        began = time.monotonic()
        PARTIAL.clear()
        print(f"== {name}", flush=True)
        try:
            value = fn(*args, **kwargs)
            RESULTS[name] = {"ok": True, "seconds": round(time.monotonic() - began, 1), **(value or {})}
        except Exception as err:  # recorded, the next step still runs
            RESULTS[name] = {**PARTIAL, "ok": False, "seconds": round(time.monotonic() - began, 1),
                             "error": f"{type(err).__name__}: {err}"[-3000:], "trace": traceback.format_exc()[-3000:]}
            value = None
        print(json.dumps({k: v for k, v in RESULTS[name].items() if k != "trace"}, default=str)[:1500], flush=True)
        save(out)
        return value

    return run


def tonearm(*args: str, env: dict[str, str] | None = None, timeout: float = 600, log: Path | None = None,
            launcher: list[str] | None = None) -> tuple[int, str, float]:
    """(exit status, last 4000 characters of output, seconds) of one CLI command."""
    began = time.monotonic()
    command = [*(launcher or [sys.executable, "-m"]), "tonearm", *args]
    run = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env or os.environ.copy(), cwd=ROOT)
    text = run.stdout + run.stderr
    if log is not None:
        log.write_text(text)
    return run.returncode, text[-4000:], round(time.monotonic() - began, 1)


def write_clips(folder: Path, count: int, rate: int, seconds: float = 10.0) -> list[Path]:
    """``count`` distinct 10-s WAVs (tones, chirps and noise at different levels)."""
    import soundfile as sf

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    t = np.arange(int(seconds * rate)) / rate
    paths = []
    for i in range(count):
        f0 = 80.0 * (1.03 ** (i % 150))
        wave = 0.3 * np.sin(2 * np.pi * (f0 + (i % 7) * 40 * t) * t) + (0.02 + 0.05 * (i % 5)) * rng.standard_normal(t.size)
        path = folder / f"clip-{i:05d}.wav"
        sf.write(path, wave.astype(np.float32), rate, subtype="PCM_16")
        paths.append(path)
    return paths


def clips_per_second(text: str) -> float | None:
    found = re.findall(r"index progress: \d+/\d+ files, ([0-9.]+) clips/s", text)
    return float(found[-1]) if found else None


def catalogue(family: str, work: Path, corpus: Path, device: str, files: int, parity_files: int,
              fp16: bool = False, fp16_export: bool = False) -> dict[str, Any]:
    from real_size_models import real_model_dir

    from index.runtime.loader import LoadedBundle, device_providers

    result: dict[str, Any] = {}
    began = time.monotonic()
    folder = real_model_dir(family, work)
    result["model_build_s"] = round(time.monotonic() - began, 1)
    bundles = work / f"bundles-{family}"
    if not bundles.is_dir():  # a rerun in the same --work keeps the bundle (and says so: export_s null)
        # fp16 on CUDA: the bundle's encoder files stay fp32, so the same bundle is the source of both index passes.
        precision = "fp16" if fp16 and fp16_export else "fp32"
        code, tail, seconds = tonearm("export", "--pretrained", str(folder), "--data", str(corpus / "manifest.jsonl"),
                                      "--out", str(bundles), "--device", device, "--precision", precision,
                                      log=work / f"export-{family}.log")
        text = (work / f"export-{family}.log").read_text()
        if precision == "fp16":
            result.update(export_fp16_exit=code, export_fp16_s=seconds, export_fp16_gate=half_gate(text))
        if code == 2 and precision == "fp16" and "--precision fp16" in tail:  # the gate refused: record it, bundle in fp32
            result["export_fp16_refused"] = [line for line in tail.splitlines() if "--precision fp16" in line][-1][-600:]
            code, tail, seconds = tonearm("export", "--pretrained", str(folder), "--data", str(corpus / "manifest.jsonl"),
                                          "--out", str(bundles), "--device", device, log=work / f"export-{family}.log")
            text = (work / f"export-{family}.log").read_text()
        result.update(export_exit=code, export_s=seconds)
        result["export_cosines"] = re.findall(r"(\w+ encoder vs the model's own \w+ embedding: min cosine [0-9.]+)", text)
        if code != 0:
            raise RuntimeError(f"export --pretrained failed ({code}): {tail[-1500:]}")
    else:
        result.update(export_exit=None, export_s=None)
    bundle = next(p for p in bundles.iterdir() if (p / "manifest.json").is_file())
    rate = int(json.loads((bundle / "manifest.json").read_text())["sample_rate"])
    audio = work / f"catalogue-{rate}"
    if not audio.is_dir():
        write_clips(audio, files, rate)
    indexed = work / f"indexed-{family}-{device}"
    if indexed.exists():
        import shutil

        shutil.rmtree(indexed)
    code, tail, seconds = tonearm("index", str(audio), "--bundle", str(bundle), "--out", str(indexed), "--device", device,
                                  log=work / f"index-{family}.log")
    result.update(index_exit=code, index_s=seconds, files=files, clip_seconds=10.0,
                  index_clips_per_s=clips_per_second(tail), index_wall_clips_per_s=round(files / seconds, 2))
    if code != 0:
        raise RuntimeError(f"tonearm index --device {device} failed ({code}): {tail[-1500:]}")
    # The reference: the same clips on the CPU provider, in this process.
    import soundfile as sf

    served = LoadedBundle.open(indexed, verify=False)
    vectors = served.audio_embeddings()
    order = [str(item["id"]) for item in served.audio_items]
    cpu = LoadedBundle.open(bundle, verify=False, providers=device_providers("cpu"))
    names = sorted(p.name for p in audio.glob("*.wav"))[:parity_files]
    waves = [sf.read(audio / n, dtype="float32")[0] for n in names]
    began = time.monotonic()
    reference = cpu.encode_audio(waves)
    cpu_seconds = time.monotonic() - began
    rows = [next(i for i, item in enumerate(order) if item.endswith(n) or item.endswith(n.removesuffix(".wav"))) for n in names]
    got = vectors[rows]
    cos = np.sum(got * reference, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(reference, axis=1))
    centred = (got - got.mean(0)), (reference - reference.mean(0))
    ccos = np.sum(centred[0] * centred[1], axis=1) / (np.linalg.norm(centred[0], axis=1) * np.linalg.norm(centred[1], axis=1))
    result.update(parity_clips=len(names), min_cos_vs_cpu=round(float(cos.min()), 6),
                  min_centred_cos_vs_cpu=round(float(ccos.min()), 6),
                  cpu_clips_per_s=round(len(names) / cpu_seconds, 2), cpu_threads=os.cpu_count())
    save_partial(result)
    if fp16:
        result.update(index_fp16(work, family, audio, bundle, device, vectors, order, files))
    return result


def half_gate(text: str) -> dict[str, float]:
    """The fp16 parity gate's min centred cosine per encoder, from a command's log (index.catalogue.half_precision)."""
    found = re.findall(r"fp16 (\w+) encoder vs fp32 on \d+ probe items: min centred cosine ([0-9.]+)", text)
    return {name: float(value) for name, value in found}


def index_fp16(work: Path, family: str, audio: Path, bundle: Path, device: str, fp32: np.ndarray,
               order: list[str], files: int) -> dict[str, Any]:
    """`tonearm index --precision fp16` over the same clips; its vectors vs the fp32 pass's (CUDA), every clip."""
    import shutil

    from index.catalogue.half_precision import centred_cosines
    from index.runtime.loader import LoadedBundle

    indexed = work / f"indexed-{family}-{device}-fp16"
    if indexed.exists():
        shutil.rmtree(indexed)
    code, tail, seconds = tonearm("index", str(audio), "--bundle", str(bundle), "--out", str(indexed), "--device", device,
                                  "--precision", "fp16", log=work / f"index-{family}-fp16.log")
    found: dict[str, Any] = {"fp16_index_exit": code, "fp16_index_s": seconds,
                             "fp16_gate": half_gate((work / f"index-{family}-fp16.log").read_text())}
    if code != 0:
        found["fp16_error"] = tail.strip().splitlines()[-1][-600:] if tail.strip() else f"exit {code}"
        return found
    half = LoadedBundle.open(indexed, verify=False)
    if [str(item["id"]) for item in half.audio_items] != order:
        raise RuntimeError("the fp16 and fp32 passes indexed different clips")
    vectors = half.audio_embeddings()
    cos = np.sum(vectors * fp32, axis=1) / (np.linalg.norm(vectors, axis=1) * np.linalg.norm(fp32, axis=1))
    centred = centred_cosines(fp32, vectors)
    record = half.manifest.catalogue_pass
    found.update(fp16_index_clips_per_s=clips_per_second(tail), fp16_index_wall_clips_per_s=round(files / seconds, 2),
                 fp16_vs_fp32_clips=len(order), fp16_vs_fp32_min_cos=round(float(cos.min()), 6),
                 fp16_vs_fp32_min_centred_cos=round(float(centred.min()), 6),
                 fp16_vs_fp32_mean_centred_cos=round(float(centred.mean()), 6),
                 fp16_manifest=None if record is None else record.model_dump(mode="json"))
    return found


def save_partial(result: dict[str, Any]) -> None:
    """The fp32 figures of the running catalogue step, kept when its fp16 part breaks (recorded by ``step``)."""
    PARTIAL.clear()
    PARTIAL.update(result)


def shard_corpus(work: Path, corpus: Path, train_clips: int, rate: int) -> Path:
    """The tiny corpus's train clips repeated under distinct ids (+ its val/test), sharded at ``rate``."""
    rows = [json.loads(line) for line in (corpus / "manifest.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["split"] == "train"]
    out_rows = []
    for i in range(train_clips):
        row = dict(train[i % len(train)])
        row["id"] = f"{row['id']}-r{i // len(train)}"
        row["audio"] = str((corpus / row["audio"]).resolve())
        out_rows.append(row)
    for row in rows:
        if row["split"] != "train":
            out_rows.append({**row, "audio": str((corpus / row["audio"]).resolve())})
    manifest = work / "repeated.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in out_rows))
    shards = work / f"shards-{rate}"
    if not (shards / "index.json").is_file():
        code, tail, _ = tonearm("data", "shard", str(manifest), "--out", str(shards), "--sample-rate", str(rate),
                                "--shard-size", "50")
        if code != 0:
            raise RuntimeError(f"data shard failed: {tail[-1500:]}")
    return shards


def metrics_of(run_dir: Path) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for path in run_dir.rglob("metrics.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            kind = row.get("kind", "train")
            if kind == "data_plan":
                found["data_plan"] = row
            elif "samples_per_s" in row or "data_wait_fraction" in row:
                # Step 1's window holds the start (workers forking, first batches); later windows the steady state.
                if row.get("step", 0) > 1 or "last_window" not in found:
                    found["last_window"] = {k: row[k] for k in row if k in {
                        "step", "samples_per_s", "data_wait_fraction", "data_wait_fraction_max", "peak_memory_mib",
                        "loss", "bad_samples"}}
            elif kind == "epoch":
                found["epoch"] = {k: v for k, v in row.items() if isinstance(v, (int, float)) and "R@" not in k}
            elif kind in {"val", "eval", "validation"}:
                found["validation"] = {k: v for k, v in row.items() if k in {"epoch", "step", "seconds"} or "mean" in k}
    return found


def torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m"]


def clap_epoch(work: Path, shards: Path, device: str, batch: int, workers: int) -> dict[str, Any]:
    from real_size_models import real_model_dir

    folder = real_model_dir("clap", work)
    out = work / "run-clap"
    code, tail, seconds = tonearm(
        "train", "configs/real/clap.yaml", f"model.audio.path={folder}", "data.manifest=null", f"data.shards={shards}",
        f"device={device}", "distributed.force_process_group=true", "optim.epochs=1", f"optim.batch_size={batch}",
        "eval.every_epochs=1", f"data.num_workers={workers}", f"out_dir={out}", "distributed.timeout_s=120",
        launcher=torchrun(), log=work / "train-clap.log", timeout=420)
    return {"exit": code, "wall_s": seconds, **metrics_of(out), **({"tail": tail[-2000:]} if code else {})}


def ask_from_shards(work: Path, shards: Path, device: str) -> dict[str, Any]:
    out = work / "run-ask"
    code, tail, seconds = tonearm(
        "train", "configs/ask/ask.yaml", "data.manifest=null", f"data.shards={shards}", f"device={device}",
        "distributed.force_process_group=true", "optim.epochs=2", "optim.batch_size=16", "data.num_workers=2",
        f"out_dir={out}", "distributed.timeout_s=120",
        launcher=torchrun(), log=work / "train-ask.log", timeout=300)
    return {"exit": code, "wall_s": seconds, **metrics_of(out), **({"tail": tail[-2000:]} if code else {})}


def failing_rank(work: Path, shards: Path, device: str) -> dict[str, Any]:
    import shutil

    import webdataset as wds

    bad = work / "shards-bad"
    if bad.exists():
        shutil.rmtree(bad)
    shutil.copytree(shards, bad)
    victim = sorted(bad.glob("train-*.tar"))[0]
    samples = list(wds.WebDataset(str(victim), shardshuffle=False))
    key = next(k for k in samples[0] if k.endswith(("flac", "wav")))
    samples[0][key] = b"\x00" * len(samples[0][key])
    victim.unlink()
    with wds.TarWriter(str(victim)) as sink:
        for sample in samples:
            sink.write({k: v for k, v in sample.items() if not k.startswith("__") or k == "__key__"})
    out = work / "run-fail"
    code, tail, seconds = tonearm(
        "train", "configs/ask/ask.yaml", "objective.knowledge=null", "data.manifest=null", f"data.shards={bad}",
        f"device={device}", "distributed.force_process_group=true", "optim.epochs=1", "optim.batch_size=16",
        "data.num_workers=1", "data.max_bad_fraction=0", f"out_dir={out}",
        launcher=torchrun(), log=work / "train-fail.log", timeout=240)
    errors = [line for line in tail.splitlines() if re.search(r"rank \d+ of \d+ failed", line)][-2:]
    return {"exit": code, "wall_s": seconds, "errors": errors}


def record(paths: list[Path]) -> int:
    """docs/BENCHMARKS.md's section from the JSONs this script wrote on the GPU machine (the first names the machine)."""
    from benchlib import publish_section

    runs = [(path, json.loads(path.read_text())) for path in paths]
    env = runs[0][1]["environment"]
    lines = [
        START,
        "## GPU catalogue pass and one-GPU training from shards (`bench/gpu_catalogue.py`)",
        "",
        f"On the lent GPU machine each row names (first: {env['gpu']}, {env['cpus']} CPUs; torch {env['torch']}, CUDA "
        f"{env['cuda']}, onnxruntime-gpu {env['onnxruntime']} carried as a wheel), {env['date']}; the GPU machine ran "
        "nothing but these commands. "
        "Recorded here with `python bench/gpu_catalogue.py --record " + " ".join(p.as_posix() for p in paths) + "`. "
        "Full default sizes, random weights (tests/real_size_models.py); catalogue clips are 10-s WAVs at the model's "
        "rate, decoded in the `tonearm index` process (one thread) and embedded in batches on the CUDA provider in fp32.",
        "",
    ]
    for path, found in runs:
        env = found["environment"]
        lines.append(f"- `{path.name}`: `python bench/gpu_catalogue.py {found.get('argv', '(defaults)')}`, "
                     f"{env['gpu']}, {env['date']}, load average {env['load'][0]:.2f} at the start, "
                     f"{env.get('load_end', [float('nan')])[0]:.2f} at the end.")
    lines += [
        "",
        "| model | clips | export --pretrained --device cuda (s) | export parity (ONNX on CUDA vs transformers) | "
        "tonearm index --device cuda: clips/s (progress) | clips/s (wall, incl. start) | min cos CUDA vs CPU "
        "(centred) | CPU provider clips/s (same machine) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for _, found in runs:
        for name, row in found.items():
            if not name.startswith("catalogue_"):
                continue
            family = f"{name.removeprefix('catalogue_')} · {found['environment']['gpu']}"
            if not row.get("ok"):
                lines.append(f"| {family} | | failed: {row.get('error', '')[:300]} | | | | | |")
                continue
            cosines = "; ".join(c.split(": ")[-1] for c in row.get("export_cosines", [])) or "passed (≥ 0.999)"
            export_s = f"{row['export_s']} (its pass in fp16)" if row.get("export_fp16_exit") == 0 else row["export_s"]
            lines.append(f"| {family} | {row['files']} | {export_s} | {cosines} | {row['index_clips_per_s']} | "
                         f"{row['index_wall_clips_per_s']} | {row['min_cos_vs_cpu']} ({row['min_centred_cos_vs_cpu']}) | "
                         f"{row['cpu_clips_per_s']} ({row['cpu_threads']} threads) |")
    lines += fp16_rows(runs)
    lines.append("")
    for path, found in runs:
        for name, title in (("clap_epoch_shards_nccl", "CLAP-size bf16 epoch from shards, NCCL, one GPU"),
                            ("ask_shards_nccl", "ASK (configs/ask/ask.yaml, default model) from shards, NCCL, one GPU"),
                            ("export_trained_cuda", "tonearm export of the ASK run's checkpoint, --device cuda"),
                            ("failing_rank_nccl", "A corrupted shard with data.max_bad_fraction=0, NCCL")):
            row = found.get(name)
            if row is None:
                continue
            if not row.get("ok"):
                lines.append(f"- {title}: the step broke: {row.get('error', '')[:400]}")
                continue
            parts = [f"exit status {row['exit']}", f"{row['wall_s']} s wall"]
            window = row.get("last_window") or {}
            if window:
                parts.append(", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in window.items()))
            if row.get("data_plan"):
                plan = row["data_plan"]
                parts.append(f"coverage {plan.get('coverage')} of {plan.get('clips')} clips")
                if row.get("epoch", {}).get("seconds"):
                    epoch = row["epoch"]
                    parts.append(f"epoch {epoch['seconds']:.1f} s = {plan.get('clips_per_epoch', 0) / epoch['seconds']:.1f} "
                                 "clips/s including the epoch's start")
            if row.get("errors"):
                parts.append("error line: `" + row["errors"][-1][:300] + "`")
            lines.append(f"- {title} (`{path.name}`): " + "; ".join(parts) + ".")
    lines += [
        "",
        "Reading: the bundle's fp32 ONNX graphs run on ONNX Runtime's CUDA provider with the export's own parity "
        "against transformers (≥ 0.99999) and give the CPU provider's vectors (centred cosine ≥ 0.99999); with the "
        "default --precision fp32 the index holds exactly what the CPU service computes for a query (the fp16 table, "
        "where present, is the opt-in pass). At these fp32 rates a "
        "50 k-clip catalogue of 10-s clips takes ~51 min with PE-Audio (~110 h on two CPU cores here) and ~4 min with "
        "CLAP on one H100. Not profiled: whether the CLAP pass is bound by its one decoding thread. NCCL ran at world "
        "size 1 (one GPU per lent machine): every collective of the loop (the step's lockstep all-gather, the metric "
        "windows, the distinct bad samples, the shard knowledge-base pass) ran on the NCCL group with tensors on "
        "cuda:0; between GPUs it was not measured. fp16 (opt-in, `--precision fp16`): CLAP's audio pass 2.6× and "
        "PE-Audio's 2.0× the fp32 rate with every clip's fp16 vector at centred cosine ≥ 0.99988 to its fp32 one; "
        "CLAP's RoBERTa text encoder fails the gate (0.990), so `export --pretrained --precision fp16` of CLAP stops "
        "and says so (the index pass embeds audio only). The failed PE-Audio row is onnxruntime-gpu 1.31's "
        "converter naming two casts alike, fixed since (index/catalogue/half_precision.py drop_duplicate_casts); the row "
        "after it is the rerun.",
        END,
    ]
    publish_section("\n".join(lines) + "\n", start=START, end=END)
    return 0


def fp16_rows(runs: list[tuple[Path, dict[str, Any]]]) -> list[str]:
    """The fp16 table (`--precision fp16`, index.catalogue.half_precision), when a run measured it."""
    rows = [(f"{family} · {found['environment']['gpu']}", row) for _, found in runs for name, row in found.items()
            if name.startswith("catalogue_") and (family := name.removeprefix("catalogue_"))
            and isinstance(row, dict) and ("fp16_index_exit" in row or "export_fp16_exit" in row)]
    if not rows:
        return []
    lines = [
        "",
        "fp16 catalogue pass (`--precision fp16`: fp16 copies of the encoders with normalisations, reductions, "
        "Softmax/Exp/Log, Sin/Cos, the rotary angles and the mel front end kept fp32; the bundle keeps its fp32 "
        "encoders; docs/models.md). Gate: min centred cosine fp16 vs fp32 on the probe set (≥ 0.999 to run).",
        "",
        "| model | clips | export --precision fp16: gate (audio / text) | tonearm index fp32: clips/s (progress) | "
        "--precision fp16: clips/s (progress) | fp16 / fp32 | fp16 clips/s (wall, incl. start and conversion) | "
        "index gate (audio) | fp16 vs fp32 vectors, every clip: min cos / min centred / mean centred |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for family, row in rows:
        gate = row.get("export_fp16_gate") or {}
        if "export_fp16_exit" not in row:
            export = "not run (export in fp32)"
        elif row["export_fp16_exit"] == 0:
            export = f"{gate.get('audio', '–')} / {gate.get('text', '–')}"
        else:
            export = f"refused: {row.get('export_fp16_refused', row['export_fp16_exit'])}"[:300]
        if row.get("fp16_index_exit") != 0:
            lines.append(f"| {family} | {row.get('files')} | {export} | {row.get('index_clips_per_s')} | "
                         f"failed: {row.get('fp16_error', row.get('error', ''))[:300]} | | | "
                         f"{(row.get('fp16_gate') or {}).get('audio', '–')} | |")
            continue
        fp32, fp16 = row.get("index_clips_per_s"), row.get("fp16_index_clips_per_s")
        ratio = f"{fp16 / fp32:.2f}×" if fp32 and fp16 else "–"
        lines.append(f"| {family} | {row['files']} | {export} | {fp32} | {fp16} | {ratio} | "
                     f"{row['fp16_index_wall_clips_per_s']} | {(row.get('fp16_gate') or {}).get('audio', '–')} | "
                     f"{row['fp16_vs_fp32_min_cos']} / {row['fp16_vs_fp32_min_centred_cos']} / "
                     f"{row['fp16_vs_fp32_mean_centred_cos']} |")
    return lines


def export_trained(work: Path, corpus: Path, device: str) -> dict[str, Any]:
    """`tonearm export CHECKPOINT --device cuda` of the ASK run's best checkpoint (the default model)."""
    code, tail, seconds = tonearm("export", str(work / "run-ask" / "best"), "--data", str(corpus / "manifest.jsonl"),
                                  "--out", str(work / "bundles-trained"), "--device", device, log=work / "export-trained.log")
    return {"exit": code, "wall_s": seconds, **({"tail": tail[-2000:]} if code else {})}


def environment(device: str) -> dict[str, Any]:
    import onnxruntime as ort
    import torch

    return {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "torch": torch.__version__,
            "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "onnxruntime": ort.__version__, "ort_providers": ort.get_available_providers(), "cpus": os.cpu_count(),
            "load": os.getloadavg(), "device": device}


def preflight(args: argparse.Namespace, fp16: bool) -> None:
    """Stop before any work, in one line, when a step could only fail later (minutes of GPU time in)."""
    unknown = [name for name in args.steps if name not in TRAIN_STEPS and not (
        name.startswith("catalogue:") and name.split(":", 1)[1] in ("clap", "pe_audio"))]
    problems = [f"unknown --steps {unknown}"] if unknown else []
    if args.device == "cuda":
        import onnxruntime as ort
        import torch

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            problems.append(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider "
                            f"({ort.get_available_providers()}): install the onnxruntime-gpu wheel")
        if any(name in TRAIN_STEPS for name in args.steps) and not torch.cuda.is_available():
            problems.append(f"torch {torch.__version__} sees no CUDA device (training steps)")
    if fp16:
        try:
            import onnx  # noqa: F401  (index.catalogue.half_precision converts with onnxruntime.transformers.float16)
            from onnxruntime.transformers.float16 import convert_float_to_float16  # noqa: F401
        except ImportError as err:
            problems.append(f"--precision fp16 needs onnx and onnxruntime.transformers ({err})")
        helped = subprocess.run([sys.executable, "-m", "tonearm", "index", "--help"], capture_output=True, text=True,
                                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
        if "--precision" not in helped.stdout:
            problems.append(f"`tonearm index` of {ROOT} has no --precision option (an older checkout?): "
                            f"{(helped.stdout + helped.stderr).strip()[-300:]}")
    if any(name.startswith("catalogue:") for name in args.steps):
        try:
            import transformers
            from real_size_models import real_model_dir  # noqa: F401

            for name in ("ClapModel", "PeAudioModel"):
                getattr(transformers, name)
        except (ImportError, AttributeError) as err:
            problems.append(f"the full-size model folders cannot be built here ({err})")
    if problems:
        raise SystemExit("gpu_catalogue.py: " + "; ".join(problems))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_catalogue.json"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-catalogue"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--files", type=int, default=256, help="10-s clips of the catalogue pass")
    parser.add_argument("--parity-files", type=int, default=8)
    parser.add_argument("--train-clips", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", nargs="+", default=["catalogue:clap", "clap_epoch", "ask", "export_trained", "fail",
                                                    "catalogue:pe_audio"],
                        help="in order: catalogue:FAMILY (clap, pe_audio), clap_epoch, ask, export_trained (after ask), fail")
    parser.add_argument("--skip-train", action="store_true",
                        help="leave out the training steps (" + ", ".join(TRAIN_STEPS) + "): the catalogue passes only")
    parser.add_argument("--no-fp16", action="store_true", help="catalogue passes in fp32 only (no --precision fp16 runs)")
    parser.add_argument("--fp16-export", nargs="*", choices=("clap", "pe_audio"), default=["clap"],
                        help="families whose export --pretrained also runs with --precision fp16 (default: clap)")
    parser.add_argument("--record", type=Path, nargs="+", help="write the BENCHMARKS.md section from these JSONs and exit")
    args = parser.parse_args()
    if args.record:
        return record(args.record)
    if args.skip_train:
        args.steps = [name for name in args.steps if name not in TRAIN_STEPS]
    fp16 = args.device == "cuda" and not args.no_fp16  # --precision fp16 is refused without --device cuda
    preflight(args, fp16)
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    RESULTS["environment"] = environment(args.device)
    RESULTS["argv"] = " ".join(sys.argv[1:])
    save(args.out)
    corpus = args.work / "corpus"
    if not (corpus / "manifest.jsonl").is_file():
        tonearm("synth", "--size", "tiny", "--out", str(corpus))
    shards: dict[int, Path] = {}

    def shards_at(rate: int, clips: int) -> Path | None:
        if rate not in shards:
            made = step(f"shard_{rate // 1000}k", args.out)(lambda: {"path": str(shard_corpus(args.work, corpus, clips, rate))})
            if made:
                shards[rate] = Path(made["path"])
        return shards.get(rate)

    for name in args.steps:  # in the order given: the most wanted figures first
        if name.startswith("catalogue:"):
            family = name.split(":", 1)[1]
            step(f"catalogue_{family}", args.out)(catalogue, family, args.work, corpus, args.device, args.files,
                                                  args.parity_files, fp16, family in args.fp16_export)
        elif name == "clap_epoch" and (path := shards_at(48000, args.train_clips)):
            step("clap_epoch_shards_nccl", args.out)(clap_epoch, args.work, path, args.device, args.batch, args.workers)
        elif name == "ask" and (path := shards_at(16000, 64)):
            step("ask_shards_nccl", args.out)(ask_from_shards, args.work, path, args.device)
        elif name == "export_trained":
            step("export_trained_cuda", args.out)(export_trained, args.work, corpus, args.device)
        elif name == "fail" and (path := shards_at(16000, 64)):
            step("failing_rank_nccl", args.out)(failing_rank, args.work, path, args.device)
    RESULTS["environment"]["load_end"] = os.getloadavg()
    save(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
