"""The Milvus backend on both real engines: the `milvus` package's standalone server and milvus-lite 3.x.

Each test names the defect it guards (issue 22): hits read from the entity, HNSW/IVF_FLAT
parameters and recall, one consistent activation across both aliases, alias errors by code,
strongly consistent registry reads, deterministic ties, errors mapped in the backend, release
of closed bundles, and no alias rewrite when nothing changes. Failures between two alias
switches are injected into the real client (a wrapper around its real method), not mocked.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from index.engines import milvus_index
from index.errors import BundleNotPublished, IndexBackendError, IndexUnavailable
from index.runtime.loader import LoadedBundle
from tests.milvus_server import ENGINES, free_ports, require_milvus

require_milvus()

from index.engines.milvus_index import (  # noqa: E402
    KINDS,
    MilvusTarget,
    MilvusVectorIndex,
    _index_params,
    _schema,
    active_bundle,
    alias_target,
    exact_top,
    publish,
    published_info,
    set_active,
)


def fresh(uri: str, **options) -> MilvusTarget:
    """A target with its own name prefix: tests share the session's server."""
    return MilvusTarget(uri=uri, prefix=f"t{uuid.uuid4().hex[:10]}", **options)


@pytest.fixture(autouse=True)
def _no_hold_off():
    """A test that injects an outage leaves no hold-off (1 s of failing at once) to the next one."""
    yield
    milvus_index._DOWN.clear()
    milvus_index._RECOVERED.clear()


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """URI of each engine in turn (module scope: publishes are shared by the tests below)."""
    if request.param == "server":
        return str(request.getfixturevalue("milvus_server").uri)
    return str(tmp_path_factory.mktemp("milvus-lite") / "tonearm.db")


@pytest.fixture(scope="module")
def published(engine: str, tiny_bundle: Path, other_bundle: Path) -> MilvusTarget:
    """Both bundles published (FLAT) once per engine."""
    target = fresh(engine)
    for bundle in (tiny_bundle, other_bundle):
        assert publish(bundle, target) is True
    return target


@pytest.fixture
def shared(published: MilvusTarget) -> MilvusTarget:
    """:func:`published` with no active aliases yet."""
    for kind in KINDS:
        try:
            published.client().drop_alias(published.alias(kind))
        except Exception:  # noqa: BLE001 - none to drop
            pass
    return published


@pytest.fixture(scope="module")
def other_bundle(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second bundle (another id, same vectors) to activate against the tiny one."""
    from tests.service.bundle_factory import collapsed_copy

    return collapsed_copy(tiny_bundle, tmp_path_factory.mktemp("other"), "other-" + tiny_bundle.name)


def tie_normalized(scores: np.ndarray, rows: np.ndarray, k: int) -> np.ndarray:
    """Rows ordered by (score rounded to 1e-5, row): the order both backends must agree on."""
    out = []
    for s, r in zip(scores, rows, strict=True):
        order = sorted(zip(np.round(s, 5).tolist(), r.tolist(), strict=True), key=lambda h: (-h[0], h[1]))
        out.append([row for _, row in order[:k]])
    return np.asarray(out)


def test_top10_equals_faiss_hits_read_from_the_entity(tiny_bundle, published):
    """milvus-lite 3.x keys hits by the primary field (``row``), not ``id``: every search failed."""
    target = published
    local = LoadedBundle.open(tiny_bundle)
    remote = LoadedBundle.open(tiny_bundle, milvus=target)
    try:
        queries = local.encode_text(["a dog barks", "un chien aboie", "犬が吠える", "rain on a roof", "bells"])
        fs, fr = local.search_audio(queries, 20)  # FAISS fetched past k, so a tie at the cut is seen whole
        ms, mr = remote.search_audio(queries, 10)
        np.testing.assert_array_equal(mr, tie_normalized(fs, fr, 10))
        np.testing.assert_allclose(ms, np.sort(fs, axis=1)[:, ::-1][:, :10], atol=1e-4)
        clips = local.encode_audio(local.eval_set().waveforms[:4])
        for languages in (None, ["fra"], ["jpn", "eng"]):
            fs, fr = local.search_text(clips, 20, languages=languages)
            ms, mr = remote.search_text(clips, 10, languages=languages)
            np.testing.assert_array_equal(mr, tie_normalized(fs, fr, 10))
            if languages:
                assert {local.text_items[r]["lang"] for r in mr.ravel()} <= set(languages)
        np.testing.assert_allclose(remote.audio_embeddings(), local.audio_embeddings(), atol=1e-6)
    finally:
        local.close()
        remote.close()


def test_filtered_search_on_milvus_gives_the_faiss_answers(tiny_bundle, published):
    """Metadata filters on the Milvus backend answer as FAISS does, and as numpy over the passing
    clips: evaluated by Milvus (``where``: publish wrote the clips' metadata and the registry its
    fields), and on our side without it (over-fetch when many clips pass, exact when few do)."""
    from index.engines.filters import MetadataTable, parse_filter

    local = LoadedBundle.open(tiny_bundle)
    remote = LoadedBundle.open(tiny_bundle, milvus=published)
    try:
        table = MetadataTable.from_items(local.audio_items)
        assert published_info(published, local.bundle_id)["meta_fields"] == {
            k: v for k, v in table.fields().items() if v != "mixed"}
        queries = local.encode_text(["a dog barks", "rain on a roof", "bells"])
        vectors = local.audio_embeddings()
        selective = {"id": local.audio_items[7]["id"]}
        half = {"id": {"in": [item["id"] for item in local.audio_items[::2]]}}
        for flt in ({"split": {"ne": "nothing"}}, half, selective):
            allowed = table.mask(parse_filter(flt))
            passing = np.flatnonzero(allowed)
            fs, fr = local.search_audio(queries, 10, allowed=allowed)
            for where in (None, parse_filter(flt)):
                ms, mr = remote.search_audio(queries, 10, allowed=allowed, where=where)
                np.testing.assert_allclose(ms, fs, atol=1e-4)
                for i in range(len(queries)):
                    ref = np.sort(vectors[passing] @ queries[i])[::-1][:10]
                    np.testing.assert_allclose(fs[i, : ref.size], ref, atol=1e-5)
                    assert set(mr[i, : ref.size]) <= set(passing.tolist()) and (mr[i, ref.size:] == -1).all()
            ms, mr = remote.search_audio(queries, 10, where=parse_filter(flt))  # Milvus alone, no mask
            np.testing.assert_allclose(ms, fs, atol=1e-4)
        clips = local.encode_audio(local.eval_set().waveforms[:2])
        allowed = table.mask(parse_filter(selective))
        fs, fr = local.search_text(clips, 5, languages=["fra"], allowed_clips=allowed)
        ms, mr = remote.search_text(clips, 5, languages=["fra"], allowed_clips=allowed)
        np.testing.assert_array_equal(mr, fr)
        ms, mr = remote.search_text(clips, 5, languages=["fra"], allowed_clips=allowed, where=parse_filter(selective))
        np.testing.assert_array_equal(mr, fr)
        assert {local.text_items[r]["clip_row"] for r in fr[fr >= 0]} == {7}
        assert {local.text_items[r]["lang"] for r in fr[fr >= 0]} == {"fra"}
    finally:
        local.close()
        remote.close()


@pytest.mark.parametrize("index_type", ["HNSW", "IVF_FLAT"])
def test_ann_collections_publish_with_parameters_and_record_recall(tiny_bundle, engine, index_type):
    """HNSW and IVF_FLAT could not be published (no build parameters) nor searched with ef/nprobe."""
    target = fresh(engine)
    assert publish(tiny_bundle, target, index_type=index_type) is True
    info = published_info(target, tiny_bundle.name)
    assert info is not None and info["index_type"] == index_type
    assert set(info["build_params"]["audio"]) == ({"M", "efConstruction"} if index_type == "HNSW" else {"nlist"})
    assert set(info["recall_at_10"]) == {"audio", "text"}
    assert all(0.9 <= r <= 1.0 for r in info["recall_at_10"].values()), info["recall_at_10"]
    remote = LoadedBundle.open(tiny_bundle, milvus=target, verify=False)
    try:
        scores, rows = remote.search_audio(remote.encode_text(["a dog barks"]), 5)
        assert (rows >= 0).all() and np.all(np.diff(scores[0]) <= 1e-6)
    finally:
        remote.close()


def test_index_only_bundles_publish_and_serve_text_to_audio(tiny_bundle, engine, tmp_path):
    """`tonearm index` bundles (no captions) were refused by `bundle publish`; now: an audio
    collection, an empty caption one (the aliases name both), recall measured with clips as queries."""
    import soundfile as sf

    from index.bundle.format import read_manifest
    from index.catalogue.own_audio import index_folder
    from index.runtime.loader import NoCaptionIndex

    rate = read_manifest(tiny_bundle).sample_rate
    rng = np.random.default_rng(3)
    (tmp_path / "sounds").mkdir()
    for i in range(12):
        sf.write(tmp_path / "sounds" / f"c{i:02d}.wav", rng.uniform(-0.5, 0.5, rate // 2 + 700 * i).astype(np.float32), rate)
    built = index_folder(tmp_path / "sounds", tiny_bundle, tmp_path / f"own-{uuid.uuid4().hex[:6]}").path
    target = fresh(engine)
    assert publish(built, target, index_type="HNSW") is True
    info = published_info(target, built.name)
    assert info is not None and (info["n_audio"], info["n_text"]) == (12, 0) and info["recall_at_10"]["audio"] >= 0.9
    local, remote = LoadedBundle.open(built), LoadedBundle.open(built, milvus=target)
    try:
        queries = local.encode_text(["noise", "a hiss"])
        np.testing.assert_array_equal(remote.search_audio(queries, 5)[1], local.search_audio(queries, 5)[1])
        with pytest.raises(NoCaptionIndex):
            remote.search_text(local.audio_embeddings()[:1], 3)
        remote.mark_active()
        assert active_bundle(target) == built.name
    finally:
        local.close()
        remote.close()


def test_publish_then_read_back_at_once(tiny_bundle, engine):
    """Bounded-consistency registry reads hid a fresh publish for 0.2–0.4 s: republish recreated it."""
    target = fresh(engine)
    assert publish(tiny_bundle, target) is True
    assert publish(tiny_bundle, target) is False
    set_active(target, tiny_bundle.name)
    assert active_bundle(target) == tiny_bundle.name


def test_ties_are_ordered_by_score_then_row_and_cut_deterministically(engine):
    """Milvus orders tied hits differently from call to call; the backend sorts (score, row)."""
    target = fresh(engine)
    name = f"{target.prefix}_ties"
    client = target.client()
    client.create_collection(name, schema=_schema(4, text=False), index_params=_index_params(client, "FLAT", {}))
    groups = np.repeat(np.eye(4, dtype=np.float32), 12, axis=0)  # 4 groups of 12 identical vectors
    order = np.random.default_rng(0).permutation(len(groups))
    client.insert(name, [{"row": int(r), "vector": groups[r].tolist()} for r in order])
    client.flush(name)
    client.load_collection(name)
    index = MilvusVectorIndex(target, name, ntotal=len(groups), dim=4)
    query = np.array([[1.0, 0.5, 0.0, 0.0]], dtype=np.float32)
    expected = exact_top(groups, query, 15)
    for _ in range(5):
        scores, rows = index.search(query, 15)
        np.testing.assert_array_equal(rows, expected)  # 12 of group 0, then rows 12, 13, 14 of group 1
    assert rows[0].tolist() == list(range(15))


def test_activation_switches_both_aliases_or_neither(tiny_bundle, other_bundle, shared, monkeypatch):
    """A failure between the audio and the text switch left audio on the new bundle, text on the old."""
    target = shared
    a, b = tiny_bundle.name, other_bundle.name
    assert set_active(target, a) is True
    client = target.client()
    real_alter = client.alter_alias

    def failing_on_text(*args, **kwargs):
        if kwargs.get("alias") == target.alias("text") and kwargs.get("collection_name") == target.collection(b, "text"):
            raise ConnectionError("injected: Milvus went away between the two alias switches")
        return real_alter(*args, **kwargs)

    monkeypatch.setattr(client, "alter_alias", failing_on_text)
    with pytest.raises(IndexBackendError, match="injected"):
        set_active(target, b)
    assert alias_target(target, "audio") == target.collection(a, "audio")  # undone
    assert alias_target(target, "text") == target.collection(a, "text")
    assert active_bundle(target) == a
    monkeypatch.setattr(client, "alter_alias", real_alter)
    assert set_active(target, b) is True and active_bundle(target) == b


def test_a_transient_alias_error_is_not_taken_for_no_alias_yet(tiny_bundle, other_bundle, shared, monkeypatch):
    """Any alter_alias failure used to mean "create it": a transient one then read "alias exists"."""
    target = shared
    set_active(target, tiny_bundle.name)
    client = target.client()
    created: list[str] = []
    real_create = client.create_alias

    def unavailable(*args, **kwargs):
        import grpc

        class Unavailable(grpc.RpcError):
            def code(self):
                return grpc.StatusCode.UNAVAILABLE

        raise Unavailable()

    def counting_create(*args, **kwargs):
        created.append(kwargs.get("alias", ""))
        return real_create(*args, **kwargs)

    monkeypatch.setattr(client, "alter_alias", unavailable)
    monkeypatch.setattr(client, "create_alias", counting_create)
    with pytest.raises(IndexUnavailable):
        set_active(target, other_bundle.name)
    milvus_index._DOWN.clear()  # the injected outage held this Milvus off for 1 s
    assert created == [] and active_bundle(target) == tiny_bundle.name


def test_concurrent_first_activations_both_succeed_and_agree(tiny_bundle, other_bundle, shared):
    """Two first activations of different bundles raced: one failed with "alias already exist"."""
    target = shared
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def activate(bundle_id: str) -> None:
        barrier.wait()
        try:
            set_active(target, bundle_id)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=activate, args=(b,)) for b in (tiny_bundle.name, other_bundle.name)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert active_bundle(target) in {tiny_bundle.name, other_bundle.name}  # both aliases name one bundle


def test_setting_the_active_bundle_again_rewrites_nothing(tiny_bundle, shared, monkeypatch):
    """Each follower rewrote both aliases on every activation."""
    target = shared
    assert set_active(target, tiny_bundle.name) is True
    client = target.client()
    writes: list[str] = []
    for method in ("alter_alias", "create_alias", "drop_alias"):
        monkeypatch.setattr(client, method, lambda *a, _m=method, **k: writes.append(_m))
    assert set_active(target, tiny_bundle.name) is False
    assert writes == []


def test_closed_bundles_are_released_unless_configured_to_stay(tiny_bundle, other_bundle, shared):
    """Every bundle ever published stayed in Milvus memory."""
    target = shared
    keep = MilvusTarget(uri=target.uri, prefix=target.prefix, release_closed=False)
    client = target.client()

    def loaded(bundle_id: str, kind: str = "audio") -> bool:
        return "NotLoad" not in str(client.get_load_state(target.collection(bundle_id, kind))["state"])

    first = LoadedBundle.open(tiny_bundle, milvus=target, verify=False)
    second = LoadedBundle.open(other_bundle, milvus=keep, verify=False)
    assert loaded(tiny_bundle.name) and loaded(other_bundle.name)
    second.close()  # release_closed=False: stays loaded
    assert loaded(other_bundle.name)
    first.close()
    assert not loaded(tiny_bundle.name) and not loaded(tiny_bundle.name, "text")


def test_unreachable_milvus_is_index_unavailable_within_the_deadline(tiny_bundle):
    """active_bundle() answered "none" when Milvus was unreachable; calls retried for minutes."""
    (port,) = free_ports(1)  # nothing listens there
    target = MilvusTarget(uri=f"http://127.0.0.1:{port}", timeout_s=1.0)
    for call in (lambda: active_bundle(target), lambda: set_active(target, "x"),
                 lambda: LoadedBundle.open(tiny_bundle, milvus=target, verify=False)):
        started = time.monotonic()
        with pytest.raises(IndexUnavailable):
            call()
        assert time.monotonic() - started < 5 * target.timeout_s  # not 75 pymilvus retries


def test_an_unpublished_bundle_says_how_to_publish(tiny_bundle, engine):
    with pytest.raises(BundleNotPublished, match="tonearm bundle publish"):
        LoadedBundle.open(tiny_bundle, milvus=fresh(engine), verify=False)


def test_a_call_past_its_deadline_on_a_collection_not_loaded_is_unavailable_not_slow(milvus_server):
    """After a restart Milvus answers the probe at once but reloads its collections; a search on one
    still loading waits out its deadline and was answered 504 `index-timeout` ("this one was slow")
    in the outage test. Now a missed deadline, an answered probe and a collection that is not
    `Loaded` is IndexUnavailable (503, retry) naming the collection; a loaded one stays IndexTimeout.

    The verdict (`_not_loaded`) is read from the real server in both states. The call itself runs
    under a 1-ms deadline, which a local server may still meet (CI once answered a query on a loaded,
    empty collection in time): so on the loaded collection it must succeed or be IndexTimeout, and on
    the released one it must be IndexUnavailable whichever way Milvus refuses it — never 504."""
    from index.errors import IndexTimeout

    target = fresh(milvus_server.uri)
    name = f"{target.prefix}_loading"
    query = ("query", (name,), {"filter": "row >= 0", "output_fields": ["row"]})
    target.call("create_collection", name, schema=_schema(4, text=False),
                index_params=_index_params(target.client(), "FLAT", {}), bulk=True)
    try:
        target.call("release_collection", name, bulk=True)
        assert target._not_loaded(*query) == f"collection {name} is NotLoad"
        assert target._not_loaded("insert", (name,), {}) is None, "only searches and queries are judged"
        hurried = fresh(milvus_server.uri, timeout_s=0.001)
        with pytest.raises(IndexUnavailable) as raised:
            with milvus_index._mapped("querying", hurried):
                hurried.call(query[0], *query[1], **query[2])
        assert not isinstance(raised.value, IndexTimeout), raised.value
        assert not milvus_index._DOWN, "Milvus answered: the circuit stays closed"
        target.call("load_collection", name, bulk=True)
        assert target._not_loaded(*query) is None, "a loaded collection: the call was slow"
        try:
            with milvus_index._mapped("querying", hurried):
                hurried.call(query[0], *query[1], **query[2])
        except IndexTimeout as slow:
            assert "answers other calls" in str(slow)

        # Just back from an outage (the circuit was open, its hold-off over: the next serving call is
        # the trial, and it answers): for RECOVERY_GRACE_S a missed deadline is 503 even on a collection
        # reading Loaded — a restarted Milvus's query nodes recover after the state says Loaded.
        key = (target.uri, target.token)
        milvus_index._DOWN[key] = (time.monotonic() - 1.0, "an outage")
        target.call(query[0], *query[1], **query[2])
        assert key not in milvus_index._DOWN and key in milvus_index._RECOVERED
        assert "came back from an outage 0 s ago" in (milvus_index._recovering(key, trial=False) or "")
        assert "answering again after an outage" in (milvus_index._recovering(key, trial=True) or "")
        try:
            with milvus_index._mapped("querying", hurried):
                hurried.call(query[0], *query[1], **query[2])
        except IndexUnavailable as recovering:
            assert not isinstance(recovering, IndexTimeout) and "came back from an outage" in str(recovering)
        milvus_index._RECOVERED[key] -= milvus_index.RECOVERY_GRACE_S + 1
        assert milvus_index._recovering(key, trial=False) is None, "past the grace: a slow call is slow again"
    finally:
        target.call("drop_collection", name, bulk=True)
