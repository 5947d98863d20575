"""The service's two micro-batchers: text queries and audio uploads (see :mod:`service.batching`).

An item carries the :class:`~service.searcher.Searcher` of the bundle its request
leased, so a micro-batch spanning a hot swap is split per bundle: each request is
answered by the bundle it started with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from service.batching import BatchMetrics, MicroBatcher
from service.searcher import AudioQuery, CaptionHit, Searcher, TextLookup
from service.settings import Settings

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


@dataclass
class Batchers:
    text: MicroBatcher[TextItem, TextResult]
    audio: MicroBatcher[AudioItem, list[CaptionHit]]

    @classmethod
    def start(cls, settings: Settings, metrics: BatchMetrics) -> Batchers:
        options = {
            "max_batch": settings.batch_max_size,
            "max_queue": settings.batch_max_queue,
            "workers": settings.batch_workers,
            "metrics": metrics,
        }
        return cls(
            text=MicroBatcher("text", per_searcher(Searcher.complete_text_batch), **options),  # type: ignore[arg-type]
            audio=MicroBatcher("audio", per_searcher(Searcher.search_audio_batch), **options),  # type: ignore[arg-type]
        )

    def close(self) -> None:
        self.text.close()
        self.audio.close()
