"""Progress of the first demo build, read from the log records the build already emits.

The build (synthetic corpus → training → export; :mod:`tonearm.demo`) logs its stage, each
training epoch and the export's progress; :class:`BuildProgress` is a logging handler that
turns those records into a status (stage, overall fraction, detail) for ``/readyz`` while
``tonearm serve`` builds. Stage weights are the measured share of each stage in a 2-core
build (synth 55 s, training 194 s, export 39 s; docs/BENCHMARKS.md "demo_build").
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

STAGES = ("synthesizing the corpus", "training", "exporting the bundle")
STAGE_WEIGHTS = (0.19, 0.67, 0.14)
EXPORT_PROGRESS = re.compile(r"export progress: (?P<what>.+) (?P<done>\d+)/(?P<total>\d+)(?: \(.*\))?$")
SYNTH_PROGRESS = re.compile(r"synth progress: rendered clips (?P<done>\d+)/(?P<total>\d+)$")
EPOCH_DONE = re.compile(r"^epoch (?P<epoch>\d+): loss")


@dataclass
class _State:
    stage: int = 0  # 1-based once the build starts
    stage_fraction: float = 0.0
    detail: str = "waiting for the build lock"
    epochs: int | None = None


class BuildProgress(logging.Handler):
    """Collects the demo build's progress from its log records (thread-safe)."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self._state = _State()
        self._lock = threading.Lock()
        self._started = time.monotonic()

    def emit(self, record: logging.LogRecord) -> None:
        stage = getattr(record, "demo_stage", None)
        message = record.getMessage()
        with self._lock:
            state = self._state
            if stage is not None:
                state.stage, state.stage_fraction = int(stage), 0.0
                state.epochs = getattr(record, "demo_epochs", None)
                state.detail = STAGES[state.stage - 1]
            elif record.name == "training.data.synth" and (m := SYNTH_PROGRESS.search(message)):
                done, total = int(m["done"]), max(1, int(m["total"]))
                state.stage_fraction = min(1.0, done / total)
                state.detail = f"synthesizing the corpus: {done}/{total} clips"
            elif record.name == "training.loop" and state.epochs and (m := EPOCH_DONE.match(message)):
                epoch = int(m["epoch"])
                state.stage_fraction = min(1.0, epoch / state.epochs)
                state.detail = f"training: epoch {epoch}/{state.epochs} done"
            elif record.name == "training.bundle.export" and (m := EXPORT_PROGRESS.search(message)):
                done, total = int(m["done"]), max(1, int(m["total"]))
                # embedding clips then captions: the two halves of the stage's long part
                half = 0.5 if m["what"].startswith("embedding captions") else 0.0
                state.stage_fraction = min(1.0, half + 0.5 * done / total)
                state.detail = f"exporting: {m['what']} {done}/{total}"

    def status(self) -> dict[str, Any]:
        """Stage (1–3, 0 before the build starts), overall fraction in [0, 1], detail, elapsed s."""
        with self._lock:
            state = self._state
            finished = sum(STAGE_WEIGHTS[: max(0, state.stage - 1)])
            current = STAGE_WEIGHTS[state.stage - 1] * state.stage_fraction if state.stage else 0.0
            return {
                "stage": STAGES[state.stage - 1] if state.stage else "starting",
                "step": state.stage,
                "steps": len(STAGES),
                "progress": round(min(1.0, finished + current), 3),
                "detail": state.detail,
                "elapsed_seconds": round(time.monotonic() - self._started, 1),
            }


@contextmanager
def attached(handler: logging.Handler, loggers: Sequence[logging.Logger]) -> Iterator[None]:
    """``handler`` on ``loggers`` with INFO records let through (whatever the configured level)."""
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
