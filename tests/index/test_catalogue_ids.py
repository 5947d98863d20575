"""Bundle clip ids follow the id grammar of added items (index/ids.py; issue 55, part 2): a bundle whose
clip ids a store could not take, or whose look-alike could be created beside it, is not published."""

from __future__ import annotations

import json
import shutil
import unicodedata

import pytest

from index.bundle import format as fmt
from index.errors import BundleError
from index.ids import catalogue_id_problems, check_catalogue_ids


def test_the_problems_name_the_rule_and_stop_at_most():
    nfd = unicodedata.normalize("NFD", "café.wav")
    problems = catalogue_id_problems(["ok", "中" * 200, nfd, "ok", " lead", "a//b", "x", "y\u3164"], most=4)
    assert len(problems) == 4
    assert "512 bytes" in problems[0] and "NFC" in problems[1] and "duplicate" in problems[2]
    assert "whitespace" in problems[3]
    assert catalogue_id_problems(["birds/owl.wav", "café.wav", "中" * 170]) == []


def test_publish_refuses_a_bundle_whose_clip_ids_a_store_could_not_take(tiny_bundle, tmp_path):
    """The tiny bundle re-staged with one clip renamed to 256 × 中 (768 bytes: over Milvus's key) and
    one to its NFD look-alike: publish names both and publishes nothing; as it was, it publishes."""
    manifest = fmt.read_manifest(tiny_bundle)
    staging = tmp_path / "staging"
    shutil.copytree(tiny_bundle, staging)
    (staging / fmt.MANIFEST_NAME).unlink()
    ids_file = staging / manifest.audio_index.ids_file
    ids_file.chmod(0o644)
    lines = [json.loads(line) for line in ids_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    original = ids_file.read_text(encoding="utf-8")
    lines[0]["id"], lines[1]["id"] = "中" * 256, unicodedata.normalize("NFD", "café")
    ids_file.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in lines), encoding="utf-8")
    renamed = manifest.model_copy(update={"bundle_id": "renamed"})
    with pytest.raises(BundleError, match="outside the id grammar") as refused:
        fmt.publish(staging, renamed)
    assert "512 bytes" in str(refused.value) and "NFC" in str(refused.value)
    assert not (tmp_path / "renamed").exists()
    ids_file.write_text(original, encoding="utf-8")
    assert fmt.publish(staging, renamed) == tmp_path / "renamed"
    with pytest.raises(BundleError, match="outside the id grammar"):
        check_catalogue_ids(["ok", "a//b"], "bundle x")
