"""What every benchmark script shares: the machine description and its docs/BENCHMARKS.md section.

Each script owns one section between its own start/end markers; writes take a file lock
so two benchmarks finishing together cannot wipe each other's section.
"""

from __future__ import annotations

import fcntl
import platform
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_MD = ROOT / "docs" / "BENCHMARKS.md"


def cpu_model() -> str:
    """The CPU's marketing name (from /proc/cpuinfo on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_section(section: str, path: Path = BENCHMARKS_MD, *, start: str, end: str) -> None:
    """Replace the text between `start` and `end` in `path` with `section` (or append it).

    `section` includes its own markers, so the next run finds and replaces it again.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        current = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
        if start in current and end in current:
            before, rest = current.split(start, 1)
            after = rest.split(end, 1)[1].lstrip("\n")
            current = before + section.rstrip("\n") + "\n" + ("\n" + after if after else "")
        else:
            current = current.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
        path.write_text(current, encoding="utf-8")


def random_train_inputs(
    batch: int, *, views: int, seconds: float, sample_rate: int, vocab: int, device: Any, length: int = 24
) -> dict[str, Any]:
    """Random keyword inputs of ``training.loop.TrainStep`` (speed and memory do not depend on content)."""
    import torch

    return {
        "waveform": 0.1 * torch.randn(batch, int(seconds * sample_rate), device=device),
        "input_ids": torch.randint(1, vocab, (views, batch, length), device=device),
        "attention_mask": torch.ones(views, batch, length, dtype=torch.long, device=device),
        "text_mask": torch.ones(views, batch, dtype=torch.bool, device=device),
        "clip_index": torch.arange(batch, device=device),
    }
