"""Open a bundle for serving: ONNX Runtime encoders + FAISS indices, no torch (docs/ARCHITECTURE.md, docs/bundle.md).

:class:`LoadedBundle` is immutable after :meth:`LoadedBundle.open`: encoders,
indices, the fixed search parameters and the per-language selectors of the
caption index are built once, and every method only reads them, so any number
of threads may encode and search concurrently (ONNX Runtime's ``run`` and
FAISS's ``search`` are thread-safe for concurrent readers).

The vectors are searched through one small interface, :class:`index.engines.vector_index.VectorIndex`,
with two backends below this module: FAISS in the bundle (:mod:`index.engines.vector_index`) and Milvus
(:mod:`index.engines.milvus_index`, imported only with ``milvus=``). Layering: bundle format → backends
→ loader → verification (:mod:`index.runtime.verify`); nothing below imports this module.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnxruntime as ort

from index.audio.decode import eval_chunks
from index.audio.frontend import (
    Padding,
    bucket_length,
    keeps_short_clips,
    pad_short_clip,
    prepare_whole_clip,
)
from index.bundle import format as fmt
from index.bundle.evalset import EvalSet, read_eval_set, read_jsonl
from index.bundle.format import BundleManifest, check_files, check_moment_head, read_manifest
from index.bundle.tokenizer import TextTokenizer
from index.engines.faiss_index import DEFAULT_MMAP_THRESHOLD
from index.engines.filters import Filter
from index.engines.vector_index import (
    PREFILTER_FRACTION,
    VectorIndex,
    exact_subset_search,
    open_faiss_index,
    overfetch_search,
)
from index.engines.vector_index import FaissVectorIndex as FaissVectorIndex  # re-exported
from index.errors import BundleError, TonearmError
from index.moments.faiss_windows import FAISS_MIN_WINDOWS, MOMENT_INDEX_DIR, FaissWindows
from index.moments.head import MomentHeadModel
from index.moments.windows import ExactWindows
from index.runtime.gpu_io import on_cuda, provider_entries, run_bound
from index.runtime.length_groups import length_groups

log = logging.getLogger(__name__)

Device = Literal["cpu", "cuda", "auto"]
TEXT_BATCH = 64
"""Most texts in one encoder call."""
TOKENIZE_CHUNK = 1024
"""Texts tokenized (and length-sorted) together: a bundle's captions are grouped within such chunks."""
AUDIO_BATCH = 16
CODEC_CALL_SAMPLES = 960_000
"""Most waveform samples in one audio encoder call of a raw-waveform bundle (PE-Audio, ``audio_frontend``
source ``pe_audio_feature_extractor``): 20 s at 48 kHz, two 10-s clips. Its codec encoder keeps 64 channels
at every input sample (a 123-MB float32 tensor per 10-s clip and intermediate), so its activation memory
is proportional to the samples of a call: 16 concurrent 10-s clips in one call took the service to 9.4 GB
RSS (docs/models.md, "PE-Audio: serving memory"). A longer clip still runs whole, alone. Clips share a
call when the encoder takes a ``padding_mask`` (:data:`MASKED_AUDIO_INPUTS`): padded to length buckets
(:func:`index.audio.frontend.bucket_length`), this many samples a call, padding included."""
AUDIO_INPUTS = ("waveform",)
PADDING_MASK = "padding_mask"
MASKED_AUDIO_INPUTS = (*AUDIO_INPUTS, PADDING_MASK)
"""A PE-Audio encoder exported since issue 49: ``padding_mask`` int64 (batch, samples), 1 where a row
holds its clip and 0 on the zeros it is padded with (training.models.pretrained_pe_audio.masked_pooled).
An encoder loaded for :data:`AUDIO_INPUTS` may have it; the loader then always feeds it."""
TEXT_INPUTS = ("input_ids", "attention_mask")
OUTPUTS = ("embedding",)


class NoCaptionIndex(BundleError):
    """Audio→text search on a bundle without a caption index (an index-only bundle)."""


def providers_for(device: Device) -> list[str]:
    """ONNX Runtime providers: CUDA first when requested (or ``auto``) and available."""
    available = ort.get_available_providers()
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" in available:
        if hasattr(ort, "preload_dlls"):  # onnxruntime >= 1.21: CUDA/cuDNN from the nvidia-* wheels, no LD_LIBRARY_PATH
            ort.preload_dlls()
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if device == "cuda":
        log.warning("CUDA requested but onnxruntime has no CUDA provider here; using CPU")
    return ["CPUExecutionProvider"]


def device_providers(device: Literal["cpu", "cuda"]) -> list[str]:
    """The providers of a catalogue pass (`tonearm export|index --device`): ``cuda`` is ONNX
    Runtime's CUDA provider (CPU as fallback for operators it lacks) and refused in one line where
    this onnxruntime has none — a pass asked to run on a GPU never silently runs on the CPU."""
    if device == "cpu":
        return ["CPUExecutionProvider"]
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        raise TonearmError(
            f"--device cuda: this onnxruntime has no CUDAExecutionProvider (available: {', '.join(available)}); "
            "install onnxruntime-gpu (its CUDA major version must match the machine's: 1.31 is built for CUDA 13) "
            "on a machine with an NVIDIA GPU, or leave out --device cuda"
        )
    if hasattr(ort, "preload_dlls"):  # onnxruntime >= 1.21: CUDA/cuDNN from the nvidia-* wheels, no LD_LIBRARY_PATH
        ort.preload_dlls()
    return ["CUDAExecutionProvider", "CPUExecutionProvider"]


def check_providers(requested: Sequence[str]) -> list[str]:
    """An explicit provider list (``TONEARM_ONNX_PROVIDERS``) checked against this onnxruntime.

    ``CPUExecutionProvider`` is appended as the fallback for operators a GPU provider lacks.
    """
    available = ort.get_available_providers()
    missing = [name for name in requested if name not in available]
    if missing:
        raise TonearmError(
            f"ONNX Runtime providers {missing} are not available in this onnxruntime "
            f"(available: {available}); install onnxruntime-gpu for CUDAExecutionProvider, "
            "or set TONEARM_ONNX_PROVIDERS=CPUExecutionProvider"
        )
    return [*requested, *([] if "CPUExecutionProvider" in requested else ["CPUExecutionProvider"])]


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Row-wise L2 normalization (zero rows stay zero)."""
    return (x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)).astype(np.float32)


GraphOptimization = Literal["disable", "basic", "extended", "all"]
_GRAPH_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


@dataclass(frozen=True)
class SessionConfig:
    """How an encoder session uses the CPU (docs/service.md, "Threads").

    ``threads`` intra-op threads (None/0: ONNX Runtime's default, one per core); one inter-op
    thread (the towers are sequential graphs); ``spinning`` off by default so idle ORT threads
    sleep instead of busy-waiting on cores FAISS, the other encoder and the HTTP worker need;
    ``memory_arena`` is ONNX Runtime's CPU arena (its default, on: right for bulk embedding at a
    few fixed shapes; the service turns it off, ``TONEARM_ONNX_MEMORY_ARENA``)."""

    threads: int | None = 1
    optimization: GraphOptimization = "all"
    spinning: bool = False
    memory_arena: bool = True

    def options(self) -> ort.SessionOptions:
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads or 0
        options.inter_op_num_threads = 1
        options.graph_optimization_level = _GRAPH_LEVELS[self.optimization]
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.spinning else "0")
        options.enable_cpu_mem_arena = self.memory_arena
        options.log_severity_level = 3
        return options


@dataclass(frozen=True)
class OnnxEncoder:
    """One ONNX encoder session with a checked interface (inputs → ``embedding`` (batch, d))."""

    session: ort.InferenceSession
    path: Path

    @classmethod
    def load(
        cls, path: Path, *, inputs: Sequence[str], embed_dim: int, providers: list[str], threads: int | None,
        session: SessionConfig | None = None, device_id: int | None = None,
    ) -> OnnxEncoder:
        """``session`` (default: ``threads`` intra-op threads, full graph optimisation, no spinning);
        ``device_id``: the GPU of a CUDA provider (:func:`index.runtime.gpu_io.provider_entries`)."""
        config = session or SessionConfig(threads=threads)
        try:
            loaded = ort.InferenceSession(str(path), config.options(), providers=provider_entries(providers, device_id))
        except Exception as err:  # onnxruntime raises its own untyped errors for bad files
            raise BundleError(f"{path}: cannot load ONNX model ({str(err).splitlines()[0]})") from None
        gpu = [name for name in providers if name != "CPUExecutionProvider"]
        if gpu and gpu[0] not in loaded.get_providers():
            # onnxruntime falls back to the CPU with only a warning when a GPU provider's libraries
            # (CUDA, cuDNN) do not load: a pass asked to run on a GPU must not crawl on the CPU.
            raise TonearmError(
                f"{path}: onnxruntime could not start {gpu[0]} (session providers: "
                f"{', '.join(loaded.get_providers())}); check that the CUDA and cuDNN libraries of this "
                "onnxruntime-gpu build are installed (onnxruntime-gpu[cuda,cudnn]) or leave out --device cuda"
            )
        encoder = cls(session=loaded, path=path)
        encoder.check_interface(inputs, embed_dim)
        return encoder

    @cached_property
    def input_names(self) -> list[str]:
        return [i.name for i in self.session.get_inputs()]

    @property
    def takes_padding_mask(self) -> bool:
        """True for an audio encoder of :data:`MASKED_AUDIO_INPUTS` (clips of different lengths in one call)."""
        return self.input_names == list(MASKED_AUDIO_INPUTS)

    def check_interface(self, inputs: Sequence[str], embed_dim: int) -> None:
        """Input/output names, ranks and the embedding width; raises :class:`BundleError`.
        An audio encoder (``inputs`` :data:`AUDIO_INPUTS`) may take :data:`PADDING_MASK` as well."""
        got_in = self.input_names
        got_out = [o.name for o in self.session.get_outputs()]
        accepted = [list(inputs), *([list(MASKED_AUDIO_INPUTS)] if list(inputs) == list(AUDIO_INPUTS) else [])]
        if got_in not in accepted or got_out != list(OUTPUTS):
            raise BundleError(
                f"{self.path}: ONNX interface {got_in} -> {got_out}, expected {list(inputs)} -> {list(OUTPUTS)}"
            )
        for node in [*self.session.get_inputs(), *self.session.get_outputs()]:
            if len(node.shape) != 2:
                raise BundleError(f"{self.path}: {node.name} has shape {node.shape}, expected rank 2")
        width = self.session.get_outputs()[0].shape[1]
        if isinstance(width, int) and width != embed_dim:
            raise BundleError(f"{self.path}: embedding width {width} != manifest embed_dim {embed_dim}")

    def run(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        if on_cuda(self.session):  # pragma: no cover - a GPU only (index.runtime.gpu_io)
            return run_bound(self.session, OUTPUTS, feeds)
        return np.asarray(self.session.run(list(OUTPUTS), feeds)[0], dtype=np.float32)


def encode_texts(
    encoder: OnnxEncoder, tokenizer: TextTokenizer, texts: Sequence[str], *, embed_dim: int,
    pad_to_longest: bool = True,
) -> np.ndarray:
    """(n, d) L2-normalized caption embeddings, in the order of ``texts``.

    With ``pad_to_longest`` (the default) the texts are run in calls of similar token length
    (:func:`index.runtime.length_groups.length_groups`: sorted, cut where the padding saved outweighs a
    call's fixed cost), each padded to its own longest text — never to ``max_length``; the towers
    mask padding, so the embeddings are those of each text alone. ``pad_to_longest=False`` runs
    chunks of :data:`TEXT_BATCH` in order at the full ``max_length`` (and so does a left-padded
    tokenizer, whose columns cannot be cut)."""
    n = len(texts)
    out = np.zeros((n, embed_dim), np.float32)
    for first in range(0, n, TOKENIZE_CHUNK):
        chunk = list(texts[first : first + TOKENIZE_CHUNK])
        ids, mask = tokenizer.encode(chunk)
        if pad_to_longest and tokenizer.padding_side == "right":
            lengths = np.maximum(mask.sum(axis=1), 1)
            groups = length_groups(lengths, max_group=TEXT_BATCH)
        else:
            lengths = np.full(len(chunk), ids.shape[1])
            groups = [np.arange(s, min(s + TEXT_BATCH, len(chunk))) for s in range(0, len(chunk), TEXT_BATCH)]
        for group in groups:
            width = int(lengths[group].max())
            feeds = {"input_ids": np.ascontiguousarray(ids[group, :width]),
                     "attention_mask": np.ascontiguousarray(mask[group, :width])}
            out[first + group] = encoder.run(feeds)
    return l2_normalize(out) if n else out


def encode_clips(
    encoder: OnnxEncoder, waveforms: Sequence[np.ndarray], *, clip_samples: int, embed_dim: int,
    frontend: fmt.AudioFrontendInfo | None, max_call_samples: int | None = None,
) -> np.ndarray:
    """What a bundle does to any clip (the service, `tonearm index`, on Ray too): clips shorter than
    ``clip_samples`` zero-padded, or padded as the manifest's ``audio_frontend`` says (a pretrained
    model's own padding, :mod:`index.audio.frontend`); then chunk-and-average. Whole clips (PE-Audio) run
    at most ``max_call_samples`` samples a call (default :data:`CODEC_CALL_SAMPLES`, the service's memory
    budget; a catalogue pass may give more, `--codec-call-samples`): a bucket two of whose clips fit in a
    call runs its clips together, long ones included (docs/models.md, "PE-Audio: length buckets")."""
    if frontend is not None and frontend.long_clips == "whole":
        hop = int(frontend.pad_multiple or 1)
        waveforms = [prepare_whole_clip(w, hop) for w in waveforms]
        return encode_waveforms(encoder, waveforms, clip_samples=clip_samples, embed_dim=embed_dim, whole=True,
                                max_call_samples=max_call_samples or CODEC_CALL_SAMPLES, bucket_multiple=hop)
    if frontend is not None:
        waveforms = [pad_short_clip(w, clip_samples, frontend.padding, frontend.pad_multiple) for w in waveforms]
    return encode_waveforms(encoder, waveforms, clip_samples=clip_samples, embed_dim=embed_dim,
                            keep_short=frontend is not None and keeps_short_clips(frontend.padding))


def encode_waveforms(
    encoder: OnnxEncoder, waveforms: Sequence[np.ndarray], *, clip_samples: int, embed_dim: int,
    keep_short: bool = False, padding: Padding = "pad", whole: bool = False, max_call_samples: int | None = None,
    bucket_multiple: int | None = None,
) -> np.ndarray:
    """(n, d) clip embeddings: L2-normalized mean over each clip's ``eval_chunks`` (docs/corpus.md);
    clips shorter than a window are padded with ``padding`` (:mod:`index.audio.frontend`).

    ``keep_short`` (a bundle whose ``audio_frontend`` pads short clips to their own length,
    :func:`index.audio.frontend.keeps_short_clips`): a clip shorter than ``clip_samples`` is one
    window of its own length instead of being zero-padded; windows run in calls of equal length.
    ``whole`` (``audio_frontend.long_clips = "whole"``): every clip is one window of its own length.
    ``max_call_samples``: a call holds at most this many samples (at least one window; :data:`CODEC_CALL_SAMPLES`).

    ``bucket_multiple`` (with ``whole``, an encoder that :attr:`~OnnxEncoder.takes_padding_mask`): each clip
    runs zero-padded to its :func:`~index.audio.frontend.bucket_length` beside the other clips of that
    bucket (the mask makes the padding exact), unless a call holds only one clip of that bucket — that clip
    runs alone at its own length (padding would only cost). Without the mask input (bundles exported
    before), calls hold clips of one exact length."""
    chunks = [w[None, :] if (whole and w.shape[0]) or (keep_short and 0 < w.shape[0] < clip_samples)
              else eval_chunks(w, clip_samples, padding)
              for w in (np.asarray(x, dtype=np.float32) for x in waveforms)]
    if not chunks:
        return np.zeros((0, embed_dim), np.float32)
    owner = np.repeat(np.arange(len(chunks)), [len(c) for c in chunks])
    windows = [row for c in chunks for row in c]
    emb = np.zeros((len(windows), embed_dim), np.float32)
    lengths = [w.shape[0] for w in windows]
    if whole and bucket_multiple and encoder.takes_padding_mask:
        widths = np.asarray([_call_width(n, bucket_multiple, max_call_samples) for n in lengths])
    else:
        widths = np.asarray(lengths)
    for width in np.unique(widths):
        rows = np.flatnonzero(widths == width)
        per_call = _clips_per_call(int(width), max_call_samples)
        for s in range(0, len(rows), per_call):
            part = rows[s : s + per_call]
            emb[part] = encoder.run(audio_feeds(encoder, [windows[i] for i in part], int(width)))
    summed = np.zeros((len(chunks), emb.shape[1]), dtype=np.float64)
    np.add.at(summed, owner, emb)
    return l2_normalize(summed)


def _clips_per_call(width: int, max_call_samples: int | None) -> int:
    return AUDIO_BATCH if max_call_samples is None else max(1, min(AUDIO_BATCH, max_call_samples // max(width, 1)))


def _call_width(samples: int, multiple: int, max_call_samples: int | None) -> int:
    """The length a whole clip runs at: its bucket when a call holds two or more of that bucket."""
    bucket = bucket_length(samples, multiple)
    return bucket if _clips_per_call(bucket, max_call_samples) > 1 else samples


def audio_feeds(encoder: OnnxEncoder, windows: Sequence[np.ndarray], width: int) -> dict[str, np.ndarray]:
    """One call's inputs: the windows (all ``width`` samples long unless the encoder takes a padding mask;
    then each zero-padded to ``width`` behind its mask)."""
    if not encoder.takes_padding_mask:
        return {"waveform": np.stack(windows)}
    waveform = np.zeros((len(windows), width), np.float32)
    mask = np.zeros((len(windows), width), np.int64)
    for row, window in enumerate(windows):
        waveform[row, : window.shape[0]] = window
        mask[row, : window.shape[0]] = 1
    return {"waveform": waveform, PADDING_MASK: mask}


def _read_items(path: Path, *, required: Sequence[str], expected: int) -> list[dict[str, Any]]:
    items = read_jsonl(path, required=required)
    if len(items) != expected:
        raise BundleError(f"{path}: {len(items)} lines but the index holds {expected} vectors")
    return items


def _files_to_verify(root: Path, manifest: BundleManifest, *, milvus: bool) -> dict[str, Any]:
    """Every file of the manifest; served from Milvus, the moment windows may be absent: `tonearm bundle publish`
    wrote them to Milvus, whose copy the replica reads (it keeps none, docs/service.md "Moments on the Milvus
    backend"). Present, they are checked like any file."""
    if not milvus or manifest.moments is None:
        return dict(manifest.files)
    optional = {manifest.moments.windows_file, manifest.moments.spans_file}
    return {rel: entry for rel, entry in manifest.files.items() if rel not in optional or (root / rel).exists()}


class LoadedBundle:
    """A bundle ready to serve: encoders, indices, ids and the held-out set (numpy in/out)."""

    def __init__(
        self,
        *,
        path: Path,
        manifest: BundleManifest,
        tokenizer: TextTokenizer,
        audio_encoder: OnnxEncoder,
        text_encoder: OnnxEncoder,
        audio_index: VectorIndex,
        text_index: VectorIndex | None,
        audio_items: list[dict[str, Any]],
        text_items: list[dict[str, Any]],
    ) -> None:
        self.path = path
        self.manifest = manifest
        self.bundle_id = manifest.bundle_id
        self.languages = list(manifest.languages)
        self.embed_dim = manifest.embed_dim
        self.sample_rate = manifest.sample_rate
        self.clip_samples = manifest.clip_samples
        self.audio_items = audio_items
        self.text_items = text_items
        self.tokenizer = tokenizer
        self._audio_encoder: OnnxEncoder | None = audio_encoder
        self._text_encoder: OnnxEncoder | None = text_encoder
        self._audio_index: VectorIndex | None = audio_index
        self._text_index: VectorIndex | None = text_index
        self.has_captions = manifest.text_index is not None
        """False for an index-only bundle (`tonearm index`): audio→text search is impossible."""
        self.milvus: Any = None
        self.moment_head: MomentHeadModel | None = None
        """The trained moment head (`tonearm train-moments`), checked against the encoders at open; None: the
        moment search uses the sliding-window scorer."""
        self._moment_windows: ExactWindows | FaissWindows | None = None
        self._moment_lock = threading.Lock()
        self._clip_rows: np.ndarray | None = None  # clip row of each caption row (filtered caption search)
        """The :class:`index.engines.milvus_index.MilvusTarget` the vectors live in (None: FAISS in the bundle)."""

    def moment_windows(self) -> Any:
        """The bundle's moment windows as a :class:`index.moments.sources.WindowSource` (None: the bundle has none):
        an :class:`index.moments.windows.ExactWindows` in memory, or from
        :data:`index.moments.faiss_windows.FAISS_MIN_WINDOWS` windows a
        :class:`index.moments.faiss_windows.FaissWindows` (memory-mapped, its index built once and kept under
        ``<bundles dir>/.moment-index``, docs/bundle.md "Moments"). Opened once (:meth:`warmup` does it before
        the bundle goes live); the files were checksummed when the bundle was opened."""
        moments = self.manifest.moments
        if moments is None:
            return None
        with self._moment_lock:
            if self._moment_windows is None:
                if moments.n_windows >= FAISS_MIN_WINDOWS:
                    entry = self.manifest.files.get(moments.windows_file)
                    key = f"{entry.sha256[:24]}-{moments.n_windows}" if entry is not None else None
                    self._moment_windows = FaissWindows(self.path, cache_dir=self.path.parent / MOMENT_INDEX_DIR,
                                                        key=key)
                else:
                    self._moment_windows = ExactWindows.load(self.path)
            return self._moment_windows

    @property
    def moment_scorer(self) -> Literal["head", "windows"]:
        """What scores moments: the trained head when the bundle carries one, else the sliding windows."""
        return "head" if self.moment_head is not None else "windows"

    @property
    def onnx_providers(self) -> list[str]:
        """The onnxruntime providers the encoders run on, best first (both encoders share them)."""
        encoder = self._audio_encoder or self._text_encoder
        return list(encoder.session.get_providers()) if encoder is not None else []

    # ------------------------------------------------------------------ open / close

    @classmethod
    def open(
        cls,
        path: Path | str,
        *,
        device: Device = "cpu",
        intra_op_threads: int | None = None,
        verify: bool = True,
        mmap_threshold_bytes: int = DEFAULT_MMAP_THRESHOLD,
        providers: Sequence[str] | None = None,
        milvus: Any = None,
        session: SessionConfig | None = None,
    ) -> LoadedBundle:
        """Load a bundle; ``verify`` checks every file's sha256 first (else only the manifest).

        Dimensions, ONNX interfaces, index sizes and id files are always checked.
        ``milvus`` (an :class:`index.engines.milvus_index.MilvusTarget`) searches the bundle's vectors
        in Milvus instead of its FAISS files (:class:`index.engines.milvus_index.BundleNotPublished`
        when they are not there). ``session`` sets the encoders' ONNX Runtime options (it wins over
        ``intra_op_threads``). Raises :class:`BundleError` naming the offending file.
        """
        root = Path(path)
        manifest = read_manifest(root)
        if verify:
            check_files(root, _files_to_verify(root, manifest, milvus=milvus is not None))
        providers = check_providers(providers) if providers else providers_for(device)
        dim = manifest.embed_dim
        audio_index: VectorIndex
        text_index: VectorIndex | None = None
        if milvus is None and manifest.milvus_only is not None:
            raise BundleError(
                f"bundle {manifest.bundle_id} keeps its vectors only in Milvus ({manifest.milvus_only.uri}; "
                "built by `tonearm index --milvus-uri`): serve it with TONEARM_INDEX_BACKEND=milvus"
            )
        if milvus is None:
            audio_index = open_faiss_index(root, manifest.audio_index, embed_dim=dim, mmap_threshold_bytes=mmap_threshold_bytes)
            if manifest.text_index is not None:
                text_index = open_faiss_index(
                    root, manifest.text_index, embed_dim=dim, mmap_threshold_bytes=mmap_threshold_bytes
                )
        else:
            from index.engines.milvus_index import open_bundle_indices

            audio_index, text_index = open_bundle_indices(milvus, manifest)
        bundle = cls(
            path=root,
            manifest=manifest,
            tokenizer=_load_tokenizer(root / manifest.tokenizer.file),
            audio_encoder=OnnxEncoder.load(
                root / manifest.audio_encoder.file, inputs=AUDIO_INPUTS, embed_dim=dim,
                providers=providers, threads=intra_op_threads, session=session,
            ),
            text_encoder=OnnxEncoder.load(
                root / manifest.text_encoder.file, inputs=TEXT_INPUTS, embed_dim=dim,
                providers=providers, threads=intra_op_threads, session=session,
            ),
            audio_index=audio_index,
            text_index=text_index,
            audio_items=_read_items(
                root / manifest.audio_index.ids_file, required=("id", "uri", "captions"), expected=audio_index.ntotal
            ),
            text_items=_read_items(
                root / manifest.text_index.ids_file, required=("clip_id", "clip_row", "lang", "text"),
                expected=text_index.ntotal,
            ) if manifest.text_index is not None and text_index is not None else [],
        )
        bundle.milvus = milvus
        try:
            bundle._check_text_items()
            bundle._check_audio_inputs()
            if manifest.moment_head is not None:
                check_moment_head(root, manifest)  # a head trained for other encoders is refused
                bundle.moment_head = MomentHeadModel.load(root)
        except BundleError:
            bundle.close()
            raise
        log.info("opened bundle %s (%d clips, %d captions, %s)", bundle.bundle_id,
                 len(bundle.audio_items), len(bundle.text_items), providers[0])
        return bundle

    def _check_text_items(self) -> None:
        """Caption rows lie in their language's range and point at the clip they name."""
        info = self.manifest.text_index
        if info is None:
            return
        path = self.path / info.ids_file
        ranges = info.language_ranges or {}
        if set(ranges) != set(self.languages):
            raise BundleError(f"{self.path / fmt.MANIFEST_NAME}: text_index.language_ranges must cover {self.languages}")
        rows = np.arange(len(self.text_items))
        lo = np.array([ranges.get(t["lang"], (0, 0))[0] for t in self.text_items], dtype=np.int64)
        hi = np.array([ranges.get(t["lang"], (0, 0))[1] for t in self.text_items], dtype=np.int64)
        clip_rows = np.array([t["clip_row"] for t in self.text_items], dtype=np.int64)
        clip_ids = [a["id"] for a in self.audio_items]
        bad = (rows < lo) | (rows >= hi) | (clip_rows < 0) | (clip_rows >= len(clip_ids))
        if not bad.any():
            bad = np.array([clip_ids[c] != t["clip_id"] for c, t in zip(clip_rows, self.text_items, strict=True)], bool)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise BundleError(f"{path}:{row + 1}: outside its language range or clip_row/clip_id mismatch")

    def _check_audio_inputs(self) -> None:
        """The audio encoder takes the inputs the manifest records (a ``padding_mask`` or not)."""
        got = self._need(self._audio_encoder).input_names
        if got != list(self.manifest.audio_encoder.inputs):
            raise BundleError(f"{self.path / self.manifest.audio_encoder.file}: inputs {got}, but "
                              f"{fmt.MANIFEST_NAME} records {self.manifest.audio_encoder.inputs}")

    def close(self) -> None:
        """Release sessions and indices; call only when no request uses the bundle any more.

        A Milvus backend also releases the bundle's collections from Milvus memory (the service
        closes a bundle once it is neither active nor the rollback target)."""
        for index in (self._audio_index, self._text_index):
            release = getattr(index, "release", None)
            if callable(release):
                release()
        self._audio_encoder = self._text_encoder = None
        self._audio_index = self._text_index = None

    def mark_active(self) -> None:
        """Record this bundle as the active one where its vectors live (Milvus aliases; FAISS: nothing)."""
        if self.milvus is not None:
            from index.engines.milvus_index import set_active

            set_active(self.milvus, self.bundle_id)  # both aliases or neither; a no-op when already right

    def _need(self, part: Any) -> Any:
        if part is None:
            raise BundleError(f"bundle {self.bundle_id} is closed")
        return part

    # ------------------------------------------------------------------ encoders

    def encode_text(self, texts: Sequence[str]) -> np.ndarray:
        """(n, d) float32 L2-normalized caption/query embeddings."""
        if isinstance(texts, str):
            raise TypeError("encode_text() takes a sequence of strings")
        return encode_texts(self._need(self._text_encoder), self.tokenizer, texts, embed_dim=self.embed_dim)

    def encode_audio(self, waveforms: Sequence[np.ndarray], *, max_call_samples: int | None = None) -> np.ndarray:
        """(n, d) clip embeddings of mono float32 waveforms at ``sample_rate`` (:func:`encode_clips`;
        ``max_call_samples``: a whole-clip bundle's samples a call, default :data:`CODEC_CALL_SAMPLES`)."""
        return encode_clips(self._need(self._audio_encoder), waveforms, clip_samples=self.clip_samples,
                            embed_dim=self.embed_dim, frontend=self.manifest.audio_frontend,
                            max_call_samples=max_call_samples)

    # ------------------------------------------------------------------ search

    def search_audio(
        self, queries: np.ndarray, k: int, *, allowed: np.ndarray | None = None, where: Filter | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k clips: (scores (n, k), rows (n, k) into ``audio_items``; -1 / -inf past the end).

        ``allowed`` (a boolean mask over the clips, :meth:`index.engines.filters.MetadataTable.mask`) keeps
        only the clips that pass: FAISS pre-filters or over-fetches (:mod:`index.engines.vector_index`).
        ``where``: the filter ``allowed`` was made from (``allowed`` may be stricter: a clip excluded,
        a takedown; never looser), for backends that evaluate filters themselves: Milvus evaluates
        it as an expression and ``allowed`` is checked on its hits (:func:`filtered_search`)."""
        index = self._need(self._audio_index)
        if allowed is None and where is None:
            return index.search(queries, k)
        return filtered_search(index, queries, k, None if allowed is None else np.asarray(allowed, dtype=bool),
                               where=where)

    def audio_embeddings(self) -> np.ndarray:
        """All clip vectors (N, d), row order = ``audio_items``, read back from the audio index.

        Exact for ``Flat`` and ``HNSW,Flat`` (and Milvus); SQ/PQ indices give their quantized values.
        The service's consistency diagnostics rank a target against all of these.
        """
        return self._need(self._audio_index).vectors()

    def search_text(
        self,
        queries: np.ndarray,
        k: int,
        *,
        languages: Collection[str] | None = None,
        allowed_clips: np.ndarray | None = None,
        where: Filter | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k captions (rows into ``text_items``), only in ``languages`` when given (empty = all),
        only of the clips ``allowed_clips`` passes when given (a mask over ``audio_items``; ``where``
        the filter it was made from, as in :meth:`search_audio`)."""
        if not self.has_captions:
            raise NoCaptionIndex(
                f"bundle {self.bundle_id} has no caption index (built by `tonearm index` from audio files only); "
                "audio→text search needs a bundle from `tonearm export`"
            )
        index = self._need(self._text_index)
        every_language = not languages or set(languages) >= set(self.languages)
        if not every_language:
            unknown = sorted(set(languages or ()) - set(self.languages))
            if unknown:
                raise ValueError(f"unknown language(s) {unknown}; bundle languages: {self.languages}")
        if allowed_clips is not None:
            rows = np.asarray(allowed_clips, dtype=bool)[self._caption_clip_rows()]
            if not every_language:
                ranges = (self.manifest.text_index.language_ranges or {}) if self.manifest.text_index else {}
                in_language = np.zeros(rows.size, dtype=bool)
                for lang in languages or ():
                    lo, hi = ranges[lang]
                    in_language[lo:hi] = True
                rows &= in_language
            return filtered_search(index, queries, k, rows, where=where,
                                   languages=None if every_language else sorted(languages or ()))
        if every_language:
            return index.search(queries, k)
        return index.search(queries, k, sorted(languages or ()))

    def _caption_clip_rows(self) -> np.ndarray:
        if self._clip_rows is None:
            self._clip_rows = np.array([int(t["clip_row"]) for t in self.text_items], dtype=np.int64)
        return self._clip_rows

    # ------------------------------------------------------------------ held-out set, warm-up

    def eval_set(self) -> EvalSet:
        """The held-out set (read from disk on each call); waveforms are ready for ``encode_audio``."""
        if self.manifest.eval_set is None:
            raise BundleError(f"bundle {self.bundle_id} has no held-out set (an index-only bundle from `tonearm index`)")
        return read_eval_set(self.path / fmt.EVAL_DIR)

    def warmup(self) -> None:
        """Run each encoder and index once (first-call allocations happen before traffic)."""
        text = self.encode_text([f"{lang} warm-up" for lang in self.languages])
        audio = self.encode_audio([np.zeros(self.clip_samples, np.float32)])
        self.search_audio(text[:1], 1)
        if self.has_captions:
            self.search_text(audio, 1, languages=self.languages[:1])
            self.search_text(audio, 1)
        moments = self.manifest.moments
        if self.milvus is None and moments is not None and moments.n_windows >= FAISS_MIN_WINDOWS:
            self.moment_windows()  # the ANN index is built (or read) before traffic, never on a query


def filtered_search(
    index: VectorIndex, queries: np.ndarray, k: int, allowed: np.ndarray | None, *,
    where: Filter | None = None, languages: Sequence[str] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of the rows ``allowed`` passes (and, with ``languages``, of those languages: ``allowed``
    already says so). FAISS decides itself (:mod:`index.engines.vector_index`). Milvus evaluates ``where``
    when its collection carries the metadata (:meth:`index.engines.milvus_index.MilvusVectorIndex.expression`)
    and ``allowed`` is checked on the hits; otherwise — a collection published without metadata, a
    filter not expressible there — it over-fetches, or ranks the passing rows' vectors exactly when
    few pass (on our side)."""
    expression = getattr(index, "expression", None)
    if where is not None and not isinstance(index, FaissVectorIndex) and callable(expression):
        text = expression(where)
        if text is not None:
            return index.search(queries, k, languages, where=text, keep=allowed)  # type: ignore[call-arg]
    if allowed is None:
        raise ValueError("filtered_search needs the mask unless the backend evaluates the filter")
    if isinstance(index, FaissVectorIndex):
        return index.search(queries, k, allowed=allowed)
    if np.count_nonzero(allowed) <= PREFILTER_FRACTION * index.ntotal:
        return exact_subset_search(index.vectors(), queries, k, allowed)
    return overfetch_search(lambda kk: index.search(queries, kk), k, allowed, ntotal=index.ntotal)


def _load_tokenizer(path: Path) -> TextTokenizer:
    try:
        return TextTokenizer.from_file(path)
    except TonearmError as err:
        raise BundleError(str(err)) from None
