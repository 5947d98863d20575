"""The real Milvus server at the demo's size (issue 33): publishing a 120,000-caption bundle through the
CLI, serving it (top-10 = FAISS exact search), and a slow call told from a dead server.

The publish used to fail every time: its recall@10 check searched through the serving path (2-s
deadline), the FLAT search of 120 k vectors ran past it, and the backend then marked Milvus down for
everyone. Now the check is bulk work (batched, bulk deadline, outside the circuit), and only a server
that does not answer a cheap probe either opens the circuit; a call that is merely slow fails alone.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.milvus_server import require_milvus

require_milvus()

from index.bundle.format import read_manifest  # noqa: E402
from index.engines import milvus_index  # noqa: E402
from index.engines.milvus_index import (  # noqa: E402
    MilvusTarget,
    MilvusVectorIndex,
    active_bundle,
    published_info,
    set_active,
)
from index.errors import IndexTimeout, IndexUnavailable, TonearmError  # noqa: E402
from index.runtime.loader import LoadedBundle  # noqa: E402
from tests.large_bundle import N_TEXT, unit_vectors  # noqa: E402

pytestmark = pytest.mark.timeout(600)

SLOW_QUERIES = 2048
SERVING_DEADLINE_S = 0.5
"""Far below what one FLAT search of the whole 256-query recall sample over 120 k vectors takes here."""


@pytest.fixture(autouse=True)
def _no_hold_off():
    yield
    milvus_index._DOWN.clear()
    milvus_index._RECOVERED.clear()


@pytest.fixture(scope="module")
def large_published(milvus_server, large_bundle: Path):
    """``large_bundle`` published once by `tonearm bundle publish`, with the serving deadline set the
    way ops set it (TONEARM_MILVUS_TIMEOUT_S, which the CLI now reads)."""
    from tonearm.cli import main as tonearm_main

    # Earlier modules' tests leave other (unreachable) URIs in the hold-off table; only this
    # server's entry matters here, and it must start clear.
    milvus_index._DOWN.clear()
    milvus_index._RECOVERED.clear()
    with pytest.MonkeyPatch.context() as env:
        # the service default (2 s): the deadline under which the demo publish failed every time
        env.setenv("TONEARM_MILVUS_TIMEOUT_S", "2.0")
        started = time.monotonic()
        assert tonearm_main(["bundle", "publish", str(large_bundle), "--milvus-uri", milvus_server.uri]) == 0
        seconds = time.monotonic() - started
    marked = [key for key in milvus_index._DOWN if key[0] == milvus_server.uri]
    assert not marked, f"the publish marked Milvus down: {milvus_index._DOWN}"
    target = MilvusTarget(uri=milvus_server.uri)
    yield target, seconds
    bundle_id = read_manifest(large_bundle).bundle_id
    for kind in milvus_index.KINDS:  # the session's server keeps running: free its memory
        try:
            target.client().drop_collection(target.collection(bundle_id, kind))
        except Exception:  # noqa: BLE001 - best effort
            pass


def test_a_demo_size_bundle_publishes_with_its_recall_checked_as_bulk_work(large_published, large_bundle):
    target, seconds = large_published
    info = published_info(target, read_manifest(large_bundle).bundle_id)
    assert info is not None and info["n_text"] == N_TEXT and info["n_audio"] == 3000
    assert info["index_type"] == "FLAT"
    assert info["recall_at_10"]["text"] >= 0.99 and info["recall_at_10"]["audio"] >= 0.99, info  # exact: ~1.0
    print(f"published {N_TEXT} captions in {seconds:.1f} s")


def _same_top(milvus: tuple[np.ndarray, np.ndarray], faiss: tuple[np.ndarray, np.ndarray]) -> None:
    """Top-10 rows equal to exact search's, but where two scores tie within float rounding."""
    (m_scores, m_rows), (f_scores, f_rows) = milvus, faiss
    np.testing.assert_allclose(m_scores, f_scores, atol=1e-4)
    for q in range(len(m_rows)):
        if not np.array_equal(m_rows[q], f_rows[q]):
            differ = np.flatnonzero(m_rows[q] != f_rows[q])
            gaps = np.abs(np.diff(f_scores[q]))
            assert all(gaps[max(0, j - 1) : j + 1].min() < 1e-5 for j in differ), (q, m_rows[q], f_rows[q])


def test_a_demo_size_bundle_serves_audio_to_text_and_text_to_audio_like_faiss(large_published, large_bundle,
                                                                                  tiny_bundle):
    target, _ = large_published
    on_milvus = LoadedBundle.open(large_bundle, milvus=target, verify=False)
    on_faiss = LoadedBundle.open(large_bundle, verify=False)
    try:
        texts = ["a dog barks in the distance", "un chien aboie", "ein Hund bellt", "rain on a tin roof",
                 "лает собака", "犬が吠える", "la pluie tombe", "a car passes by"]
        text_q = on_milvus.encode_text(texts)
        _same_top(on_milvus.search_audio(text_q, 10), on_faiss.search_audio(text_q, 10))  # text → audio
        clips = on_milvus.eval_set().waveforms[:8]
        audio_q = np.concatenate([on_milvus.encode_audio(clips), unit_vectors(24, on_milvus.embed_dim, 7)])
        _same_top(on_milvus.search_text(audio_q, 10), on_faiss.search_text(audio_q, 10))  # audio → text
        for languages in ([on_milvus.languages[0]], on_milvus.languages[1:3]):
            _same_top(on_milvus.search_text(audio_q, 10, languages=languages),
                      on_faiss.search_text(audio_q, 10, languages=languages))
        assert not milvus_index._DOWN
    finally:
        on_milvus.close()
        on_faiss.close()


def test_a_demo_size_bundle_activates_and_rolls_back_on_the_server(large_published, large_bundle, tiny_bundle):
    from index.engines.milvus_index import publish

    target, _ = large_published
    large_id, tiny_id = read_manifest(large_bundle).bundle_id, read_manifest(tiny_bundle).bundle_id
    publish(tiny_bundle, target)  # False when another test published it already
    set_active(target, tiny_id)
    assert set_active(target, large_id) is True and active_bundle(target) == large_id
    assert set_active(target, tiny_id) is True and active_bundle(target) == tiny_id  # the rollback


def test_a_slow_search_fails_alone_while_fast_ones_keep_succeeding(large_published, large_bundle):
    """One search past its deadline (2,048 queries over 120 k FLAT vectors under a 20-ms deadline: the
    server is still working when it passes) among fast ones (one query, k = 10, 1-s deadline) from four
    threads, all through one client and one circuit: the slow one is an IndexTimeout (504
    `index-timeout` in the service), every fast one succeeds, and Milvus is never marked down."""
    base, _ = large_published
    target = MilvusTarget(uri=base.uri, timeout_s=1.0)
    manifest = read_manifest(large_bundle)
    name = target.collection(manifest.bundle_id, "text")
    target.call("load_collection", name, bulk=True)
    index = MilvusVectorIndex(target, name, ntotal=N_TEXT, dim=manifest.embed_dim)
    queries = unit_vectors(SLOW_QUERIES, manifest.embed_dim, 3)
    stop, failures, successes = threading.Event(), [], []

    def fast(worker: int) -> None:
        i = 0
        while not stop.is_set():
            try:
                scores, rows = index.search(queries[(worker * 7 + i) % 64 :][:1], 10)
                assert rows.shape == (1, 10) and (rows >= 0).all()
                successes.append(worker)
            except Exception as err:  # noqa: BLE001 - recorded, asserted below
                failures.append(repr(err))
            i += 1

    threads = [threading.Thread(target=fast, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.5)
        before = len(successes)
        started = time.monotonic()
        slow = MilvusVectorIndex(dataclasses.replace(target, timeout_s=0.02), name, ntotal=N_TEXT,
                                 dim=manifest.embed_dim)
        with pytest.raises(IndexTimeout, match="answers other calls"):
            slow.search(queries, 10)
        slow_s = time.monotonic() - started
        time.sleep(1.0)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not failures, failures[:3]
    assert len(successes) > before, "no fast search finished while the slow one ran"
    assert slow_s < target.timeout_s + target.probe_attempts * target.probe_timeout_s + 3.0
    assert not milvus_index._DOWN, "a slow call opened the circuit"


def test_a_frozen_server_is_unreachable_once_its_probes_fail_too(large_published, milvus_server):
    """SIGSTOP: connections open, nothing answers — the call misses its deadline and so does every
    probe, so the circuit opens: 503 `index-unavailable` for everyone, the next call fails at once.
    After SIGCONT the first call past the hold-off closes it again — also when Milvus answers that
    trial with an error (an alias not found: `active_bundle` reads it as "none"), which used to leave
    the circuit open for good."""
    base, _ = large_published
    target = MilvusTarget(uri=base.uri, timeout_s=1.0, hold_off_s=1.0)
    assert milvus_server.pid is not None
    os.kill(milvus_server.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(IndexUnavailable) as raised:
            active_bundle(target)
        took = time.monotonic() - started
        assert not isinstance(raised.value, IndexTimeout), raised.value
        assert took < target.timeout_s + target.probe_attempts * target.probe_timeout_s + 2.0, took
        started = time.monotonic()
        with pytest.raises(IndexUnavailable, match="not answering"):
            active_bundle(target)
        assert time.monotonic() - started < 0.2  # the circuit is open: no second deadline
    finally:
        os.kill(milvus_server.pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while True:  # once it answers again (after the hold-off, one call tries), calls succeed
        try:
            active_bundle(target)
            break
        except IndexUnavailable as err:
            assert time.monotonic() < deadline, f"Milvus never answered again after SIGCONT: {err}"
            time.sleep(0.5)


def test_the_cli_reads_the_milvus_deadlines_from_the_service_settings(monkeypatch):
    from index.engines.milvus_index import ENV, target_from_args
    from service.settings import Settings

    for option, name in ENV.items():  # the service has the same settings under the same names
        assert name == "TONEARM_" + f"milvus_{option}".upper()
        assert Settings.model_fields[f"milvus_{option}"].default == getattr(MilvusTarget, option), option
    monkeypatch.setenv("TONEARM_MILVUS_TIMEOUT_S", "3.5")
    monkeypatch.setenv("TONEARM_MILVUS_BULK_TIMEOUT_S", "600")
    monkeypatch.setenv("TONEARM_MILVUS_PROBE_ATTEMPTS", "3")
    target = target_from_args("http://127.0.0.1:1", None)
    assert (target.timeout_s, target.bulk_timeout_s, target.probe_attempts) == (3.5, 600.0, 3)
    monkeypatch.setenv("TONEARM_MILVUS_PROBE_TIMEOUT_S", "-1")
    with pytest.raises(TonearmError, match="TONEARM_MILVUS_PROBE_TIMEOUT_S"):
        target_from_args("http://127.0.0.1:1", None)
