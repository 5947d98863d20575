"""The catalogue pass: decode beside the encoder (issue 49).

Every in-process catalogue pass — `tonearm export`, `export --pretrained`, `tonearm index` — embeds its
clips through :func:`clip_embedder`: the clips of a chunk (:mod:`index.embed_checkpoint`) are decoded by
``decode_workers`` worker processes (a ``spawn`` process pool: the parent's ONNX Runtime and torch
threads are never forked) while this process runs the encoder on the clips decoded before. At most
``prefetch`` clips are decoded ahead (bounded memory); decoded clips are gathered into a window,
sorted by length and cut into encoder calls of at most ``batch_samples`` samples
(:func:`length_batches`: the memory budget of one call) so clips of similar length share a call.

One implementation for the torch and the torch-free paths (a torch ``DataLoader`` would add nothing
here: the encoder is ONNX Runtime and reads numpy arrays; its pinned host buffers are ONNX Runtime's,
:func:`index.gpu_io.cuda_provider_options`). ``decode_workers`` 0 decodes in this process (the
library default, and what a one-core machine should use); `tonearm export|index` default to the cores
left after the encoder's own (:func:`default_decode_workers`).

:class:`PassClock` measures the time the encoder waited for decoded clips and the time it was busy;
the progress line shows both (``decode wait``, ``encoder busy``): an encoder busy < 90 % of the time
is starved by decoding — give the pass more decode workers (docs/models.md, "Throughput").
"""

from __future__ import annotations

import multiprocessing
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from index.embed_checkpoint import Chunk, EmbedChunk
from index.errors import AudioDecodeError

BATCH_SAMPLES = 16 * 480_000
"""Samples of one encoder call's clips (a memory budget: 16 clips of 10 s at 48 kHz, 30 MB of float32)."""
PREFETCH = 64
"""Clips decoded ahead of the encoder (and the window sorted by length)."""


@dataclass(frozen=True)
class DecodeCall:
    """``fn(path, *args, **kwargs)``: a picklable decode function of one path (``fn`` at module level)."""

    fn: Callable[..., np.ndarray]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self, path: Any) -> np.ndarray:
        return self.fn(path, *self.args, **self.kwargs)


@dataclass(frozen=True)
class PassOptions:
    """How the pass decodes: worker processes (0: in this process), clips decoded ahead, the samples
    of one encoder call."""

    decode_workers: int = 0
    prefetch: int = PREFETCH
    batch_samples: int = BATCH_SAMPLES

    def __post_init__(self) -> None:
        if self.decode_workers < 0 or self.prefetch < 1 or self.batch_samples < 1:
            raise ValueError(f"bad pass options {self}")


def default_decode_workers(encoder_threads: int = 1) -> int:
    """The cores left after the encoder's threads (at least one worker; 0 on a single core)."""
    from index.cpus import available_cores

    cores = available_cores()
    return 0 if cores <= 1 else max(1, cores - encoder_threads)


class PassClock:
    """Wall time of a pass, the time it waited for decoded clips and the time its encoder ran."""

    def __init__(self) -> None:
        self.began = time.monotonic()
        self.decode_wait = 0.0
        self.encode_busy = 0.0
        self.clips = 0

    def elapsed(self) -> float:
        return time.monotonic() - self.began

    def busy_fraction(self) -> float:
        return self.encode_busy / max(self.elapsed(), 1e-9)

    def describe(self) -> str:
        elapsed = max(self.elapsed(), 1e-9)
        return f"decode wait {100 * self.decode_wait / elapsed:.0f} %, encoder busy {100 * self.busy_fraction():.0f} %"


def _decode_one(decode: Callable[[Any], np.ndarray], path: Any) -> tuple[np.ndarray | None, str]:
    """In a worker: the waveform, or None and why it cannot be decoded."""
    try:
        return np.ascontiguousarray(decode(path), dtype=np.float32), ""
    except AudioDecodeError as err:
        return None, str(err).removeprefix(f"{path}: ")


class Decoder:
    """Decodes paths in order, ``workers`` processes at a time, at most ``prefetch`` ahead."""

    def __init__(self, decode: Callable[[Any], np.ndarray], options: PassOptions, clock: PassClock) -> None:
        self.decode, self.options, self.clock = decode, options, clock
        self.pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> Decoder:
        if self.options.decode_workers > 0:
            self.pool = ProcessPoolExecutor(self.options.decode_workers,
                                            mp_context=multiprocessing.get_context("spawn"))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None

    def imap(self, paths: Sequence[Any]) -> Iterator[tuple[np.ndarray | None, str]]:
        """``(waveform or None, reason)`` per path, in order."""
        if self.pool is None:
            for path in paths:
                began = time.monotonic()
                found = _decode_one(self.decode, path)
                self.clock.decode_wait += time.monotonic() - began  # decoding here: the encoder waits
                yield found
            return
        pending: deque[Future[tuple[np.ndarray | None, str]]] = deque()
        queue = iter(paths)
        for path in queue:
            pending.append(self.pool.submit(_decode_one, self.decode, path))
            if len(pending) >= self.options.prefetch:
                break
        while pending:
            began = time.monotonic()
            found = pending.popleft().result()
            self.clock.decode_wait += time.monotonic() - began
            nxt = next(queue, None)
            if nxt is not None:
                pending.append(self.pool.submit(_decode_one, self.decode, nxt))
            yield found


def length_batches(lengths: Sequence[int], batch_samples: int) -> list[list[int]]:
    """Indices into ``lengths`` sorted by length and cut into calls of at most ``batch_samples``
    samples each (padded to the call's longest clip; one clip a call when it alone exceeds the budget)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = max(lengths[i], 1)
        if current and (len(current) + 1) * longest > batch_samples:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


Encode = Callable[[list[np.ndarray]], np.ndarray]


def clip_embedder(ids: Sequence[str], sources: Sequence[Any], decode: Callable[[Any], np.ndarray], encode: Encode, *,
                  dim: int, decoder: Decoder) -> EmbedChunk:
    """The :data:`~index.embed_checkpoint.EmbedChunk` of a clips pass: the chunk's ``sources`` decoded by
    ``decoder`` and encoded by ``encode`` (waves → (n, d)) in length-sorted calls of the pass's budget;
    a clip that cannot be decoded is skipped with its reason."""
    clock, options = decoder.clock, decoder.options

    def embed(indices: Sequence[int], advance: Callable[[int], None]) -> Chunk:
        kept: list[int] = []
        vectors: dict[int, np.ndarray] = {}
        skipped: list[tuple[str, str]] = []
        window: list[tuple[int, np.ndarray]] = []

        def flush() -> None:
            lengths = [len(w) for _, w in window]
            for batch in length_batches(lengths, options.batch_samples):
                began = time.monotonic()
                out = encode([window[b][1] for b in batch])
                clock.encode_busy += time.monotonic() - began
                for b, row in zip(batch, out, strict=True):
                    vectors[window[b][0]] = row
            clock.clips += len(window)
            advance(len(window))
            window.clear()

        for i, (wave, reason) in zip(indices, decoder.imap([sources[i] for i in indices]), strict=True):
            if wave is None:
                skipped.append((ids[i], reason))
                advance(1)
                continue
            kept.append(i)
            window.append((i, wave))
            if len(window) >= options.prefetch or sum(len(w) for _, w in window) >= 4 * options.batch_samples:
                flush()
        if window:
            flush()
        embeddings = np.stack([vectors[i] for i in kept]).astype(np.float32) if kept else np.zeros((0, dim), np.float32)
        return Chunk([ids[i] for i in kept], embeddings, skipped)

    return embed
