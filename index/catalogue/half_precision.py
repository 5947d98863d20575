"""Half-precision catalogue pass (`tonearm export|index --device cuda --precision fp16`, issue 41).

The bundle keeps its fp32 encoders — the service embeds queries with them — and only the
catalogue pass runs an fp16 copy of each, made here for the pass and thrown away after it
(docs/models.md, "Where the catalogue pass runs"). The copy has fp32 inputs and outputs
(``onnxruntime.transformers.float16``, ``keep_io_types``); inside it stays fp32:

* the numerically fragile op types :data:`FP32_OPS`: normalisations (LayerNorm, BatchNorm,
  InstanceNorm, GroupNorm), reductions (ReduceMean/Sum/L2: sums of thousands of values),
  Pow/Sqrt/Reciprocal, Softmax/Exp/Log, Sin/Cos (a rotary angle of 500 rad has a 0.25 rad step
  in fp16), plus onnxruntime's own default list (Range, CumSum, Min, Max, ...);
* the mel front end, when the graph computes it (CLAP): every node a ``Log`` depends on when no
  ``Softmax`` lies upstream of it — the STFT convolution, the squares and the mel projection,
  whose power values exceed fp16's 65,504 (training/models/frontend.py computes it in fp32 too);
* the position subgraph of rotary encoders (PE-Audio's text and audio transformers): every node a
  ``Sin``/``Cos`` depends on whose value comes from shapes, not from the input audio — the
  angles themselves, not only their sine.

The rest — matmuls, convolutions, GELU, residual adds, PE-Audio's codec — runs in fp16.

**Parity gate.** Before the pass, a probe set (the catalogue's first :data:`PROBE_CLIPS` clips and
four synthetic signals; for captions, the export's parity captions and the first
:data:`PROBE_TEXTS` catalogue captions) is embedded with the fp32 and the fp16 graph on the pass's
providers; when the lowest **centred cosine** (both sets L2-normalised, each set's mean row
removed: what differs between items, not what they share — as training/bundle/step0.py) is below
:data:`MIN_CENTRED_COSINE`, the command stops with one line and writes nothing. It does not fall
back to fp32: the user asked for fp16 and reruns with ``--precision fp32`` knowingly. A bundle
embedded in fp16 records it (``manifest.catalogue_pass``); an fp32 pass records nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from index.bundle import format as fmt
from index.errors import TonearmError
from index.runtime.loader import OnnxEncoder

log = logging.getLogger(__name__)

Precision = Literal["fp32", "fp16"]
MIN_CENTRED_COSINE = 0.999
"""Lowest centred cosine fp16 vs fp32 over the probe set that lets an fp16 pass run."""
PROBE_CLIPS = 12
"""Catalogue clips in the audio probe set (besides :func:`probe_waves`)."""
PROBE_TEXTS = 24
"""Catalogue captions in the caption probe set (besides the export's parity captions)."""
FP32_OPS = (
    "LayerNormalization", "BatchNormalization", "InstanceNormalization", "GroupNormalization",
    "ReduceMean", "ReduceSum", "ReduceL2", "ReduceSumSquare", "Pow", "Sqrt", "Reciprocal",
    "Softmax", "LogSoftmax", "Exp", "Log", "Sin", "Cos",
)
"""Op types the fp16 copy keeps in fp32 (module docstring)."""
_NO_VALUE = {"Shape", "Size"}
"""Ops whose output depends on an input's shape only, not on its values."""
EXTERNAL_DATA_BYTES = 2 * 1024**3
"""ONNX protobufs are capped at 2 GB: a larger encoder keeps its weights in an external file, and the
converter (its shape inference on the in-memory model) cannot copy it; refused in one line."""


class HalfPrecisionParityError(TonearmError):
    """The fp16 copy of an encoder disagrees with the fp32 graph on the probe set."""


def check_precision_options(precision: Precision, device: str | None, *, ray: bool = False,
                            quantized: Sequence[str] = ()) -> None:
    """One line (exit status 2) for the combinations ``--precision fp16`` does not run: on the CPU
    (ONNX Runtime's CPU provider casts most fp16 kernels back to fp32: slower, nothing gained), on
    Ray (its actors run the CPU provider) and for an encoder that is not fp32 (``--quantize``).
    ``device`` None: not checked (a library call chooses its providers itself; the tests run the
    fp16 copies on the CPU provider)."""
    if precision == "fp32":
        return
    if device is not None and device != "cuda":
        raise TonearmError("--precision fp16 needs --device cuda: the CPU provider has no gain from fp16 "
                           "(it casts most kernels back to fp32); leave out --precision or add --device cuda")
    if ray:
        raise TonearmError("--precision fp16 runs the in-process pass on CUDA; Ray's actors run the CPU provider: "
                           "leave out --ray or --precision fp16")
    if quantized:
        raise TonearmError(f"--precision fp16 copies fp32 encoders; the {' and '.join(quantized)} encoder is "
                           "quantized: leave out --quantize or --precision fp16")


# ----------------------------------------------------------------------------- conversion


def _producers(graph: Any) -> dict[str, Any]:
    return {out: node for node in graph.node for out in node.output}


def _ancestors(node: Any, producers: dict[str, Any], *, through: Callable[[Any], bool]) -> list[Any]:
    """Nodes ``node`` depends on (itself included), following only inputs of nodes ``through`` accepts."""
    seen: dict[int, Any] = {}
    stack = [node]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen[id(current)] = current
        if not through(current):
            continue
        stack.extend(producers[name] for name in current.input if name in producers)
    return list(seen.values())


def fp32_node_names(model: Any) -> list[str]:
    """Names of the nodes kept fp32 besides :data:`FP32_OPS`: the mel front end and rotary angles."""
    graph = model.graph
    producers = _producers(graph)
    valued = {i.name for i in graph.input if i.type.tensor_type.elem_type == 1}  # float graph inputs
    for node in graph.node:  # ONNX nodes are in topological order
        if node.op_type not in _NO_VALUE and any(name in valued for name in node.input):
            valued.update(node.output)

    def from_audio(node: Any) -> bool:  # does the node's value depend on a float graph input?
        return any(name in valued for name in node.output)

    names: set[str] = set()
    for node in graph.node:
        if node.op_type == "Log":
            upstream = _ancestors(node, producers, through=lambda _n: True)
            if not any(n.op_type == "Softmax" for n in upstream):
                names.update(n.name for n in upstream)
        elif node.op_type in ("Sin", "Cos"):
            names.update(n.name for n in _ancestors(node, producers, through=lambda n: n.op_type not in _NO_VALUE)
                         if not from_audio(n))
    return sorted(name for name in names if name)


def drop_round_trips(model: Any) -> int:
    """Remove the fp32 → fp16 → fp32 casts the converter puts between two fp32 nodes; returns how many.

    ``convert_float_to_float16`` wraps every blocked node alone: its fp32 output is cast to fp16 and
    cast back for the next blocked node, so a chain kept "in fp32" still passes every value through fp16
    (CLAP's mel floor 1e-10 becomes 0 and its log −inf). A ``Cast`` to fp16 the converter inserted
    after an fp32 value (``*_cast_to_fp16_node``, ``graph_input_cast*``) followed by a ``Cast`` to fp32
    is replaced by the fp32 value itself; the fp16 cast goes when nothing else reads it."""
    graph = model.graph
    nodes = list(graph.node)
    fp16_casts = {node.output[0]: node for node in nodes
                  if node.op_type == "Cast" and (node.name.endswith("_cast_to_fp16_node")
                                                 or node.name.startswith("graph_input_cast"))}
    replace = {node.output[0]: fp16_casts[node.input[0]].input[0] for node in nodes
               if node.op_type == "Cast" and node.input[0] in fp16_casts
               and any(a.name == "to" and a.i == 1 for a in node.attribute)}
    kept = [node for node in nodes if not (node.op_type == "Cast" and node.output[0] in replace)]
    for node in kept:
        for i, name in enumerate(node.input):
            if name in replace:
                node.input[i] = replace[name]
    read = {name for node in kept for name in node.input} | {o.name for o in graph.output}
    unread = {name for name in fp16_casts if name not in read}
    kept = [node for node in kept if not (node.op_type == "Cast" and node.output[0] in unread)]
    values = [v for v in graph.value_info if v.name not in replace and v.name not in unread]
    del graph.node[:]
    graph.node.extend(kept)
    del graph.value_info[:]
    graph.value_info.extend(values)
    return len(replace)


def drop_duplicate_casts(model: Any) -> int:
    """Remove the second and later copies of a ``Cast`` the converter added twice; returns how many.

    onnxruntime ≤ 1.31's ``convert_float_to_float16`` inserts one ``<input>_cast_to_fp32_node`` per
    blocked node that reads an fp16 value, so a value read by two blocked nodes (PE-Audio's Snake
    ``alpha``, read by its Mul and its Reciprocal) gets two nodes of the same name and output, and the
    model does not load ("two nodes with same node name"; found on an H200 with onnxruntime-gpu
    1.31.1; 1.32 shares the cast). The copies compute the same value: the first is kept."""
    graph = model.graph
    seen: set[tuple[str, tuple[str, ...], tuple[str, ...]]] = set()
    kept, dropped = [], 0
    for node in graph.node:
        key = (node.name, tuple(node.input), tuple(node.output))
        if node.op_type == "Cast" and node.name and key in seen:
            dropped += 1
            continue
        seen.add(key)
        kept.append(node)
    if dropped:
        del graph.node[:]
        graph.node.extend(kept)
        values, names = [], set()
        for value in graph.value_info:
            if value.name not in names:
                names.add(value.name)
                values.append(value)
        del graph.value_info[:]
        graph.value_info.extend(values)
    return dropped


def half_precision_copy(src: Path | str, dst: Path | str) -> Path:
    """Write the fp16 copy of the ONNX model ``src`` (fp32 inputs/outputs; module docstring) to ``dst``."""
    src, dst = Path(src), Path(dst)
    size = sum(p.stat().st_size for p in (src, *src.parent.glob(f"{src.name}.data")))
    if size >= EXTERNAL_DATA_BYTES:  # the converter's shape inference runs on the in-memory model: ≤ 2 GB
        raise TonearmError(f"--precision fp16: {src.name} is {size / 1e9:.1f} GB with its weights; fp16 copies of "
                           "encoders over 2 GB are not made (yet): rerun with --precision fp32")
    try:
        import onnx
        from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16
    except ImportError as err:
        raise TonearmError(f"--precision fp16 needs the onnx package ({err}): pip install 'tonearm[gpu]'") from None
    model = onnx.load(str(src))
    half = convert_float_to_float16(model, keep_io_types=True, op_block_list=[*DEFAULT_OP_BLOCK_LIST, *FP32_OPS],
                                    node_block_list=fp32_node_names(model))
    drop_duplicate_casts(half)
    drop_round_trips(half)
    onnx.save(half, str(dst))
    log.info("%s: fp16 copy for the catalogue pass written to %s (%.1f MB -> %.1f MB)", src.name, dst,
             src.stat().st_size / 1e6, dst.stat().st_size / 1e6)
    return dst


def load_half(src: Path, folder: Path, *, inputs: Sequence[str], embed_dim: int, providers: Sequence[str]) -> OnnxEncoder:
    """The fp16 copy of the encoder ``src``, written into ``folder`` and loaded on ``providers``."""
    path = half_precision_copy(src, folder / f"{src.stem}.fp16.onnx")
    return OnnxEncoder.load(path, inputs=inputs, embed_dim=embed_dim, providers=list(providers), threads=None)


# ----------------------------------------------------------------------------- parity gate


def centred_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per item: cosine of ``a[i]`` and ``b[i]`` after L2-normalising every row and removing each
    set's mean row (training.bundle.step0.centred_cosines, in numpy)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    a, b = a - a.mean(0), b - b.mean(0)
    return np.asarray((a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-300))


def probe_waves(sample_rate: int, samples: int) -> list[np.ndarray]:
    """Four unrelated float32 signals of ``samples`` samples (a chirp with noise, white noise, a pulsed
    tone, a high tone over faint noise; seeded), so a probe set always has items that differ."""
    rng = np.random.default_rng(0)
    t = np.arange(samples) / sample_rate
    seconds = max(samples / sample_rate, 1e-3)
    return [
        (0.3 * np.sin(2 * np.pi * (200 + 2000 * t / seconds) * t) + 0.05 * rng.standard_normal(t.shape)).astype(np.float32),
        (0.2 * rng.standard_normal(t.shape)).astype(np.float32),
        (0.3 * np.sin(2 * np.pi * 440 * t) * (np.sin(2 * np.pi * 3 * t) > 0)).astype(np.float32),
        (0.3 * np.sin(2 * np.pi * 3000 * t) + 0.01 * rng.standard_normal(t.shape)).astype(np.float32),
    ]


def parity_gate(what: str, fp32: np.ndarray, fp16: np.ndarray, *, minimum: float = MIN_CENTRED_COSINE) -> float:
    """The lowest centred cosine of the probe set's fp16 vs fp32 embeddings; one-line
    :class:`HalfPrecisionParityError` below ``minimum``."""
    if len(fp32) < 2:
        raise ValueError("a centred cosine needs at least two probe items")
    worst = float(centred_cosines(fp32, fp16).min())
    if not worst >= minimum:
        raise HalfPrecisionParityError(
            f"--precision fp16: the {what} encoder's fp16 copy disagrees with its fp32 graph on {len(fp32)} probe items "
            f"(min centred cosine {worst:.6f} < {minimum}); nothing was written: rerun with --precision fp32"
        )
    log.info("fp16 %s encoder vs fp32 on %d probe items: min centred cosine %.6f", what, len(fp32), worst)
    return worst


def gate(what: str, encode_fp32: Callable[[list[Any]], np.ndarray], encode_fp16: Callable[[list[Any]], np.ndarray],
         items: Sequence[Any]) -> tuple[float, int]:
    """:func:`parity_gate` of ``items`` embedded by both encode functions: (min centred cosine, items)."""
    probe = list(items)
    return parity_gate(what, encode_fp32(probe), encode_fp16(probe)), len(probe)


def catalogue_pass_info(found: dict[str, tuple[float, int]], device: str) -> fmt.CataloguePassInfo:
    """The manifest's record of an fp16 pass: per encoder its probe set's min centred cosine and size."""
    return fmt.CataloguePassInfo(
        precision="fp16", device=device,  # type: ignore[arg-type]
        parity_min_centred_cosine={name: round(value, 6) for name, (value, _) in found.items()},
        probe_items={name: n for name, (_, n) in found.items()}, min_centred_cosine=MIN_CENTRED_COSINE,
    )
