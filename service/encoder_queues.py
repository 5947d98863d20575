"""The service's two micro-batchers: text queries and audio uploads (see :mod:`service.batching`).

An item carries the :class:`~service.searcher.Searcher` of the bundle its request
leased, so a micro-batch spanning a hot swap is split per bundle: each request is
answered by the bundle it started with.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from index.cpus import available_cores
from service.batching import BatchMetrics, MicroBatcher
from service.searcher import AudioQuery, CaptionHit, Searcher, TextLookup
from service.settings import Settings

log = logging.getLogger(__name__)

Q = TypeVar("Q")
R = TypeVar("R")

TextItem = tuple[Searcher, TextLookup]
TextResult = list[tuple[np.ndarray, np.ndarray]]
AudioItem = tuple[Searcher, AudioQuery]


def per_searcher(
    run: Callable[[Searcher, list[Q]], Sequence[R]],
) -> Callable[[Sequence[tuple[Searcher, Q]]], list[R]]:
    """A batch function over (searcher, query) items that calls ``run`` once per searcher, keeping order."""

    def run_items(items: Sequence[tuple[Searcher, Q]]) -> list[R]:
        groups: dict[int, list[int]] = {}
        for position, (searcher, _) in enumerate(items):
            groups.setdefault(id(searcher), []).append(position)
        results: dict[int, R] = {}
        for positions in groups.values():
            searcher = items[positions[0]][0]
            answers = run(searcher, [items[p][1] for p in positions])
            results.update(zip(positions, answers, strict=True))
        return [results[p] for p in range(len(items))]

    return run_items


AUTO_BATCH_WORKERS_MIN, AUTO_BATCH_WORKERS_MAX = 2, 64


def batch_workers_for(settings: Settings, cores: int) -> int:
    """Threads per encoder queue: ``TONEARM_BATCH_WORKERS``, or with 0 (auto) one per usable core,
    2 to 64. Each worker runs one single-threaded encoder call at a time, so a queue uses as many
    cores as it has workers: 2 on the 2-core machines the defaults were tuned on, and all 16 on a
    16-core host, where a fixed 2 served a fifth of the text load (docs/BENCHMARKS.md, real_size)."""
    if settings.batch_workers:
        return settings.batch_workers
    return min(AUTO_BATCH_WORKERS_MAX, max(AUTO_BATCH_WORKERS_MIN, cores))


@dataclass
class Batchers:
    text: MicroBatcher[TextItem, TextResult]
    audio: MicroBatcher[AudioItem, list[CaptionHit]]

    @classmethod
    def start(cls, settings: Settings, metrics: BatchMetrics) -> Batchers:
        workers = batch_workers_for(settings, available_cores())
        log.info("%d batch worker(s) per encoder queue", workers)
        options = {
            "max_batch": settings.batch_max_size,
            "max_queue": settings.batch_max_queue,
            "workers": workers,
            "metrics": metrics,
        }
        return cls(
            text=MicroBatcher("text", per_searcher(Searcher.complete_text_batch), **options),  # type: ignore[arg-type]
            audio=MicroBatcher("audio", per_searcher(Searcher.search_audio_batch), **options),  # type: ignore[arg-type]
        )

    def close(self) -> None:
        self.text.close()
        self.audio.close()
