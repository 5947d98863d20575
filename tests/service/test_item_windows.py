"""Added items' moment windows when they are written (issue 54, part 4): computed with the item's vector (the
201 means its moments are searchable), stored beside it (index/items/embeddings.py), read by another replica,
gone with the item — and never embedded on the query path.

Through the in-process app with the keyword bundle (tests/service/fakes.py: 1-s windows at 16 kHz), default
limits. The encoder calls are counted by a wrapper around the bundle's real ``encode_audio`` (no mock)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from service.app import create_app
from tests.service.conftest import ADMIN, fake_opener, make_settings, running_client
from tests.service.fakes import KeywordBundle
from tests.service.test_long_items import EVENT, _post, _recording, _wav


class CountedEncoder:
    """The bundle's own ``encode_audio``, counting its calls."""

    def __init__(self, encode: Callable[[Sequence[np.ndarray]], np.ndarray]) -> None:
        self.encode, self.calls = encode, 0

    def __call__(self, waveforms: Sequence[np.ndarray]) -> np.ndarray:
        self.calls += 1
        return self.encode(waveforms)


def _count_encoder(client) -> CountedEncoder:
    bundle = client.app.state.tonearm.registry.active_searcher().bundle
    counted = CountedEncoder(bundle.encode_audio)
    bundle.encode_audio = counted
    return counted


def _moments(client, query: str = "bell", k: int = 5) -> list[dict]:
    found = client.post("/v1/search/moments", json={"query": query, "k": k})
    assert found.status_code == 200, found.text
    return found.json()["hits"]


def _near(hit: dict, span: tuple[float, float]) -> bool:
    return abs(hit["start"] - span[0]) <= 1.0 and abs(hit["end"] - span[1]) <= 1.0


def test_a_ten_minute_recording_is_searchable_at_its_201_without_an_encoder_call_at_query_time(fake_client) -> None:
    counted = _count_encoder(fake_client)
    r = _post(fake_client, "walk-10min", _wav(_recording(600.0, EVENT)))
    assert r.status_code == 201, r.text
    assert counted.calls > 0  # its windows and vector were embedded by the write
    searcher = fake_client.app.state.tonearm.registry.active_searcher()
    built = searcher._added_source
    assert built is not None and built[0] is searcher.items  # the items' window search was built by the write

    written = counted.calls
    (hit,) = _moments(fake_client, k=1)
    assert hit["id"] == "walk-10min" and _near(hit, EVENT), hit
    assert _moments(fake_client, k=1) == [hit]
    assert counted.calls == written, "a moment query embedded audio"
    assert searcher._added_source is built  # and no query rebuilt it

    assert _post(fake_client, "chirp", _wav(_recording(1.5))).status_code == 201  # no windows: the search is kept
    assert searcher._added_source is not built and searcher._added_source[1] is built[1]


def test_a_deleted_or_replaced_recording_s_windows_are_never_returned(fake_client) -> None:
    counted = _count_encoder(fake_client)
    assert _post(fake_client, "walk", _wav(_recording(180.0, (100.0, 104.0)))).status_code == 201
    assert _post(fake_client, "other", _wav(_recording(30.0))).status_code == 201  # silence: no bell
    assert [h["id"] for h in _moments(fake_client)][:1] == ["walk"]

    # replaced by a 40-s recording (decoded whole, below the search uploads' minute): its windows too are
    # computed by the write, and the old recording's moment is gone
    assert _post(fake_client, "walk", _wav(_recording(40.0, (10.0, 14.0)))).status_code == 201
    written = counted.calls
    hits = [h for h in _moments(fake_client) if h["id"] == "walk"]
    assert hits and _near(hits[0], (10.0, 14.0)), hits
    assert not any(h["start"] >= 40.0 for h in hits), hits  # nothing of the 3-minute recording
    assert counted.calls == written

    assert fake_client.delete("/v1/items/walk", headers=ADMIN).status_code == 200
    assert all(h["id"] != "walk" for h in _moments(fake_client)), "a deleted recording's moment was returned"
    searcher = fake_client.app.state.tonearm.registry.active_searcher()
    live = {searcher.items.items[int(r)].audio for r in np.flatnonzero(searcher.items.alive)}
    assert set(searcher._item_windows) == live  # the deleted and replaced recordings' windows were dropped


def test_a_second_replica_answers_the_moment_from_the_stored_windows(fake_bundles: Path, fake_client) -> None:
    assert _post(fake_client, "walk-3min", _wav(_recording(180.0, (120.0, 126.0)))).status_code == 201
    (first,) = _moments(fake_client, k=1)

    opened: list[KeywordBundle] = []

    def counting_opener(path: Path) -> KeywordBundle:
        bundle = fake_opener(path)
        bundle.encode_audio = CountedEncoder(bundle.encode_audio)  # type: ignore[method-assign]
        opened.append(bundle)
        return bundle

    settings = make_settings(bundles_dir=fake_bundles, bundle="fake-a", gate_metric="t2a_R@1_mean")
    with running_client(create_app(settings, opener=counting_opener)) as replica:
        state = replica.app.state.tonearm
        before = state.registry.active_searcher().bundle.encode_audio.calls
        (hit,) = _moments(replica, k=1)
        assert hit == first
        assert state.registry.active_searcher().bundle.encode_audio.calls == before
        assert state.items.embedded_from_store >= 1  # its vector and windows were read, not embedded
    assert opened


def test_a_store_written_before_windows_were_kept_is_completed_once_short_items_without_a_decode(
        fake_bundles: Path, fake_client) -> None:
    assert _post(fake_client, "walk-2min", _wav(_recording(120.0, (60.0, 64.0)))).status_code == 201
    assert _post(fake_client, "chirp", _wav(_recording(1.5))).status_code == 201
    (first,) = _moments(fake_client, k=1)
    entries = sorted((fake_bundles / ".items" / "embeddings").rglob("*.win"))
    assert len(entries) == 2
    for entry in entries:
        entry.unlink()  # as a store of the release before

    settings = make_settings(bundles_dir=fake_bundles, bundle="fake-a", gate_metric="t2a_R@1_mean")
    with running_client(create_app(settings, opener=fake_opener)) as replica:
        assert _moments(replica, k=1) == [first]
        assert replica.app.state.tonearm.items.embedded_from_store == 1  # the chirp: its header says it is short
    assert sorted((fake_bundles / ".items" / "embeddings").rglob("*.win")) == entries  # both written again
