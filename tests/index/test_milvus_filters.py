"""Filters evaluated by Milvus (issue 40): the filter tree as a Milvus expression over the published
JSON metadata, on both real engines (the standalone server, milvus-lite 3.x).

The references are written here or in tests/index/test_filters.py: which items pass is decided by
plain Python over the items' dicts (``_passes``), the top-k over them by numpy brute force, and
FAISS's own filtered search (IndexFlatIP with the mask) is the other backend compared with.
"""

from __future__ import annotations

import uuid

import faiss
import numpy as np
import pytest

from index.engines.filters import MetadataTable, milvus_expr, milvus_string, parse_filter
from index.engines.vector_index import FaissVectorIndex
from index.runtime.loader import filtered_search
from tests.index.test_filters import FILTERS, ITEMS, _assert_same_top_k, _brute_force, _passes
from tests.milvus_server import ENGINES, require_milvus

require_milvus()

from index.engines.milvus_index import (  # noqa: E402
    META_FIELD,
    MilvusTarget,
    MilvusVectorIndex,
    create_collection,
    write_rows,
)

D = 16
HOSTILE = [
    'q"uote', "back\\slash", "new\nline\ttab\rcr", '" or row >= 0 or "', "') or (row >= 0",
    "é日本😀", "line\u2028sep\u0085nel", "\\\"", "",
]
"""String values a request may compare with: each must match its own item and nothing else."""


def _items() -> list[dict]:
    items = [dict(item, metadata=dict(item["metadata"])) for item in ITEMS]
    for i, value in enumerate(HOSTILE):  # the first items carry the hostile values instead
        items[i]["metadata"]["license"] = value
        items[i]["metadata"]["tags"] = [value]
    return items


MILVUS_ITEMS = _items()


def _reference(item: dict, flt: dict) -> bool:
    """``_passes`` with an empty list taken as no value (the documented semantics: ``{"tags": {"ne":
    "rain"}}`` keeps items that have tags, none of them "rain")."""
    meta = {k: v for k, v in item["metadata"].items() if v != []}
    return _passes(dict(item, metadata=meta), flt)

EXTRA_FILTERS = [
    *[{"license": value} for value in HOSTILE],
    {"tags": {"any": HOSTILE[:4]}},
    {"license": {"in": HOSTILE}},
    {"not": {}},  # nothing
    {"not": {"not": {"license": {"ne": "cc0"}}}},
    {"duration": {"gte": 5, "lt": 5.5}, "or": [{"loop": True}, {"tags": {"ne": "rain"}}]},
    {"loop": {"in": [True]}},
    {"duration": {"in": [float(MILVUS_ITEMS[77]["metadata"]["duration"]), 1e20]}},
]
ALL_FILTERS = FILTERS + EXTRA_FILTERS


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    vectors = rng.standard_normal((len(MILVUS_ITEMS), D)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    queries = vectors[rng.choice(len(vectors), 5, replace=False)] + 0.1 * rng.standard_normal((5, D)).astype(np.float32)
    return vectors, queries.astype(np.float32)


@pytest.fixture(scope="module", params=ENGINES)
def collection(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, data) -> MilvusVectorIndex:
    """The items' vectors and metadata in a FLAT collection of each engine, written as publish writes them."""
    from index.engines.filters import milvus_metadata

    if request.param == "server":
        uri = str(request.getfixturevalue("milvus_server").uri)
    else:
        uri = str(tmp_path_factory.mktemp("milvus-lite") / "filters.db")
    target = MilvusTarget(uri=uri, prefix=f"t{uuid.uuid4().hex[:10]}", timeout_s=30.0)
    vectors, _ = data
    fields = MetadataTable.from_items(MILVUS_ITEMS).fields()
    name = target.collection("filters", "audio")
    build = create_collection(target, name, dim=D, text=False, index_type="FLAT", n=len(vectors), meta=True)
    write_rows(target, name, np.arange(len(vectors)), vectors, metas=[milvus_metadata(i, fields) for i in MILVUS_ITEMS])
    target.call("flush", name, bulk=True)
    target.call("load_collection", name, bulk=True)
    yield MilvusVectorIndex(target, name, ntotal=len(vectors), dim=D, build=build, meta_fields=fields)
    target.call("drop_collection", name, bulk=True)


@pytest.mark.parametrize("flt", ALL_FILTERS, ids=[repr(f)[:60] for f in ALL_FILTERS])
def test_milvus_evaluates_the_filter_with_the_answers_of_faiss_and_brute_force(collection, data, flt):
    """Milvus alone (its expression, no mask of ours) returns the brute-force top-k over the items
    that pass, and FAISS's filtered search the same; selective filters (one item of 6,000) too."""
    vectors, queries = data
    allowed = np.array([_reference(item, flt) for item in MILVUS_ITEMS])
    parsed = parse_filter(flt)
    expression = collection.expression(parsed)
    assert expression is not None
    flat = faiss.IndexFlatIP(D)
    flat.add(vectors)
    mask = MetadataTable.from_items(MILVUS_ITEMS).mask(parsed)
    for k in (1, 10):
        reference = _brute_force(vectors, queries, allowed, k)
        scores, rows = collection.search(queries, k, where=expression)
        _assert_same_top_k(scores, rows, reference, k)
        fs, fr = FaissVectorIndex(flat, {}).search(queries, k, allowed=mask)
        np.testing.assert_array_equal(rows, fr)
        np.testing.assert_allclose(scores, fs, atol=1e-5)


def test_hostile_strings_match_their_own_item_only(collection, data):
    vectors, queries = data
    for i, value in enumerate(HOSTILE):
        for flt in ({"license": value}, {"tags": value}):
            _, rows = collection.search(queries[:1], 3, where=collection.expression(parse_filter(flt)))
            assert rows[0].tolist() == [i, -1, -1], (value, flt)


def test_a_stricter_mask_is_applied_on_the_hits_and_the_old_collections_filter_on_our_side(collection, data):
    """``keep`` (the query's own clip excluded, a takedown) drops hits Milvus returned and fetches
    further; a collection published without metadata (``meta_fields`` None), or a string no Milvus
    parser reads back, falls back to filtering on our side with the same answers."""
    vectors, queries = data
    flt = parse_filter({"license": "cc0"})
    allowed = MetadataTable.from_items(MILVUS_ITEMS).mask(flt)
    stricter = allowed.copy()
    stricter[_brute_force(vectors, queries, allowed, 30)[0][0][1]] = False  # query 0's best
    stricter[np.flatnonzero(allowed)[::3]] = False  # and a third of the rest
    reference = _brute_force(vectors, queries, stricter, 10)
    _assert_same_top_k(*filtered_search(collection, queries, 10, stricter, where=flt), reference, 10)
    old = MilvusVectorIndex(collection.target, collection.collection, ntotal=collection.ntotal, dim=D)
    assert old.expression(flt) is None
    _assert_same_top_k(*filtered_search(old, queries, 10, stricter, where=flt), reference, 10)
    control = parse_filter({"license": "a\x01b"})
    assert collection.expression(control) is None and milvus_string("a\x01b") is None
    found = filtered_search(collection, queries, 5, np.zeros(collection.ntotal, bool), where=control)
    assert (found[1] == -1).all()


def test_expressions_escape_every_request_string():
    """What reaches Milvus from a request: escaped field names and strings, numbers, booleans."""
    fields = {'we"ird\\': "string", "n": "number", "b": "boolean", "t": "strings"}
    flt = parse_filter({'we"ird\\': '" or row >= 0 or "', "n": {"gt": 1e20, "in": [1, 2]}, "b": {"in": [True]},
                        "t": {"all": ["x\n"]}, "or": [{}, {"not": {}}]})
    text = milvus_expr(flt, fields, in_operator=False)
    assert text == (
        '(((exists meta["we\\"ird\\\\"]) and (meta["we\\"ird\\\\"] == "\\" or row >= 0 or \\"")) and '
        '(((exists meta["n"]) and (meta["n"] > 1e+20)) and ((exists meta["n"]) and (meta["n"] == 1.0 or meta["n"] == 2.0))) '
        'and ((exists meta["b"]) and (meta["b"] == true)) and ((exists meta["t"]) and (json_contains_all(meta["t"], ["x\\n"]))) '
        'and ((row >= 0) or (not (row >= 0))))'
    )
    assert milvus_expr(parse_filter({"unknown": 1}), fields) is None
    assert milvus_expr(parse_filter({"n": "a string"}), fields) is None
    assert f'meta["{META_FIELD}"]' not in text
