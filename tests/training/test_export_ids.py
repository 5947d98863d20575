"""`tonearm export` applies the id grammar to the catalogue before the embedding pass (issue 55, part 2), as
`tonearm index` does (tests/service/test_folder_ids.py): a clip id is stored in NFC, an id the grammar
refuses and an NFC duplicate of an earlier id are skipped and listed in ``skipped_clips`` with the rule,
and the bundle passes the publish check. Real: the session's tiny checkpoint and corpus (one export,
~3–10 s on 2 cores)."""

from __future__ import annotations

import json
import logging
import shutil
import unicodedata
from pathlib import Path

import pytest

from index.bundle import format as fmt
from index.ids import check_catalogue_ids
from training.bundle import export

CAFE = "café-03"
RENAMED = {  # row of the tiny corpus (train split) → its new id
    3: unicodedata.normalize("NFD", CAFE),
    4: CAFE,  # the NFC twin of row 3's id: skipped, row 3 kept
    5: "中" * 256,  # 768 bytes
    6: "birds /owl",
    7: "zero\u200bwidth",
}


def test_an_export_stores_nfc_ids_and_skips_the_ids_the_grammar_refuses(
    tiny_checkpoint: Path, tiny_corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    corpus = tmp_path / "corpus"
    shutil.copytree(tiny_corpus.parent, corpus)
    manifest = corpus / tiny_corpus.name
    rows = [json.loads(line) for line in manifest.read_text(encoding="utf-8").splitlines()]
    assert all(rows[i]["split"] == "train" for i in RENAMED)
    for i, new in RENAMED.items():
        rows[i]["id"] = new
    manifest.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")

    with caplog.at_level(logging.WARNING, logger="training.bundle.export"):
        bundle = export.export_bundle(tiny_checkpoint, manifest=manifest, out_dir=tmp_path / "out", progress=False)
    ids = [json.loads(line)["id"] for line in (bundle / fmt.AUDIO_IDS).read_text(encoding="utf-8").splitlines()]
    assert ids == [CAFE if i == 3 else r["id"] for i, r in enumerate(rows) if i not in (4, 5, 6, 7)]
    check_catalogue_ids(ids, "the exported bundle")
    captioned = {json.loads(line)["clip_id"] for line in (bundle / fmt.TEXT_IDS).read_text(encoding="utf-8").splitlines()}
    assert CAFE in captioned and RENAMED[3] not in captioned

    skipped = {s.id: s.reason for s in fmt.read_manifest(bundle).skipped_clips or []}
    assert list(skipped) == [CAFE, "中" * 256, "birds /owl", "zero\\u200bwidth"]  # in catalogue order
    assert "in Unicode NFC the same id as the earlier clip" in skipped[CAFE]
    assert "at most 512 bytes" in skipped["中" * 256]
    assert "begin or end with whitespace" in skipped["birds /owl"]
    assert "U+200B" in skipped["zero\\u200bwidth"]
    assert all('docs/service.md, "Ids"' in reason for reason in skipped.values())
    assert "\u200b" not in (bundle / fmt.MANIFEST_NAME).read_text(encoding="utf-8")
    assert any("4 catalogue clips are not indexed for their ids" in r.getMessage() for r in caplog.records)
