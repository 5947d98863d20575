"""Hostile requests on every public route: malformed input is a 4xx problem document, never a 500
(issue 47, SPEC §17), ids follow one grammar (index.ids) on every route that takes one, and
item writes and bundle activation may be separate tokens. The in-process ASGI app with the keyword
bundle; uploads are real audio.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import unicodedata
from pathlib import Path

import pytest

from index.ids import ItemIdError, check_id
from index.items.log import MAX_METADATA_FIELDS
from service.app import create_app
from tests.service.conftest import ADMIN, fake_opener, make_settings, running_client
from tests.service.fakes import tone, wav_bytes
from tests.service.test_routes import assert_problem

WAV = wav_bytes(tone(["dog"]))


def _post_item(client, item_id, metadata=None, headers=ADMIN):
    return client.post("/v1/items", headers=headers, data={"id": item_id, "metadata": json.dumps(metadata or {})},
                       files={"file": ("x.wav", WAV, "audio/wav")})


# ------------------------------------------------------------------ malformed input: 4xx, never 500


TEXT_BODIES = [
    {"query": "dog", "filter": {"background": "\ud800"}},  # a lone surrogate: ClipFilter.key encoded it (500)
    {"query": "dog", "filter": {"license": {"in": ["cc0", "\udfff"]}}},
    {"query": "\ud800 dog"},
    {"query": "dog", "lang": "\ud800"},
    {"query": "dog", "k": 10**30},
    {"query": "dog", "k": 1e308},
    {"query": "dog", "k": "ten"},
    {"query": "dog", "min_score": float("nan")},
    {"query": ["dog"]},
    {"query": "dog", "filter": {"duration": {"lte": 10**400}}},
    {"query": "dog", "filter": {"duration": {"lte": -(10**400)}}},
]


@pytest.mark.parametrize("body", TEXT_BODIES, ids=range(len(TEXT_BODIES)))
def test_malformed_text_search_bodies_are_4xx_problems(fake_client, body):
    batch = {k: v for k, v in body.items() if k != "query"}
    batch["queries"] = [body["query"]]
    for path, payload in (("/v1/search/text", body), ("/v1/search/text:batch", batch)):
        # NaN as the literal a client may send; lone surrogates as the \\ud800 escapes JSON allows
        raw = json.dumps(payload, allow_nan=True)
        r = fake_client.post(path, content=raw, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (path, r.status_code, r.text[:300])
        assert r.headers["content-type"].startswith("application/problem+json")


@pytest.mark.parametrize("depth", [990, 3000, 100_000])
def test_deeply_nested_json_is_a_4xx_problem_in_a_body_and_in_the_filter_parameter(fake_client, depth):
    """~990 levels made `filter=` raise RecursionError (only ValueError was caught): a 500."""
    deep = "[" * depth + "]" * depth
    for path in ("/v1/search/text", "/v1/search/text:batch"):
        r = fake_client.post(path, content='{"query": "dog", "queries": ["dog"], "filter": ' + deep + "}",
                             headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (path, r.status_code, r.text[:200])
    r = fake_client.post("/v1/items", headers=ADMIN, data={"id": "deep", "metadata": deep},
                         files={"file": ("x.wav", WAV, "audio/wav")})
    assert_problem(r, 422, "validation-error")
    if depth > 3000:  # past what a URL carries
        return
    params = {"filter": '{"not":' * depth + '{"license":"cc0"}' + "}" * depth}
    assert_problem(fake_client.get("/v1/search/similar/clip-dog", params=params), 422, "validation-error")
    assert_problem(fake_client.post("/v1/search/similar", params=params, content=WAV), 422, "validation-error")
    assert_problem(fake_client.post("/v1/search/audio", params=params, content=WAV), 422, "validation-error")


@pytest.mark.parametrize("value", ["\\ud800", "\\udfff x"])
def test_a_lone_surrogate_in_a_filter_parameter_is_a_422(fake_client, value):
    params = {"filter": '{"license": "' + value + '"}'}
    r = fake_client.get("/v1/search/similar/clip-dog", params=params)
    assert 400 <= r.status_code < 500, r.text
    assert_problem(fake_client.post("/v1/search/similar", params=params, content=WAV), r.status_code,
                   r.json()["type"].rsplit(":", 1)[1])


@pytest.mark.parametrize(("name", "value"), [("k", "1e400"), ("k", "nan"), ("k", "-1"), ("k", "9" * 30), ("k", "1.5"),
                                             ("min_score", "nan"), ("min_score", "inf"), ("min_score", "-1e400")])
def test_bad_numbers_in_query_parameters_are_422(fake_client, name, value):
    assert_problem(fake_client.get("/v1/search/similar/clip-dog", params={name: value}), 422, "validation-error")


def test_metadata_limit_counts_what_the_caller_sent(fake_client):
    fields = {f"f{i}": i for i in range(MAX_METADATA_FIELDS)}
    r = _post_item(fake_client, "sixty-four", fields)
    assert r.status_code == 201, r.text
    assert len(r.json()["metadata"]) == MAX_METADATA_FIELDS + 1  # and the measured duration
    body = assert_problem(_post_item(fake_client, "sixty-five", {**fields, "one-more": 1}), 422, "validation-error")
    assert "65 fields" in body["detail"]


# ------------------------------------------------------------------ the id grammar


REFUSED_IDS = {
    "x/../val-02401": "'..' segment",
    "x/./y": "'.' segment",
    "..": "'..' segment",
    "/lead": "empty segment",
    "trail/": "empty segment",
    "a//b": "empty segment",
    "   ": "only whitespace",
    "\u3000\u2003": "only whitespace",
    "evil\u202egnp.wav": "format",
    "a\u2066b": "format",
    "zero\u200bwidth": "format",
    "bom\ufeff": "format",
    "tab\there": "control",
    "nel\u0085": "control",
    "x" * 257: "1–256 characters",
    "中" * 256: "at most 512 bytes",  # 256 characters, 768 bytes: over Milvus's VARCHAR primary key
    " lead": "begin or end with whitespace",
    "trail ": "begin or end with whitespace",
    "a/ /b": "begin or end with whitespace",
    "dir /x": "begin or end with whitespace",
    "\u3164": "invisible filler",
    "\u2800\u2800": "invisible filler",
    "a\u115fb": "invisible filler",
    "line\u2028break": "line separator",
    "para\u2029": "paragraph separator",
    "non\ufdd0char": "noncharacter",
    "plane\U0001fffe": "noncharacter",
}


@pytest.mark.parametrize("item_id", list(REFUSED_IDS), ids=[ascii(i)[:24] for i in REFUSED_IDS])
def test_ids_outside_the_grammar_are_refused_at_creation_and_never_looked_up(fake_client, item_id):
    body = assert_problem(_post_item(fake_client, item_id), 422, "validation-error")
    assert REFUSED_IDS[item_id] in body["detail"]
    batch = fake_client.post("/v1/items:batch", headers=ADMIN, data={"items": json.dumps([{"id": item_id}])},
                             files=[("file", ("a.wav", WAV, "audio/wav"))])
    assert_problem(batch, 422, "validation-error")
    with pytest.raises(ItemIdError):
        check_id(item_id)


def test_the_published_pattern_agrees_with_the_checker():
    """The OpenAPI pattern (what clients validate against) and check_id refuse the same ids, except
    for what a pattern cannot say (the byte length; NFC is applied, not required)."""
    import random
    import re

    from index.ids import MAX_ID_BYTES, MAX_ID_CHARS, json_pattern

    pattern = re.compile(json_pattern())
    alphabet = ["a", "Z", "中", "/", ".", " ", "\u3000", "\u3164", "\u2800", "\u2028", "\ufdd0", "\u200b", "\t",
                "é", "\U0001fffe", "-"]
    rng = random.Random(0)
    samples = list(REFUSED_IDS) + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(3000)]
    for item_id in samples:
        if len(item_id.encode()) > MAX_ID_BYTES or len(item_id) > MAX_ID_CHARS:  # maxLength, and bytes in prose
            continue
        try:
            check_id(item_id)
            accepted = True
        except ItemIdError:
            accepted = False
        assert accepted == bool(pattern.fullmatch(item_id)), ascii(item_id)


def test_a_dot_dot_id_can_never_take_down_the_clip_it_normalises_to(fake_client):
    """`curl -X DELETE …/v1/items/x/../clip-dog` sends /v1/items/clip-dog: harmless only because the id
    `x/../clip-dog` can never be created. Sent unnormalised (percent-encoded) it is a 422."""
    assert _post_item(fake_client, "x/../clip-dog").status_code == 422
    r = fake_client.delete("/v1/items/x%2F..%2Fclip-dog", headers=ADMIN)
    assert_problem(r, 422, "validation-error")
    assert fake_client.get("/v1/items/clip-dog", headers=ADMIN).status_code == 200
    hits = fake_client.post("/v1/search/text", json={"query": "dog", "k": 20}).json()["hits"]
    assert "clip-dog" in {h["id"] for h in hits}


def test_ids_are_stored_in_nfc_and_look_alikes_are_one_item(fake_client):
    nfd, nfc = "caf\u0065\u0301/cr\u0065\u0300me", unicodedata.normalize("NFC", "caf\u00e9/cr\u00e8me")
    assert nfd != nfc and unicodedata.normalize("NFC", nfd) == nfc
    first = _post_item(fake_client, nfd, {"n": 1})
    assert first.status_code == 201 and first.json()["id"] == nfc
    assert _post_item(fake_client, nfc, {"n": 2}).status_code == 201  # replaces: the same item
    for sent in (nfd, nfc):  # addressed either way
        got = fake_client.get(f"/v1/items/{sent}", headers=ADMIN)
        assert got.status_code == 200 and got.json()["id"] == nfc and got.json()["metadata"]["n"] == 2
    hits = fake_client.post("/v1/search/text", json={"query": "dog", "k": 20}).json()["hits"]
    assert [h["id"] for h in hits].count(nfc) == 1 and nfd not in {h["id"] for h in hits}
    similar = fake_client.get(f"/v1/search/similar/{nfd}")
    assert similar.status_code == 200 and similar.json()["id"] == nfc
    assert fake_client.delete(f"/v1/items/{nfd}", headers=ADMIN).status_code == 200
    assert fake_client.get(f"/v1/items/{nfc}", headers=ADMIN).status_code == 404


SLASHED = ["birds/owl.wav", "a/b/c d?.wav", "100%/#1", "ünïcødé/ß"]


@pytest.mark.parametrize("item_id", SLASHED)
def test_ids_with_slashes_work_on_every_route_that_takes_an_id(fake_client, item_id):
    assert _post_item(fake_client, item_id).status_code == 201
    path = "/".join(_quote(segment) for segment in item_id.split("/"))
    for url in (f"/v1/search/similar/{path}", f"/v1/items/{path}", f"/v1/audio/{path}"):
        r = fake_client.get(url, headers=ADMIN)
        assert r.status_code == 200, (url, r.text[:200])
    assert fake_client.get(f"/v1/search/similar/{path}").json()["id"] == item_id
    assert fake_client.delete(f"/v1/items/{path}", headers=ADMIN).json()["id"] == item_id


def _quote(segment: str) -> str:
    from urllib.parse import quote

    return quote(segment, safe="")


@pytest.mark.skipif(shutil.which("node") is None, reason="node runs the demo page's id encoding")
def test_the_demo_pages_id_encoding_reaches_the_item(fake_client):
    """The demo page's own `idPath` (service/web/app.js, run by node) builds the "more like this" and
    audio URLs of ids with `/`, `?`, `#`, `%` and spaces; each reaches its item."""
    source = (Path(__file__).resolve().parents[2] / "service" / "web" / "app.js").read_text()
    start = source.index("function idPath(")
    function = source[start:source.index("\n}\n", start) + 3]
    script = function + "\nconsole.log(JSON.stringify(JSON.parse(process.argv[1]).map(idPath)));"
    paths = json.loads(subprocess.run(["node", "-e", script, json.dumps(SLASHED)], capture_output=True, text=True,
                                      check=True, timeout=30).stdout)
    for item_id, path in zip(SLASHED, paths, strict=True):
        assert _post_item(fake_client, item_id).status_code == 201
        r = fake_client.get(f"/v1/search/similar/{path}?k=3")
        assert r.status_code == 200 and r.json()["id"] == item_id, (path, r.text[:200])
        assert fake_client.get(f"/v1/audio/{path}").status_code == 200


# ------------------------------------------------------------------ tokens


ITEMS_TOKEN = "items-writer-token-abcdef"


@pytest.fixture
def two_token_client(fake_bundles):
    settings = make_settings(bundles_dir=fake_bundles, bundle="fake-a", items_token=ITEMS_TOKEN,
                             environment="production")
    with running_client(create_app(settings, opener=fake_opener)) as client:
        yield client


def test_an_items_token_writes_items_but_cannot_activate_bundles(two_token_client):
    client = two_token_client
    items = {"Authorization": f"Bearer {ITEMS_TOKEN}"}
    assert _post_item(client, "by-items-token", headers=items).status_code == 201
    assert client.get("/v1/items/by-items-token", headers=items).status_code == 200
    assert client.delete("/v1/items/by-items-token", headers=items).status_code == 200
    for method, path, body in (("POST", "/v1/bundles/activate", {"bundle_id": "fake-b", "force": True}),
                               ("POST", "/v1/bundles/rollback", None), ("GET", "/v1/bundles", None)):
        assert_problem(client.request(method, path, headers=items, json=body), 401, "unauthorized")
    # the admin token keeps both scopes (TONEARM_ADMIN_TOKEN alone works as before)
    assert _post_item(client, "by-admin-token").status_code == 201
    r = client.post("/v1/bundles/activate", headers=ADMIN, json={"bundle_id": "fake-b", "force": True})
    assert r.status_code == 200, r.text
    assert_problem(_post_item(client, "nobody", headers={"Authorization": "Bearer wrong-token-123456789"}),
                   401, "unauthorized")


# ------------------------------------------------------------------ uploads within the pod's budget


def test_a_legal_batch_of_eight_large_files_never_touches_tmp(fake_client, tmp_path, monkeypatch):
    """8 × 9.9 MiB (each under TONEARM_MAX_UPLOAD_BYTES) answered 500 ENOSPC: Starlette spooled every
    part over 1 MiB to /tmp, the pod's 64-MiB memory volume. With a temporary directory where nothing
    can be written at all, the batch must still succeed: the parts stay in the process."""
    import tempfile

    import numpy as np
    import soundfile as sf

    rate, seconds = 48_000, 54  # 54 s of 48-kHz stereo PCM-16: 9.9 MiB, inside every limit
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    sf.write(buf, (0.1 * rng.standard_normal((rate * seconds, 2))).astype(np.float32), rate,
             format="WAV", subtype="PCM_16")
    big = buf.getvalue()
    assert 9.5 * 2**20 < len(big) < 10 * 2**20
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-dir"))  # a spool to disk would fail
    files = [("file", (f"{i}.wav", big, "audio/wav")) for i in range(8)]
    specs = [{"id": f"large/{i}"} for i in range(8)]
    r = fake_client.post("/v1/items:batch", headers=ADMIN, files=files, data={"items": json.dumps(specs)})
    assert r.status_code == 201, r.text[:300]
    assert [i["id"] for i in r.json()["items"]] == [s["id"] for s in specs]
    # one upload route over the same spool-free parser
    r = fake_client.post("/v1/search/similar", files={"file": ("big.wav", big, "audio/wav")})
    assert r.status_code == 200, r.text[:300]


def test_a_full_volume_is_a_507_problem_not_a_500(fake_client, fake_bundles):
    """ENOSPC from the item log (its volume full) is reported as such."""
    import errno

    store = fake_client.app.state.tonearm.items
    real_put = store.log.put

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    store.log.put = full
    try:
        assert_problem(_post_item(fake_client, "no-room"), 507, "insufficient-storage")
    finally:
        store.log.put = real_put
