"""Benchmark: real-size encoders served on two cores, beside their peers (SPEC §11, issue 21).

No pretrained weights can be downloaded here, so the models are built at their full default
size with random weights (tests/real_size_models.py: CLAP = HTS-AT 27.5 M + RoBERTa-base
124.6 M; AST-base 86 M + XLM-R-base 278 M), trained two steps with configs/real/*.yaml and
exported with `tonearm export` — the code path real weights take. Speed does not depend on
the weights' values; retrieval quality does, so quality numbers come from trained bundles
(tests/training/test_quantize.py), not from these.

Steps (each one call, under ``heavy`` / ``quiet-run``, ≤ 10 min):

    python bench/real_size.py build clap          # model folder, 2 training steps, export
    python bench/real_size.py build ast_xlmr
    python bench/real_size.py encoders            # ORT fp32 vs int8 throughput + agreement, thread settings
    python bench/real_size.py build clap --quantize text   # the same run exported with an int8 text tower
    python bench/real_size.py serve clap --servers tonearm,tonearm+int8-text,reference,infinity
    python bench/real_size.py serve ast_xlmr --servers tonearm,reference,infinity
    python bench/real_size.py tail                # demo bundle: cold text p99 at 16 clients, batching on/off

Issue 32: tonearm beside Infinity at equal query length and precision, and PE-Audio beside CLAP:

    python bench/real_size.py serve clap --kinds text-cold \
        --servers tonearm,tonearm+int8-text,infinity,infinity-roberta,infinity-roberta-int8
    python bench/real_size.py build pe_audio      # `tonearm export --pretrained` of the folder (no training)
    python bench/real_size.py build pe_audio --quantize both
    python bench/real_size.py build clap_pretrained
    python bench/real_size.py serve pe_audio --servers tonearm,tonearm+int8-both
    python bench/real_size.py serve clap_pretrained --servers tonearm

Both servers are sent the same texts (bench/service_load.py ``text_query``). ``infinity`` on the CLAP
folder encodes every query as 20 tokens (:data:`INFINITY_CLAP_TOKENS`); ``infinity-roberta[-int8]``
serves the CLAP text tower saved as a RoBERTa folder and encodes whole queries, like tonearm.

Models, runs and bundles live in WORK (``--work``, default ``~/.cache/tonearm/real-bench``). Every
step adds its rows to ``bench/results/real_size.json`` (in the repository, so that measurements
outlive the machine they were taken on) and rewrites the ``real_size`` section of
docs/BENCHMARKS.md from all rows, with command, machine, date and load of each, followed by
``bench/results/real_size_notes.md`` (the hand-written analysis).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from service_load import Connection, Server, free_port, measure, text_query, wav_clip  # noqa: E402

from benchlib import bundle_or_demo, cpu_model, write_section  # noqa: E402

START = "<!-- bench:real_size:start -->"
END = "<!-- bench:real_size:end -->"
RESULTS = ROOT / "bench" / "results" / "real_size.json"
NOTES = ROOT / "bench" / "results" / "real_size_notes.md"
INFINITY = Path(os.environ.get("INFINITY_VENV", "/root/infinity-venv")) / "bin" / "infinity_emb"
MODELS = {"clap": ["clap"], "ast_xlmr": ["ast", "xlmr"], "pe_audio": ["pe_audio"], "clap_pretrained": ["clap"]}
PRETRAINED = {"pe_audio": "pe_audio", "clap_pretrained": "clap"}
"""Presets exported from a model folder with no training (`tonearm export --pretrained`) → that folder."""
QUERY = "a dog barks twice then a siren passes by in the rain"
INFINITY_CLAP_TOKENS = 20
"""Infinity 0.0.78's CLAP path encodes every text as this many tokens (cut, or padded up to it): its
transformers 4.57 ``ClapConfig`` carries the old default ``max_length`` 20, and its CLAP model tokenizes with
``padding="max_length"`` and slices ``input_ids[:, :max_length]`` (infinity_emb/transformer/audio/torch.py)."""
INFINITY_SERVERS = {
    # --servers name: (model folder per preset and workload, --dtype); None = Infinity's default
    "infinity": ({"clap": {"text-cold": "clap", "audio": "clap"}, "ast_xlmr": {"text-cold": "xlmr"}}, None),
    "infinity-roberta": ({"clap": {"text-cold": "clap_text_roberta"}}, "float32"),
    "infinity-roberta-int8": ({"clap": {"text-cold": "clap_text_roberta"}}, "int8"),
}
"""Infinity variants: ``infinity`` serves the preset's own folders (for CLAP: text cut to
:data:`INFINITY_CLAP_TOKENS` tokens, and audio); ``infinity-roberta[-int8]`` serves the CLAP text tower as
a plain RoBERTa folder (tests/real_size_models.py ``clap_text_roberta``), so it encodes whole queries,
in fp32 or with Infinity's int8 (``--dtype int8``)."""


def work_dir(args: argparse.Namespace) -> Path:
    path = Path(args.work).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_results() -> list[dict[str, Any]]:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else []


def cpu_tag() -> str:
    """Which CPU a row was measured on: the VM's model name hides the generation, and int8 speed
    depends on it (VNNI / AVX-512 vs AVX2 only), so family, model and the widest vector ISA go with it."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return cpu_model()
    flags = set(fields.get("flags", "").split())
    isa = ("AVX-512 VNNI" if "avx512_vnni" in flags else "AVX-512, no VNNI" if "avx512f" in flags
           else "AVX2, no AVX-512" if "avx2" in flags else "no AVX2")
    return f"{cpu_model()} family {fields.get('cpu family', '?')} model {fields.get('model', '?')} ({isa})"


def gpu_name() -> str:
    """The GPU a ``reference-cuda`` row ran on (nvidia-smi's name)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown GPU"
    return out.strip().splitlines()[0] if out.strip() else "unknown GPU"


def add_results(rows: list[dict[str, Any]]) -> None:
    stamp = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "load": round(os.getloadavg()[0], 2),
             "cpu": cpu_tag() + ("" if os.cpu_count() == 2 else f", {os.cpu_count()} cores"),
             "command": "python bench/real_size.py " + " ".join(sys.argv[1:])}
    results = load_results() + [{**stamp, **row} for row in rows]
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


QUIET = {"below": None}  # `serve --quiet-below LOAD`: wait for the 1-min load average to fall under LOAD before each row


def before_row() -> dict[str, float]:
    """Wait (≤ 5 min) until the machine is quiet, when asked to; the row records the load it started at
    and, via :func:`client_cpu`, the load generator's own CPU."""
    below = QUIET["below"]
    deadline = time.monotonic() + 300
    while below is not None and os.getloadavg()[0] >= below and time.monotonic() < deadline:
        time.sleep(2)
    return {"load_before": round(os.getloadavg()[0], 2), "_cpu0": time.process_time(), "_t0": time.perf_counter()}


def client_cpu(mark: dict[str, float]) -> dict[str, float]:
    """The row's start load and the cores the load generator (this process) used while it ran."""
    cores = (time.process_time() - mark["_cpu0"]) / max(time.perf_counter() - mark["_t0"], 1e-9)
    return {"load_before": mark["load_before"], "client_cores": round(cores, 2)}


def rss_mib(pid: int) -> float:
    """Resident memory of a process (VmRSS), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ----------------------------------------------------------------------------- build


def cmd_build(args: argparse.Namespace) -> None:
    """Model folders (random weights, full size), two training steps of the preset, `tonearm export`;
    for :data:`PRETRAINED` presets the folder exported as it is (`tonearm export --pretrained`)."""
    from real_size_models import (  # tests/real_size_models.py
        mini_manifest,
        real_model_dir,
        train_preset,
    )

    from training.bundle.export import export_bundle
    from training.bundle.pretrained import export_pretrained_bundle
    from training.bundle.quantize import QuantizeConfig
    from training.data.synth import generate_corpus

    work = work_dir(args)
    corpus = work / "corpus" / "manifest.jsonl"
    if not corpus.exists():
        generate_corpus(size="tiny", seed=0, out_dir=corpus.parent, progress=False)
    manifest = mini_manifest(corpus, work / f"manifest-{args.preset}.jsonl", per_split=args.clips_per_split)
    started = time.perf_counter()
    dirs = {name: real_model_dir(name, work) for name in MODELS[args.preset]}
    made = time.perf_counter()
    # random weights: the held-out R@10 of such a model means nothing, so a drop only warns here
    quantize = QuantizeConfig.from_choice(args.quantize, on_loss="warn")
    key = bundle_key(args.preset, args.quantize)
    if args.preset in PRETRAINED:
        bundle = export_pretrained_bundle(dirs[PRETRAINED[args.preset]], manifest=manifest,
                                          out_dir=work / "bundles" / args.preset, progress=False, quantize=quantize)
        exported = time.perf_counter()
        (work / f"{key}.bundle").write_text(str(bundle))
        add_results([{"kind": "build", "preset": key, "bundle": bundle.name, "models_s": made - started,
                      "export_s": exported - made, "onnx_mb": onnx_sizes(bundle)}])
        return
    run_marker = work / f"{args.preset}.run"
    if args.quantize != "none" and run_marker.exists():  # the int8 variant of an already trained preset
        run = Path(run_marker.read_text().strip())
    else:
        run = train_preset(args.preset, dirs, manifest, work / "runs" / args.preset)
        run_marker.write_text(str(run))
    trained = time.perf_counter()
    checkpoint = run / "best" if (run / "best").is_dir() else run / "last"
    bundle = export_bundle(checkpoint, manifest=manifest, out_dir=work / "bundles" / args.preset, progress=False,
                           quantize=quantize)
    exported = time.perf_counter()
    (work / f"{key}.bundle").write_text(str(bundle))
    add_results([{"kind": "build", "preset": key, "bundle": bundle.name, "models_s": made - started,
                  "train_s": trained - made, "export_s": exported - trained, "onnx_mb": onnx_sizes(bundle)}])


def onnx_sizes(bundle: Path) -> dict[str, float]:
    """MB of each ONNX model of a bundle: the ``.onnx`` file plus its external data file (``.onnx.data``,
    written for a model above ~2 GB; PE-Audio's fp32 towers, 1.1 and 1.3 GB, have none)."""
    from training.bundle.onnx_export import external_data_file

    sizes = {}
    for path in sorted(bundle.glob("*.onnx")):
        data = external_data_file(path)
        sizes[path.name] = round((path.stat().st_size + (data.stat().st_size if data.exists() else 0)) / 1e6, 1)
    return sizes


def bundle_key(preset: str, quantize: str = "none") -> str:
    """``clap`` (fp32) or ``clap+int8-text`` (exported with ``--quantize text``), ``pe_audio+int8-both``, ..."""
    return preset if quantize == "none" else f"{preset}+int8-{quantize}"


def bundle_of(work: Path, preset: str, quantize: str = "none") -> Path:
    marker = work / f"{bundle_key(preset, quantize)}.bundle"
    if not marker.exists():
        raise SystemExit(f"no {bundle_key(preset, quantize)} bundle yet: run "
                         f"`python bench/real_size.py build {preset} --quantize {quantize}` first")
    return Path(marker.read_text().strip())


# ----------------------------------------------------------------------------- encoders


def _rate(run: Any, seconds: float) -> tuple[float, np.ndarray]:
    """Calls per second of ``run()`` over about ``seconds`` (after one warm-up call) and its last output."""
    out = run()
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        out = run()
        calls += 1
    return calls / (time.perf_counter() - started), out


def cmd_encoders(args: argparse.Namespace) -> None:
    """ONNX Runtime encoder throughput, fp32 vs dynamic int8, and their per-item agreement."""
    from index.audio.decode import eval_chunks
    from index.bundle.tokenizer import TextTokenizer
    from index.runtime.loader import (
        AUDIO_INPUTS,
        TEXT_INPUTS,
        OnnxEncoder,
        SessionConfig,
        audio_feeds,
    )
    from training.bundle.quantize import cosines, quantize_model

    work = work_dir(args)
    rows = []
    texts = [f"{QUERY} {i}" for i in range(16)]
    for preset in args.presets.split(","):
        bundle = bundle_of(work, preset)
        manifest = json.loads((bundle / "manifest.json").read_text())
        dim, rate = manifest["embed_dim"], manifest["sample_rate"]
        tokenizer = TextTokenizer.from_file(bundle / "tokenizer.json")
        clip = eval_chunks(np.random.default_rng(0).standard_normal(10 * rate).astype(np.float32) * 0.1,
                           manifest["clip_samples"])
        with tempfile.TemporaryDirectory() as scratch:
            for modality, inputs in (("text", TEXT_INPUTS), ("audio", AUDIO_INPUTS)):
                fp32_path = bundle / f"{modality}_encoder.onnx"
                int8_path = quantize_model(fp32_path, Path(scratch) / f"{modality}.int8.onnx")
                for threads in (1, 2):
                    session = SessionConfig(threads=threads)
                    outputs = {}
                    for precision, path in (("fp32", fp32_path), ("int8", int8_path)):
                        encoder = OnnxEncoder.load(path, inputs=inputs, embed_dim=dim, providers=["CPUExecutionProvider"],
                                                   threads=threads, session=session)
                        for batch in (1, 8):
                            if modality == "text":
                                feeds = dict(zip(inputs, tokenizer.encode(texts[:batch], pad_to_longest=True), strict=True))
                            else:
                                feeds = audio_feeds(encoder, [clip[0]] * batch, clip.shape[1])  # + PE-Audio's mask
                            calls, out = _rate(lambda e=encoder, f=feeds: e.run(f), args.seconds)
                            outputs[precision, batch] = out
                            rows.append({"kind": "encoder", "preset": preset, "modality": modality, "threads": threads,
                                         "precision": precision, "batch": batch, "items_per_s": calls * batch,
                                         "mb": round(path.stat().st_size / 1e6, 1)})
                            print(rows[-1], flush=True)
                    agreement = cosines(outputs["int8", 8], outputs["fp32", 8])
                    rows.append({"kind": "agreement", "preset": preset, "modality": modality, "threads": threads,
                                 "min_cosine": float(agreement.min()), "mean_cosine": float(agreement.mean())})
            for precision, path in (("fp32", bundle / "text_encoder.onnx"), ("int8", Path(scratch) / "text.int8.onnx")):
                for batch in (4, 8):
                    texts_per_s = served_mix_ceiling(path, tokenizer, dim=dim, batch=batch, seconds=args.seconds)
                    rows.append({"kind": "encoder", "preset": preset, "modality": "text", "threads": "2 × 1",
                                 "precision": precision, "batch": batch, "items_per_s": texts_per_s,
                                 "mb": round(path.stat().st_size / 1e6, 1), "queries": "served mix"})
                    print(rows[-1], flush=True)
    add_results(rows)


def served_mix_ceiling(path: Path, tokenizer: Any, *, dim: int, batch: int, seconds: float) -> float:
    """Texts/s of what `tonearm serve` runs for cold text at its defaults, without HTTP, search or
    clients: two 1-thread sessions side by side, each encoding batches of ``batch`` queries drawn
    from the serving benchmark's mix (bench/service_load.py QUERIES with a unique suffix, 32–57
    tokens) through ``encode_texts`` (length-grouped calls). The ceiling the served rate can reach."""
    import threading

    from service_load import QUERIES

    from index.runtime.loader import TEXT_INPUTS, OnnxEncoder, SessionConfig, encode_texts

    rng = np.random.default_rng(0)
    batches = [[f"{QUERIES[q]} {i}-{q}-{time.perf_counter_ns()}" for q in rng.integers(0, len(QUERIES), batch)]
               for i in range(64)]
    encoders = [OnnxEncoder.load(path, inputs=TEXT_INPUTS, embed_dim=dim, providers=["CPUExecutionProvider"],
                                 threads=1, session=SessionConfig(threads=1)) for _ in range(2)]
    for encoder in encoders:  # warm-up
        encode_texts(encoder, tokenizer, batches[0], embed_dim=dim)
    done = [0, 0]
    stop_at = time.perf_counter() + seconds

    def run(worker: int) -> None:
        i = worker
        while time.perf_counter() < stop_at:
            encode_texts(encoders[worker], tokenizer, batches[i % len(batches)], embed_dim=dim)
            done[worker] += batch
            i += 2

    started = time.perf_counter()
    threads = [threading.Thread(target=run, args=(w,)) for w in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(done) / (time.perf_counter() - started)


# ----------------------------------------------------------------------------- serving


class Infinity:
    """`infinity_emb v2` (its own venv) serving a model folder on the CPU, ready when /health answers."""

    def __init__(self, model: Path, *, log: Path, batch_size: int = 32, dtype: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = model.name
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
               "DO_NOT_TRACK": "1", "OMP_NUM_THREADS": "2"}
        cmd = [str(INFINITY), "v2", "--model-id", str(model), "--served-model-name", self.name, "--port", str(self.port),
               "--engine", "torch", "--device", "cpu", "--batch-size", str(batch_size), "--no-bettertransformer",
               "--no-model-warmup"] + (["--dtype", dtype] if dtype else [])
        self.log = log
        with log.open("w") as sink:
            self.process = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)

    def __enter__(self) -> Infinity:
        import httpx

        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"infinity exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"infinity not ready:\n{self.log.read_text()[-3000:]}")

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


async def _infinity_worker(server: Infinity, kind: str, clip: bytes, stop_at: float, out: list, errors: list,
                           wid: int) -> None:
    """One closed-loop client: the texts tonearm's text workload sends (service_load.text_query), or ``clip``."""
    connection = Connection("127.0.0.1", server.port)
    audio_uri = "data:audio/wav;base64," + base64.b64encode(clip).decode()
    i = 0
    try:
        while time.perf_counter() < stop_at:
            if kind == "audio":
                path, item = "/embeddings_audio", audio_uri
            else:
                path, item = "/embeddings", text_query(kind, wid, i)
            body = json.dumps({"model": server.name, "input": [item]}).encode()
            started = time.perf_counter()
            try:
                status, _ = await connection.request("POST", path, body, "application/json")
                ok = status == 200
            except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                ok, connection = False, Connection("127.0.0.1", server.port)
            (out if ok else errors).append((time.perf_counter() - started) * 1000)
            i += 1
    finally:
        connection.close()


async def measure_infinity(server: Infinity, *, kind: str, clients: int, seconds: float, clip: bytes) -> dict:
    out: list[float] = []
    errors: list[float] = []
    started = time.perf_counter()
    await asyncio.gather(*(_infinity_worker(server, kind, clip, started + seconds, out, errors, w)
                           for w in range(clients)))
    elapsed = time.perf_counter() - started
    lat = np.asarray(out)
    p50, p99 = np.percentile(lat, [50, 99]) if len(lat) else (0.0, 0.0)
    return {"requests": len(out), "errors": len(errors), "p50_ms": p50, "p99_ms": p99, "rps": len(out) / elapsed}


def query_tokens(tokenizer_json: Path, *, limit: int | None = None, padded: bool = False) -> float:
    """Mean tokens per cold-text query (service_load.text_query, 16 clients × 16 queries) with the
    tokenizer of ``tokenizer_json``, special tokens included, cut to ``limit``; ``padded``: a bundle's
    tokenizer (fixed padding: count the attention mask, it cuts at the bundle's max length)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    queries = [text_query("text-cold", w, i) for w in range(16) for i in range(16)]
    lengths = [sum(e.attention_mask) if padded else len(e.ids) for e in tokenizer.encode_batch(queries)]
    return round(float(np.mean([min(n, limit) if limit else n for n in lengths])), 1)


def _row(preset: str, server: str, kind: str, clients: int, stats: dict, **extra: Any) -> dict[str, Any]:
    return {"kind": "serve", "preset": preset, "server": server, "workload": kind, "clients": clients,
            **{k: stats[k] for k in ("requests", "errors", "p50_ms", "p99_ms", "rps")}, **extra}


def _result_stats(result: Any) -> dict:
    row = result.row()
    return {"requests": row["requests"], "errors": row["errors"], "p50_ms": row["p50_ms"], "p99_ms": row["p99_ms"],
            "rps": row["rps"]}


def serve_tonearm(bundle: Path, *, preset: str, label: str, env: dict[str, str], kinds: list[str],
                  clients: list[int], seconds: float, clip: bytes, scratch: Path, reference: bool = False) -> list[dict]:
    tokens = query_tokens(bundle / "tokenizer.json", padded=True)
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        started = time.perf_counter()
        checkpoint = json.loads((bundle / "manifest.json").read_text())["source"]["checkpoint"]
        if not Path(checkpoint).is_dir():  # a bundle copied from elsewhere: its checkpoint copied beside it
            checkpoint = str(bundle.parent / "checkpoint")
        server = Server(bundle, threads=4, redis_url=None, log=scratch / f"{label}.log", reference=reference,
                        checkpoint=Path(checkpoint) if reference else None)
        with server:
            ready_s = time.perf_counter() - started
            rows = [{"kind": "startup", "preset": preset, "server": label, "ready_s": ready_s,
                     "rss_mib": rss_mib(server.process.pid)}]
            print(rows[-1], flush=True)
            for kind in kinds:
                for c in clients:
                    mark = before_row()
                    result = asyncio.run(measure(server.url, server=label, target=preset, kind=kind, clients=c,
                                                 seconds=seconds, clip=clip))
                    rows.append(_row(preset, label, kind, c, _result_stats(result), **client_cpu(mark),
                                     **({"tokens": tokens} if kind.startswith("text") else {})))
                    print(rows[-1], f"load {os.getloadavg()[0]:.1f}", flush=True)
            rows[0]["rss_after_mib"] = rss_mib(server.process.pid)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return rows


def cmd_serve(args: argparse.Namespace) -> None:
    """tonearm, the reference server and Infinity on the same bundle / model folder, same clients."""
    QUIET["below"] = args.quiet_below
    work = work_dir(args)
    bundle = bundle_of(work, args.preset)
    manifest = json.loads((bundle / "manifest.json").read_text())
    clip = wav_clip(10.0, manifest["sample_rate"])
    kinds, clients = args.kinds.split(","), [int(c) for c in args.clients.split(",")]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        for server in args.servers.split(","):
            if server in INFINITY_SERVERS:
                rows += serve_infinity(server, args.preset, work, kinds, clients, args.seconds, clip, scratch)
            elif server in ("reference", "reference-cuda"):  # reference-cuda: its encoders on the GPU
                env = {"TONEARM_REFERENCE_DEVICE": "cuda"} if server == "reference-cuda" else {}
                served = serve_tonearm(bundle, preset=args.preset, label=server, env=env, kinds=kinds,
                                       clients=clients, seconds=args.seconds, clip=clip, scratch=scratch, reference=True)
                rows += [{**row, "gpu": gpu_name()} for row in served] if env else served
            else:  # tonearm[+int8-text][:NAME=VALUE;NAME=VALUE] — bundle and settings variants
                name, _, spec = server.partition(":")
                quantize = name.partition("+int8-")[2] or "none"  # tonearm+int8-text: the `build --quantize text` bundle
                env = {("" if k.startswith("TONEARM_") else "TONEARM_") + k: v
                       for k, v in (item.split("=", 1) for item in spec.split(";") if item)}
                rows += serve_tonearm(bundle_of(work, args.preset, quantize), preset=args.preset, label=server,
                                      env=env, kinds=kinds, clients=clients, seconds=args.seconds, clip=clip,
                                      scratch=scratch)
            add_results(rows)
            rows = []
    write_report()


def serve_infinity(server: str, preset: str, work: Path, kinds: list[str], clients: list[int], seconds: float,
                   clip: bytes, scratch: Path) -> list[dict]:
    """Infinity variant ``server`` (:data:`INFINITY_SERVERS`) on the preset's model folders, one
    Infinity per folder; text rows carry ``tokens``, the mean tokens per query as Infinity encodes it."""
    from real_size_models import real_model_dir  # tests/real_size_models.py

    rows: list[dict] = []
    presets, dtype = INFINITY_SERVERS[server]
    if preset not in presets:
        return [{"kind": "failed", "preset": preset, "server": server,
                 "why": f"{server} is defined for {', '.join(sorted(presets))} only"}]
    folders = presets[preset]
    for folder in sorted(set(folders.values())):
        wanted = [k for k in kinds if folders.get(k) == folder]
        if not wanted:
            continue
        model = real_model_dir(folder, work)  # built on first use (clap_text_roberta: from the clap folder)
        limit = INFINITY_CLAP_TOKENS if folder == "clap" else None
        tokens = query_tokens(model / "tokenizer.json", limit=limit)
        started = time.perf_counter()
        try:
            infinity = Infinity(model, log=scratch / f"{server}-{folder}.log", dtype=dtype)
            with infinity:
                startup = {"kind": "startup", "preset": preset, "server": f"{server} ({folder})",
                           "ready_s": time.perf_counter() - started, "rss_mib": rss_mib(infinity.process.pid)}
                rows.append(startup)
                print(startup, flush=True)
                for kind in wanted:
                    for c in clients:
                        mark = before_row()
                        stats = asyncio.run(measure_infinity(infinity, kind=kind, clients=c, seconds=seconds, clip=clip))
                        rows.append(_row(preset, server, kind, c, stats, model=folder, **client_cpu(mark),
                                         **({"tokens": tokens} if kind.startswith("text") else {})))
                        print(rows[-1], f"load {os.getloadavg()[0]:.1f}", flush=True)
                startup["rss_after_mib"] = rss_mib(infinity.process.pid)
        except RuntimeError as err:
            rows.append({"kind": "failed", "preset": preset, "server": f"{server} ({folder})",
                         "why": str(err).strip().splitlines()[-1][:300]})
            print(rows[-1], flush=True)
    if server == "infinity":
        for kind in kinds:
            if kind not in folders:
                rows.append({"kind": "failed", "preset": preset, "server": server, "workload": kind,
                             "why": f"Infinity has no {kind} embedding for this model folder (AST is not one of its "
                                    "audio models)"})
    return rows


def cmd_tail(args: argparse.Namespace) -> None:
    """Demo bundle, cold text at 16 clients: p99 with micro-batching on (default) and off (batch of one)."""
    bundle = bundle_or_demo(args.bundle)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as scratch_dir:
        for repeat in range(args.repeats):
            for label, env in (("batching on", {}), ("batching off", {"TONEARM_BATCH_MAX_SIZE": "1"})):
                rows += [dict(r, repeat=repeat) for r in serve_tonearm(
                    bundle, preset="demo", label=label, env=env, kinds=["text-cold"], clients=[16],
                    seconds=args.seconds, clip=b"", scratch=Path(scratch_dir))]
    add_results(rows)
    write_report()


# ----------------------------------------------------------------------------- report


def _fmt(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def _table(rows: list[dict], columns: list[str]) -> str:
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "".join("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |\n" for r in rows)


def _latest_run(results: list[dict], server: str, preset: str) -> list[dict]:
    """Rows of the newest command that served ``server`` on ``preset``, on that command's CPU."""
    marks = [r for r in results if r.get("kind") == "serve" and r.get("server") == server and r.get("preset") == preset]
    if not marks:
        return []
    command, cpu = marks[-1]["command"], marks[-1]["cpu"]
    return [r for r in results if r.get("command") == command and r.get("cpu") == cpu and r.get("preset") == preset]


def like_for_like(results: list[dict]) -> str:
    """Cold text req/s, tonearm beside Infinity at equal query length and precision (issue 32), from the
    newest `serve clap` run that had ``infinity-roberta``; the CLAP-folder row (20 tokens) for contrast."""
    rows = _latest_run(results, "infinity-roberta", "clap")
    serve = {(r["server"], r["clients"]): r for r in rows if r.get("kind") == "serve" and r.get("workload") == "text-cold"}
    if not serve:
        return ""
    clients = sorted({c for _, c in serve})
    pairs = [("tonearm", "infinity-roberta", "fp32, whole queries"),
             ("tonearm+int8-text", "infinity-roberta-int8", "int8 text tower, whole queries"),
             ("tonearm", "infinity", "**not like for like**: Infinity's CLAP folder cuts queries to 20 tokens")]
    lines = []
    for ours, theirs, what in pairs:
        cells = []
        for c in clients:
            a, b = serve.get((ours, c)), serve.get((theirs, c))
            cells.append(f"{a['rps']:.1f} / {b['rps']:.1f} = **{a['rps'] / b['rps']:.2f}×**" if a and b and b["rps"]
                         else "–")
        tokens = "/".join(_fmt(serve.get((s, clients[-1]), {}).get("tokens", "?")) for s in (ours, theirs))
        lines.append(f"| {ours} ÷ {theirs} | {what} | {tokens} | " + " | ".join(cells) + " |\n")
    first = rows[0]
    measured = [r for r in serve.values() if "load_before" in r]
    quiet = (f" 1-min load average before each row {min(r['load_before'] for r in measured):.2f}–"
             f"{max(r['load_before'] for r in measured):.2f}; the load generator (same two cores) used "
             f"{min(r['client_cores'] for r in measured):.2f}–{max(r['client_cores'] for r in measured):.2f} "
             f"of a core during a row, the same clients for both servers." if measured else "")
    return (f"\n### Like for like: cold text, tonearm ÷ Infinity at equal tokens and precision (CLAP-size)\n\n"
            f"`{first['command']}` ({first['date']}, {first['cpu']}; same queries for both servers: "
            f"bench/service_load.py `text_query`).{quiet} Cells: tonearm req/s / Infinity req/s = ratio; tokens: mean "
            f"tokens per query as each server encodes it (tonearm / Infinity).\n\n"
            "| tonearm ÷ peer | what | tokens | " + " | ".join(f"{c} client{'s' * (c > 1)}" for c in clients)
            + " |\n|---|---|---|" + "---:|" * len(clients) + "\n" + "".join(lines))


def _rate_fmt(rps: float) -> str:
    return f"{rps:.2f}" if rps < 1 else f"{rps:.1f}"


def pretrained_table(results: list[dict]) -> str:
    """PE-Audio beside the CLAP-size pretrained bundle (issue 32): export, ONNX sizes, startup, req/s
    (the newest row of each cell on the newest CPU)."""
    lines = []
    clients: list[int] = []
    for preset in ("pe_audio", "clap_pretrained"):
        # every command's rows on the newest CPU that served the preset, a later row replacing an earlier one
        # of the same server, workload and clients (e.g. a longer audio-only run after the first)
        mine = [r for r in results if r.get("preset") == preset and r.get("kind") in ("serve", "startup")]
        rows = [r for r in mine if r.get("cpu") == mine[-1]["cpu"]] if mine else []
        serve = {(r["server"], r["workload"], r["clients"]): r for r in rows if r.get("kind") == "serve"}
        startup = {r["server"]: r for r in rows if r.get("kind") == "startup"}
        clients = clients or sorted({c for _, _, c in serve})
        for server in dict.fromkeys(s for s, _, _ in serve):
            quantize = server.partition("+int8-")[2] or "none"
            builds = [r for r in results if r.get("kind") == "build" and r.get("preset") == bundle_key(preset, quantize)]
            build = builds[-1] if builds else {}
            sizes = ", ".join(f"{k.removesuffix('_encoder.onnx')} {v / 1000:.2f} GB" for k, v in build.get("onnx_mb", {}).items())
            up = startup.get(server, {})
            rates = [_rate_fmt(serve[server, kind, c]["rps"]) if (server, kind, c) in serve else "–"
                     for kind in ("text-cold", "audio") for c in clients]
            lines.append(f"| {preset} | {server} | {_fmt(build.get('export_s', '–'))} | {sizes} | "
                         f"{_fmt(up.get('ready_s', '–'))} | {_fmt(up.get('rss_mib', '–'))} | "
                         f"{_fmt(up.get('rss_after_mib', '–'))} | " + " | ".join(rates)
                         + f" | {up.get('date', '–')}, load {up.get('load', '–')} |\n")
    if not lines:
        return ""
    head = " | ".join([f"text {c}" for c in clients] + [f"audio {c}" for c in clients])
    return ("\n### Pretrained bundles: PE-Audio beside CLAP-size (`build pe_audio|clap_pretrained`, `tonearm export "
            "--pretrained`, no training)\n\nreq/s at 1/8/16 clients (cold text, 10-s clips); export s and ONNX sizes "
            "(`.onnx` + external data) from the newest build of that bundle; startup to /readyz, RSS then and after the "
            "server's last workload.\n\n"
            f"| bundle | server | export s | ONNX | ready s | RSS MiB | RSS after load MiB | {head} | startup recorded, load |\n"
            "|---|---|---:|---|---:|---:|---:|" + "---:|" * (2 * len(clients)) + "---|\n" + "".join(lines))


def write_report(*, write: bool = True) -> str:
    results = load_results()
    parts = [f"{START}\n## real_size — real-size encoders served on CPU cores, two unless a row says more (bench/real_size.py)\n\n",
             f"- machine: each row names its CPU (`cpu`: 2 cores unless a core count follows) and, for "
             "`reference-cuda` (the reference server's encoders on the GPU), its GPU (`gpu`); tonearm itself always "
             "serves on the CPU. GPU training steps and encoder throughput: section \"GPU at real size\". Rendered "
             f"on {cpu_tag()}, {platform.system()} {platform.release()}, Python {platform.python_version()}\n"
             "- models: random weights at full default size (tests/real_size_models.py), trained two steps "
             "(configs/real/*.yaml) and exported by `tonearm export`, or for `pe_audio` / `clap_pretrained` exported "
             "untrained by `tonearm export --pretrained`; speed does not depend on the weights' values\n"
             "- each row carries its command, date and the 1-min load average **when the row was recorded, i.e. right "
             "after its measurement**: for startup/serve rows that load is the benchmark's own (the load generator and "
             "the server share the two cores; the reference server's thread pool alone reaches 5–14). Each command "
             "started quiet (`quiet-run` waits for load < 1.5) unless the notes below say otherwise; they give the load at "
             "start\n"]
    sections = [
        ("build", "Build (model folders, 2 training steps, export)",
         ["preset", "bundle", "models_s", "train_s", "export_s", "onnx_mb", "date", "load", "cpu"]),
        ("encoder", "Encoder throughput (ONNX Runtime, one process, items/s)",
         ["preset", "modality", "threads", "precision", "batch", "queries", "items_per_s", "mb", "date", "load",
          "cpu"]),
        ("agreement", "int8 vs fp32 agreement on the benchmark inputs (per item)",
         ["preset", "modality", "threads", "min_cosine", "mean_cosine", "cpu"]),
        ("startup", "Startup to /readyz 200 and resident memory",
         ["preset", "server", "ready_s", "rss_mib", "rss_after_mib", "date", "load", "cpu", "gpu"]),
        ("serve", "Search under load (closed-loop clients, 10-s clips for audio; `tokens`: mean tokens per text "
                  "query as that server encodes it)",
         ["preset", "server", "workload", "tokens", "clients", "requests", "errors", "p50_ms", "p99_ms", "rps", "date",
          "load", "cpu", "gpu"]),
        ("failed", "Peers that could not run", ["preset", "server", "workload", "why"]),
    ]
    parts += [like_for_like(results), pretrained_table(results)]
    for kind, title, columns in sections:
        rows = [r for r in results if r.get("kind") == kind]
        if rows:
            parts.append(f"\n### {title}\n\n{_table(rows, columns)}")
    commands = sorted({r["command"] for r in results})
    parts.append("\nCommands: " + "; ".join(f"`{c}`" for c in commands) + "\n")
    if NOTES.exists():
        parts.append("\n" + NOTES.read_text())
    section = "".join(parts) + f"{END}\n"
    if write:
        write_section(section, start=START, end=END)
    return section


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="~/.cache/tonearm/real-bench")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build")
    build.add_argument("preset", choices=sorted(MODELS))
    build.add_argument("--clips-per-split", type=int, default=2)
    build.add_argument("--quantize", choices=["none", "text", "audio", "both"], default="none",
                       help="export the preset's trained run again with these encoders int8 (bundle clap+int8-text, ...)")
    enc = sub.add_parser("encoders")
    enc.add_argument("--presets", default="clap,ast_xlmr")
    enc.add_argument("--seconds", type=float, default=3.0)
    serve = sub.add_parser("serve")
    serve.add_argument("preset", choices=sorted(MODELS))
    serve.add_argument("--servers", default="tonearm,reference,infinity",
                       help="comma-separated: reference, reference-cuda (its encoders on the GPU), infinity, "
                            "infinity-roberta, infinity-roberta-int8 (the CLAP text tower as a RoBERTa folder: whole "
                            "queries; fp32 / Infinity's --dtype int8), "
                            "tonearm[+int8-text|+int8-both][:NAME=VALUE;...] (a bundle built with `build --quantize "
                            "text|both`; TONEARM_NAME settings for that server)")
    serve.add_argument("--kinds", default="text-cold,audio")
    serve.add_argument("--clients", default="1,8,16")
    serve.add_argument("--seconds", type=float, default=8.0)
    serve.add_argument("--quiet-below", type=float, default=None, metavar="LOAD",
                       help="before each row, wait (at most 5 min) for the 1-min load average to fall below LOAD")
    tail = sub.add_parser("tail")
    tail.add_argument("--seconds", type=float, default=10.0)
    tail.add_argument("--repeats", type=int, default=2)
    tail.add_argument("--bundle", help="demo bundle directory (default: the cached demo, built if needed)")
    sub.add_parser("report")
    args = parser.parse_args()
    sys.path.append(str(ROOT / "tests"))  # after ROOT: tests/training must not shadow training/
    {"build": cmd_build, "encoders": cmd_encoders, "serve": cmd_serve, "tail": cmd_tail,
     "report": lambda a: write_report()}[args.command](args)
    if args.command in ("build", "encoders"):
        write_report()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
