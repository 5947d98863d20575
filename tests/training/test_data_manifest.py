from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tonearm.errors import DataError
from training.data.manifest import ClipRecord, load_manifest, write_manifest

LANGS = ("eng", "fra")


def _line(clip_id: str, **overrides: object) -> str:
    obj = {"id": clip_id, "audio": f"audio/{clip_id}.wav", "captions": {"eng": [f"{clip_id} sound"]},
           "split": "train"}
    obj.update(overrides)
    return json.dumps(obj)


def _manifest(tmp_path: Path, lines: list[str], *, audio: tuple[str, ...] = ("a", "b", "c")) -> Path:
    (tmp_path / "audio").mkdir(exist_ok=True)
    for name in audio:
        (tmp_path / "audio" / f"{name}.wav").write_bytes(b"x")
    path = tmp_path / "manifest.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_resolves_audio_and_keeps_extra_fields_in_meta(tmp_path: Path) -> None:
    path = _manifest(tmp_path, [
        _line("a", captions={"eng": ["a dog", "a hound"], "fra": ["un chien", "un chien de chasse"]},
              meta={"events": ["dog"]}, duration=3.5),
        "",
        _line("b", split="test"),
    ])
    records = load_manifest(path, languages=LANGS)
    assert [r.id for r in records] == ["a", "b"]
    assert records[0].audio == (tmp_path / "audio" / "a.wav").resolve()
    assert records[0].captions == {"eng": ["a dog", "a hound"], "fra": ["un chien", "un chien de chasse"]}
    assert records[0].meta == {"events": ["dog"], "duration": 3.5}
    assert [r.id for r in load_manifest(path, languages=LANGS, split="test")] == ["b"]


def test_write_then_load_round_trip_with_relative_audio(tmp_path: Path) -> None:
    (tmp_path / "clips").mkdir()
    audio = tmp_path / "clips" / "x.wav"
    audio.write_bytes(b"x")
    record = ClipRecord("x", audio, {"eng": ["café au lait"], "fra": ["un café"]}, "val", {"k": [1, 2]})
    out = tmp_path / "sub" / "manifest.jsonl"
    write_manifest([record], out)
    line = out.read_text(encoding="utf-8")
    assert json.loads(line)["audio"] == "../clips/x.wav"
    assert "café" in line and list(json.loads(line)) == sorted(json.loads(line))
    (loaded,) = load_manifest(out, languages=LANGS)
    assert loaded == ClipRecord("x", audio.resolve(), record.captions, "val", {"k": [1, 2]})


def test_unknown_language_is_an_error_naming_language_and_line(tmp_path: Path) -> None:
    path = _manifest(tmp_path, [_line("a"), _line("b", captions={"eng": ["x"], "deu": ["y"]})])
    with pytest.raises(DataError, match=r"manifest.jsonl:2: captions in language 'deu'.*\(eng, fra\)"):
        load_manifest(path, languages=LANGS)


def test_invalid_language_code(tmp_path: Path) -> None:
    path = _manifest(tmp_path, [_line("a", captions={"en": ["x"]})])
    with pytest.raises(DataError, match=r":1: language 'en' is not an ISO 639-3 code"):
        load_manifest(path, languages=LANGS)


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"id": "c", "audio": "audio/c.wav"', r":3: invalid JSON"),
        (json.dumps({"id": "c", "audio": "audio/c.wav"}), r":3: missing field\(s\) captions, split"),
        (_line("a"), r":3: duplicate id 'a' \(first on line 1\)"),
        (_line("c", captions={"eng": "one string"}), r":3: captions\['eng'\] must be a list of strings"),
        (_line("c", captions={"eng": []}), r":3: clip has no captions"),
        (_line("c", split=""), r":3: 'split' must be a non-empty string"),
        ("[1, 2]", r":3: expected a JSON object"),
    ],
)
def test_bad_lines_are_reported_with_line_numbers(tmp_path: Path, bad_line: str, message: str) -> None:
    path = _manifest(tmp_path, [_line("a"), _line("b"), bad_line])
    with pytest.raises(DataError, match=message):
        load_manifest(path, languages=LANGS)


def test_missing_audio_is_reported_then_skipped_on_request(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _manifest(tmp_path, [_line("a"), _line("gone1"), _line("b"), _line("gone2")], audio=("a", "b"))
    with pytest.raises(DataError, match=r"2 of 4 audio files are missing, e\.g\. .*gone1\.wav \(line 2\), "
                                        r".*gone2\.wav \(line 4\); .*skip"):
        load_manifest(path, languages=LANGS)
    with caplog.at_level(logging.WARNING):
        records = load_manifest(path, languages=LANGS, skip_missing_audio=True)
    assert [r.id for r in records] == ["a", "b"]
    assert "2 of 4 audio files are missing" in caplog.text and "skipping" in caplog.text


def test_absent_split_and_empty_or_missing_manifest(tmp_path: Path) -> None:
    path = _manifest(tmp_path, [_line("a")])
    with pytest.raises(DataError, match=r"no clips in split 'test' \(splits present: train\)"):
        load_manifest(path, languages=LANGS, split="test")
    with pytest.raises(DataError, match="manifest not found"):
        load_manifest(tmp_path / "nope.jsonl", languages=LANGS)
    path.write_text("\n", encoding="utf-8")
    with pytest.raises(DataError, match="manifest is empty"):
        load_manifest(path, languages=LANGS)
