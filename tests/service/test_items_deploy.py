"""Items where a deployment breaks them (issue 47): an item log a replica cannot write (not ready,
never serving without the takedowns), replicas on private logs sharing one Redis (no cache entry
crosses catalogues), records that cannot be embedded (quarantined: the replica stays ready and a
bundle activation succeeds), corrupt log lines, and the swap's final catch-up.

Everything is real except the bundle (the keyword bundle of tests/service/fakes.py): the item log on
disk, a read-only tmpfs mount (root) or a 0555 directory (not root), the session's redis-server.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

from index.items.log import AUDIO_DIR, LOG_NAME, ItemLog
from tests.service.conftest import ADMIN, fake_opener, make_settings, running_client, wait_until
from tests.service.fakes import KeywordBundle, tone, wav_bytes
from tests.service.test_routes import assert_problem


def _post(client, item_id, concepts, seconds=1.0, metadata=None):
    return client.post("/v1/items", headers=ADMIN, data={"id": item_id, "metadata": json.dumps(metadata or {})},
                       files={"file": ("x.wav", wav_bytes(tone(concepts, seconds)), "audio/wav")})


def _hits(client, query, k=10):
    r = client.post("/v1/search/text", json={"query": query, "k": k})
    assert r.status_code == 200, r.text
    return {h["id"]: h["score"] for h in r.json()["hits"]}


def _ids(client, query, k=10):
    return list(_hits(client, query, k))


@contextlib.contextmanager
def read_only_dir(tmp_path: Path):
    """A directory this process cannot write: a read-only tmpfs mount as root (EROFS, what a
    `readOnly: true` volume gives), else a 0555 directory (EACCES)."""
    target = tmp_path / "ro"
    target.mkdir()
    if os.geteuid() == 0:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tonearm-test-ro", str(target)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(f"CI=true: cannot mount a read-only tmpfs as root: {done.stderr.strip()}")
            pytest.skip(f"cannot mount a read-only tmpfs: {done.stderr.strip()}")
        try:
            yield target
        finally:
            subprocess.run(["umount", "-l", str(target)], check=False)
    else:
        target.chmod(0o555)
        try:
            yield target
        finally:
            target.chmod(0o755)


# ---------------------------------------------------------------- readiness


def test_a_replica_that_cannot_write_the_item_log_is_not_ready_and_says_why(fake_bundles, tmp_path, caplog):
    with read_only_dir(tmp_path) as ro:
        settings = make_settings(bundles_dir=fake_bundles, bundle="fake-a", items_dir=ro / "items")
        from service.app import create_app

        with caplog.at_level("ERROR"), running_client(create_app(settings, opener=fake_opener)) as client:
            ready = client.get("/readyz")
            assert_problem(ready, 503, "items-unavailable")
            assert str(ro / "items") in ready.json()["detail"] and "TONEARM_ITEMS_ENABLED=false" in ready.json()["detail"]
            assert_problem(_post(client, "x", ["dog"]), 503, "items-unavailable")
            assert "tonearm_items_ready 0.0" in client.get("/metrics").text
        assert any("cannot be opened for writing" in r.getMessage() for r in caplog.records)

    # the same settings with items switched off explicitly: ready, and the item routes say they are off
    off = make_settings(bundles_dir=fake_bundles, bundle="fake-a", items_dir=tmp_path / "unused", items_enabled=False)
    from service.app import create_app

    with running_client(create_app(off, opener=fake_opener)) as client:
        assert client.get("/readyz").status_code == 200
        r = _post(client, "x", ["dog"])
        assert_problem(r, 503, "items-unavailable")
        assert "off" in r.json()["detail"]
    assert not (tmp_path / "unused").exists()


def test_an_unusable_item_dir_keeps_the_replica_unready_until_it_opens_then_takedowns_apply_first(
    fake_bundles, tmp_path, monkeypatch
):
    import service.app as app_module

    monkeypatch.setattr(app_module, "ITEMS_RETRY_S", 0.05)
    blocker = tmp_path / "volume"
    blocker.write_text("a file where the mount should be")  # the directory cannot be created: ENOTDIR
    items_dir = blocker / "items"
    settings = make_settings(bundles_dir=fake_bundles, bundle="fake-a", items_dir=items_dir, items_poll_s=10)
    with running_client(app_module.create_app(settings, opener=fake_opener)) as client:
        r = client.get("/readyz")
        assert_problem(r, 503, "items-unavailable")
        assert "Not a directory" in r.json()["detail"]
        assert "clip-dog" in _ids(client, "a dog")  # it loaded its bundle; only readiness holds it back

        staged = tmp_path / "staged"  # the volume appears, holding a takedown another replica made
        ItemLog(staged / "items").delete("clip-dog")
        blocker.unlink()
        staged.rename(blocker)
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=10, what="the replica to become ready")
        assert "clip-dog" not in _ids(client, "a dog")  # ready means: with every takedown
        assert _post(client, "added-dog", ["dog"]).status_code == 201
        assert _ids(client, "a dog")[0] == "added-dog"


def test_a_log_that_cannot_be_read_for_items_stale_s_makes_the_replica_unready_until_it_reads_again(
    fake_bundles, tmp_path
):
    """At run time, not only at start: the volume goes away (the item directory is moved, as an
    unmounted or unreachable volume looks to ``stat``) — past ``items_stale_s`` the replica is not
    ready (it could be missing takedowns); the volume comes back with a takedown made meanwhile → ready,
    with the takedown applied."""
    from service.app import create_app

    items_dir = tmp_path / "items"
    settings = make_settings(bundles_dir=fake_bundles, bundle="fake-a", items_dir=items_dir, items_poll_s=0.05,
                             items_stale_s=0.5)
    with running_client(create_app(settings, opener=fake_opener)) as client:
        assert client.get("/readyz").status_code == 200
        away = tmp_path / "away"
        items_dir.rename(away)
        wait_until(lambda: client.get("/readyz").status_code == 503, timeout=10, what="the replica to turn unready")
        detail = client.get("/readyz").json()["detail"]
        assert str(items_dir) in detail and "takedowns" in detail and "TONEARM_ITEMS_STALE_S" in detail
        ItemLog(away).delete("clip-dog")  # another replica's takedown, while this one cannot read the log
        away.rename(items_dir)
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=10, what="the replica to be ready again")
        assert "clip-dog" not in _ids(client, "a dog")


@pytest.mark.skipif(os.geteuid() != 0, reason="remounting a tmpfs read-only needs root")
def test_a_volume_that_turns_read_only_refuses_writes_with_503_and_keeps_applying_takedowns(fake_bundles, tmp_path):
    """The volume is remounted read-only under a running replica: a write answers 503
    ``items-unavailable`` naming the volume (not 500); reads still work, so the replica stays ready and
    follows the log."""
    from service.app import create_app

    volume = tmp_path / "volume"
    volume.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tonearm-test-rw", str(volume)], check=True)
    try:
        settings = make_settings(bundles_dir=fake_bundles, bundle="fake-a", items_dir=volume / "items", items_poll_s=0.05)
        with running_client(create_app(settings, opener=fake_opener)) as client:
            assert _post(client, "before", ["bell"]).status_code == 201
            subprocess.run(["mount", "-o", "remount,ro", str(volume)], check=True)
            r = _post(client, "after", ["dog"])
            assert_problem(r, 503, "items-unavailable")
            assert "read-only" in r.json()["detail"].lower()
            assert client.get("/readyz").status_code == 200
            assert "before" in _ids(client, "a bell")
    finally:
        subprocess.run(["umount", "-l", str(volume)], check=False)  # lazy: the replica's log fds may still be open


# ---------------------------------------------------------------- cache across catalogues


def test_replicas_on_private_logs_sharing_redis_never_read_each_others_results(fake_bundles, tmp_path, shared_redis):
    """Two replicas of one bundle, one Redis, one key prefix, each on its own log (the emptyDir
    workaround of the issue): both logs at the same version hold different items."""
    from service.app import create_app

    prefix = f"t{uuid.uuid4().hex[:10]}"
    apps = [create_app(make_settings(bundles_dir=fake_bundles, bundle="fake-a", items_dir=tmp_path / f"log-{name}",
                                     redis_url=shared_redis.url, key_prefix=prefix, items_poll_s=10), opener=fake_opener)
            for name in ("a", "b")]
    with running_client(apps[0]) as a, running_client(apps[1]) as b:
        assert _ids(a, "a dog")[0] == "clip-dog" and _ids(b, "a dog")[0] == "clip-dog"  # no items yet
        assert _post(a, "only-on-a", ["dog"]).status_code == 201
        assert _post(b, "only-on-b", ["dog", "rain", "bell"]).status_code == 201  # both logs at version 1
        for _ in range(2):  # a's results are cached first; the second round is all from the cache
            on_a, on_b = _hits(a, "a dog"), _hits(b, "a dog")
            assert on_a["only-on-a"] == pytest.approx(1.0, abs=1e-4) and "only-on-b" not in on_a
            # b's own item, with its own score (dog+rain+bell: 1/sqrt(3)), never a's row read as b's
            assert "only-on-a" not in on_b and on_b["only-on-b"] == pytest.approx(0.577, abs=0.01)
        assert a.delete("/v1/items/only-on-a", headers=ADMIN).status_code == 200
        assert _post(a, "second-on-a", ["bell"]).status_code == 201  # a: version 3
        assert _post(b, "second-on-b", ["siren"]).status_code == 201
        assert _post(b, "third-on-b", ["siren", "dog"]).status_code == 201  # b: version 3, 3 items
        for _ in range(2):
            for client, own, foreign in ((a, {"second-on-a"}, {"only-on-b", "second-on-b", "third-on-b"}),
                                         (b, {"only-on-b", "second-on-b", "third-on-b"}, {"only-on-a", "second-on-a"})):
                found = set(_ids(client, "a dog siren bell", k=10))
                assert own <= found and not foreign & found
        keys = [k.decode() for k in shared_redis_client(shared_redis).keys(f"{prefix}:*t2a*")]
        logs = {ItemLog(tmp_path / f"log-{n}").log_id for n in ("a", "b")}
        assert keys and all(any(f"-L{log_id}-v" in key for log_id in logs) for key in keys)


def shared_redis_client(server):
    import redis

    return redis.Redis.from_url(server.url)


# ---------------------------------------------------------------- quarantine


def test_items_that_cannot_be_embedded_are_quarantined_and_block_neither_readiness_nor_an_activation(
    fake_bundles, caplog
):
    from service.app import create_app

    settings = make_settings(bundles_dir=fake_bundles, bundle="fake-a", gate_metric="t2a_R@1_mean", items_poll_s=10)
    with running_client(create_app(settings, opener=fake_opener)) as client:
        assert _post(client, "good", ["dog"]).status_code == 201
        assert _post(client, "gone", ["bell"]).status_code == 201
        assert _post(client, "long", ["rain"], seconds=3.0).status_code == 201
        assert _post(client, "garbled", ["siren"], seconds=1.5).status_code == 201
        assert _post(client, "clip-rain", ["dog", "bell"], seconds=2.5).status_code == 201  # replaces a clip
    items = fake_bundles / ".items"
    log = ItemLog(items)
    by_id = {r.id: r for r in log}
    (items / AUDIO_DIR / by_id["gone"].audio).unlink()
    (items / AUDIO_DIR / by_id["garbled"].audio).write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk" * 10)
    with open(items / LOG_NAME, "ab") as handle:  # a crash's block of NULs ending in a newline
        handle.write(b"\x00" * 300 + b"\n")
    os.truncate(items / AUDIO_DIR / by_id["clip-rain"].audio, 100)  # a torn upload: undecodable too

    lowered = make_settings(bundles_dir=fake_bundles, bundle="fake-a", gate_metric="t2a_R@1_mean", items_poll_s=10,
                            max_item_audio_seconds=2.0)  # the item limit judges stored items
    with caplog.at_level("ERROR"), running_client(create_app(lowered, opener=fake_opener)) as client:
        assert client.get("/readyz").status_code == 200
        found = _ids(client, "dog bell rain siren", k=20)
        assert "good" in found and not {"gone", "long", "garbled", "clip-rain"} & set(found)  # clip-rain: replaced
        listing = client.get("/v1/items", params={"status": "quarantined"}, headers=ADMIN)
        assert listing.status_code == 200, listing.text
        reasons = {i["id"]: i["reason"] for i in listing.json()["items"]}
        assert reasons == {"gone": "missing-audio", "long": "over-limit", "garbled": "undecodable",
                           "clip-rain": "undecodable"}
        assert [c["length"] for c in listing.json()["corrupt_lines"]] == [300]
        metrics = client.get("/metrics").text
        assert "tonearm_items_quarantined 4.0" in metrics and "tonearm_items_corrupt_lines 1.0" in metrics
        assert 'tonearm_items_quarantine_events_total{reason="missing-audio"} 1.0' in metrics
        assert_problem(client.get("/v1/items", params={"status": "live"}, headers=ADMIN), 422, "validation-error")
        assert client.get("/v1/items", params={"status": "quarantined"}).status_code == 401

        activated = client.post("/v1/bundles/activate", json={"bundle_id": "fake-b"}, headers=ADMIN)
        assert activated.status_code == 200, activated.text
        assert client.get("/readyz").json()["bundle_id"] == "fake-b"
        assert "good" in _ids(client, "a dog")
        assert len(client.get("/v1/items", params={"status": "quarantined"}, headers=ADMIN).json()["items"]) == 4

        assert _post(client, "gone", ["bell"]).status_code == 201  # re-posted: out of quarantine, searchable
        assert client.delete("/v1/items/long", headers=ADMIN).status_code == 404  # not in the catalogue
        assert "gone" in _ids(client, "a bell")
        assert {i["id"] for i in client.get("/v1/items", params={"status": "quarantined"},
                                            headers=ADMIN).json()["items"]} == {"long", "garbled", "clip-rain"}
    assert any("quarantined (missing-audio)" in r.getMessage() for r in caplog.records)
    assert any("300 NUL bytes" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- the swap's catch-up


def test_an_item_acknowledged_while_a_swap_re_embeds_is_searchable_the_moment_the_swap_is_done(fake_bundles):
    from service.app import create_app

    embedding = threading.Event()
    posted = threading.Event()

    class SlowB(KeywordBundle):
        def encode_audio(self, waveforms):
            if self.bundle_id == "fake-b" and not posted.is_set() and any(len(w) == 20_000 for w in waveforms):
                embedding.set()  # the candidate re-embeds the stored items: hold it until the write is acknowledged
                assert posted.wait(30)
            return super().encode_audio(waveforms)

    def opener(path):
        return SlowB(path, bundle_id=path.name, degrade=path.name.endswith("worse"))

    settings = make_settings(bundles_dir=fake_bundles, bundle="fake-a", gate_metric="t2a_R@1_mean",
                             items_poll_s=10)  # the follower would take 10 s: only the catch-up can make it
    with running_client(create_app(settings, opener=opener)) as client:
        assert _post(client, "before", ["bell"], seconds=1.25).status_code == 201  # 20,000 samples: its re-embedding
        registry = client.app.state.tonearm.registry
        done: list[object] = []
        swap = threading.Thread(target=lambda: done.append(registry.activate("fake-b")))
        swap.start()
        assert embedding.wait(30)
        assert registry.active_id == "fake-a"
        assert _post(client, "during", ["rain", "siren"]).status_code == 201  # acknowledged while fake-b re-embeds
        posted.set()
        swap.join(30)
        assert done and registry.active_id == "fake-b"
        assert _hits(client, "rain siren", k=1) == {"during": pytest.approx(1.0, abs=1e-4)}
        assert "before" in _ids(client, "a bell")
        assert client.app.state.tonearm.registry.active_searcher().items.version == 2


@pytest.mark.skipif(shutil.which("mount") is None, reason="no mount(8)")
def test_read_only_helper_really_refuses_writes(tmp_path):
    with read_only_dir(tmp_path) as ro, pytest.raises(OSError):
        (ro / "x").write_text("x")


def test_a_replay_decodes_one_batch_at_a_time(tmp_path):
    """A replay (replica start, a swap re-embedding every item) passes the whole log to the embedder:
    it must decode ``EMBED_BATCH`` stored files, encode them, then read the next — never hold every
    item's waveform at once (items × decoded size: ~3 GiB at 10 k items of 5 s). Observed on the real
    store: the stored files read between two encoder calls."""
    from service.items import EMBED_BATCH, ItemStore

    store = ItemStore(tmp_path / "items", make_settings(items_dir=tmp_path / "items"))
    n = 2 * EMBED_BATCH + 3
    for i in range(n):
        store.log.put(f"item-{i}", wav_bytes(tone(["bell"], 0.2 + 0.01 * i)), audio_format="wav")
    history = store.log.history()
    records = list(history.records[: history.length])
    bundle = KeywordBundle(tmp_path / "bundle")
    events: list[str] = []
    read, encode = store.log.audio_path, bundle.encode_audio
    store.log.audio_path = lambda record: (events.append("read"), read(record))[1]  # type: ignore[method-assign]
    bundle.encode_audio = lambda waves: (events.append("encode"), encode(waves))[1]  # type: ignore[method-assign]

    out = store._embed_audio(bundle, records, missing=[])

    assert out.shape == (n, bundle.embed_dim) and not np.isnan(out).any()
    runs = [len(run) for run in "".join("r" if e == "read" else "|" for e in events).split("|") if run]
    assert sum(runs) == n and max(runs) <= EMBED_BATCH, runs


def test_a_replica_starts_without_re_embedding_what_another_embedded(tmp_path):
    """Item embeddings are kept per bundle beside the log (index/items/embeddings.py): a second store on
    the same volume (a replica starting, or restarting) replays the log without one encoder call, to
    the same vectors; another bundle's encoder does not read them; an audio file rewritten since is
    embedded again, never served from the stale vector."""
    from service.items import ItemStore

    settings = make_settings(items_dir=tmp_path / "items")
    first = ItemStore(tmp_path / "items", settings)
    for i in range(5):
        first.log.put(f"item-{i}", wav_bytes(tone(["bell", "dog"][i % 2:], 0.3 + 0.05 * i)), audio_format="wav")
    history = first.log.history()
    records = list(history.records[: history.length])
    embedded = first._embed_audio(KeywordBundle(tmp_path / "a"), records, missing=[])

    calls: list[int] = []
    bundle = KeywordBundle(tmp_path / "a")
    encode = bundle.encode_audio
    bundle.encode_audio = lambda waves: (calls.append(len(waves)), encode(waves))[1]  # type: ignore[method-assign]
    second = ItemStore(tmp_path / "items", settings)
    again = second._embed_audio(bundle, records, missing=[])
    assert calls == [] and second.embedded_from_store == 5
    np.testing.assert_array_equal(again, embedded)

    other = KeywordBundle(tmp_path / "b", bundle_id="fake-b")
    other_encode = other.encode_audio
    other.encode_audio = lambda waves: (calls.append(len(waves)), other_encode(waves))[1]  # type: ignore[method-assign]
    second._embed_audio(other, records, missing=[])
    assert sum(calls) == 5  # another bundle: its own encoder, once

    calls.clear()
    path = second.log.audio_path(records[0])
    path.write_bytes(path.read_bytes() + b"\0" * 64)  # rewritten since (a torn or replaced file)
    second._embed_audio(bundle, records, missing=[])
    assert calls == [1]


def test_a_full_memory_budget_fails_the_sync_instead_of_quarantining(tmp_path):
    """The item sync's decodes draw from the process's memory budget: when uploads hold all of it, the
    decode is refused (503 overloaded) — nothing is wrong with the item, so it must not be quarantined
    (a 201 for an item never searchable); the sync fails whole and the next one embeds it."""
    import dataclasses

    from service.errors import ServiceError
    from service.items import ItemStore
    from service.memory_budget import MemoryBudget

    store = ItemStore(tmp_path / "items", make_settings(items_dir=tmp_path / "items"))
    store.log.put("busy", wav_bytes(tone(["bell"], 0.5)), audio_format="wav")
    history = store.log.history()
    records = list(history.records[: history.length])
    budget = MemoryBudget(1 << 20)
    store.limits = dataclasses.replace(store.limits, budget=budget, wait_s=0.1)
    held = budget.take(budget.capacity, 1.0)
    with pytest.raises(ServiceError) as refused:
        store._embed_audio(KeywordBundle(tmp_path / "a"), records, missing=[])
    assert refused.value.slug == "overloaded" and store.quarantine == {}
    budget.give(held)
    assert not np.isnan(store._embed_audio(KeywordBundle(tmp_path / "a"), records, missing=[])).any()
