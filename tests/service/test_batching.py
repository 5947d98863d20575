"""Micro-batching: what is waiting is taken together, never waiting to fill; order, per-request errors,
cancelled requests skipped, bounded queue → 503 + Retry-After; results identical to unbatched search."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from service.app import create_app
from service.batching import BatchMetrics, MicroBatcher
from service.cache import LocalCache
from service.errors import ServiceError
from service.metrics import ServiceMetrics
from service.searcher import AudioQuery, Searcher
from tests.service.conftest import make_settings, wait_until
from tests.service.fakes import KeywordBundle
from tests.service.test_routes import assert_problem


class HeldSquares:
    """A batch function (squares) whose next call can be held open; records every batch it ran."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()

    def hold(self) -> None:
        self.release.clear()
        self.entered.clear()

    def __call__(self, items: Sequence[int]) -> list[int]:
        self.batches.append(list(items))
        self.entered.set()
        assert self.release.wait(30)
        if any(i < 0 for i in items):
            raise ValueError(f"negative item in {list(items)}")
        return [i * i for i in items]


def batcher(fn: HeldSquares, **overrides) -> MicroBatcher[int, int]:
    options = {"max_batch": 8, "max_queue": 64, "workers": 1, "metrics": BatchMetrics(CollectorRegistry())}
    options.update(overrides)
    return MicroBatcher("test", fn, **options)  # type: ignore[arg-type]


async def _queued(b: MicroBatcher, count: int) -> None:
    while b._waiting < count:  # noqa: SLF001 - the queue depth the metrics gauge also reports
        await asyncio.sleep(0.001)


def test_a_lone_request_is_not_held_back_and_waiting_ones_share_the_next_batch():
    fn = HeldSquares()
    b = batcher(fn)

    async def scenario():
        assert await b.submit(3) == 9  # alone: a batch of one, no wait for others
        fn.hold()
        first = asyncio.ensure_future(b.submit(1))
        await asyncio.to_thread(fn.entered.wait, 10)
        rest = [asyncio.ensure_future(b.submit(i)) for i in range(2, 12)]
        await _queued(b, 10)
        fn.release.set()
        return await first, await asyncio.gather(*rest)

    try:
        first, rest = asyncio.run(scenario())
    finally:
        b.close()
    assert first == 1 and rest == [i * i for i in range(2, 12)]  # each request got its own result, in order
    assert fn.batches == [[3], [1], list(range(2, 10)), [10, 11]]  # what waited, up to max_batch 8


def test_with_two_workers_each_takes_at_most_half_of_what_waits():
    """One worker taking the whole queue leaves the other idle and makes the big batch's requests
    wait for its last item (p99 doubled on the demo bundle); each take is at most its share."""
    fn = HeldSquares()
    b = batcher(fn, workers=2, max_batch=16)

    async def scenario():
        fn.hold()
        busy = [asyncio.ensure_future(b.submit(i)) for i in (100, 101)]
        deadline = asyncio.get_running_loop().time() + 10
        while len(fn.batches) < 2 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.001)
        if fn.batches != [[100], [101]]:  # one worker took both: the other stays idle
            fn.release.set()
            return fn.batches, None
        rest = [asyncio.ensure_future(b.submit(i)) for i in range(12)]
        await _queued(b, 12)
        fn.release.set()
        return await asyncio.gather(*busy), await asyncio.gather(*rest)

    try:
        busy, rest = asyncio.run(scenario())
    finally:
        b.close()
    assert rest is not None, f"both workers should hold a batch of one, got {busy}"
    assert busy == [10000, 10201] and rest == [i * i for i in range(12)]
    later = fn.batches[2:]
    assert sorted(i for batch in later for i in batch) == list(range(12))
    assert max(len(batch) for batch in later) <= 6, later  # 12 waiting, 2 workers


def test_sizes_count_toward_the_batch_limit():
    fn = HeldSquares()
    b = batcher(fn, max_batch=4)

    async def scenario():
        fn.hold()
        first = asyncio.ensure_future(b.submit(0))
        await asyncio.to_thread(fn.entered.wait, 10)
        jobs = [asyncio.ensure_future(b.submit(i, size=3)) for i in (1, 2)]
        await _queued(b, 6)
        fn.release.set()
        await asyncio.gather(first, *jobs)

    try:
        asyncio.run(scenario())
    finally:
        b.close()
    assert fn.batches == [[0], [1], [2]]  # 3 + 3 > 4: the second waits for the next batch


def test_a_failing_request_fails_alone():
    fn = HeldSquares()
    b = batcher(fn)

    async def scenario():
        fn.hold()
        first = asyncio.ensure_future(b.submit(1))
        await asyncio.to_thread(fn.entered.wait, 10)
        jobs = [asyncio.ensure_future(b.submit(i)) for i in (2, -3, 4)]
        await _queued(b, 3)
        fn.release.set()
        return await first, await asyncio.gather(*jobs, return_exceptions=True)

    try:
        first, (two, bad, four) = asyncio.run(scenario())
    finally:
        b.close()
    assert (first, two, four) == (1, 4, 16)
    assert isinstance(bad, ValueError) and "-3" in str(bad)
    assert fn.batches[1] == [2, -3, 4] and [-3] in fn.batches[2:]  # the failed batch was retried one by one


def test_a_cancelled_request_is_skipped_and_leaves_the_others_intact():
    fn = HeldSquares()
    metrics = BatchMetrics(CollectorRegistry())
    b = batcher(fn, metrics=metrics)

    async def scenario():
        fn.hold()
        first = asyncio.ensure_future(b.submit(1))
        await asyncio.to_thread(fn.entered.wait, 10)
        keep_a, gone, keep_b = (asyncio.ensure_future(b.submit(i)) for i in (2, 5, 3))
        await _queued(b, 3)
        gone.cancel()  # what a client disconnect does to its request
        await asyncio.sleep(0)
        fn.release.set()
        return await first, await keep_a, await keep_b, gone

    try:
        first, a, c, gone = asyncio.run(scenario())
    finally:
        b.close()
    assert (first, a, c) == (1, 4, 9) and gone.cancelled()
    assert fn.batches == [[1], [2, 3]]  # 5 was never computed
    assert metrics.skipped.labels(encoder="test")._value.get() == 1  # noqa: SLF001


def test_a_full_queue_refuses_at_once():
    fn = HeldSquares()
    b = batcher(fn, max_queue=2)

    async def scenario():
        fn.hold()
        first = asyncio.ensure_future(b.submit(1))
        await asyncio.to_thread(fn.entered.wait, 10)
        queued = [asyncio.ensure_future(b.submit(i)) for i in (2, 3)]
        await _queued(b, 2)
        with pytest.raises(ServiceError) as refused:
            await b.submit(4)
        fn.release.set()
        await asyncio.gather(first, *queued)
        return refused.value

    try:
        refused = asyncio.run(scenario())
    finally:
        b.close()
    assert refused.slug == "overloaded" and refused.status == 503 and refused.extra["retry_after"] >= 1
    assert [4] not in fn.batches


# ------------------------------------------------------------------ searcher: batched == unbatched


def test_batched_text_and_audio_search_equal_one_by_one_on_a_real_bundle(tiny_bundle):
    from index.runtime.loader import LoadedBundle

    bundle = LoadedBundle.open(tiny_bundle)

    def searcher() -> Searcher:  # a fresh cache each time: nothing is answered from a previous call
        return Searcher(bundle, cache=LocalCache(max_entries=0, ttl_seconds=60, metrics=ServiceMetrics()), key_prefix="t", max_query_chars=500)

    queries = [["a dog barks"], ["un chien aboie", "rain on a roof"], ["a dog barks", "犬が吠える"], ["bells"]]
    ks = [5, 10, 5, 3]
    one = searcher()
    alone = [one.complete_text(one.lookup_text(q, lang=None, k=k)) for q, k in zip(queries, ks, strict=True)]
    many = searcher()
    together = many.complete_text_batch([many.lookup_text(q, lang=None, k=k) for q, k in zip(queries, ks, strict=True)])
    assert len(together) == len(alone)
    for request_alone, request_together in zip(alone, together, strict=True):
        for (s1, r1), (s2, r2) in zip(request_alone, request_together, strict=True):
            np.testing.assert_array_equal(r1, r2)
            np.testing.assert_allclose(s1, s2, atol=1e-5)

    waves = bundle.eval_set().waveforms[:3]
    audio = [AudioQuery(waves[0], (), 5), AudioQuery(waves[1], (bundle.languages[0],), 5), AudioQuery(waves[2], (), 3)]
    by_one = [searcher().search_audio(q.waveform, languages=q.languages, k=q.k) for q in audio]
    assert [[(h.clip_id, h.text) for h in hits] for hits in searcher().search_audio_batch(audio)] == [
        [(h.clip_id, h.text) for h in hits] for hits in by_one
    ]
    assert all(h.lang == bundle.languages[0] for h in by_one[1])


# ------------------------------------------------------------------ over HTTP (uvicorn)


class HeldKeywordBundle(KeywordBundle):
    """The keyword bundle whose text encoder can be held, logging what it encoded."""

    def __init__(self, path: Path, **kwargs) -> None:
        self.release = threading.Event()
        self.release.set()
        self.holding = threading.Event()
        self.encoded: list[str] = []
        self.lock = threading.Lock()
        super().__init__(path, **kwargs)

    def encode_text(self, texts):
        if texts and texts[0].startswith("hold"):
            self.holding.set()
            assert self.release.wait(30)
        with self.lock:
            self.encoded.extend(texts)
        return super().encode_text(texts)


def _depth(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith('tonearm_batch_queue_depth{encoder="text"}'):
            return float(line.split()[-1])
    return 0.0


def test_backpressure_and_disconnects_over_http(fake_bundles, uvicorn_runner):
    bundles: dict[str, HeldKeywordBundle] = {}

    def opener(path: Path) -> HeldKeywordBundle:
        bundles[path.name] = HeldKeywordBundle(path, bundle_id=path.name)
        return bundles[path.name]

    settings = make_settings(bundles_dir=fake_bundles, bundle="fake-a", batch_max_queue=2, batch_workers=1)
    with uvicorn_runner(create_app(settings, opener=opener)) as server:
        server.wait_ready()
        bundle = bundles["fake-a"]
        bundle.release.clear()
        results: dict[str, httpx.Response | Exception] = {}

        def ask(query: str, timeout: float = 30) -> None:
            try:
                results[query] = httpx.post(server.url + "/v1/search/text", json={"query": query, "k": 2}, timeout=timeout)
            except httpx.HTTPError as err:
                results[query] = err

        threads = [threading.Thread(target=ask, args=("hold dog",))]
        threads[0].start()
        wait_until(bundle.holding.is_set, what="the first request to occupy the encoder")
        # the client of "gone siren" gives up while queued; "bell" waits
        threads += [threading.Thread(target=ask, args=("gone siren", 0.5)), threading.Thread(target=ask, args=("bell",))]
        for thread in threads[1:]:
            thread.start()
        wait_until(lambda: _depth(server.url) == 2, what="two queued requests")
        refused = httpx.post(server.url + "/v1/search/text", json={"query": "rain", "k": 2}, timeout=10)
        problem = assert_problem(refused, 503, "overloaded")
        assert refused.headers["retry-after"] == "1" and "queue is full" in problem["detail"]
        wait_until(lambda: "gone siren" in results, what="the impatient client to give up")
        # ...and for the server to have seen it go (its handler ends as a 499, after marking the queued
        # job): on a busy machine the event loop may see the disconnect only after the release below
        wait_until(lambda: 'status="499"' in httpx.get(server.url + "/metrics", timeout=5).text,
                   what="the server to see the client's disconnect")
        bundle.release.set()
        for thread in threads:
            thread.join(30)
        assert results["hold dog"].status_code == 200 and results["bell"].status_code == 200
        assert results["bell"].json()["hits"][0]["id"] == "clip-bell"
        assert isinstance(results["gone siren"], httpx.TimeoutException)
        assert "gone siren" not in bundle.encoded and "bell" in bundle.encoded  # the disconnect cost no encode
        metrics = httpx.get(server.url + "/metrics", timeout=5).text
        assert 'tonearm_batch_skipped_total{encoder="text"} 1.0' in metrics
        assert 'tonearm_batch_rejected_total{encoder="text"} 1.0' in metrics
        assert 'tonearm_batch_size_count{encoder="text"}' in metrics
        assert 'tonearm_batch_queue_seconds_count{encoder="text"}' in metrics
        assert results["hold dog"].json()["hits"][0]["id"] == "clip-dog"
