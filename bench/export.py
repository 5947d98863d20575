"""Benchmark: ONNX vs PyTorch encoder latency, and FAISS index build throughput + ANN recall@10.

Encoders: the built-in towers of the default config (random weights — latency does
not depend on them) exported with ``training.bundle.onnx_export``; text = ``max_length``
token batches, audio = 5-s clips; batch 1 and 32; the same thread count for
PyTorch (``torch.set_num_threads``) and ONNX Runtime (``intra_op_num_threads``),
1 by default (on a shared 2-core machine, 2 torch threads measured mostly
OpenMP spin-waits); median of ``--repeats`` runs after one warm-up. The int8 row is the dynamically
quantized text encoder (``tonearm export --quantize-text``).

Indices: ``--n`` synthetic unit vectors of dim ``--dim`` clustered around 1000
centres; build = train + add with ``index.engines.faiss_index.build_index`` (the export
code path, search parameters fixed as in bundles; IVF/PQ trained on a
``--max-train`` sample); recall@10 against exact
search on 1000 perturbed database vectors, tie-tolerant.

    OMP_NUM_THREADS=2 python bench/export.py            # table + docs/BENCHMARKS.md (~2-3 min)
    OMP_NUM_THREADS=2 python bench/export.py --no-write --n 20000
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from index.engines.faiss_index import build_index  # noqa: E402
from training.bundle.onnx_export import export_audio_encoder, export_text_encoder  # noqa: E402
from training.config import TrainConfig  # noqa: E402
from training.models.dual_encoder import build_dual_encoder  # noqa: E402

from benchlib import cpu_model, publish_section, synthetic_vectors  # noqa: E402

START, END = "<!-- bench/export.py -->", "<!-- /bench/export.py -->"
FACTORIES = ("Flat", "HNSW32,Flat", "IVF256,Flat", "IVF256,PQ32")


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ort_session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def encoder_rows(threads: int, repeats: int, workdir: Path) -> list[dict]:
    """Latency (ms) of PyTorch vs ONNX (and int8 ONNX text) at batch 1 and 32."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    cfg = TrainConfig()
    torch.set_num_threads(threads)
    model = build_dual_encoder(cfg.model, cfg.frontend, vocab_size=cfg.model.text.vocab_size).eval()
    length = cfg.model.text.max_length
    audio_path = export_audio_encoder(model.audio_module(), workdir / "audio.onnx", sample_rate=cfg.frontend.sample_rate)
    text_path = export_text_encoder(model.text_module(), workdir / "text.onnx", max_length=length)
    int8_path = workdir / "text.int8.onnx"
    quantize_dynamic(str(text_path), str(int8_path), weight_type=QuantType.QInt8)
    sessions = {name: ort_session(p, threads) for name, p in (("audio", audio_path), ("text", text_path), ("int8", int8_path))}
    rng = np.random.default_rng(0)
    rows = []
    for batch in (1, 32):
        wave = (0.1 * rng.standard_normal((batch, 5 * cfg.frontend.sample_rate))).astype(np.float32)
        ids = rng.integers(5, cfg.model.text.vocab_size, (batch, length)).astype(np.int64)
        mask = np.ones_like(ids)
        with torch.no_grad():
            t_audio = median_seconds(lambda w=wave: model.audio_module()(torch.from_numpy(w)), repeats)
            t_text = median_seconds(
                lambda i=ids, m=mask: model.text_module()(torch.from_numpy(i), torch.from_numpy(m)), repeats
            )
        o_audio = median_seconds(lambda w=wave: sessions["audio"].run(None, {"waveform": w}), repeats)
        feeds = {"input_ids": ids, "attention_mask": mask}
        o_text = median_seconds(lambda f=feeds: sessions["text"].run(None, f), repeats)
        o_int8 = median_seconds(lambda f=feeds: sessions["int8"].run(None, f), repeats)
        rows.append({"encoder": "audio (5 s)", "batch": batch, "torch": t_audio, "onnx": o_audio, "int8": None})
        rows.append({"encoder": f"text ({length} tokens)", "batch": batch, "torch": t_text, "onnx": o_text,
                     "int8": o_int8})
    return rows


def index_rows(n: int, dim: int, seed: int, max_train: int) -> list[dict]:
    """Build seconds, vectors/s and recall@10 per factory (the export code path)."""
    vectors, queries = synthetic_vectors(n, dim, seed)
    rows = []
    for factory in FACTORIES:
        start = time.perf_counter()
        built = build_index(vectors, factory, queries=queries, max_train_vectors=max_train)
        seconds = time.perf_counter() - start
        rows.append({"factory": factory, "seconds": seconds, "rate": n / seconds,
                     "recall": built.ann_recall_at_10, "params": built.search_params})
        print(f"  {factory}: {seconds:.1f} s", flush=True)
    return rows




def markdown(
    enc: list[dict], idx: list[dict], *, command: str, threads: int, n: int, dim: int, max_train: int
) -> str:
    lines = [
        START,
        "## Export: ONNX vs PyTorch encoders, FAISS index build",
        "",
        f"- command: `{command}`",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores visible; torch and ONNX Runtime both with {threads} "
        f"thread(s); onnxruntime {ort.__version__}, torch {torch.__version__}",
        f"- date: {dt.date.today().isoformat()}; load average (1 min) at the end: {os.getloadavg()[0]:.1f} "
        "(other jobs share the machine: absolute times are pessimistic, ratios more reliable)",
        "- encoders: default-config built-in towers (random weights), median latency after one warm-up",
        "",
        "| encoder | batch | PyTorch (ms) | ONNX (ms) | ONNX / PyTorch | ONNX int8 (ms) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in enc:
        int8 = f"{1000 * r['int8']:.1f}" if r["int8"] is not None else "—"
        lines.append(
            f"| {r['encoder']} | {r['batch']} | {1000 * r['torch']:.1f} | {1000 * r['onnx']:.1f} "
            f"| {r['onnx'] / r['torch']:.2f} | {int8} |"
        )
    lines += [
        "",
        f"FAISS build (train on ≤ {max_train:,} sampled vectors + add all; OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}) of {n:,} × {dim} unit vectors around 1000 centres "
        "(noise-to-signal 0.5), inner product; recall@10 vs exact on 1000 perturbed database vectors "
        "(tie-tolerant), with the search parameters bundles fix at load:",
        "",
        "| factory | build (s) | vectors/s | search params | ANN recall@10 |",
        "|---|---:|---:|---|---:|",
    ]
    for r in idx:
        params = ", ".join(f"{k}={v}" for k, v in r["params"].items()) or "—"
        lines.append(f"| {r['factory']} | {r['seconds']:.2f} | {r['rate']:,.0f} | {params} | {r['recall']:.3f} |")
    lines.append(END)
    return "\n".join(lines) + "\n"




def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch and ONNX Runtime intra-op threads")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-train", type=int, default=10_000, help="IVF/PQ training sample")
    parser.add_argument("--no-write", action="store_true", help="print only; do not update docs/BENCHMARKS.md")
    args = parser.parse_args(argv)

    print("encoders ...", flush=True)
    with tempfile.TemporaryDirectory() as workdir:
        enc = encoder_rows(args.threads, args.repeats, Path(workdir))
    print("indices ...", flush=True)
    idx = index_rows(args.n, args.dim, args.seed, args.max_train)
    command = "OMP_NUM_THREADS=2 python bench/export.py " + " ".join(argv if argv is not None else sys.argv[1:])
    section = markdown(enc, idx, command=command.strip(), threads=args.threads, n=args.n, dim=args.dim,
                       max_train=args.max_train)
    publish_section(section, start=START, end=END, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
