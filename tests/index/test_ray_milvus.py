"""`tonearm index --ray --milvus-uri` (issue 22 item 4): Ray workers publish straight to a real
Milvus server, and the result is what `tonearm index` + `tonearm bundle publish` give.

The Ray cluster (2 CPUs, a pool of two embedding actors, loopback only) is the one
tests/index/test_ray_embed.py ran on (``ray_address``, package scope in tests/index/conftest.py), the
sound folder that module's; the Milvus server is the session's standalone server
(tests/milvus_server.py). Each actor writes its own files' vectors into the collection;
the driver gets back only row numbers and errors. Compared with the single-process path:
the same clip ids row by row, the same vectors (float tolerance), the same top-k through the
Milvus backend, and a bundle the service serves and activates with TONEARM_INDEX_BACKEND=milvus.

Both runs index the folder with a per-file metadata table (``--metadata``): the Ray writers publish
each clip's metadata as `tonearm bundle publish` does (same JSON objects, same registry fields),
so filtered searches are evaluated by Milvus and equal numpy brute force over the clips whose
metadata (as written in the table, checked here in plain Python) passes. The corrupt file's row
gives ``rating`` a second type among the candidates: the Ray layout, made before decoding, leaves
that field out and the registry does not list it, so that filter is evaluated on our side — with
the same answer.

Moment windows (issue 54, part 5): on a folder with two long files after a file that fails to decode on a
worker (tests/index/test_pass_windows.py's), the actors write the long files' windows into the bundle's windows
collections; they are the in-process pass's (count, spans, vectors to float16), keyed by the audio-index rows,
registered as `tonearm bundle publish` registers the same bundle's, and a moment search over
``published_windows`` finds the long file. The driver's finish (moves, index type, recall) is also run alone
on synthetic windows, past a lowered FLAT threshold, so its HNSW switch is exercised without 50,000 windows.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pytest

from index.bundle.format import AUDIO_IDS, read_manifest
from index.catalogue.own_audio import index_folder
from index.errors import BundleError
from index.runtime.loader import LoadedBundle
from tests.index.test_ray_embed import N_FILES, sound_folder, tonearm  # noqa: F401 (fixtures)
from tests.milvus_server import require_milvus

require_milvus()

from index.engines.milvus_index import MilvusTarget, active_bundle, publish, published_info  # noqa: E402

pytestmark = pytest.mark.slow
QUERIES = ["a short noise burst", "white noise", "a quiet hiss", "static"]
LICENSES = ("cc0", "by", "nc")
FILTERS = [  # (filter, the same predicate in plain Python over a file's metadata row)
    ({"license": "cc0"}, lambda m: m["license"] == "cc0"),
    ({"seconds": {"lte": 1.5}}, lambda m: m["seconds"] <= 1.5),
    ({"tags": {"any": ["loud"]}, "loop": False}, lambda m: "loud" in m["tags"] and not m["loop"]),
    ({"or": [{"not": {"license": {"in": ["by", "nc"]}}}, {"seconds": {"gt": 3}}]},
     lambda m: m["license"] == "cc0" or m["seconds"] > 3),
    ({"id": "set2/clip10.wav"}, lambda m: m["file"] == "set2/clip10.wav"),
    ({"rating": {"gte": 3}}, lambda m: m["rating"] >= 3),  # a field the Ray layout leaves to our side
]


def _metadata_table(folder: Path, path: Path) -> dict[str, dict]:
    """A ``--metadata`` JSONL for the folder's clips (and one row for the corrupt file); file → row."""
    rows = {}
    for i in range(N_FILES):
        rel = f"set{i % 4}/clip{i:02d}.wav"
        assert (folder / rel).is_file()
        rows[rel] = {"file": rel, "license": LICENSES[i % 3], "seconds": round(0.3 + 0.12 * i, 2),
                     "tags": ["even" if i % 2 == 0 else "odd"] + (["loud"] if i % 3 == 0 else []),
                     "loop": i % 4 == 0, "rating": i % 5}
    rows["set1/broken.wav"] = {"file": "set1/broken.wav", "license": "cc0", "rating": "bad"}
    path.write_text("".join(json.dumps(row) + "\n" for row in rows.values()))
    return rows


def test_ray_workers_publish_what_index_and_bundle_publish_give(
    ray_address: str, ray_home: Path, sound_folder: Path, tiny_bundle: Path, milvus_server, tmp_path: Path  # noqa: F811
) -> None:
    target = MilvusTarget(uri=milvus_server.uri)
    tag = uuid.uuid4().hex[:8]
    table = _metadata_table(sound_folder, tmp_path / f"meta-{tag}.jsonl")
    local = index_folder(sound_folder, tiny_bundle, tmp_path / f"local-{tag}",  # the single-process path
                         metadata=tmp_path / f"meta-{tag}.jsonl")
    assert publish(local.path, target) is True
    out = tmp_path / f"ray-{tag}"
    run = tonearm("-v", "index", str(sound_folder), "--bundle", str(tiny_bundle), "--out", str(out),
                  "--ray", ray_address, "--ray-workers", "2", "--milvus-uri", target.uri,
                  "--metadata", str(tmp_path / f"meta-{tag}.jsonl"), home=ray_home)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"{N_FILES} files indexed, 2 skipped" in run.stdout
    assert "set1/broken.wav" in run.stdout and "readme.txt" in run.stdout
    assert "TONEARM_INDEX_BACKEND=milvus" in run.stdout
    # readme.txt fails the format check on the driver (no key); broken.wav passes it and fails to
    # decode on a worker: one gap in the collection's keys.
    assert f"Ray pass: {N_FILES + 1} rows on 2 worker processes (pool of 2)" in run.stderr

    manifest = read_manifest(out)
    assert manifest.milvus_only is not None and len(manifest.milvus_only.gaps) == 1
    assert manifest.audio_index.file == "" and not list(out.glob("*.faiss"))
    assert (out / AUDIO_IDS).read_text() == (local.path / AUDIO_IDS).read_text()  # same ids, same rows
    mine, theirs = published_info(target, out.name), published_info(target, local.path.name)
    assert mine is not None and theirs is not None
    assert {k: mine[k] for k in ("n_audio", "n_text", "index_type", "dim")} == {
        k: theirs[k] for k in ("n_audio", "n_text", "index_type", "dim")}
    assert mine["recall_at_10"]["audio"] == 1.0
    assert theirs["meta_fields"]["rating"] == "number" and "license" in theirs["meta_fields"]
    assert mine["meta_fields"] == {k: v for k, v in theirs["meta_fields"].items() if k != "rating"}

    with pytest.raises(BundleError, match="TONEARM_INDEX_BACKEND=milvus"):
        LoadedBundle.open(out)  # no FAISS file to fall back on
    on_ray, single, faiss = (LoadedBundle.open(out, milvus=target), LoadedBundle.open(local.path, milvus=target),
                             LoadedBundle.open(local.path))
    try:
        vectors = on_ray.audio_embeddings()
        np.testing.assert_allclose(vectors, single.audio_embeddings(), atol=2e-5)
        np.testing.assert_allclose(vectors, faiss.audio_embeddings(), atol=2e-5)
        queries = np.concatenate([single.encode_text(QUERIES), vectors[:4]])
        got, expected = on_ray.search_audio(queries, 10), single.search_audio(queries, 10)
        np.testing.assert_array_equal(got[1], expected[1])
        np.testing.assert_allclose(got[0], expected[0], atol=1e-4)
        np.testing.assert_array_equal(got[1], faiss.search_audio(queries, 10)[1])
        _assert_same_metadata(target, out.name, local.path.name, on_ray.audio_items)
        _assert_filters_are_brute_force(on_ray, single, table, queries, vectors)

        on_ray.mark_active()  # the active aliases name its (audio, empty text) collections
        assert active_bundle(target) == out.name
    finally:
        for bundle in (on_ray, single, faiss):
            bundle.close()
    _serve_and_activate(tmp_path, out.name, local.path.name, target.uri)


def _assert_same_metadata(target: MilvusTarget, ray_id: str, local_id: str, clips: list[dict]) -> None:
    """Each clip's ``meta`` JSON in the Ray-written collection is the one `bundle publish` wrote (less
    the field only the corrupt file made two-typed); the empty text collections carry the column too."""
    from index.engines.milvus_index import META_FIELD

    def metas(bundle_id: str, kind: str = "audio") -> list[dict]:
        rows = target.call("query", target.collection(bundle_id, kind), filter="row >= 0",
                           output_fields=["row", META_FIELD], consistency_level="Strong", bulk=True)
        return sorted((row[META_FIELD] for row in rows), key=lambda meta: meta["id"])

    mine, theirs = metas(ray_id), metas(local_id)
    assert [meta["id"] for meta in mine] == sorted(clip["id"] for clip in clips)
    assert mine == [{k: v for k, v in meta.items() if k != "rating"} for meta in theirs]
    assert {"license", "seconds", "tags", "loop"} <= set(mine[0]) and "rating" in theirs[0]
    for bundle_id in (ray_id, local_id):
        fields = {f["name"] for f in target.call("describe_collection", target.collection(bundle_id, "text"))["fields"]}
        assert META_FIELD in fields, bundle_id


def _assert_filters_are_brute_force(on_ray: LoadedBundle, single: LoadedBundle, table: dict[str, dict],
                                    queries: np.ndarray, vectors: np.ndarray) -> None:
    """Filtered top-k on the Ray-published collection = numpy over the clips whose table row passes;
    evaluated by Milvus alone (no mask given) wherever the registry lists the filter's fields."""
    from index.engines.filters import parse_filter

    for raw, passes in FILTERS:
        flt = parse_filter(raw)
        allowed = np.array([passes({**table[clip["id"]], "file": clip["id"]}) for clip in on_ray.audio_items])
        assert 0 < allowed.sum() < len(allowed), raw
        by_milvus = on_ray._audio_index.expression(flt) is not None  # type: ignore[union-attr]
        assert by_milvus == ("rating" not in raw), raw
        assert single._audio_index.expression(flt) is not None, raw  # type: ignore[union-attr]
        k = 5
        scores, rows = on_ray.search_audio(queries, k, allowed=None if by_milvus else allowed, where=flt)
        passing = np.flatnonzero(allowed)
        exact = queries @ vectors[passing].T
        order = np.argsort(-exact, axis=1, kind="stable")[:, :k]
        expected_rows = np.where(order < len(passing), passing[np.minimum(order, len(passing) - 1)], -1)
        n = min(k, len(passing))
        np.testing.assert_array_equal(rows[:, :n], expected_rows[:, :n], err_msg=str(raw))
        np.testing.assert_allclose(scores[:, :n], np.take_along_axis(exact, order, 1)[:, :n], atol=1e-4)
        assert (rows[:, n:] == -1).all(), raw
        np.testing.assert_array_equal(rows, single.search_audio(queries, k, allowed=allowed, where=flt)[1])


def _serve_and_activate(bundles_dir: Path, ray_id: str, local_id: str, uri: str) -> None:
    """The service on the Milvus backend serves the Ray-published bundle, then activates the other."""
    from service.app import create_app
    from tests.service.conftest import ADMIN, make_settings, running_client

    settings = make_settings(bundles_dir=bundles_dir, bundle=ray_id, index_backend="milvus", milvus_uri=uri)
    with running_client(create_app(settings)) as client:
        answers = {}
        for bundle_id in (ray_id, local_id):
            if bundle_id == local_id:
                r = client.post("/v1/bundles/activate", json={"bundle_id": local_id, "force": True}, headers=ADMIN)
                assert r.status_code == 200, r.text
            body = client.post("/v1/search/text", json={"query": QUERIES[0], "k": 5}).json()
            assert body["bundle_id"] == bundle_id, body
            filtered = client.post("/v1/search/text", json={"query": QUERIES[0], "k": 5,
                                                            "filter": {"license": "cc0", "loop": False}}).json()
            answers[bundle_id] = [(hit["id"], round(hit["score"], 4)) for hit in body["hits"] + filtered["hits"]]
        assert answers[ray_id] == answers[local_id] and len(answers[ray_id]) == 10
        assert json.loads(json.dumps(answers))  # plain data


def test_refusals_are_one_line_errors(
    ray_home: Path, sound_folder: Path, tiny_bundle: Path, milvus_server, tmp_path: Path  # noqa: F811
) -> None:
    lite = tonearm("index", str(sound_folder), "--bundle", str(tiny_bundle), "--out", str(tmp_path / "x"),
                   "--ray", "--milvus-uri", str(tmp_path / "milvus.db"), home=ray_home)
    assert lite.returncode == 2 and "Milvus Lite file can be opened by one process only" in lite.stderr
    assert len(lite.stderr.strip().splitlines()) == 1, lite.stderr
    no_ray = tonearm("index", str(sound_folder), "--bundle", str(tiny_bundle), "--out", str(tmp_path / "x"),
                     "--milvus-uri", milvus_server.uri, home=ray_home)
    assert no_ray.returncode == 2 and "--milvus-uri needs --ray" in no_ray.stderr
    no_uri = tonearm("index", str(sound_folder), "--bundle", str(tiny_bundle), "--out", str(tmp_path / "x"),
                     "--ray", "--milvus-index", "HNSW", home=ray_home)
    assert no_uri.returncode == 2 and "need --milvus-uri" in no_uri.stderr
    target = MilvusTarget(uri=milvus_server.uri)
    taken = tmp_path / f"taken-{uuid.uuid4().hex[:8]}"
    assert publish(index_folder(sound_folder, tiny_bundle, taken).path, target)
    again = tonearm("index", str(sound_folder), "--bundle", str(tiny_bundle), "--out", str(tmp_path / taken.name),
                    "--ray", "--milvus-uri", milvus_server.uri, home=ray_home)
    assert again.returncode == 2 and "already exists" in again.stderr  # the directory: checked first
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    again = tonearm("index", str(sound_folder), "--bundle", str(tiny_bundle), "--out", str(elsewhere / taken.name),
                    "--ray", "--milvus-uri", milvus_server.uri, home=ray_home)
    assert again.returncode == 2 and "already published to Milvus" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1, again.stderr


def test_ray_workers_publish_the_windows_of_long_files(
    ray_address: str, ray_home: Path, tiny_bundle: Path, milvus_server, tmp_path: Path
) -> None:
    """`index --ray --milvus-uri` on a folder with long files: their windows are in Milvus as `bundle publish` of
    the in-process bundle puts them, the manifest counts them, and a moment search over them finds the file — the
    source a replica serving the bundle from Milvus answers /v1/search/moments with (service/bundles.py; the route
    itself is tests/service/test_moments_milvus.py's: a replica's start on the Milvus backend costs ~30 s here)."""
    from index.engines.milvus_windows import (
        MilvusWindows,
        published_windows,
        window_index_type,
        windows_build_params,
    )
    from index.moments.sources import search_sources
    from tests.index.test_pass_windows import bundle_windows_of, write_long_folder

    target = MilvusTarget(uri=milvus_server.uri)
    tag = uuid.uuid4().hex[:8]
    folder = write_long_folder(tmp_path / "sounds", read_manifest(tiny_bundle).sample_rate)
    local = index_folder(folder, tiny_bundle, tmp_path / f"local-{tag}")
    out = tmp_path / f"ray-{tag}"
    run = tonearm("-v", "index", str(folder), "--bundle", str(tiny_bundle), "--out", str(out),
                  "--ray", ray_address, "--ray-workers", "2", "--milvus-uri", target.uri, home=ray_home)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "4 files indexed, 1 skipped" in run.stdout and "b_broken.wav" in run.stdout
    assert "11 moment windows of 2 long files" in run.stderr
    assert "moment windows published" in run.stdout and "11 windows of 2 long files" in run.stdout

    manifest, theirs = read_manifest(out), read_manifest(local.path)
    assert manifest.milvus_only is not None and manifest.milvus_only.gaps == [1]  # b_broken.wav: keys 2, 4 moved
    assert manifest.moments == theirs.moments and theirs.moments is not None and theirs.moments.n_windows == 11
    assert not (out / theirs.moments.windows_file).exists()
    entry = published_info(target, out.name)["windows"]  # type: ignore[index]
    # what publish_windows records for these windows (its own functions: publishing the local bundle too cost ~15 s)
    assert {k: v for k, v in entry.items() if k != "build_s"} == {
        "n_windows": 11, "n_recordings": 2, "dim": manifest.embed_dim, "index_type": window_index_type(11),
        "build_params": windows_build_params("FLAT", 11), "recall_at_10": 1.0}

    spans, vectors = bundle_windows_of(local.path)
    bundle = LoadedBundle.open(out, milvus=target)
    try:
        source = published_windows(bundle)
        assert isinstance(source, MilvusWindows) and source.count() == 11
        rows = [i for i, item in enumerate(bundle.audio_items) if item["id"] in ("c_long.wav", "e_long.wav")]
        assert rows == [1, 3] and sorted({int(r) for r in spans[:, 0]}) == rows
        for row, (got_spans, got) in zip(rows, source.windows_of(rows), strict=True):
            mine = spans[:, 0] == row
            np.testing.assert_allclose(got_spans, spans[mine, 1:], atol=1e-9)
            np.testing.assert_allclose(got, vectors[mine], atol=2e-3)  # stored as float16
        window = np.flatnonzero(spans[:, 0] == 3)[4]  # a window of e_long.wav
        (hit, *_) = search_sources(vectors[window], 2, [source])
        assert hit.key == 3 and bundle.audio_items[3]["id"] == "e_long.wav"
        assert hit.start <= spans[window, 1:].mean() <= hit.end  # the moment holds the query window's centre
        source.release()
    finally:
        bundle.close()


def test_the_driver_moves_counts_and_indexes_the_windows_the_writers_left(
    milvus_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """finish_windows on windows written as the actors write them (keys: rows among the files that passed the
    format check, two of which failed to decode; one batch written twice, as by a retried Ray task): each moves to
    its audio-index row, the count is checked, past the FLAT threshold the index becomes HNSW, and the recall of
    the best recordings is measured against exact search read back in chunks (12 recordings: the top 10 is a cut)."""
    from index.catalogue import milvus_pass_windows as pass_windows
    from index.engines import milvus_windows

    monkeypatch.setattr(milvus_windows, "FLAT_UP_TO", 20)  # what window_index_type reads: HNSW above 20 windows
    monkeypatch.setattr(pass_windows, "PUBLISH_BATCH", 8)  # the exact side reads 2-3 recordings a chunk
    target = MilvusTarget(uri=milvus_server.uri, release_closed=False)  # left loaded for the checks (~3 s)
    rng = np.random.default_rng(5)
    gaps = (1, 4)
    sizes = {key: 0 if key in (2, 6, 10) else 3 + key % 2 for key in range(17) if key not in gaps}  # 0: short
    written = {}
    for key, n in sizes.items():
        vectors = rng.normal(size=(n, 8)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        written[key] = (np.column_stack([np.arange(n) * 1.0, np.arange(n) + 2.0]), vectors)
    long = [key for key, n in sizes.items() if n]
    store = pass_windows.begin_windows(target, f"synthetic-{uuid.uuid4().hex[:8]}", dim=8)
    sink = pass_windows.MilvusWindowSink.of(store)
    for batch in (long[6:], long[:6], long[6:9]):  # two actors in any order, then a batch again
        sink([(key, *written[key]) for key in batch])
    counts = [sizes.get(key, 0) for key in range(17)]
    kept = sorted(sizes)
    entry = pass_windows.finish_windows(store, counts, kept)["windows"]
    n_windows = sum(sizes.values())
    assert (len(long), n_windows) == (12, 43)
    assert {k: entry[k] for k in ("n_windows", "n_recordings", "dim", "index_type")} == {
        "n_windows": n_windows, "n_recordings": 12, "dim": 8, "index_type": "HNSW"}
    assert entry["build_params"] == milvus_windows.windows_build_params("HNSW", n_windows)
    assert entry["recall_at_10"] == 1.0  # 43 windows: HNSW at ef >= 1024 is exact
    state = target.call("describe_index", store.collection, index_name=target.call("list_indexes", store.collection)[0])
    assert state["index_type"] == "HNSW"
    source = milvus_windows.MilvusWindows(target, store.collection, dim=8, index_type="HNSW",
                                          build=entry["build_params"], int_keys=True, flush=False)
    source.load()
    try:
        assert source.count() == n_windows
        rows = [kept.index(key) for key in long]  # audio-index row ← written key
        for key, (spans, vectors) in zip(long, source.windows_of(rows), strict=True):
            np.testing.assert_allclose(spans, written[key][0])
            np.testing.assert_allclose(vectors, written[key][1], atol=2e-3)
        others = sorted(set(range(17)) - set(rows))
        assert [len(s) for s, _ in source.windows_of(others)] == [0] * len(others)
        assert source.best_recordings(written[16][1][2], 1)[0][0] == kept.index(16) == 14
    finally:
        source.drop()
