"""`tonearm export|index --device cuda` (issue 41): the catalogue pass runs on ONNX Runtime's CUDA
provider, and where this onnxruntime has none the command stops before any work with one line
(exit status 2) — it never runs on the CPU when a GPU was asked for. On a machine with the CUDA
provider the refusal cannot happen; the CUDA pass itself is checked where a GPU is lent.

`--precision fp16` (index.catalogue.half_precision) runs only with `--device cuda`: elsewhere it is refused in one
line before any work (the fp16 copies and their gate are tested on the CPU provider in
tests/training/test_half_precision.py).

Cost: ~10 s (five CLI processes, nothing embedded).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import pytest

from index.errors import TonearmError
from index.runtime.loader import device_providers

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


def tonearm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tonearm", *args], capture_output=True, text=True, timeout=120,
                          env=os.environ)


@pytest.mark.skipif(HAS_CUDA, reason="this onnxruntime has the CUDA provider: nothing to refuse")
@pytest.mark.parametrize("command", [
    ("export", "CKPT", "--data", "m.jsonl", "--out", "bundles"),
    ("export", "--pretrained", "MODEL", "--data", "m.jsonl", "--out", "bundles"),
    ("index", "AUDIO", "--bundle", "B", "--out", "NEW"),
])
def test_cuda_without_a_cuda_provider_is_one_line(command: tuple[str, ...], tmp_path: Path) -> None:
    run = tonearm(*command[:-1], str(tmp_path / command[-1]), "--device", "cuda")
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device cuda: this onnxruntime has no CUDAExecutionProvider" in lines[0], run.stderr
    assert not (tmp_path / command[-1]).exists()


@pytest.mark.parametrize("command", [
    ("export", "CKPT", "--data", "m.jsonl", "--out", "bundles"),
    ("index", "AUDIO", "--bundle", "B", "--out", "NEW"),
])
def test_fp16_without_cuda_is_one_line(command: tuple[str, ...], tmp_path: Path) -> None:
    run = tonearm(*command[:-1], str(tmp_path / command[-1]), "--precision", "fp16")
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "--precision fp16 needs --device cuda" in lines[0], run.stderr
    assert not (tmp_path / command[-1]).exists()


def test_device_providers() -> None:
    assert device_providers("cpu") == ["CPUExecutionProvider"]
    if HAS_CUDA:
        assert device_providers("cuda") == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    else:
        with pytest.raises(TonearmError, match="install onnxruntime-gpu"):
            device_providers("cuda")


@pytest.mark.skipif(HAS_CUDA, reason="this onnxruntime has the CUDA provider: the session would start on it")
def test_a_gpu_session_that_falls_back_to_the_cpu_is_refused(tmp_path: Path) -> None:
    """onnxruntime only warns when a requested GPU provider cannot start and runs on the CPU;
    the encoder loader refuses such a session in one line (here: asking this CPU-only build for CUDA)."""
    import onnx
    from onnx import TensorProto, helper

    from index.runtime.loader import OnnxEncoder

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["embedding"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, [1, 4])])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises(TonearmError, match="could not start CUDAExecutionProvider"):
        OnnxEncoder.load(path, inputs=["x"], embed_dim=4, providers=["CUDAExecutionProvider", "CPUExecutionProvider"],
                         threads=1)
    assert OnnxEncoder.load(path, inputs=["x"], embed_dim=4, providers=["CPUExecutionProvider"], threads=1)
