"""Ctrl-C (SIGINT) and SIGTERM stop a training run at a step boundary.

Raising ``KeyboardInterrupt`` wherever the signal lands would leave the model half
way through a step: BatchNorm statistics already updated by the forward pass of a
step that is never counted, so ``last/`` would not be a state the uninterrupted run
ever passed through and a resume could not be exact. Instead the first signal only
sets a flag that the loop reads after each optimizer step; the loop then saves
``last/`` and raises :class:`TrainingInterrupted`. A second signal stops at once,
without saving (``last/`` then holds the previous epoch end).
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(KeyboardInterrupt):
    """The run stopped on request after saving ``last/`` at `step`."""

    def __init__(self, *, step: int, epoch: int, batch_in_epoch: int) -> None:
        super().__init__(f"interrupted at step {step}")
        self.step, self.epoch, self.batch_in_epoch = step, epoch, batch_in_epoch


class StopRequest:
    """Context manager turning SIGINT/SIGTERM into a flag (`requested`) for the loop to poll.

    Only the main thread can install signal handlers; elsewhere (a run started from a
    worker thread) the flag never rises and signals keep their usual effect.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.warning(
            "%s: stopping after this step and saving last/ (press Ctrl-C again to stop now without saving)",
            signal.Signals(signum).name,
        )

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def ignore_ctrl_c(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: workers leave Ctrl-C to the main process.

    A terminal sends SIGINT to the whole process group; a worker that died of it
    would make the main process fail while it finishes the current step. (SIGTERM
    keeps its default: the loader terminates its workers with it.)
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
