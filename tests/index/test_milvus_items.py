"""Added items kept in Milvus (issue 47, part 5): :class:`index.items.milvus_store.MilvusItemStore` on the real
Milvus standalone server of the test session (tests/milvus_server.py).

The brute-force parity also runs on milvus-lite 3.x. The reference is independent of Milvus and of
the expression writer: exact inner products in numpy over the live items, filtered by :meth:`index.engines.filters.MetadataTable.mask` (the evaluator the FAISS
backend uses). A second replica is a second process with its own client; a reconnect drops the
process's client and opens a new one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from tests.milvus_server import require_milvus

require_milvus()

from index.engines import milvus_index  # noqa: E402
from index.engines.filters import FilterError, MetadataTable, parse_filter  # noqa: E402
from index.engines.milvus_index import MilvusTarget  # noqa: E402
from index.items.milvus_store import MilvusItemStore, row_metadata  # noqa: E402

DIM = 16
N = 600
K = 10
LICENSES = ("cc0", "cc-by", "cc-by-nc", "proprietary")
TAGS = ("rain", "wind", "night", "city", "birds", "sea")
FILTERS = [
    {},
    {"license": "cc0"},
    {"license": {"in": ["cc0", "cc-by"]}},
    {"not": {"license": "cc0"}},
    {"license": {"ne": "proprietary"}},
    {"duration": {"lte": 5}},
    {"duration": {"gt": 2.5, "lt": 7}},
    {"tags": "rain"},
    {"tags": {"any": ["wind", "sea"]}},
    {"tags": {"all": ["rain", "night"]}},
    {"tags": {"ne": "city"}},
    {"or": [{"loop": True}, {"tags": "birds"}]},
    {"and": [{"loop": False}, {"duration": {"gte": 3}}, {"not": {"tags": "rain"}}]},
    {"id": {"in": ["it-00007", "it-00123", "it-00599", "absent"]}},  # ~0.5 % selectivity
    {"license": "cc0", "duration": {"lt": 0.5}},  # rare
]


def _metadata(rng: np.random.Generator, i: int) -> dict:
    meta: dict = {"duration": round(float(rng.uniform(0.1, 10.0)), 2)}
    if i % 7:  # some items have no license: missing, never equal, never "ne"
        meta["license"] = LICENSES[int(rng.integers(len(LICENSES)))]
    if i % 5:
        meta["tags"] = sorted({TAGS[int(t)] for t in rng.integers(len(TAGS), size=int(rng.integers(1, 4)))})
    if i % 3 == 0:
        meta["loop"] = bool(rng.integers(2))
    meta["credit"] = {"author": f"a{i}"}  # an object: stored, never filterable
    return meta


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.standard_normal((n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


class Reference:
    """The live items as the test wrote them: exact search, filters by MetadataTable."""

    def __init__(self) -> None:
        self.items: dict[str, tuple[np.ndarray, dict]] = {}

    def search(self, queries: np.ndarray, k: int, flt: dict) -> tuple[np.ndarray, list[list[str]]]:
        ids = sorted(self.items)
        vectors = np.stack([self.items[i][0] for i in ids])
        table = MetadataTable.from_items([row_metadata(i, self.items[i][1]) for i in ids])
        mask = table.mask(parse_filter(flt))
        scores = queries @ vectors.T
        out_s = np.full((len(queries), k), -np.inf, np.float32)
        out_i: list[list[str]] = []
        for q in range(len(queries)):
            rows = sorted(np.flatnonzero(mask), key=lambda r: (-scores[q, r], ids[r]))[:k]
            out_s[q, : len(rows)] = scores[q, rows]
            out_i.append([ids[r] for r in rows])
        return out_s, out_i


@pytest.fixture(scope="module")
def store(milvus_server) -> tuple[MilvusItemStore, Reference]:
    """One store of N items per module (the session's server is shared: a fresh prefix)."""
    target = MilvusTarget(uri=milvus_server.uri, prefix=f"t{uuid.uuid4().hex[:10]}")
    s = MilvusItemStore(target, dim=DIM).open()
    rng = np.random.default_rng(47)
    vectors = _unit(rng, N)
    ref = Reference()
    batch = []
    for i in range(N):
        item_id, meta = f"it-{i:05d}", _metadata(rng, i)
        batch.append((item_id, vectors[i], meta))
        ref.items[item_id] = (vectors[i], meta)
    s.put(batch[:100])
    s.put(batch[100:], docs=[{"audio": f"{b[0]}.flac"} for b in batch[100:]])
    yield s, ref
    s.drop()


def _check(store: MilvusItemStore, ref: Reference, queries: np.ndarray, flt: dict) -> None:
    got_s, got_i = store.search(queries, K, parse_filter(flt))
    want_s, want_i = ref.search(queries, K, flt)
    assert got_i == want_i, flt
    np.testing.assert_allclose(got_s, want_s, atol=1e-5)


def test_search_equals_brute_force_with_filters(store):
    s, ref = store
    queries = _unit(np.random.default_rng(1), 4)
    assert s.count() == N
    for flt in FILTERS:
        _check(s, ref, queries, flt)
    # the filters are selective where they should be: guard against a filter that passes everything
    table = MetadataTable.from_items([row_metadata(i, m) for i, (_, m) in sorted(ref.items.items())])
    assert min(int(table.mask(parse_filter(f)).sum()) for f in FILTERS) < 10


def test_milvus_lite_equals_brute_force(tmp_path: Path):
    """The same store on milvus-lite 3.x (no ``in`` on JSON keys there: ``milvus_expr`` writes ``or``
    chains), with a delete and a takedown."""
    s = MilvusItemStore(MilvusTarget(uri=str(tmp_path / "items.db"), prefix="lite"), dim=DIM).open()
    rng = np.random.default_rng(48)
    vectors, ref = _unit(rng, 300), Reference()
    batch = [(f"it-{i:05d}", vectors[i], _metadata(rng, i)) for i in range(300)]
    ref.items.update({item_id: (vector, meta) for item_id, vector, meta in batch})
    s.put(batch)
    s.delete(["it-00001"])
    s.takedown(["it-00002", "clip-1"])
    del ref.items["it-00001"], ref.items["it-00002"]
    assert s.count() == len(ref.items) and s.ids(takedown=True) == ["clip-1", "it-00002"]
    queries = _unit(np.random.default_rng(5), 3)
    for flt in FILTERS:
        _check(s, ref, queries, flt)


def test_fields_and_filter_errors(store):
    s, _ = store
    fields = s.fields()
    assert fields == {"duration": "number", "id": "string", "license": "string", "loop": "boolean",
                      "tags": "strings"}  # "credit" (an object) is not filterable
    with pytest.raises(FilterError, match="not in the catalogue"):
        s.search(np.zeros((1, DIM), np.float32), K, parse_filter({"genre": "rock"}))
    with pytest.raises(FilterError, match="holds numbers"):
        s.search(np.zeros((1, DIM), np.float32), K, parse_filter({"duration": "long"}))


def test_upsert_delete_takedown_and_a_second_replica(store, tmp_path: Path):
    """Writes on this replica are seen by a second process at once (Strong reads), and the other way
    round; then the same after this process reconnects."""
    s, ref = store
    rng = np.random.default_rng(2)
    queries = _unit(rng, 3)
    # replace one item (twice in one batch: the last wins; new vector right on query 0, new metadata),
    # delete two, take down a bundle clip
    s.put([("it-00010", queries[2], {"license": "cc-by"}), ("it-00010", queries[0], {"license": "cc0", "duration": 0.2})])
    ref.items["it-00010"] = (queries[0], {"license": "cc0", "duration": 0.2})
    s.delete(["it-00011", "it-00012", "never-added"])
    del ref.items["it-00011"], ref.items["it-00012"]
    s.takedown(["clip-7", "it-00013"])  # a takedown over an added item replaces it
    del ref.items["it-00013"]
    assert s.ids(takedown=True) == ["clip-7", "it-00013"]
    assert len(s.ids(takedown=False)) == len(ref.items) == s.count()
    got = s.get(["it-00010", "it-00100", "clip-7"])
    assert got["it-00010"].metadata == {"license": "cc0", "duration": 0.2, "id": "it-00010"}
    assert got["it-00100"].doc == {"audio": "it-00100.flac"} and got["clip-7"].takedown
    scores, ids = s.search(queries, K, parse_filter({"license": "cc0", "duration": {"lt": 0.5}}))
    assert ids[0][0] == "it-00010" and scores[0, 0] == pytest.approx(1.0, abs=1e-5)
    for flt in ({}, {"license": "cc0"}, {"tags": {"any": ["rain"]}}):
        _check(s, ref, queries, flt)

    # a second replica: another process, its own client, no shared volume
    script = tmp_path / "replica.py"
    script.write_text(
        "import json, sys\nimport numpy as np\n"
        "from index.engines.filters import parse_filter\nfrom index.engines.milvus_index import MilvusTarget\n"
        "from index.items.milvus_store import MilvusItemStore\n"
        "uri, prefix, q = sys.argv[1], sys.argv[2], np.array(json.loads(sys.argv[3]), np.float32)\n"
        f"s = MilvusItemStore(MilvusTarget(uri=uri, prefix=prefix), dim={DIM}).open()\n"
        "out = {f: s.search(q, 10, parse_filter(json.loads(f)))[1] for f in sys.argv[4:]}\n"
        "out['takedowns'] = s.ids(takedown=True)\n"
        "s.put([('from-replica-2', q[1], {'license': 'cc0', 'tags': ['rain']})])\n"
        "print(json.dumps(out))\n"
    )
    filters = [json.dumps(f) for f in ({}, {"license": "cc0"}, {"tags": {"all": ["rain", "night"]}})]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, str(script), s.target.uri, s.target.prefix,
                           json.dumps(queries.tolist()), *filters], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["takedowns"] == ["clip-7", "it-00013"]
    for f in filters:
        assert seen[f] == ref.search(queries, K, json.loads(f))[1], f
    ref.items["from-replica-2"] = (queries[1], {"license": "cc0", "tags": ["rain"]})
    _, ids = s.search(queries[1:2], 1, parse_filter({"tags": "rain"}))
    assert ids == [["from-replica-2"]]  # the other replica's write, seen here at once

    # a reconnect: this process's client closed and dropped; a new store object on a new client
    key = (s.target.uri, s.target.token)
    milvus_index._CLIENTS.pop(key).close()
    again = MilvusItemStore(MilvusTarget(uri=s.target.uri, prefix=s.target.prefix), dim=DIM).open()
    for flt in ({}, {"license": "cc0"}, {"not": {"tags": "rain"}}):
        _check(again, ref, queries, flt)
    assert again.ids(takedown=True) == ["clip-7", "it-00013"]


def test_dimension_is_checked(store):
    s, _ = store
    with pytest.raises(Exception, match="holds 16-d vectors"):
        MilvusItemStore(s.target, dim=DIM * 2).open()


@pytest.mark.slow
def test_items_survive_the_server_killed_right_after_the_writes(store, milvus_server):
    """Acknowledged writes are flushed: Milvus SIGKILLed at once comes back with every item, takedown
    and delete (a restart of the session's server, ~20 s)."""
    import time

    from index.errors import IndexBackendError, IndexUnavailable

    s, ref = store
    rng = np.random.default_rng(3)
    queries = _unit(rng, 2)
    s.put([("last-write", queries[0], {"license": "cc-by", "tags": ["sea"]})])
    ref.items["last-write"] = (queries[0], {"license": "cc-by", "tags": ["sea"]})
    s.delete(["it-00020"])
    del ref.items["it-00020"]
    s.takedown(["clip-9"])
    milvus_server.kill()
    milvus_server.start()
    milvus_index._DOWN.clear()
    deadline = time.monotonic() + 120
    while True:
        try:
            reopened = MilvusItemStore(MilvusTarget(uri=s.target.uri, prefix=s.target.prefix), dim=DIM).open()
            takedowns = reopened.ids(takedown=True)
            break
        except (IndexUnavailable, IndexBackendError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    assert "clip-9" in takedowns and reopened.count() == len(ref.items)
    for flt in ({}, {"license": "cc-by"}, {"tags": {"any": ["sea", "night"]}}):
        _check(reopened, ref, queries, flt)


def test_writes_in_a_block_are_flushed_together_and_the_flush_mode_follows_the_version(milvus_server, tmp_path):
    """A service write touches two or three collections; `flushed_together` flushes them once, at the
    end, concurrently (one 0.5-s flush poll instead of one per collection). Milvus's statistics count
    only flushed rows: none inside the block, every row after it — also when the block fails.

    The flush mode: `auto` flushes each write on the session's Milvus 2.3.5 and on Milvus Lite (no
    flush rate limit there) and would not from 2.4 (0.1 flush per second per collection by default);
    `off` is refused before 2.4: there pymilvus's query iterator — every listing — reads at a
    client-side timestamp and missed an unflushed row (measured here). Not rehearsed: a 2.4+ server
    (PyPI's `milvus` is 2.3.5). Two fresh stores (the module's has deletes, which a compaction could
    apply to the counts meanwhile); each store costs seconds to create, each flush ~1 s."""
    from index.errors import TonearmError
    from index.items.milvus_store import flush_each_write, flushed_together

    target = MilvusTarget(uri=milvus_server.uri, prefix=f"t{uuid.uuid4().hex[:10]}")
    assert str(target.call("get_server_version", bulk=True)).lstrip("v").startswith("2.3.")
    assert flush_each_write(target, "auto") is True and flush_each_write(target, "write") is True
    lite = MilvusTarget(uri=str(tmp_path / "lite.db"))
    assert flush_each_write(lite, "auto") is True
    for where in (target, lite):
        with pytest.raises(TonearmError, match="need Milvus 2.4 or later"):
            flush_each_write(where, "off")
    with pytest.raises(ValueError, match="expected one of auto, write, off"):
        flush_each_write(target, "sometimes")

    first, second = (MilvusItemStore(target, dim=DIM, name=name).open() for name in ("first", "second"))
    flushed = lambda s: int(target.client().get_collection_stats(s.collection)["row_count"])  # noqa: E731
    vectors = _unit(np.random.default_rng(5), 5)
    before = 0
    try:
        with flushed_together():
            first.put([("zz-a", vectors[0], {"license": "cc0"})])
            second.put([("b", vectors[1], {"license": "cc0"})])
            second.takedown(["clip-1"])
            assert (flushed(first), flushed(second)) == (before, 0), "flushes wait for the block's end"
            assert list(first.get(["zz-a"])) == ["zz-a"], "a Strong query sees the unflushed write"
        assert (flushed(first), flushed(second)) == (before + 1, 2)
        with pytest.raises(RuntimeError, match="after the write"), flushed_together():
            second.put([("c", vectors[2], {})])
            raise RuntimeError("after the write")
        assert flushed(second) == 3, "a failed block still flushes what it wrote"
        second.flush = False  # what `off` does on 2.4+: acknowledged from the write-ahead log
        second.put([("e", vectors[4], {})])
        assert list(second.get(["e"])) == ["e"] and flushed(second) == 3
    finally:
        first.drop()
        second.drop()
