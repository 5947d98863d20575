"""The catalogue pass: decode beside the encoder (issue 49).

Every in-process catalogue pass — `tonearm export`, `export --pretrained`, `tonearm index` — embeds its
clips through :func:`clip_embedder`: the clips of a chunk (:mod:`index.catalogue.checkpoint`) are decoded by
``decode_workers`` worker processes (a ``spawn`` process pool: the parent's ONNX Runtime and torch
threads are never forked) while this process runs the encoder on the clips decoded before. Each file is
decoded under the pass's limits (``PassOptions.limits``, :class:`index.audio.decode.DecodeLimits`: a source
rate floor, the samples and bytes one file may cost — past one, the file is skipped with the reason), and at
most ``prefetch`` clips and ``decode_memory`` bytes are decoded ahead (bounded memory); decoded clips are gathered into a window,
sorted by length and cut into encoder calls of at most ``batch_samples`` samples
(:func:`length_batches`: the memory budget of one call) so clips of similar length share a call.

One implementation for the torch and the torch-free paths (a torch ``DataLoader`` would add nothing
here: the encoder is ONNX Runtime and reads numpy arrays; its pinned host buffers are ONNX Runtime's,
:func:`index.runtime.gpu_io.cuda_provider_options`). ``decode_workers`` 0 decodes in this process (the
library default, and what a one-core machine should use); `tonearm export|index` default to the cores
left after the encoder's own (:func:`default_decode_workers`).

:class:`PassClock` measures the time the encoder waited for decoded clips and the time it was busy;
the progress line shows both (``decode wait``, ``encoder busy``): an encoder busy < 90 % of the time
is starved by decoding — give the pass more decode workers (docs/models.md, "Throughput").
"""

from __future__ import annotations

import multiprocessing
import os
import re
import shutil
import subprocess
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from index.audio.decode import DecodeLimits
from index.catalogue.checkpoint import Chunk, EmbedChunk, Windows
from index.catalogue.pass_windows import Decoded, encode_windows
from index.errors import AudioDecodeError, TonearmError

BATCH_SAMPLES = 16 * 480_000
"""Samples of one encoder call's clips (a memory budget: 16 clips of 10 s at 48 kHz, 30 MB of float32)."""
PREFETCH = 64
"""Clips decoded ahead of the encoder (and the window sorted by length)."""


DECODE_MEMORY = 2 << 30
"""Default bytes of audio the pass's decoding may hold at once (`--decode-memory`): the decodes in flight and
the decoded clips not yet handed to the encoder, each counted at its header's
:func:`~index.audio.decode.decode_estimate` (:class:`Decoder`; split among the devices of ``--devices``)."""


@dataclass(frozen=True)
class DecodeCall:
    """``fn(path, *args, **kwargs)``: a picklable decode function of one path (``fn`` at module level);
    ``sample_rate``: the rate it decodes to, when the pass's memory budget should count each file at its
    header's estimate (:meth:`index.audio.decode.DecodeLimits.estimate`; None: not counted)."""

    fn: Callable[..., np.ndarray]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    sample_rate: int | None = None

    def __call__(self, path: Any) -> np.ndarray:
        return self.fn(path, *self.args, **self.kwargs)


@dataclass(frozen=True)
class PassOptions:
    """How the pass decodes: worker processes (0: in this process), clips decoded ahead, the samples
    of one encoder call; ``devices``: the devices the catalogue is split over, one process each
    (:class:`DevicePool`; None: this process's encoder only); ``limits``: what one file may cost to decode
    (a file past them is skipped with the reason); ``decode_memory``: the bytes the decoding may hold at once;
    ``codec_call_samples``: the samples of one call of a whole-clip (PE-Audio) encoder, so that clips of one
    length bucket, long ones too, share calls (None: :data:`index.runtime.loader.CODEC_CALL_SAMPLES`, the
    service's budget; :func:`index.runtime.loader.encode_clips`)."""

    decode_workers: int = 0
    prefetch: int = PREFETCH
    batch_samples: int = BATCH_SAMPLES
    devices: tuple[int, ...] | None = None
    limits: DecodeLimits = DecodeLimits()
    decode_memory: int = DECODE_MEMORY
    codec_call_samples: int | None = None

    def __post_init__(self) -> None:
        if (self.decode_workers < 0 or self.prefetch < 1 or self.batch_samples < 1 or self.decode_memory < 1
                or (self.codec_call_samples is not None and self.codec_call_samples < 1)):
            raise ValueError(f"bad pass options {self}")


def default_decode_workers(encoder_threads: int = 1) -> int:
    """The cores left after the encoder's threads (at least one worker; 0 on a single core)."""
    from index.cpus import available_cores

    cores = available_cores()
    return 0 if cores <= 1 else max(1, cores - encoder_threads)


class PassClock:
    """Wall time of a pass, the time it waited for decoded clips and the time its encoder ran, and the moment
    windows it embedded (:mod:`index.catalogue.pass_windows`). ``timed`` False: a pass whose decoding and
    encoding run elsewhere (Ray), which only counts the windows."""

    def __init__(self, *, timed: bool = True) -> None:
        self.began = time.monotonic()
        self.timed = timed
        self.decode_wait = 0.0
        self.encode_busy = 0.0
        self.clips = 0
        self.windows = 0
        self.long_files = 0

    def count_windows(self, windows: int, files: int = 1) -> None:
        self.windows += windows
        self.long_files += files

    def elapsed(self) -> float:
        return time.monotonic() - self.began

    def busy_fraction(self) -> float:
        return self.encode_busy / max(self.elapsed(), 1e-9)

    def describe(self) -> str:
        elapsed = max(self.elapsed(), 1e-9)
        parts = [f"decode wait {100 * self.decode_wait / elapsed:.0f} %, encoder busy {100 * self.busy_fraction():.0f} %"
                 ] if self.timed else []
        if self.long_files:
            parts.append(f"{self.windows} moment windows of {self.long_files} long files")
        return ", ".join(parts)


Decoding = np.ndarray | Decoded
"""What a pass's decode function returns: the clip's waveform, or with its windows' recording (a
:class:`~index.catalogue.pass_windows.WindowedDecode`)."""


def _decode_one(decode: Callable[[Any], Decoding], path: Any) -> tuple[Decoding | None, str]:
    """In a worker: the waveform (or :class:`~index.catalogue.pass_windows.Decoded`), or None and why it cannot
    be decoded."""
    try:
        found = decode(path)
        return (found if isinstance(found, Decoded) else np.ascontiguousarray(found, dtype=np.float32)), ""
    except AudioDecodeError as err:
        return None, str(err).removeprefix(f"{path}: ")


_END = object()


class Decoder:
    """Decodes paths in order, ``workers`` processes at a time, at most ``prefetch`` ahead and — when
    ``decode`` is a :class:`DecodeCall` with its ``sample_rate`` — at most ``options.decode_memory`` bytes
    ahead: each file is counted at its header's estimate under ``options.limits`` (read here before it is
    handed to a worker) from then until it is yielded; a file alone may pass the budget (its own limits
    bound it), so the most held is max(budget, one file's ``limits.max_bytes``)."""

    def __init__(self, decode: Callable[[Any], Decoding], options: PassOptions, clock: PassClock, *,
                 threads: bool = False) -> None:
        self.decode, self.options, self.clock, self.threads = decode, options, clock, threads
        self.pool: Executor | None = None
        self.held = 0
        """Bytes of the files handed to workers and not yet yielded (their estimates)."""
        self.most_held = 0

    def cost(self, path: Any) -> int:
        """What ``path`` counts against the budget (0 when the pass does not say its rate)."""
        rate = getattr(self.decode, "sample_rate", None)
        return self.options.limits.estimate(path, rate) if rate else 0

    def __enter__(self) -> Decoder:
        if self.options.decode_workers > 0 and self.threads:  # in a device process (DevicePool)
            self.pool = ThreadPoolExecutor(self.options.decode_workers)
        elif self.options.decode_workers > 0:
            self.pool = ProcessPoolExecutor(self.options.decode_workers,
                                            mp_context=multiprocessing.get_context("spawn"))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None

    def imap(self, paths: Sequence[Any]) -> Iterator[tuple[Decoding | None, str]]:
        """``(waveform or None, reason)`` per path, in order (a :class:`~index.catalogue.pass_windows.Decoded`
        when the decode function windows)."""
        if self.pool is None:
            for path in paths:
                began = time.monotonic()
                found = _decode_one(self.decode, path)
                self.clock.decode_wait += time.monotonic() - began  # decoding here: the encoder waits
                yield found
            return
        pool, budget = self.pool, self.options.decode_memory
        pending: deque[tuple[Future[tuple[Decoding | None, str]], int]] = deque()
        queue = iter(paths)
        waiting: tuple[Any, int] | None = None

        def top_up() -> None:
            nonlocal waiting
            while len(pending) < self.options.prefetch:
                if waiting is None:
                    path = next(queue, _END)
                    if path is _END:
                        return
                    waiting = (path, self.cost(path))
                path, cost = waiting
                if pending and self.held + cost > budget:
                    return  # over the budget: wait until the encoder takes a decoded clip
                pending.append((pool.submit(_decode_one, self.decode, path), cost))
                self.held += cost
                self.most_held = max(self.most_held, self.held)
                waiting = None

        top_up()
        while pending:
            future, cost = pending.popleft()
            began = time.monotonic()
            found = future.result()
            self.clock.decode_wait += time.monotonic() - began
            self.held -= cost
            top_up()
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


def clip_embedder(ids: Sequence[str], sources: Sequence[Any], decode: Callable[[Any], Decoding], encode: Encode, *,
                  dim: int, decoder: Decoder) -> EmbedChunk:
    """The :data:`~index.catalogue.checkpoint.EmbedChunk` of a clips pass: the chunk's ``sources`` decoded by
    ``decoder`` and encoded by ``encode`` (waves → (n, d)) in length-sorted calls of the pass's budget;
    a clip that cannot be decoded is skipped with its reason. With a windowing decode
    (:class:`~index.catalogue.pass_windows.WindowedDecode`) a long recording's moment windows are encoded by
    ``encode`` as soon as it is decoded, and go into the chunk beside its clip vector."""
    clock, options = decoder.clock, decoder.options
    plan = getattr(decode, "plan", None)

    def embed(indices: Sequence[int], advance: Callable[[int], None]) -> Chunk:
        kept: list[int] = []
        vectors: dict[int, np.ndarray] = {}
        windows: dict[str, Windows] = {}
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

        for i, (found, reason) in zip(indices, decoder.imap([sources[i] for i in indices]), strict=True):
            if found is None:
                skipped.append((ids[i], reason))
                advance(1)
                continue
            wave = found.clip if isinstance(found, Decoded) else found
            if isinstance(found, Decoded) and found.whole is not None and plan is not None:
                windows[ids[i]] = encode_windows(plan, found.whole, lambda w: encode(list(w)), clock)  # held once
            kept.append(i)
            window.append((i, wave))
            if len(window) >= options.prefetch or sum(len(w) for _, w in window) >= options.batch_samples:
                flush()  # one call's worth: encode it while the workers decode the next
        if window:
            flush()
        embeddings = np.stack([vectors[i] for i in kept]).astype(np.float32) if kept else np.zeros((0, dim), np.float32)
        return Chunk([ids[i] for i in kept], embeddings, skipped, windows=windows)

    return embed


# ----------------------------------------------------------------------------- every device of a node


@dataclass(frozen=True)
class EncoderSpec:
    """What a device process needs to embed clips as the pass's own encoder does: the ONNX file, the
    providers, and the bundle's audio preparation — ``frontend`` (a manifest ``audio_frontend``:
    :func:`index.runtime.loader.encode_clips`, the service's path) or, with ``frontend`` None, ``padding``
    (:func:`index.runtime.loader.encode_waveforms`, a trained checkpoint's zero/tile padding)."""

    path: str
    embed_dim: int
    clip_samples: int
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    frontend: dict[str, Any] | None = None
    padding: str = "pad"
    threads: int | None = 1
    call_samples: int | None = None
    """A whole-clip encoder's samples a call (:attr:`PassOptions.codec_call_samples`)."""

    def load(self, device_id: int | None) -> Encode:
        from index.bundle.format import AudioFrontendInfo
        from index.runtime.loader import AUDIO_INPUTS, OnnxEncoder, encode_clips, encode_waveforms

        encoder = OnnxEncoder.load(Path(self.path), inputs=AUDIO_INPUTS, embed_dim=self.embed_dim,
                                   providers=list(self.providers), threads=self.threads,
                                   device_id=device_id)
        frontend = AudioFrontendInfo.model_validate(self.frontend) if self.frontend is not None else None
        if frontend is not None:
            return lambda waves: encode_clips(encoder, waves, clip_samples=self.clip_samples,
                                              embed_dim=self.embed_dim, frontend=frontend,
                                              max_call_samples=self.call_samples)
        return lambda waves: encode_waveforms(encoder, waves, clip_samples=self.clip_samples,
                                              embed_dim=self.embed_dim, padding=self.padding)  # type: ignore[arg-type]


def parse_devices(text: str | None, device: str) -> list[int] | None:
    """``--devices 0,1,…|all`` → device ids (None: one device, the default); ``all``: every CUDA device
    this process can see (:func:`cuda_device_count`: ``CUDA_VISIBLE_DEVICES`` applies as CUDA applies it)."""
    if text is None:
        return None
    if device != "cuda":
        raise TonearmError("--devices needs --device cuda (the catalogue split over GPUs)")
    if text == "all":
        count = cuda_device_count()
        if count < 1:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            why = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
            raise TonearmError(f"--devices all: no CUDA device visible{why}")
        return list(range(count))
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise TonearmError(f"--devices {text!r}: expected all or a comma-separated list of GPU numbers") from None
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
        raise TonearmError(f"--devices {text!r}: expected distinct GPU numbers >= 0")
    return ids


@dataclass(frozen=True)
class PhysicalGpu:
    """A GPU as ``nvidia-smi -L`` lists it (which ignores ``CUDA_VISIBLE_DEVICES``): its UUID and those of
    its MIG devices."""

    uuid: str
    migs: tuple[str, ...] = ()


def nvidia_smi_gpus(listing: str) -> list[PhysicalGpu]:
    """The GPUs of ``nvidia-smi -L``'s output, in index order, each with the MIG devices listed under it."""
    gpus: list[PhysicalGpu] = []
    for line in listing.splitlines():
        found = re.search(r"\(UUID: ((?:GPU|MIG)-[^)\s]+)\)", line)
        if line.startswith("GPU "):
            gpus.append(PhysicalGpu(found.group(1) if found else ""))
        elif found and found.group(1).startswith("MIG-") and gpus:
            gpus[-1] = PhysicalGpu(gpus[-1].uuid, (*gpus[-1].migs, found.group(1)))
    return gpus


def _leading_number(entry: str) -> int | None:
    """The unsigned number ``entry`` starts with, as CUDA's ``strtoul`` reads it (``1gpu`` → 1); None
    for none or a sign (``-1``)."""
    digits = re.match(r"\+?(\d+)", entry)
    return int(digits.group(1)) if digits else None


def _unique_prefix(entry: str, candidates: Sequence[str]) -> str | None:
    matches = [c for c in candidates if c and c.startswith(entry)]
    return matches[0] if len(matches) == 1 else None


def visible_cuda_devices(value: str | None, gpus: Sequence[PhysicalGpu]) -> int:
    """How many CUDA devices a process sees on a machine with ``gpus`` under ``CUDA_VISIBLE_DEVICES`` =
    ``value``, by CUDA's rules (CUDA C Programming Guide, "CUDA Environment Variables"; torch's
    ``_parse_visible_devices`` restates them): unset, every GPU; set, the comma-separated entries in
    order — a GPU index (read as ``strtoul`` does), a GPU UUID or a unique prefix of one (``GPU-8932f937``),
    a MIG device's UUID (``MIG-…``) or ``MIG-<GPU UUID>/<GI>/<CI>`` — up to the first entry that names no
    device (``-1``, an index past the last GPU, an unknown or ambiguous UUID, an empty entry): the empty
    string and ``-1`` see none. A device named twice makes the list see none.

    MIG (NVIDIA MIG User Guide, "CUDA Device Enumeration": with CUDA 11/R450 and CUDA 12/R525 "a single
    CUDA process can only enumerate a single MIG device", however many are created or listed): all the MIG
    devices a list names count as one device, the first of them, and a later MIG entry is passed over (it
    is still read: an unknown one ends the list, one named twice makes it see none). A GPU in MIG mode —
    one ``nvidia-smi -L`` lists MIG devices under — is not a CUDA device of its own: named by index or UUID,
    or counted when the variable is unset, it stands for its MIG devices and so counts only as that one MIG
    device (a process that names such a GPU by index sees one MIG device of it; two MIG GPUs by index are
    still one device). Whole GPUs without MIG devices count one each beside it. The count is an upper bound
    for ``--devices all``: it never plans more device processes than CUDA gives. A GPU in MIG mode with no
    MIG device created is listed as a plain GPU by ``nvidia-smi -L`` and so still counts as one; CUDA gives
    nothing for it, and its device process stops with its error."""
    if value is None:
        return sum(1 for g in gpus if not g.migs) + (1 if any(g.migs for g in gpus) else 0)
    gpu_ids = [g.uuid for g in gpus]
    mig_ids = [m for g in gpus for m in g.migs]
    mig_gpus = {i for i, g in enumerate(gpus) if g.migs}
    seen: list[str] = []
    whole = 0
    mig = False
    for raw in value.split(","):
        entry = raw.strip()
        named: str | None
        if entry.startswith("MIG-GPU-"):  # MIG-<GPU UUID>/<GPU instance>/<compute instance> (CUDA 11.0-11.x)
            parts = entry.removeprefix("MIG-").split("/")
            parent = _unique_prefix(parts[0], gpu_ids)
            named = entry if parent is not None and len(parts) == 3 and all(p.isdigit() for p in parts[1:]) else None
        elif entry.startswith("MIG-"):
            named = _unique_prefix(entry, mig_ids)
        elif entry.startswith("GPU-"):
            named = _unique_prefix(entry, gpu_ids)
        else:
            number = _leading_number(entry)
            named = None if number is None or number >= len(gpus) else (gpu_ids[number] or f"#{number}")
        if named is None:
            break
        if named in seen:
            return 0
        seen.append(named)
        index = gpu_ids.index(named) if named in gpu_ids else (int(named[1:]) if named.startswith("#") else None)
        if index is None or index in mig_gpus:
            mig = True  # a MIG device, or a GPU in MIG mode standing for its MIG devices
        else:
            whole += 1
    return whole + (1 if mig else 0)


def cuda_device_count() -> int:
    """CUDA devices visible to this process: ``nvidia-smi -L``'s GPUs (0 without the tool) under this
    process's ``CUDA_VISIBLE_DEVICES`` (:func:`visible_cuda_devices`)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    found = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return visible_cuda_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), nvidia_smi_gpus(found.stdout))


class DeviceError(TonearmError):
    """A device process of ``--devices`` that could not start its encoder, or ended while embedding: the
    message names the device and what it said."""


_DEVICE: dict[str, Any] = {}
"""In a device process: its encode function and its decoder (set once by :func:`_start_device`), or the
error that stopped them (``error``), reported by :func:`_device_ready`."""


def _start_device(spec: EncoderSpec, decode: Callable[[Any], Decoding], options: PassOptions,
                  device_id: int) -> None:
    try:
        clock = PassClock()
        # threads, not processes: a pool worker's own process pool is never shut down (it leaves through
        # os._exit after joining its children, which then wait forever)
        decoder = Decoder(decode, options, clock, threads=True).__enter__()
        _DEVICE.update(encode=spec.load(device_id), decoder=decoder, device=device_id, dim=spec.embed_dim)
    except Exception as err:  # noqa: BLE001 - told to the parent by _device_ready, which names the device
        first = (str(err).strip().splitlines() or [""])[0]
        _DEVICE["error"] = f"{type(err).__name__}: {first}" if first else type(err).__name__


def _device_ready() -> str:
    """In a device process: "" once its encoder is loaded, else why it could not be."""
    return str(_DEVICE.get("error", ""))


def _embed_on_device(ids: Sequence[str], sources: Sequence[Any],
                     indices: Sequence[int]) -> tuple[Chunk, float, float, int, int]:
    """In a device process: its share of a chunk, its encoder-busy and decode-wait seconds, and the moment
    windows and long files it embedded."""
    decoder: Decoder = _DEVICE["decoder"]
    clock = decoder.clock
    before = clock.encode_busy, clock.decode_wait, clock.windows, clock.long_files
    embed = clip_embedder(ids, sources, decoder.decode, _DEVICE["encode"], dim=_DEVICE["dim"], decoder=decoder)
    chunk = embed(list(indices), lambda _n: None)
    return (chunk, clock.encode_busy - before[0], clock.decode_wait - before[1], clock.windows - before[2],
            clock.long_files - before[3])


class DevicePool:
    """One process per device (``spawn``; a one-worker pool each, so a share and a failure belong to a known
    device), each with its own encoder session and decode threads; a chunk is split into one contiguous share
    per device and the shares concatenated back in item order, so the pass's result (ids, order, skips) is the
    one-device pass's and the vectors match it to float tolerance.

    Entering the pool starts every device and waits until each has loaded its encoder: a device that cannot
    (CUDA libraries missing, a bad ``device_id``, its process killed) stops the pass before any chunk, with a
    :class:`DeviceError` naming each such device and its error."""

    def __init__(self, spec: EncoderSpec, devices: Sequence[int], decode: Callable[[Any], Decoding],
                 options: PassOptions, clock: PassClock) -> None:
        self.spec, self.devices, self.decode, self.clock = spec, list(devices), decode, clock
        share = max(0, options.decode_workers // max(1, len(self.devices)))
        self.options = replace(options, decode_workers=share, devices=None,
                               decode_memory=max(1, options.decode_memory // max(1, len(self.devices))))
        self.pools: list[ProcessPoolExecutor] = []

    def __enter__(self) -> DevicePool:
        context = multiprocessing.get_context("spawn")
        try:
            for device in self.devices:
                self.pools.append(ProcessPoolExecutor(1, mp_context=context, initializer=_start_device,
                                                      initargs=(self.spec, self.decode, self.options, device)))
            ready = [pool.submit(_device_ready) for pool in self.pools]
            failed = []
            for device, future in zip(self.devices, ready, strict=True):
                try:
                    error = future.result()
                except BrokenProcessPool:
                    error = "its process ended while starting (killed, out of memory, or a crash in the provider)"
                if error:
                    failed.append(f"device {device}: {error}")
            if failed:
                raise DeviceError(f"--devices: {len(failed)} of {len(self.devices)} device processes could not "
                                  f"start their encoder ({self.spec.path}, providers "
                                  f"{', '.join(self.spec.providers)}): " + "; ".join(failed))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        pools, self.pools = self.pools, []
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)

    def embedder(self, ids: Sequence[str], sources: Sequence[Any]) -> EmbedChunk:
        assert self.pools, "use DevicePool as a context manager"
        pools, n = self.pools, len(self.devices)

        def embed(indices: Sequence[int], advance: Callable[[int], None]) -> Chunk:
            indices = list(indices)
            size = max(1, -(-len(indices) // n))
            shares = [indices[k : k + size] for k in range(0, len(indices), size)]
            began = time.monotonic()
            futures = [pool.submit(_embed_on_device, [ids[i] for i in share], [sources[i] for i in share],
                                   list(range(len(share)))) for pool, share in zip(pools, shares, strict=False)]
            parts = []
            for device, future in zip(self.devices, futures, strict=False):
                try:
                    parts.append(future.result())
                except BrokenProcessPool:
                    raise DeviceError(f"--devices: the process of device {device} ended while embedding its share "
                                      "of a chunk (killed, out of memory, or a crash in the provider); the chunks "
                                      "saved so far are kept for a rerun") from None
            wall = time.monotonic() - began
            self.clock.encode_busy += wall * (sum(p[1] for p in parts) / max(wall * len(parts), 1e-9))
            self.clock.decode_wait += wall * (sum(p[2] for p in parts) / max(wall * len(parts), 1e-9))
            self.clock.count_windows(sum(p[3] for p in parts), sum(p[4] for p in parts))
            advance(len(indices))
            chunks = [p[0] for p in parts]
            dim = self.spec.embed_dim
            embeddings = (np.concatenate([c.embeddings for c in chunks]) if chunks else np.zeros((0, dim), np.float32))
            return Chunk([c for ch in chunks for c in ch.clip_ids], embeddings, [s for ch in chunks for s in ch.skipped],
                         windows={c: w for ch in chunks for c, w in ch.windows.items()})

        return embed


def pass_embedder(ids: Sequence[str], sources: Sequence[Any], decode: Callable[[Any], Decoding], encode: Encode, *,
                  dim: int, options: PassOptions, clock: PassClock, spec: EncoderSpec | None,
                  stack: Any) -> EmbedChunk:
    """The pass's :data:`~index.catalogue.checkpoint.EmbedChunk`: on ``options.devices`` (one process each,
    ``spec`` their encoder) or in this process (``encode``); its pools entered on ``stack`` (an ExitStack)."""
    if options.devices:
        if spec is None:  # a programming error: every pass hands its encoder's spec (tests/index/test_catalogue_pass.py)
            raise ValueError("a pass over several devices needs the encoder's EncoderSpec")
        pool = stack.enter_context(DevicePool(spec, options.devices, decode, options, clock))
        return pool.embedder(ids, sources)
    decoder = stack.enter_context(Decoder(decode, options, clock))
    return clip_embedder(ids, sources, decode, encode, dim=dim, decoder=decoder)


CUDA_CODEC_CALL_SAMPLES = BATCH_SAMPLES
"""Default samples of a whole-clip (PE-Audio) encoder call in a catalogue pass with ``--device cuda``: the
pass's own call budget, 7.68 M samples (sixteen 10-s clips at 48 kHz, two of 60 s), so every length bucket
of clips up to 60 s shares calls; ~8x the CPU service's :data:`index.runtime.loader.CODEC_CALL_SAMPLES`
(~1 GB of codec activations per 960,000 samples on the CPU: a GPU of 16 GB or more holds it; not measured
on one here). On the CPU the pass keeps the service's budget: buckets cost there (docs/models.md)."""


def pass_options_from_args(args: Any) -> PassOptions:
    """`--decode-workers N`, `--devices LIST` (with `--device`), the decode limits (`--min-sample-rate`,
    `--max-decode-samples`, `--max-decoded-bytes`; 0 lifts one), `--decode-memory` and `--codec-call-samples`
    (default :data:`CUDA_CODEC_CALL_SAMPLES` with `--device cuda`, else the service's) as :class:`PassOptions`."""
    workers = getattr(args, "decode_workers", None)
    device = getattr(args, "device", "cpu")
    devices = parse_devices(getattr(args, "devices", None), device)
    call = getattr(args, "codec_call_samples", None) or (CUDA_CODEC_CALL_SAMPLES if device == "cuda" else None)
    return PassOptions(decode_workers=default_decode_workers() if workers is None else workers,
                       devices=tuple(devices) if devices else None, limits=decode_limits_from_args(args),
                       decode_memory=getattr(args, "decode_memory", None) or DECODE_MEMORY, codec_call_samples=call)


def decode_limits_from_args(args: Any) -> DecodeLimits:
    """The decode limits of `tonearm export|index` (each flag absent: the default; 0: no such limit)."""
    default = DecodeLimits()

    def flag(name: str, fallback: int | None) -> int | None:
        value = getattr(args, name, None)
        return fallback if value is None else (value or None)

    return DecodeLimits(min_sample_rate=flag("min_sample_rate", default.min_sample_rate),
                        max_samples=flag("max_decode_samples", default.max_samples),
                        max_bytes=flag("max_decoded_bytes", default.max_bytes))
