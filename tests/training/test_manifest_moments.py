"""The manifest's ``moments`` field (docs/corpus.md, "Moments"): read, validated, written back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tonearm.errors import DataError
from training.data.manifest import MomentRecord, load_manifest, write_manifest

LANGS = ("eng", "fra")


def _write(tmp_path: Path, moments: object) -> Path:
    (tmp_path / "walk.wav").write_bytes(b"x")
    line = {"id": "walk", "audio": "walk.wav", "split": "test", "captions": {"eng": ["a walk"]},
            "moments": moments}
    path = tmp_path / "manifest.jsonl"
    path.write_text(json.dumps(line) + "\n", encoding="utf-8")
    return path


def test_moments_are_read_and_written_back_unchanged(tmp_path: Path) -> None:
    moments = [{"start": 12.4, "end": 17.9, "captions": {"eng": ["a dog barks"], "fra": ["un chien aboie"]}},
               {"start": 0, "end": 3, "captions": {"eng": ["a dog barks"]}}]
    (record,) = load_manifest(_write(tmp_path, moments), languages=LANGS)
    assert record.moments == [MomentRecord(12.4, 17.9, {"eng": ["a dog barks"], "fra": ["un chien aboie"]}),
                              MomentRecord(0.0, 3.0, {"eng": ["a dog barks"]})]
    assert "moments" not in record.meta
    write_manifest([record], tmp_path / "out" / "m.jsonl")
    (again,) = load_manifest(tmp_path / "out" / "m.jsonl", languages=LANGS)
    assert again.moments == record.moments


def test_a_clip_without_moments_is_written_without_the_key(tmp_path: Path) -> None:
    (record,) = load_manifest(_write(tmp_path, []), languages=LANGS)
    write_manifest([record], tmp_path / "m.jsonl")
    assert "moments" not in json.loads((tmp_path / "m.jsonl").read_text())


@pytest.mark.parametrize(
    ("moments", "message"),
    [
        ({"start": 0}, "must be a list"),
        ([{"start": 1, "end": 2}], "exactly start, end and captions"),
        ([{"start": 5, "end": 5, "captions": {"eng": ["x"]}}], "0 <= start < end"),
        ([{"start": -1, "end": 5, "captions": {"eng": ["x"]}}], "0 <= start < end"),
        ([{"start": "1", "end": 5, "captions": {"eng": ["x"]}}], "must be numbers"),
        ([{"start": 1, "end": 5, "captions": {"deu": ["x"]}}], "not among the configured"),
        ([{"start": 1, "end": 5, "captions": {"eng": []}}], "no captions"),
    ],
)
def test_bad_moments_name_the_line_and_the_moment(tmp_path: Path, moments: object, message: str) -> None:
    with pytest.raises(DataError, match=message) as err:
        load_manifest(_write(tmp_path, moments), languages=LANGS)
    assert "manifest.jsonl:1" in str(err.value)


def test_dropping_other_languages_drops_them_from_moments_too(tmp_path: Path) -> None:
    moments = [{"start": 1, "end": 2, "captions": {"eng": ["a"], "deu": ["b"]}},
               {"start": 3, "end": 4, "captions": {"deu": ["c"]}}]
    (record,) = load_manifest(_write(tmp_path, moments), languages=LANGS, drop_other_languages=True)
    assert record.moments == [MomentRecord(1.0, 2.0, {"eng": ["a"]})]
