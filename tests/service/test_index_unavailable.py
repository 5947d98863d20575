"""An index backend that cannot answer (Milvus down) is a 503 `index-unavailable` with Retry-After,
decided once per micro-batch: the batcher must not retry each request alone (that multiplied the
backend's deadline while a worker stalled), and the searcher maps the backend's error itself."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest

from index.errors import IndexTimeout, IndexUnavailable
from service.cache import LocalCache
from service.errors import ServiceError
from service.metrics import ServiceMetrics
from service.searcher import INDEX_RETRY_AFTER_S, Searcher
from tests.service.fakes import KeywordBundle
from tests.service.test_batching import HeldSquares, _queued, batcher


class Unreachable(HeldSquares):
    """A batch function whose index is down: every call fails with index-unavailable."""

    def __call__(self, items: Sequence[int]) -> list[int]:
        self.batches.append(list(items))
        self.entered.set()
        assert self.release.wait(30)
        raise ServiceError("index-unavailable", "Milvus unreachable", retry_after=1)


def test_an_index_outage_fails_the_whole_batch_once_without_one_by_one_retries():
    fn = Unreachable()
    b = batcher(fn)

    async def scenario():
        fn.hold()
        first = asyncio.ensure_future(b.submit(1))
        await asyncio.to_thread(fn.entered.wait, 10)
        jobs = [asyncio.ensure_future(b.submit(i)) for i in (2, 3, 4)]
        await _queued(b, 3)
        fn.release.set()
        return await asyncio.gather(first, *jobs, return_exceptions=True)

    try:
        outcomes = asyncio.run(scenario())
    finally:
        b.close()
    assert all(isinstance(o, ServiceError) and o.slug == "index-unavailable" for o in outcomes)
    assert fn.batches == [[1], [2, 3, 4]]  # one call per batch: no retry of 2, 3 and 4 alone


class DownIndex(KeywordBundle):
    """The keyword bundle with its vector index unreachable (what the Milvus backend raises)."""

    def search_audio(self, queries: np.ndarray, k: int):
        raise IndexUnavailable("searching tonearm_x_audio (Milvus at http://127.0.0.1:1): deadline exceeded")

    def search_text(self, queries: np.ndarray, k: int, *, languages=None):
        raise IndexUnavailable("searching tonearm_x_text (Milvus at http://127.0.0.1:1): deadline exceeded")


@pytest.mark.parametrize("call", ["text", "audio", "consistency"])
def test_the_searcher_maps_an_unreachable_index_to_503_with_retry_after(call, tmp_path):
    from tests.service.fakes import tone

    searcher = Searcher(DownIndex(tmp_path), cache=LocalCache(max_entries=0, ttl_seconds=60, metrics=ServiceMetrics()), key_prefix="t", max_query_chars=200)
    with pytest.raises(ServiceError) as caught:
        if call == "text":
            searcher.search_text(["a dog"], k=3)
        elif call == "audio":
            searcher.search_audio(tone(["dog"]), k=3)
        else:
            searcher.consistency({"eng": "a dog", "fra": "un chien"}, k=3)
    assert caught.value.slug == "index-unavailable" and caught.value.status == 503
    assert caught.value.extra["retry_after"] == INDEX_RETRY_AFTER_S and "deadline" in caught.value.detail


class SlowIndex(KeywordBundle):
    """The keyword bundle whose searches run past their deadline while Milvus answers others."""

    def search_audio(self, queries: np.ndarray, k: int):
        raise IndexTimeout("searching tonearm_x_audio (Milvus at http://127.0.0.1:1): gRPC DEADLINE_EXCEEDED; "
                           "Milvus answers other calls")

    def search_text(self, queries: np.ndarray, k: int, *, languages=None):
        raise IndexTimeout("searching tonearm_x_text (Milvus at http://127.0.0.1:1): gRPC DEADLINE_EXCEEDED; "
                           "Milvus answers other calls")


@pytest.mark.parametrize("call", ["text", "audio"])
def test_the_searcher_maps_one_slow_index_call_to_504_index_timeout(call, tmp_path):
    """Slow is not dead: only this request fails, as 504 `index-timeout` (not the outage's 503)."""
    from tests.service.fakes import tone

    searcher = Searcher(SlowIndex(tmp_path), cache=LocalCache(max_entries=0, ttl_seconds=60, metrics=ServiceMetrics()),
                        key_prefix="t", max_query_chars=200)
    with pytest.raises(ServiceError) as caught:
        if call == "text":
            searcher.search_text(["a dog"], k=3)
        else:
            searcher.search_audio(tone(["dog"]), k=3)
    assert caught.value.slug == "index-timeout" and caught.value.status == 504
    assert caught.value.extra["retry_after"] == INDEX_RETRY_AFTER_S
