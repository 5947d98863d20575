"""Embedding passes as Ray Data jobs: `tonearm index --ray` and `tonearm export --ray` (SPEC §12).

A pass over files (or captions) becomes one Ray Data pipeline::

    from_items(rows)  ->  map_batches(AudioEmbedder | TextEmbedder, actor pool)  ->  driver

* The rows (``row`` number + file path, or ``row`` + caption) are split into blocks,
  several per worker, so the files are sharded across the pool and a slow worker
  takes fewer blocks.
* Each worker is a Ray actor holding **one** ONNX Runtime session, created once from
  the encoder's bytes (shipped through the object store, so workers need no copy of
  the bundle); ``intra_op_num_threads`` equals the CPUs the actor reserves, so N
  actors on N cores do not oversubscribe.
* With a :class:`~index.catalogue.pass_windows.WindowPlan` an actor also embeds the moment windows of each
  long recording it decodes (the decode of its clip vector: one decode per file) and returns them beside
  the vector (:func:`~index.catalogue.pass_windows.serialize_windows`); the caller checkpoints them with
  the chunk, as the in-process pass does.
* Actors decode and embed exactly as the single-process path does (the caller's own
  ``decode`` function, under the pass's decode limits, then :func:`index.bundle.evalset.prepare_waveform` and
  :func:`index.runtime.loader.encode_waveforms` / :func:`index.runtime.loader.encode_texts`), so the
  vectors match it to float tolerance (ONNX batch composition differs). A file that
  cannot be decoded comes back with its error message instead of a vector. An actor decodes beside its
  encoder: its decode threads decode the next group of :data:`AUDIO_GROUP_FILES` files while a group is
  encoded (:class:`AudioEmbedder`).
* Passes are checkpointed by the caller, one Ray job a chunk (:func:`index.catalogue.checkpoint.embed_in_chunks`;
  `tonearm index --ray` in :mod:`index.catalogue.own_audio`, the exports in :mod:`training.bundle.parts`).
* The driver puts the rows back in input order; the bundle, ids and index are
  then written by the same code as the single-process path.
* With a *sink* (`tonearm index --ray --milvus-uri`) each actor writes its own vectors into the
  Milvus collection (:class:`index.engines.milvus_index.CollectionSink`, row = the file's position), with
  each file's metadata object (``metas``, laid out on the driver; it travels in the file's row as
  JSON, so each actor gets only its own files'), and returns only row numbers and errors: the
  driver never holds the vectors. With a *window sink* as well, an actor writes the moment windows of the
  long recordings it decodes there too (:class:`index.catalogue.milvus_pass_windows.MilvusWindowSink`, keyed by
  the file's row) and returns only how many it wrote per row.

Addresses (``--ray [ADDRESS]``) and Ray token authentication: :mod:`index.catalogue.ray_connect`. Audio paths
must be readable at the same path on every worker (a shared volume); docs/deploy.md, "Ray".
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnxruntime as ort

from index.audio.decode import DecodeLimits, decode_audio
from index.audio.frontend import Padding
from index.bundle.evalset import prepare_waveform
from index.bundle.format import AudioFrontendInfo
from index.bundle.tokenizer import TextTokenizer
from index.catalogue.checkpoint import Windows
from index.catalogue.pass_windows import WindowPlan, deserialize_windows, serialize_windows
from index.catalogue.ray_connect import connect
from index.errors import AudioDecodeError, TonearmError
from index.runtime.loader import (
    AUDIO_INPUTS,
    TEXT_INPUTS,
    OnnxEncoder,
    encode_clips,
    encode_texts,
    encode_waveforms,
)

log = logging.getLogger(__name__)

Policy = Literal["center", "chunk"]
Decode = Callable[[Path, int], np.ndarray]
"""(path, sample rate) -> mono float32 waveform, or :class:`AudioDecodeError`; a module-level
function (Ray pickles it by reference)."""
Sink = Callable[[np.ndarray, np.ndarray, list[dict[str, Any]]], None]
"""(row numbers, vectors, the rows' metadata objects) -> None: where an actor writes its vectors
itself instead of returning them to the driver (:class:`index.engines.milvus_index.CollectionSink`); picklable."""
WindowSink = Callable[[list[tuple[int, np.ndarray, np.ndarray]]], None]
"""``[(row number, spans (m, 2), vectors (m, d)), ...]`` -> None: where an actor writes the moment windows of the
long recordings it decodes instead of returning them (:class:`index.catalogue.milvus_pass_windows.MilvusWindowSink`);
picklable."""
AUDIO_BATCH_FILES = 16
"""Files per actor call (the single-process `tonearm index` embeds 16 at a time too)."""
AUDIO_GROUP_FILES = 4
"""Files per encoder call of an actor: one group is encoded while the next is decoded (:class:`AudioEmbedder`),
so three quarters of a call's decoding runs beside its encoding."""
TEXT_BATCH = 256
BLOCKS_PER_WORKER = 4
ACTOR_START_TIMEOUT_S = 600
"""Every actor of the pool must start within this; then the blocks are shared among all of them
(else the first actor up takes every block of a small job)."""


def decode_whole(path: Path, sample_rate: int, limits: DecodeLimits | None = None) -> np.ndarray:
    """The export's decoding (:func:`index.audio.decode.decode_audio`) under ``limits`` (default: the
    catalogue pass's, :class:`index.audio.decode.DecodeLimits`), as a :data:`Decode` (bind other limits with
    :func:`functools.partial`)."""
    return decode_audio(path, sample_rate=sample_rate, **(limits or DecodeLimits()).kwargs())


@dataclass(frozen=True)
class RayOptions:
    """Where and how wide an embedding pass runs on Ray."""

    address: str | None = None
    """None: RAY_ADDRESS / the local cluster / a new local instance; else ``auto``, ``HOST:PORT``, ``ray://…``
    (:func:`index.catalogue.ray_connect.resolve`)."""
    workers: int | None = None
    """Actors in the pool (one ONNX session each); None: the cluster's CPUs // ``cpus_per_worker``."""
    cpus_per_worker: int | None = None
    """CPUs each actor reserves (decoding and its ONNX Runtime intra-op threads); None: 1 on the CPU,
    :data:`CUDA_CPUS_PER_WORKER` with ``device`` cuda (an actor decodes beside its GPU)."""
    progress: bool = False
    device: Literal["cpu", "cuda"] = "cpu"
    """cuda: each actor asks Ray for ``gpus_per_worker`` GPUs and runs ONNX Runtime's CUDA provider."""
    gpus_per_worker: float = 1.0

    @property
    def cpus(self) -> int:
        return self.cpus_per_worker or (CUDA_CPUS_PER_WORKER if self.device == "cuda" else 1)


CUDA_CPUS_PER_WORKER = 4
"""CPUs a GPU actor reserves by default: its decoding (docs/models.md, "Throughput": ~4-8 cores a GPU)."""


def ray_options_from_args(args: Any) -> RayOptions:
    """`--ray [ADDRESS]`, `--ray-workers`, `--ray-cpus-per-worker` and `--device` as :class:`RayOptions`."""
    return RayOptions(address=args.ray or None, workers=getattr(args, "ray_workers", None),
                      cpus_per_worker=getattr(args, "ray_cpus_per_worker", None), progress=True,
                      device=getattr(args, "device", "cpu") or "cpu")


def actor_resources(options: RayOptions) -> dict[str, Any]:
    """What each embedding actor asks Ray for: ``num_cpus`` (decoding + ONNX threads) and, on CUDA, ``num_gpus``."""
    found: dict[str, Any] = {"num_cpus": options.cpus}
    if options.device == "cuda":
        found["num_gpus"] = options.gpus_per_worker
    return found


def _session(model: Any, inputs: Sequence[str], embed_dim: int, threads: int, device: str = "cpu") -> OnnxEncoder:
    """One ONNX session from the encoder bytes (an object-store ref is resolved by Ray); ``device`` cuda:
    the CUDA provider on the GPU Ray gave the actor (its ``CUDA_VISIBLE_DEVICES``), refused in one line
    when it does not start."""
    import ray

    from index.runtime.gpu_io import CUDA, provider_entries

    data = ray.get(model) if isinstance(model, ray.ObjectRef) else model
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    providers = [CUDA, "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
    session = ort.InferenceSession(data, options, providers=provider_entries(providers))
    if device == "cuda" and session.get_providers()[0] != CUDA:  # pragma: no cover - a GPU node only
        raise TonearmError(f"Ray actor on {socket.gethostname()}: onnxruntime could not start {CUDA} "
                           "(install onnxruntime-gpu on the workers, or leave out --device cuda)")
    encoder = OnnxEncoder(session=session, path=Path("<ray actor>"))
    encoder.check_interface(inputs, embed_dim)
    return encoder


class AudioEmbedder:
    """Ray Data actor: decodes a batch of files and embeds them with its own ONNX session, decoding beside
    encoding: the batch runs as encoder calls of :data:`AUDIO_GROUP_FILES` files, and while one group is
    encoded the actor's decode threads decode the next (at most two groups decoded or in flight: memory of
    2 × :data:`AUDIO_GROUP_FILES` files, each under the pass's decode limits). ``decode_threads``: one on the
    CPU (the actor's CPUs run the encoder), the CPUs it reserves less one with ``device`` cuda (the GPU
    encodes; decoding is what bounds it, docs/models.md, "Throughput")."""

    def __init__(self, model: Any, *, decode: Decode, embed_dim: int, sample_rate: int, clip_samples: int,
                 policy: Policy, threads: int, sink: Sink | None = None, padding: Padding = "pad",
                 frontend: AudioFrontendInfo | None = None, device: str = "cpu", call_samples: int | None = None,
                 windows: WindowPlan | None = None, window_sink: WindowSink | None = None) -> None:
        self.encoder = _session(model, AUDIO_INPUTS, embed_dim, threads, device)
        self.windows = windows  # long recordings' moment windows, from the decode of their clip vector
        self.window_sink = window_sink  # where they go instead of back to the driver (then only counts go back)
        self.call_samples = call_samples  # a whole-clip encoder's samples a call (PassOptions.codec_call_samples)
        self.decode = decode
        self.sink = sink
        self.embed_dim, self.sample_rate, self.clip_samples, self.policy = embed_dim, sample_rate, clip_samples, policy
        self.padding = padding
        self.frontend = frontend  # a bundle's own short-clip padding: embed exactly as LoadedBundle.encode_audio
        self.decode_threads = max(1, threads - 1) if device == "cuda" else 1
        self.decoding = ThreadPoolExecutor(self.decode_threads, thread_name_prefix="decode")
        self.timeline: list[tuple[str, int, float, float]] = []
        """(``decode`` / ``encode``, group, began, ended) of the last call (time.monotonic; what the tests read)."""

    def _decoded(self, path: str, group: int) -> tuple[np.ndarray | None, np.ndarray | None, str]:
        """(the clip's prepared waveform, the whole recording when it is long and windowed, error)."""
        began = time.monotonic()
        try:
            wave = self.decode(Path(path), self.sample_rate)
            whole = wave if self.windows is not None and self.windows.is_long(len(wave)) else None
            prepared = prepare_waveform(wave, clip_samples=self.clip_samples, policy=self.policy, padding=self.padding)
            return prepared, whole, ""
        except AudioDecodeError as err:
            return None, None, str(err)
        finally:
            self.timeline.append(("decode", group, began, time.monotonic()))

    def _encode(self, waves: list[np.ndarray], group: int) -> np.ndarray:
        began = time.monotonic()
        try:
            if self.frontend is not None:
                return encode_clips(self.encoder, waves, clip_samples=self.clip_samples, embed_dim=self.embed_dim,
                                    frontend=self.frontend, max_call_samples=self.call_samples)
            return encode_waveforms(self.encoder, waves, clip_samples=self.clip_samples, embed_dim=self.embed_dim,
                                    padding=self.padding)
        finally:
            self.timeline.append(("encode", group, began, time.monotonic()))

    def _encode_windows(self, windows: Sequence[np.ndarray], group: int) -> np.ndarray:
        return self._encode(list(windows), group)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        began = time.time()
        self.timeline = []
        paths = [str(p) for p in batch["path"]]
        groups = [list(range(s, min(s + AUDIO_GROUP_FILES, len(paths)))) for s in range(0, len(paths), AUDIO_GROUP_FILES)]
        errors = [""] * len(paths)
        out = np.zeros((len(paths), self.embed_dim), np.float32)
        windows = [b""] * len(paths)
        counts = np.zeros(len(paths), np.int64)  # windows written to the window sink, by row

        def submit(g: int) -> list[Future[tuple[np.ndarray | None, np.ndarray | None, str]]]:
            return [self.decoding.submit(self._decoded, paths[i], g) for i in groups[g]] if g < len(groups) else []

        pending = submit(0)
        for g, rows in enumerate(groups):
            following = submit(g + 1)  # decoded by the threads while this group is encoded here
            waves, kept, long = [], [], []
            for row, future in zip(rows, pending, strict=True):
                wave, whole, error = future.result()
                if wave is None:
                    errors[row] = error
                else:
                    waves.append(wave)
                    kept.append(row)
                    if whole is not None:
                        long.append((row, whole))
            if waves:
                out[kept] = self._encode(waves, g)
            if long and self.windows is not None:  # only then is a recording kept whole
                encode = functools.partial(self._encode_windows, group=g)
                written = []
                for row, whole in long:
                    spans, vectors = self.windows.embed(whole, encode)
                    if self.window_sink is None:
                        windows[row] = serialize_windows((spans, vectors))
                    elif len(spans):
                        counts[row] = len(spans)
                        written.append((int(batch["row"][row]), spans, vectors))
                if written and self.window_sink is not None:  # a group's windows at a time: held no longer
                    self.window_sink(written)
            pending = following
        ok = np.array([not e for e in errors], dtype=bool)
        if self.sink is not None:  # written from here: only row numbers and errors go back to the driver
            metas = [json.loads(str(meta)) for meta in batch["meta"][ok]]
            self.sink(batch["row"][ok].astype(np.int64), out[ok], metas)
            out = out[:, :0]
        found = ({"n_windows": counts} if self.window_sink is not None
                 else {"windows": np.array(windows, dtype=object)} if self.windows is not None and self.sink is None
                 else {})
        return {"row": batch["row"], "embedding": out, "error": np.array(errors, dtype=object), **found,
                **_stamps(len(errors), began)}


class TextEmbedder:
    """Ray Data actor: tokenizes and embeds a batch of captions with its own ONNX session."""

    def __init__(self, model: Any, *, tokenizer_json: str, embed_dim: int, threads: int, device: str = "cpu") -> None:
        from tokenizers import Tokenizer

        self.encoder = _session(model, TEXT_INPUTS, embed_dim, threads, device)
        self.tokenizer = TextTokenizer(Tokenizer.from_str(tokenizer_json))
        self.embed_dim = embed_dim

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        began = time.time()
        texts = [str(t) for t in batch["text"]]
        out = encode_texts(self.encoder, self.tokenizer, texts, embed_dim=self.embed_dim)
        return {"row": batch["row"], "embedding": out, **_stamps(len(texts), began)}


def _stamps(n: int, began: float) -> dict[str, np.ndarray]:
    """Which worker embedded the rows, and when its call began and ended (wall clock)."""
    return {"worker": np.full(n, os.getpid()), "began": np.full(n, began), "ended": np.full(n, time.time())}


@dataclass(frozen=True)
class RayEmbedded:
    """Vectors in input order; ``errors[i]`` is "" for an embedded row, else why it was not."""

    embeddings: np.ndarray
    """(n, d); (n, 0) when the actors wrote the vectors to a sink."""
    errors: list[str]
    workers: int
    """Distinct worker processes that embedded rows (what the sharding reached)."""
    busy_s: float = 0.0
    """From the first actor call's start to the last one's end: the pool's working span, without
    the pass's fixed costs (actor start, session creation) — rows / busy_s is its throughput."""
    windows: list[Windows | None] | None = None
    """With a :class:`~index.catalogue.pass_windows.WindowPlan`: each row's moment windows (None: not long)."""
    window_counts: list[int] | None = None
    """With a window sink: the windows each row's actor wrote there (0: not long, or not decoded)."""


def pool_size(options: RayOptions, resources: dict[str, float]) -> int:
    """Actors in the pool: ``options.workers``, else as many as the cluster's CPUs (GPUs with ``device``
    cuda) hold at the resources each asks for."""
    if options.workers:
        return options.workers
    by_cpu = int(resources.get("CPU", 1)) // options.cpus
    if options.device == "cuda":
        gpus = float(resources.get("GPU", 0))
        if gpus < options.gpus_per_worker:
            raise TonearmError("--device cuda --ray: the Ray cluster has no GPU (ray status shows its resources)")
        return max(1, min(by_cpu, int(gpus // options.gpus_per_worker)))
    return max(1, by_cpu)


def build_dataset(rows: list[dict[str, Any]], actor: type, constructor: dict[str, Any], *, batch_size: int,
                  options: RayOptions, workers: int) -> Any:
    """The pass's lazy Ray Data pipeline: ``rows`` in blocks → ``actor`` pool with :func:`actor_resources`."""
    from ray import data as ray_data

    blocks = max(1, min(len(rows), workers * BLOCKS_PER_WORKER))
    return ray_data.from_items(rows, override_num_blocks=blocks).map_batches(
        actor, fn_constructor_kwargs=constructor | {"threads": options.cpus, "device": options.device},
        batch_size=batch_size, concurrency=workers, batch_format="numpy", **actor_resources(options),
    )


def _run(rows: list[dict[str, Any]], actor: type, constructor: dict[str, Any], *, batch_size: int,
         options: RayOptions, dim: int, advance: Callable[[int], None] | None) -> RayEmbedded:
    ray = connect(options.address)
    from ray import data as ray_data

    context = ray_data.DataContext.get_current()
    context.enable_progress_bars = options.progress
    context.wait_for_min_actors_s = ACTOR_START_TIMEOUT_S  # the whole pool up before blocks are handed out
    workers = pool_size(options, ray.cluster_resources())
    dataset = build_dataset(rows, actor, constructor, batch_size=batch_size, options=options, workers=workers)
    embeddings = np.zeros((len(rows), 0 if constructor.get("sink") is not None else dim), np.float32)
    errors = [""] * len(rows)
    counted = constructor.get("window_sink") is not None
    windows: list[Windows | None] | None = (
        [None] * len(rows) if constructor.get("windows") is not None and not counted else None)
    counts: list[int] | None = [0] * len(rows) if counted else None
    seen: set[int] = set()
    first, last = float("inf"), 0.0
    try:
        for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"):
            first, last = min(first, float(batch["began"].min())), max(last, float(batch["ended"].max()))
            order = batch["row"].astype(np.int64)
            embeddings[order] = batch["embedding"]
            for row, error in zip(order, batch.get("error", [""] * len(order)), strict=True):
                errors[int(row)] = str(error)
            if windows is not None and "windows" in batch:
                for row, data in zip(order, batch["windows"], strict=True):
                    windows[int(row)] = deserialize_windows(bytes(data), dim)
            if counts is not None and "n_windows" in batch:
                for row, n in zip(order, batch["n_windows"], strict=True):
                    counts[int(row)] = int(n)
            seen.update(int(w) for w in batch["worker"])
            if advance is not None:
                advance(len(order))
    except ray.exceptions.RayError as err:
        raise _worker_error(err) from None
    log.info("Ray pass: %d rows on %d worker processes (pool of %d)", len(rows), len(seen), workers)
    return RayEmbedded(embeddings=embeddings, errors=errors, workers=len(seen), busy_s=max(0.0, last - first),
                       windows=windows, window_counts=counts)


def _worker_error(err: BaseException) -> TonearmError:
    """A failure inside an actor, as the one-line error the CLI prints (the actor's own
    :class:`TonearmError` when it raised one, e.g. Milvus unreachable from a worker)."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, TonearmError):
            return cause
        cause = getattr(cause, "cause", None) or cause.__cause__
    lines = [line for line in str(err).splitlines() if line.strip()]
    return TonearmError(f"the Ray embedding pass failed: {lines[-1] if lines else type(err).__name__}")


def embed_audio_files(paths: Sequence[Path | str], model: bytes, *, decode: Decode, embed_dim: int, sample_rate: int,
                      clip_samples: int, policy: Policy, options: RayOptions,
                      advance: Callable[[int], None] | None = None, sink: Sink | None = None,
                      metas: Sequence[dict[str, Any]] | None = None,
                      padding: Padding = "pad", frontend: AudioFrontendInfo | None = None,
                      call_samples: int | None = None, windows: WindowPlan | None = None,
                      window_sink: WindowSink | None = None) -> RayEmbedded:
    """Clip embeddings of ``paths`` (decoded, prepared with ``policy``, chunk-averaged) on Ray; with
    ``windows`` also the moment windows of the long recordings among them (``RayEmbedded.windows``).

    ``sink``: each actor writes its vectors there (row = position in ``paths``) with ``metas[row]``
    (the row's metadata object; ``{}`` when not given) and the driver gets none back
    (``embeddings`` is (n, 0)): a collection larger than the driver's memory. Without ``window_sink`` such a
    pass windows nothing; with it (and ``windows``) each actor writes the long recordings' windows there (key =
    the row) and the driver gets only their counts (``RayEmbedded.window_counts``)."""
    if window_sink is not None and windows is None:
        raise ValueError("a window sink needs the windows' plan")
    if not paths:
        return RayEmbedded(np.zeros((0, 0 if sink is not None else embed_dim), np.float32), [], 0,
                           window_counts=[] if window_sink is not None else None)
    ray = connect(options.address)
    constructor = {"model": ray.put(model), "decode": decode, "embed_dim": embed_dim, "sample_rate": sample_rate,
                   "clip_samples": clip_samples, "policy": policy, "sink": sink, "padding": padding,
                   "frontend": frontend, "call_samples": call_samples,
                   "windows": windows if sink is None or window_sink is not None else None, "window_sink": window_sink}
    rows: list[dict[str, Any]] = [{"row": i, "path": str(p)} for i, p in enumerate(paths)]
    if metas is not None and len(metas) != len(rows):
        raise ValueError(f"{len(metas)} metadata objects for {len(rows)} files")
    if sink is not None:
        for row in rows:
            row["meta"] = json.dumps(metas[row["row"]] if metas is not None else {}, ensure_ascii=False)
    return _run(rows, AudioEmbedder, constructor, batch_size=AUDIO_BATCH_FILES, options=options,
                dim=embed_dim, advance=advance)


def embed_captions(texts: Sequence[str], model: bytes, tokenizer: TextTokenizer, *, embed_dim: int,
                   options: RayOptions, advance: Callable[[int], None] | None = None) -> RayEmbedded:
    """Caption embeddings of ``texts`` on Ray (tokenizer shipped as its JSON)."""
    if not texts:
        return RayEmbedded(np.zeros((0, embed_dim), np.float32), [], 0)
    ray = connect(options.address)
    constructor = {"model": ray.put(model), "tokenizer_json": tokenizer.to_str(), "embed_dim": embed_dim}
    rows = [{"row": i, "text": t} for i, t in enumerate(texts)]
    return _run(rows, TextEmbedder, constructor, batch_size=TEXT_BATCH, options=options, dim=embed_dim,
                advance=advance)
