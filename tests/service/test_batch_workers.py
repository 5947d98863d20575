"""TONEARM_BATCH_WORKERS: explicit, or 0 (the default) = one worker per usable core, 2 to 64."""

from __future__ import annotations

import pytest

from index.cpus import available_cores
from service.batching import BatchMetrics
from service.encoder_queues import Batchers, batch_workers_for
from tests.service.conftest import make_settings


@pytest.mark.parametrize(("cores", "expected"), [(1, 2), (2, 2), (16, 16), (200, 64)])
def test_auto_is_one_worker_per_core_within_2_to_64(cores: int, expected: int) -> None:
    assert make_settings().batch_workers == 0
    assert batch_workers_for(make_settings(), cores) == expected


def test_an_explicit_count_is_kept_whatever_the_cores() -> None:
    assert batch_workers_for(make_settings(batch_workers=3), 16) == 3
    assert batch_workers_for(make_settings(batch_workers=5), 1) == 5


def test_started_batchers_run_that_many_threads() -> None:
    from prometheus_client import CollectorRegistry

    batchers = Batchers.start(make_settings(), BatchMetrics(CollectorRegistry()))
    try:
        expected = batch_workers_for(make_settings(), available_cores())
        assert len(batchers.text._threads) == expected and len(batchers.audio._threads) == expected
    finally:
        batchers.close()
