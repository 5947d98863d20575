"""Observability of training (SPEC §13, issue 30 item 6): throughput, data wait, peak memory.

:class:`Observer` times the DataLoader (time blocked in ``next()``) against each step's wall
time, counts samples, and at every logged step hands back one window's scalars:

- ``samples_per_s``: samples of the global batch (this rank's batch × world size) per second of
  step wall time in the window;
- ``data_wait_fraction``: seconds blocked in the loader's ``next()`` / step wall seconds, in [0, 1];
- ``peak_memory_mib`` (CUDA only): ``torch.cuda.max_memory_allocated`` in the window (reset after).

Under torchrun every rank measures its own window and :func:`training.distributed.reduce_window`
gathers them (one collective per logged step, on every rank): ``samples_per_s`` and
``data_wait_fraction`` are the means over ranks, ``data_wait_fraction_max`` the worst rank's data
wait (a starved rank stalls every rank at the next collective, so the warning below follows it),
and ``peak_memory_mib`` the largest rank's. The epoch record's ``bad_samples`` counts the distinct
undecodable clips of every rank (:func:`training.distributed.distinct_over_ranks`).

A step's wall time runs from asking the loader for its batch to the end of its bookkeeping, so
validation and checkpoints between epochs are not counted. When the data-wait fraction exceeds
``log.data_wait_warn`` in ``log.data_wait_windows`` consecutive windows, one warning line is logged
(again only after the wait has dropped below and climbed back). The first window (step 1) holds
the loader's start-up (workers spawning, first prefetch) and does not count towards the warning.

Every record written to ``metrics.jsonl`` also goes to TensorBoard event files in the run
directory (``log.tensorboard``, tags ``KIND/NAME`` such as ``step/samples_per_s``) and to W&B when
``log.wandb`` or ``WANDB_PROJECT`` names a project (``WANDB_MODE=offline`` is honoured by wandb);
only rank 0 writes.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from training import distributed
from training.config import ConfigError, LogConfig

log = logging.getLogger(__name__)

T = TypeVar("T")

TIMING_KEYS = frozenset({"seconds", "samples_per_s", "data_wait_fraction", "data_wait_fraction_max", "peak_memory_mib"})
"""Record keys that measure time or memory: they differ between two runs of the same config."""


def batch_size_of(batch: Any) -> int:
    """Clips in a training batch (its waveform's first dimension), or 1 for anything else."""
    waveform = getattr(batch, "waveform", None)
    return int(len(waveform)) if waveform is not None else 1


class Observer:
    """Step timer, throughput meter and the TensorBoard / W&B sinks of one training process."""

    def __init__(
        self,
        cfg: LogConfig,
        *,
        out_dir: Path,
        enabled: bool,
        device: torch.device,
        world_size: int = 1,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.enabled = enabled
        self.device = device
        self.world_size = world_size
        self.windows = 0
        self.slow_streak = 0
        self._reset_window()
        self._fetch_started: float | None = None
        self._pending_samples = 0
        self._tensorboard: Any = None
        self._wandb: Any = None
        project = cfg.wandb or os.environ.get("WANDB_PROJECT")
        if project:
            try:
                import wandb
            except ImportError:
                raise ConfigError(
                    f"W&B logging was asked for (project {project!r} from "
                    f"{'log.wandb' if cfg.wandb else 'WANDB_PROJECT'}) but the wandb package is "
                    "not installed: pip install wandb, or unset it"
                ) from None
            if enabled:
                self._wandb = wandb.init(project=project, dir=str(out_dir), config=config or {})
        self._tensorboard_dir = out_dir if enabled and cfg.tensorboard else None
        self._purge_step: int | None = None
        if self._tensorboard_dir is not None:
            try:
                import torch.utils.tensorboard  # noqa: F401
            except ImportError:
                raise ConfigError(
                    "log.tensorboard needs the tensorboard package (pip install tensorboard, part "
                    "of tonearm[train]); or set log.tensorboard=false"
                ) from None

    def _reset_window(self) -> None:
        self._wait = 0.0
        self._wall = 0.0
        self._samples = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    # --- timing -------------------------------------------------------------------------------

    def batches(self, loader: Iterable[T]) -> Iterator[T]:
        """Iterate `loader`, timing each ``next()``; call :meth:`step_end` after each step."""
        iterator = iter(loader)
        while True:
            self._fetch_started = started = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                self._fetch_started = None
                return
            self._wait += time.perf_counter() - started
            self._pending_samples = batch_size_of(batch)
            yield batch

    def step_end(self) -> None:
        """Close the step whose batch :meth:`batches` yielded last."""
        if self._fetch_started is None:
            return
        self._wall += time.perf_counter() - self._fetch_started
        self._samples += self._pending_samples * self.world_size
        self._fetch_started = None

    def window(self) -> dict[str, float]:
        """The scalars of the steps since the last call (then a new window starts)."""
        wall = max(self._wall, 1e-9)
        values = {
            "samples_per_s": self._samples / wall,
            "data_wait_fraction": min(1.0, self._wait / wall) if self._wall > 0 else 0.0,
        }
        if self.device.type == "cuda":
            values["peak_memory_mib"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        values = distributed.reduce_window(values)  # every rank's, one collective (module doc)
        self.windows += 1
        if self.windows > 1:  # the first window holds the loader's start-up
            self._check_data_wait(values["data_wait_fraction_max"])
        self._reset_window()
        return values

    def _check_data_wait(self, fraction: float) -> None:
        if fraction <= self.cfg.data_wait_warn:
            self.slow_streak = 0
            return
        self.slow_streak += 1
        if self.slow_streak == self.cfg.data_wait_windows and self.enabled:
            log.warning(
                "data wait %.1f%% of step time (the worst rank's) over the last %d logging windows "
                "(> %.0f%%): the model is starved; raise data.num_workers, train from shards, or check the disk",
                100 * fraction,
                self.slow_streak,
                100 * self.cfg.data_wait_warn,
            )

    # --- sinks --------------------------------------------------------------------------------

    def restart_from(self, step: int) -> None:
        """The run (re)starts after `step`: 0 deletes earlier event files in the run directory; a
        resumed run's TensorBoard drops the events after `step` that it will log again."""
        if self._tensorboard_dir is None or self._tensorboard is not None:
            return
        if step == 0:
            for old in self._tensorboard_dir.glob("events.out.tfevents.*"):
                old.unlink()
        else:
            self._purge_step = step + 1

    def _tensorboard_writer(self) -> Any:
        if self._tensorboard is None and self._tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(
                log_dir=str(self._tensorboard_dir), purge_step=self._purge_step
            )
        return self._tensorboard

    def write(self, record: dict[str, Any]) -> None:
        """Send a ``metrics.jsonl`` record's numbers to TensorBoard and W&B (rank 0)."""
        if not self.enabled or (self._tensorboard_dir is None and self._wandb is None):
            return
        kind, step = str(record.get("kind", "step")), int(record.get("step", 0))
        scalars = {
            f"{kind}/{name}": float(value)
            for name, value in record.items()
            if name not in ("kind", "step")
            and isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
        }
        writer = self._tensorboard_writer()
        if writer is not None:
            for tag, value in scalars.items():
                writer.add_scalar(tag, value, global_step=step)
            writer.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        self._tensorboard_dir = None  # closed for good
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
