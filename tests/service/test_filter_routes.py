"""Filters on every search route and "more like this", through the ASGI app with the keyword bundle.

The references are numpy over the keyword bundle's own vectors (its model) and a plain-Python
pick of the clips that pass, written here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from index.engines.filters import MAX_CLAUSES, MAX_DEPTH, MAX_VALUES
from tests.service.fakes import CLIPS, KeywordBundle, text_vector, tone, wav_bytes
from tests.service.test_routes import assert_problem

IDS = list(CLIPS)
LICENSE = {clip: ("cc0", "by")[row % 2] for row, clip in enumerate(IDS)}
DURATION = {clip: float(1 + row) for row, clip in enumerate(IDS)}


MODEL = KeywordBundle(Path("/nonexistent"))
"""A fresh instance of the keyword model: its encoders give the reference vectors."""


def _reference(query_vector: np.ndarray, passing: list[str], k: int, exclude: str | None = None):
    if not passing:
        return []
    vectors = MODEL.encode_audio([tone(CLIPS[c]) for c in passing])
    scores = vectors @ (query_vector / np.linalg.norm(query_vector))
    order = sorted(range(len(passing)), key=lambda i: (-scores[i], i))
    return [(passing[i], float(scores[i])) for i in order if passing[i] != exclude][:k]


def _assert_same_ranking(got, expected, every):
    """Same scores rank by rank, and each hit is a passing clip with its reference score (ties may swap)."""
    np.testing.assert_allclose([g[1] for g in got], [e[1] for e in expected], atol=1e-5)
    score_of = dict(every)
    for clip, score in got:
        assert clip in score_of and abs(score_of[clip] - score) < 1e-5


@pytest.mark.parametrize(
    ("flt", "passing"),
    [
        ({"license": "cc0"}, [c for c in IDS if LICENSE[c] == "cc0"]),
        ({"duration": {"lte": 2}}, [c for c in IDS if DURATION[c] <= 2]),
        ({"tags": {"any": ["siren"]}}, [c for c in IDS if "siren" in CLIPS[c]]),
        ({"or": [{"id": "clip-rain"}, {"not": {"license": "cc0"}}]}, [c for c in IDS if c == "clip-rain" or LICENSE[c] != "cc0"]),
        ({"id": "clip-bell"}, ["clip-bell"]),
        ({"license": "none"}, []),
    ],
)
def test_filtered_text_search_equals_brute_force_over_the_passing_clips(fake_client, flt, passing):
    query = "a dog, a dog and a siren"
    r = fake_client.post("/v1/search/text", json={"query": query, "k": 3, "filter": flt})
    assert r.status_code == 200, r.text
    got = [(h["id"], h["score"]) for h in r.json()["hits"]]
    expected = _reference(text_vector(query), passing, 3)
    _assert_same_ranking(got, expected, _reference(text_vector(query), passing, len(IDS)))
    # the batch route and a repeat (served from the cache, keyed by the filter) agree
    batch = fake_client.post("/v1/search/text:batch", json={"queries": [query, query], "k": 3, "filter": flt})
    assert batch.status_code == 200, batch.text
    assert [[h["id"] for h in item["hits"]] for item in batch.json()["results"]] == [[g[0] for g in got]] * 2


def test_a_filter_does_not_leak_into_the_unfiltered_cache(fake_client):
    body = {"query": "a dog", "k": 5}
    filtered = fake_client.post("/v1/search/text", json={**body, "filter": {"id": "clip-rain"}}).json()["hits"]
    assert [h["id"] for h in filtered] == ["clip-rain"]
    assert len(fake_client.post("/v1/search/text", json=body).json()["hits"]) == 5


def test_audio_to_caption_search_takes_a_filter_as_a_json_query_parameter(fake_client):
    params = {"filter": json.dumps({"license": "by"}), "lang": "eng", "k": 5}
    r = fake_client.post("/v1/search/audio", params=params, content=wav_bytes(tone(["dog"])))
    assert r.status_code == 200, r.text
    assert {h["clip_id"] for h in r.json()["hits"]} == {c for c in IDS if LICENSE[c] == "by"}


def test_more_like_a_catalogue_clip_excludes_it_and_equals_brute_force(fake_client):
    target = MODEL.encode_audio([tone(CLIPS["clip-dog-siren"])])[0]
    r = fake_client.get("/v1/search/similar/clip-dog-siren", params={"k": 10})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == "clip-dog-siren"
    expected = _reference(target, IDS, 10, exclude="clip-dog-siren")
    _assert_same_ranking([(h["id"], h["score"]) for h in body["hits"]], expected, expected)
    filtered = fake_client.get(
        "/v1/search/similar/clip-dog-siren", params={"filter": json.dumps({"license": "cc0"}), "min_score": 0.5}
    ).json()["hits"]
    passing = [c for c in IDS if LICENSE[c] == "cc0"]
    assert [h["id"] for h in filtered] == [e[0] for e in _reference(target, passing, 10, "clip-dog-siren")
                                           if e[1] >= 0.5]
    assert_problem(fake_client.get("/v1/search/similar/no-such-clip"), 404, "unknown-target")


def test_more_like_an_upload(fake_client):
    r = fake_client.post("/v1/search/similar", params={"k": 2}, content=wav_bytes(tone(["bell"])))
    assert r.status_code == 200, r.text
    assert r.json()["hits"][0]["id"] == "clip-bell" and r.json()["duration_seconds"] == pytest.approx(1.0)
    r = fake_client.post(
        "/v1/search/similar", params={"filter": json.dumps({"tags": "rain"})}, content=wav_bytes(tone(["bell"]))
    )
    assert [h["id"] for h in r.json()["hits"]] == ["clip-rain"]


def _nested(depth: int) -> dict:
    flt: dict = {"license": "cc0"}
    for _ in range(depth - 1):
        flt = {"not": flt}
    return flt


HOSTILE = [
    (_nested(MAX_DEPTH + 1), "validation-error"),
    (_nested(500), "validation-error"),
    ({"id": {"in": [f"x{i}" for i in range(MAX_VALUES + 1)]}}, "validation-error"),
    ({"or": [{"license": "cc0"}] * (MAX_CLAUSES + 1)}, "validation-error"),
    ({"owner": "me"}, "invalid-filter"),
    ({"duration": "long"}, "invalid-filter"),
    ({"license": {"gte": 3}}, "invalid-filter"),
    ({"duration": {"lte": 10**400}}, "validation-error"),
    ({"license": {"regex": ".*"}}, "validation-error"),
    ({"license": None}, "validation-error"),
    ("license = 'cc0'", "validation-error"),
]


@pytest.mark.parametrize(("flt", "slug"), HOSTILE, ids=[str(h[0])[:40] for h in HOSTILE])
def test_hostile_filters_are_422_problems_on_every_route(fake_client, flt, slug):
    assert_problem(fake_client.post("/v1/search/text", json={"query": "dog", "filter": flt}), 422, slug)
    assert_problem(fake_client.post("/v1/search/text:batch", json={"queries": ["dog"], "filter": flt}), 422, slug)
    params = {"filter": json.dumps(flt)}
    assert_problem(fake_client.get("/v1/search/similar/clip-dog", params=params), 422, slug)
    audio = wav_bytes(tone(["dog"]))
    assert_problem(fake_client.post("/v1/search/similar", params=params, content=audio), 422, slug)
    assert_problem(fake_client.post("/v1/search/audio", params=params, content=audio), 422, slug)


def test_unparsable_filter_parameter_is_a_422(fake_client):
    r = fake_client.get("/v1/search/similar/clip-dog", params={"filter": "{not json"})
    assert_problem(r, 422, "validation-error")


def test_openapi_states_the_catalogues_fields_in_the_filter_schema(fake_client):
    doc = fake_client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    top = schemas["Filter"]
    assert set(top["properties"]) == {"id", "uri", "license", "duration", "tags", "and", "or", "not"}
    assert top["additionalProperties"] is False
    assert "lte" in top["properties"]["duration"]["anyOf"][1]["properties"]
    assert "lte" not in top["properties"]["license"]["anyOf"][1]["properties"]
    assert "not" not in schemas[f"FilterLevel{MAX_DEPTH}"]["properties"]
    assert schemas["TextSearchRequest"]["properties"]["filter"] == {"$ref": "#/components/schemas/Filter"}
    similar = doc["paths"]["/v1/search/similar/{item_id}"]["get"]["parameters"]
    assert [p["content"]["application/json"]["schema"] for p in similar if p["name"] == "filter"] == [
        {"$ref": "#/components/schemas/Filter"}
    ]
