"""The filter language (index.engines.filters) and filtered FAISS search (index.engines.vector_index).

References are written here: the passing rows are picked with plain Python over the items'
dicts, and the top-k over them by numpy brute force — never the code under test called twice.
"""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from index.engines.filters import (
    MAX_CLAUSES,
    MAX_DEPTH,
    MAX_VALUES,
    FilterError,
    MetadataTable,
    parse_filter,
)
from index.engines.vector_index import EXACT_SUBSET_ROWS, PREFILTER_ROWS, FaissVectorIndex
from tests.index.filter_reference import passes

N, D = 6000, 16
LICENSES = ["cc0", "by", "by-nc"]


def _items(n: int = N) -> list[dict]:
    rng = np.random.default_rng(3)
    items = []
    for i in range(n):
        meta: dict = {"license": LICENSES[i % 3], "duration": float(rng.uniform(0, 20)),
                      "tags": [t for t in ("foley", "rain", "door") if rng.random() < 0.4], "loop": bool(i % 5 == 0)}
        if i % 7 == 0:
            del meta["license"]  # a missing value
        items.append({"id": f"c{i:05d}", "uri": f"file:///{i}.wav", "captions": {}, "split": "test", "metadata": meta})
    return items


ITEMS = _items()


def _passes(item: dict, flt: dict) -> bool:
    """The reference evaluator (tests/index/filter_reference.py) on an item's fields: its top-level keys
    win over its ``metadata`` keys of the same name, ``captions`` is not a field."""
    return passes({**item["metadata"], **{k: v for k, v in item.items() if k not in ("captions", "metadata")}}, flt)


FILTERS = [
    {"license": "cc0"},
    {"duration": {"lte": 5}},
    {"tags": {"any": ["rain", "door"]}},
    {"tags": "foley", "loop": False},
    {"not": {"license": "cc0"}},
    {"license": {"ne": "by"}},
    {"or": [{"license": {"in": ["by-nc"]}}, {"duration": {"gt": 19.5}}]},
    {"and": [{"tags": {"all": ["rain", "door"]}}, {"not": {"duration": {"gte": 3, "lt": 17}}}]},
    {"id": "c04242"},  # one item of 6,000
    {"id": {"in": ["c00001", "c00010", "c05999"]}},
    {"split": "test"},
    {"license": "pd"},  # nothing passes
]


@pytest.mark.parametrize("flt", FILTERS, ids=[str(f) for f in FILTERS])
def test_mask_matches_a_plain_python_reference(flt):
    table = MetadataTable.from_items(ITEMS)
    expected = np.array([_passes(item, flt) for item in ITEMS])
    np.testing.assert_array_equal(table.mask(parse_filter(flt)), expected)


def _brute_force(vectors, queries, allowed, k):
    rows = np.flatnonzero(allowed)
    scores = queries @ vectors[rows].T
    return [[(float(scores[i, j]), int(rows[j])) for j in np.argsort(-scores[i], kind="stable")[:k]]
            for i in range(len(queries))]


def _assert_same_top_k(got_scores, got_rows, reference, k):
    for i, ref in enumerate(reference):
        rows = [int(r) for r in got_rows[i] if r >= 0]
        assert len(rows) == min(k, len(ref)) == len(ref)
        np.testing.assert_allclose(got_scores[i, : len(rows)], [s for s, _ in ref], rtol=0, atol=1e-5)
        assert rows == [r for _, r in ref] or np.allclose(np.diff([s for s, _ in ref]), 0, atol=1e-5)


@pytest.mark.parametrize("flt", FILTERS, ids=[str(f) for f in FILTERS])
def test_filtered_flat_top_k_equals_brute_force_over_the_passing_items(flt):
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((N, D)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    queries = vectors[rng.choice(N, 7, replace=False)] + 0.1 * rng.standard_normal((7, D)).astype(np.float32)
    index = faiss.IndexFlatIP(D)
    index.add(vectors)
    allowed = np.array([_passes(item, flt) for item in ITEMS])
    table = MetadataTable.from_items(ITEMS)
    for k in (1, 10, 50):
        scores, rows = FaissVectorIndex(index, {}).search(queries, k, allowed=table.mask(parse_filter(flt)))
        assert rows.shape == (7, k)
        assert np.all(allowed[rows[rows >= 0]])
        _assert_same_top_k(scores, rows, _brute_force(vectors, queries, allowed, k), k)


def _unit_vectors_in_an_ivf(rng: np.random.Generator, n: int) -> tuple[np.ndarray, faiss.IndexIVFFlat]:
    """``n`` random unit vectors and an exact-valued IVF64,Flat (inner product) holding them."""
    vectors = rng.standard_normal((n, D)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(D), D, 64, faiss.METRIC_INNER_PRODUCT)
    ivf.train(vectors)
    ivf.add(vectors)
    return vectors, ivf


def test_both_strategies_are_exercised_and_ivf_finds_a_one_in_many_item():
    """Broad filters over-fetch, selective ones pre-filter; on IVF with nprobe 1 the pre-filter
    scans every list, so a lone passing item far from the query is still found."""
    rng = np.random.default_rng(1)
    n = 20_000
    vectors, ivf = _unit_vectors_in_an_ivf(rng, n)
    index = FaissVectorIndex(ivf, {"nprobe": 1})
    query = -vectors[:1]  # the lone passing row 0 is the farthest one from the query
    allowed = np.zeros(n, bool)
    allowed[0] = True
    scores, rows = index.search(query, 5, allowed=allowed)
    assert rows[0].tolist() == [0, -1, -1, -1, -1]
    np.testing.assert_allclose(scores[0, 0], -1.0, atol=1e-5)
    assert PREFILTER_ROWS < n // 2
    broad = rng.random(n) < 0.5
    flat = faiss.IndexFlatIP(D)
    flat.add(vectors)
    scores, rows = FaissVectorIndex(flat, {}).search(vectors[:3], 10, allowed=broad)
    _assert_same_top_k(scores, rows, _brute_force(vectors, vectors[:3], broad, 10), 10)


def _nested(depth: int) -> dict:
    flt: dict = {"license": "cc0"}
    for _ in range(depth - 1):
        flt = {"not": flt}
    return flt


@pytest.mark.parametrize(
    ("flt", "message"),
    [
        (_nested(MAX_DEPTH + 1), "nest at most"),
        ({"license": {"in": ["x"] * (MAX_VALUES + 1)}}, "at most"),
        ({"or": [{"license": "cc0"}] * (MAX_CLAUSES + 1)}, "at most"),
        ({"license": {"lt": "z"}}, "takes a number"),
        ({"license": {"regex": ".*"}}, "unknown operator"),
        ({"license": None}, "expected a string"),
        ({"license": ["cc0"]}, "expected a string"),
        ({"and": {"license": "cc0"}}, "non-empty list"),
        ({"license": {}}, "at least one"),
        ({"tags": {"any": [1]}}, "list of strings"),
        ({"license": {"in": ["a", 1]}}, "one type"),
        ([], "JSON object"),
    ],
)
def test_malformed_filters_are_rejected_before_any_catalogue(flt, message):
    with pytest.raises(FilterError, match=message):
        parse_filter(flt)


@pytest.mark.parametrize(
    ("flt", "message"),
    [
        ({"owner": "me"}, "not in the catalogue"),
        ({"duration": "long"}, "holds numbers"),
        ({"license": {"gt": 1}}, "holds strings"),
        ({"license": {"any": ["cc0"]}}, "needs a list field"),
        ({"loop": 1}, "holds booleans"),
        ({"tags": {"lt": 2}}, "lists of strings"),
    ],
)
def test_unknown_fields_and_wrong_types_are_user_errors(flt, message):
    table = MetadataTable.from_items(ITEMS[:50])
    with pytest.raises(FilterError, match=message):
        table.mask(parse_filter(flt))


def test_the_deepest_allowed_filter_and_the_largest_list_are_accepted():
    table = MetadataTable.from_items(ITEMS[:50])
    assert table.mask(parse_filter(_nested(MAX_DEPTH))).dtype == bool
    big = {"id": {"in": [f"c{i:05d}" for i in range(MAX_VALUES)]}}
    assert table.mask(parse_filter(big)).all()
    assert parse_filter({}).matches_all and table.mask(parse_filter({})).all()


@pytest.mark.parametrize("passing", [1, 300, EXACT_SUBSET_ROWS, EXACT_SUBSET_ROWS + 200])
def test_ivf_prefilter_finds_every_passing_row_whether_read_back_or_scanned(passing):
    """At most EXACT_SUBSET_ROWS passing rows are read back by id and ranked exactly, more are found
    by a scan of every list; with nprobe 1 either must reach rows far from the query's own list."""
    rng = np.random.default_rng(2)
    n = 20_000
    vectors, ivf = _unit_vectors_in_an_ivf(rng, n)
    index = FaissVectorIndex(ivf, {"nprobe": 1})
    allowed = np.zeros(n, bool)
    allowed[rng.choice(n, passing, replace=False)] = True
    assert passing <= PREFILTER_ROWS  # the pre-filter, not the over-fetch
    queries = vectors[rng.choice(n, 5, replace=False)]
    for k in (1, 10):
        scores, rows = index.search(queries, k, allowed=allowed)
        _assert_same_top_k(scores, rows, _brute_force(vectors, queries, allowed, k), k)
    assert bool(ivf.direct_map.type) == (passing <= EXACT_SUBSET_ROWS)  # read back through the direct map


def test_an_on_disk_ivf_reads_few_passing_rows_back_from_its_lists(tmp_path):
    from index.engines.faiss_index import load_index, parse_factory
    from index.engines.faiss_ondisk import build_sharded

    rng = np.random.default_rng(3)
    n = 4_000
    vectors = rng.standard_normal((n, D)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    built = build_sharded(vectors, tmp_path / "audio.faiss", "IVF16,SQfp16", work=tmp_path / "shards", shard_rows=1_500)
    assert built.built is not None and (tmp_path / "audio.ivfdata").exists()
    loaded = load_index(tmp_path / "audio.faiss", spec=parse_factory("IVF16,SQfp16", D),
                        search_params={"nprobe": 1}, mmap_threshold_bytes=0)
    allowed = np.zeros(n, bool)
    allowed[rng.choice(n, 40, replace=False)] = True
    queries = vectors[rng.choice(n, 5, replace=False)]
    scores, rows = FaissVectorIndex(loaded, {"nprobe": 1}).search(queries, 10, allowed=allowed)
    reference = _brute_force(vectors, queries, allowed, 10)  # the original vectors; fp16 codes are within 1e-3
    for i, ref in enumerate(reference):
        assert rows[i].tolist() == [r for _, r in ref]
        np.testing.assert_allclose(scores[i], [s for s, _ in ref], atol=2e-3)
