"""Learning-rate schedules: hand-computed values at the warm-up, decay and step boundaries."""

from __future__ import annotations

import math

import pytest

from training.schedule import Schedule, learning_rate


def test_warmup_is_linear_and_reaches_base_lr() -> None:
    s = Schedule(base_lr=1.0, total_steps=100, warmup_steps=4, kind="constant")
    assert [learning_rate(i, s) for i in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])


def test_cosine_hits_half_at_midpoint_and_zero_at_end() -> None:
    s = Schedule(base_lr=2.0, total_steps=110, warmup_steps=10, kind="cosine")
    assert learning_rate(10, s) == pytest.approx(2.0)
    assert learning_rate(60, s) == pytest.approx(1.0)  # half-way through the 100 decay steps
    assert learning_rate(35, s) == pytest.approx(1.0 + math.cos(math.pi / 4))
    assert learning_rate(110, s) == pytest.approx(0.0, abs=1e-12)
    assert learning_rate(500, s) == pytest.approx(0.0, abs=1e-12)  # clamped after the horizon


def test_cosine_floor() -> None:
    s = Schedule(base_lr=1.0, total_steps=10, kind="cosine", min_ratio=0.1)
    assert learning_rate(10, s) == pytest.approx(0.1)
    assert learning_rate(5, s) == pytest.approx(0.55)


def test_step_decay_multiplies_by_gamma_every_step_size() -> None:
    s = Schedule(base_lr=1.0, total_steps=100, warmup_steps=2, kind="step", step_size=5, gamma=0.5)
    values = [learning_rate(i, s) for i in (2, 6, 7, 12, 17)]
    assert values == pytest.approx([1.0, 1.0, 0.5, 0.25, 0.125])


def test_schedule_is_monotone_non_increasing_after_warmup() -> None:
    s = Schedule(base_lr=1e-3, total_steps=50, warmup_steps=5)
    values = [s(i) for i in range(5, 60)]
    assert all(b <= a + 1e-15 for a, b in zip(values, values[1:], strict=False))


def test_negative_step_is_rejected() -> None:
    with pytest.raises(ValueError):
        learning_rate(-1, Schedule(base_lr=1.0, total_steps=1))
