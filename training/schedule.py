"""Learning-rate schedules as pure functions of the optimizer step.

The loop sets ``lr = learning_rate(step, ...)`` on every parameter group before
each step, so resuming needs only the step number (no scheduler object to save).

* linear warm-up from ``base_lr / (warmup_steps + 1)`` to ``base_lr`` over the
  first ``warmup_steps`` steps, then
* ``cosine``: half-cosine decay from ``base_lr`` to ``min_ratio · base_lr`` at ``total_steps``;
* ``step``: multiply by ``gamma`` every ``step_size`` steps (the loop passes
  ``step_size_epochs · steps_per_epoch``);
* ``constant``: ``base_lr``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

ScheduleName = Literal["cosine", "step", "constant"]


@dataclass(frozen=True)
class Schedule:
    """Everything the learning rate depends on besides the step."""

    base_lr: float
    total_steps: int
    warmup_steps: int = 0
    kind: ScheduleName = "cosine"
    step_size: int = 1
    gamma: float = 0.1
    min_ratio: float = 0.0

    def __call__(self, step: int) -> float:
        return learning_rate(step, self)


def learning_rate(step: int, schedule: Schedule) -> float:
    """Learning rate for the 0-based optimizer ``step``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    s = schedule
    if step < s.warmup_steps:
        return s.base_lr * (step + 1) / (s.warmup_steps + 1)
    if s.kind == "constant":
        return s.base_lr
    if s.kind == "step":
        return s.base_lr * s.gamma ** ((step - s.warmup_steps) // max(1, s.step_size))
    decay_steps = max(1, s.total_steps - s.warmup_steps)
    progress = min(1.0, (step - s.warmup_steps) / decay_steps)
    floor = s.min_ratio * s.base_lr
    return floor + (s.base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
