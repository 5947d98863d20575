"""Why a PE-Audio bundle's service reached 9.4 GB RSS at 16 concurrent clips (issue 41): measure it.

PE-Audio's audio encoder starts with a DAC-style codec encoder at the waveform's own rate (48 kHz):
its first stage keeps 64 channels at every sample, so one 10-s clip is a 64 × 480,000 float32 tensor
(123 MB) per intermediate, and the residual units (Snake activation, two convolutions, the skip) hold
several at once. The service encodes concurrent clips as **one** micro-batch (``batch_max_size``,
default 32), so 16 clips of 10 s make every such tensor 16× larger — activation memory, not weights.

This script exports the codec encoder of the default (full-size) ``PeAudioEncoderConfig`` (random
weights, ~22 M parameters: the transformer after it works on 25 tokens/s and costs little) to ONNX and
runs it in ONNX Runtime as the service does (CPU provider, arena off) at a batch of 1, 4 and 16 clips
of 10 s and at one clip of 60 s, each in a fresh process; it prints the RSS before the call and its
peak during it (Linux: the peak is reset through /proc/self/clear_refs just before the call).

    PYTHONPATH=. python bench/pe_audio_memory.py [--batches 1 4 16] [--long 60]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

RATE = 48_000


def export(path: Path) -> None:
    import torch
    from transformers import PeAudioEncoderConfig
    from transformers.models.pe_audio.modeling_pe_audio import PeAudioDacEncoder

    config = PeAudioEncoderConfig()
    codec = PeAudioDacEncoder(config.dac_config).eval()
    torch.onnx.export(codec, (torch.zeros(1, 1, RATE),), str(path), input_names=["waveform"],
                      output_names=["codes"], dynamic_axes={"waveform": {0: "batch", 2: "samples"}}, opset_version=18,
                      dynamo=False)


def run(path: str, batch: int, seconds: float) -> None:
    import numpy as np
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.enable_cpu_mem_arena = False  # the service's default (service/settings.py onnx_memory_arena)
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    wave = (0.1 * np.random.default_rng(0).standard_normal((batch, 1, int(seconds * RATE)))).astype(np.float32)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    before = status_kib("VmRSS")
    session.run(None, {"waveform": wave})
    peak = status_kib("VmHWM")
    print(f"| {batch} | {seconds:g} | {before / 1024:.0f} | {peak / 1024:.0f} | {(peak - before) / 1024:.0f} |",
          flush=True)


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--long", type=float, default=60.0)
    parser.add_argument("--run", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run(args.run[0], int(args.run[1]), float(args.run[2]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "codec.onnx"
        export(path)
        print("| clips per call | seconds each | RSS before the call (MiB) | peak RSS (MiB) | rise (MiB) |")
        print("|---:|---:|---:|---:|---:|")
        for batch, seconds in [*((b, 10.0) for b in args.batches), (1, args.long)]:
            subprocess.run([sys.executable, __file__, "--run", str(path), str(batch), str(seconds)], check=True)


if __name__ == "__main__":
    main()
