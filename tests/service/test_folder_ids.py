"""`tonearm index` over a folder applies the id grammar before the embedding pass (issue 55, part 2).

Real files named as real folders hold them (ext4 keeps names as bytes: an NFD name and its NFC twin are
two files); the real tiny bundle's encoders; the published bundle checked by the publish check and
`tonearm bundle publish` to Milvus; the service through its real app, on the item log."""

from __future__ import annotations

import json
import os
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from index.ids import check_catalogue_ids
from index.runtime.loader import LoadedBundle
from index.runtime.verify import verify_bundle
from service.app import create_app
from tests.milvus_server import require_milvus
from tests.service.bundle_factory import copy_bundle
from tests.service.conftest import ADMIN, make_settings, running_client
from tonearm.cli import main as tonearm_main

CAFE = "café.wav"
CAFE_NFD = unicodedata.normalize("NFD", CAFE)
LONG = "中" * 80 + "/" + "中" * 80 + "/" + "中" * 10 + ".wav"  # 516 bytes of UTF-8, every name under 255
REFUSED = {  # file name → what its skipped reason says
    CAFE: "in Unicode NFC the same id as the earlier clip",  # the NFC twin: the NFD file sorts first
    "birds /owl.wav": "begin or end with whitespace",
    LONG: "at most 512 bytes of UTF-8; this one has 516",
    "zero\u200bwidth.wav": "U+200B",
}


@pytest.fixture(scope="module")
def folder(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    rate = LoadedBundle.open(tiny_bundle).sample_rate
    root = tmp_path_factory.mktemp("named")
    rng = np.random.default_rng(55)
    for i, rel in enumerate(["plain.wav", CAFE_NFD, *REFUSED]):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        sf.write(path, rng.uniform(-0.5, 0.5, rate // 2 * (i + 1)).astype(np.float32), rate, format="WAV")
    with open(os.path.join(os.fsencode(root), b"latin1-\xe9t\xe9.wav"), "wb") as handle:  # not UTF-8
        handle.write((root / "plain.wav").read_bytes())
    return root


@pytest.fixture(scope="module")
def named_bundle(folder: Path, tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("named_bundles") / "named"
    assert tonearm_main(["index", str(folder), "--bundle", str(tiny_bundle), "--out", str(out)]) == 0
    return out


def test_the_bundle_holds_nfc_ids_and_lists_the_refused_names_with_the_rule(named_bundle: Path, folder: Path) -> None:
    rows = [json.loads(line) for line in (named_bundle / "audio_ids.jsonl").read_text(encoding="utf-8").splitlines()]
    assert {r["id"]: r["uri"] for r in rows} == {CAFE: CAFE_NFD, "plain.wav": "plain.wav"}  # uri: the file as named
    assert (folder / rows[[r["id"] for r in rows].index(CAFE)]["uri"]).is_file()
    manifest = verify_bundle(named_bundle)
    skipped = {s.id: s.reason for s in manifest.skipped_clips or []}
    assert len(skipped) == len(REFUSED) + 1, skipped
    for name, rule in REFUSED.items():
        shown = name.replace("\u200b", "\\u200b")
        assert rule in skipped[shown], (name, skipped)
        assert "docs/service.md" in skipped[shown]
    assert "lone surrogate" in skipped["latin1-\\udce9t\\udce9.wav"]
    text = (named_bundle / "manifest.json").read_text(encoding="utf-8")
    assert "\u200b" not in text and "\\udce9" in text  # never an invisible character raw
    check_catalogue_ids([r["id"] for r in rows], "the named bundle")  # what `bundle publish` checks


def test_tonearm_bundle_publish_takes_the_bundle(named_bundle: Path, tmp_path: Path) -> None:
    require_milvus()
    assert tonearm_main(["bundle", "publish", str(named_bundle), "--milvus-uri", str(tmp_path / "m.db")]) == 0


def test_the_nfc_form_of_a_decomposed_file_addresses_its_clip_never_a_look_alike(
    named_bundle: Path, folder: Path, tmp_path: Path
) -> None:
    """The clip of the NFD file is stored as NFC: its audio streams, and POSTing either form replaces that
    clip (an existing id: re-posting replaces, docs/service.md "Items") instead of adding a second one."""
    bundles = tmp_path / "bundles"
    copy_bundle(named_bundle, bundles)
    app = create_app(make_settings(bundles_dir=bundles, bundle=named_bundle.name, items_dir=tmp_path / "items"))
    with running_client(app) as client:
        streamed = client.get(f"/v1/audio/{CAFE}")
        assert streamed.status_code == 200 and streamed.content == (folder / CAFE_NFD).read_bytes()
        assert client.get(f"/v1/items/{CAFE}", headers=ADMIN).json()["source"] == "bundle"
        audio = (folder / "plain.wav").read_bytes()
        for sent in (CAFE, CAFE_NFD):
            r = client.post("/v1/items", headers=ADMIN, data={"id": sent, "metadata": "{}"},
                            files={"file": ("a.wav", audio, "audio/wav")})
            assert r.status_code == 201, r.text
            assert r.json()["id"] == CAFE
        assert client.get(f"/v1/items/{CAFE}", headers=ADMIN).json()["source"] == "added"
        hits = client.post("/v1/search/text", json={"query": "noise", "k": 10}).json()["hits"]
        assert sorted(h["id"] for h in hits) == sorted([CAFE, "plain.wav"])
