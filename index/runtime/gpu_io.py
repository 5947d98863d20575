"""ONNX Runtime on a CUDA device for the catalogue pass (issue 49): provider options and I/O binding.

Kept apart from everything else because none of it can run on a machine without an NVIDIA GPU
(the test suite's): the CPU path never enters this module's CUDA branches.

* :func:`provider_entries` gives the CUDA provider its options: ``cudnn_conv_algo_search`` =
  ``HEURISTIC`` — ONNX Runtime's default, ``EXHAUSTIVE``, benchmarks every cuDNN convolution
  algorithm on each new input shape, which a catalogue of mixed clip lengths (PE-Audio's whole
  clips, the last windows of a batch) pays again and again; the heuristic choice costs nothing per
  shape (onnxruntime docs, CUDA execution provider, "cudnn_conv_algo_search"). ``device_id`` picks
  the GPU of a process (`--devices`), ``do_copy_in_default_stream`` keeps copies ordered with compute.
* :func:`run_bound` runs a CUDA session through I/O binding: the batch is copied host→device once
  from a page-locked (pinned) staging buffer that ONNX Runtime's CUDA allocator owns, and the
  embeddings come back into host memory, without ONNX Runtime's per-call host allocations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

CUDA = "CUDAExecutionProvider"
CUDA_OPTIONS: dict[str, str] = {"cudnn_conv_algo_search": "HEURISTIC", "do_copy_in_default_stream": "1"}


def provider_entries(providers: Sequence[Any], device_id: int | None = None) -> list[Any]:
    """``providers`` as ONNX Runtime takes them, the CUDA provider with :data:`CUDA_OPTIONS` (and ``device_id``)."""
    entries: list[Any] = []
    for provider in providers:
        if provider == CUDA:
            options = dict(CUDA_OPTIONS)
            if device_id is not None:
                options["device_id"] = str(device_id)
            entries.append((CUDA, options))
        else:
            entries.append(provider)
    return entries


def on_cuda(session: Any) -> bool:
    return bool(session.get_providers()) and session.get_providers()[0] == CUDA


def run_bound(session: Any, outputs: Sequence[str], feeds: dict[str, np.ndarray]) -> np.ndarray:  # pragma: no cover - needs a GPU
    """One call of a CUDA session through I/O binding (module docstring); the first output as float32."""
    import onnxruntime as ort

    device_id = int(session.get_provider_options().get(CUDA, {}).get("device_id", 0))
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value), "cuda",
                                                                            device_id))
    binding.bind_output(outputs[0], "cpu")
    session.run_with_iobinding(binding)
    return np.asarray(binding.copy_outputs_to_cpu()[0], dtype=np.float32)
