"""`tonearm data convert --format castella|clotho-moment` on small files in the published layouts.

CASTELLA: ``github.com/line/CASTELLA`` ``json/{en,ja}/<split>.json`` (README "Annotation files").
Clotho-Moment: ``github.com/line/lighthouse`` ``data/clotho_moment/clotho_moment_<split>_release.jsonl``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tonearm.errors import DataError
from training.data.cli import add_data_parser
from training.data.manifest import MomentRecord, load_manifest
from training.data.moment_formats import convert_castella, convert_clotho_moment

CASTELLA_EN = [
    {"yid": "-0awng26xQ8", "global_caption": "A man is talking while driving, stops somewhere, then drives again",
     "duration": 299, "num_moments": 2,
     "moments": [{"local_caption": "A man starts the car engine", "timestamps": [[70, 76]]},
                 {"local_caption": "A man signals and drives", "timestamps": [[177, 190], [52, 66], [80, 80]]}]},
    {"yid": "rwb6PSAee5Y", "global_caption": "A door and a toilet", "duration": 74, "num_moments": 0,
     "moments": []},
]
CASTELLA_JA = [
    {"yid": "-0awng26xQ8", "global_caption": "男性が運転しながら話す", "duration": 299, "num_moments": 2,
     "moments": [{"local_caption": "男性が車のエンジンをかける", "timestamps": [[70, 76]]},
                 {"local_caption": "男性が合図して運転する", "timestamps": [[177, 190], [52, 66], [80, 80]]}]},
    {"yid": "rwb6PSAee5Y", "global_caption": "ドアとトイレ", "duration": 74, "num_moments": 0, "moments": []},
]
CLOTHO_MOMENT = [
    {"qid": "32694", "query": "A toilet flushes and its bowl eventually refills with water.", "duration": 60,
     "vid": "Singapore_0.0_60.0", "relevant_windows": [[41.1, 48.1]], "fg_dB": 0.7394922882103927},
    {"qid": "32695", "query": "People shout as other people are chatting in the background.", "duration": 60,
     "vid": "Singapore_1.0_61.0", "relevant_windows": [[26.6, 51.6]], "fg_dB": -1.9050650672390876},
    {"qid": "rwT_2", "query": "Engine noise", "duration": 60, "vid": "Singapore_1.0_61.0",
     "relevant_windows": [[2, 9], [30.5, 40]]},
]


def _audio(tmp_path: Path, *names: str) -> Path:
    audio = tmp_path / "audio"
    audio.mkdir(exist_ok=True)
    for name in names:
        (audio / name).write_bytes(b"x")
    return audio


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def test_castella_english_and_japanese_one_moment_per_timestamp(tmp_path: Path) -> None:
    (tmp_path / "en.json").write_text(json.dumps(CASTELLA_EN, indent=2), encoding="utf-8")
    (tmp_path / "ja.json").write_text(json.dumps(CASTELLA_JA, ensure_ascii=False), encoding="utf-8")
    audio = _audio(tmp_path, "-0awng26xQ8.wav", "rwb6PSAee5Y.flac")
    records = convert_castella(tmp_path / "en.json", audio_dir=audio, split="test",
                               lang_files={"jpn": tmp_path / "ja.json"})
    first, second = records
    assert first.id == "-0awng26xQ8" and first.audio == audio / "-0awng26xQ8.wav"
    assert first.captions == {"eng": [CASTELLA_EN[0]["global_caption"]], "jpn": ["男性が運転しながら話す"]}
    drives = {"eng": ["A man signals and drives"], "jpn": ["男性が合図して運転する"]}
    assert first.moments == [  # [80, 80] is zero-length: left out
        MomentRecord(70.0, 76.0, {"eng": ["A man starts the car engine"], "jpn": ["男性が車のエンジンをかける"]}),
        MomentRecord(177.0, 190.0, drives), MomentRecord(52.0, 66.0, drives)]
    assert first.meta == {"source": "castella", "duration": 299}
    assert second.moments == [] and second.audio == audio / "rwb6PSAee5Y.flac"  # another extension found


def test_castella_side_file_must_match_the_moments(tmp_path: Path) -> None:
    (tmp_path / "en.json").write_text(json.dumps(CASTELLA_EN), encoding="utf-8")
    (tmp_path / "ja.json").write_text(json.dumps(CASTELLA_JA[:1]), encoding="utf-8")
    audio = _audio(tmp_path, "-0awng26xQ8.wav", "rwb6PSAee5Y.wav")
    with pytest.raises(DataError, match="'rwb6PSAee5Y' is missing or has other moments"):
        convert_castella(tmp_path / "en.json", audio_dir=audio, split="test", lang_files={"jpn": tmp_path / "ja.json"})
    (tmp_path / "bad.json").write_text(json.dumps({"yid": "x"}), encoding="utf-8")
    with pytest.raises(DataError, match="expected a JSON list"):
        convert_castella(tmp_path / "bad.json", audio_dir=audio, split="test")


def test_clotho_moment_groups_queries_by_recording_with_translations_by_qid(tmp_path: Path) -> None:
    main = _jsonl(tmp_path / "clotho_moment_val_release.jsonl", CLOTHO_MOMENT)
    fra = _jsonl(tmp_path / "fra.jsonl", [{**CLOTHO_MOMENT[2], "query": "Bruit de moteur"}])
    audio = _audio(tmp_path, "Singapore_0.0_60.0.wav", "Singapore_1.0_61.0.wav")
    records = convert_clotho_moment(main, audio_dir=audio, split="val", lang_files={"fra": fra})
    assert [r.id for r in records] == ["Singapore_0.0_60.0", "Singapore_1.0_61.0"]
    assert records[0].audio == audio / "Singapore_0.0_60.0.wav"
    assert records[0].moments == [MomentRecord(41.1, 48.1, {"eng": [CLOTHO_MOMENT[0]["query"]]})]
    engine = {"eng": ["Engine noise"], "fra": ["Bruit de moteur"]}
    assert records[1].moments == [MomentRecord(26.6, 51.6, {"eng": [CLOTHO_MOMENT[1]["query"]]}),
                                  MomentRecord(2.0, 9.0, engine), MomentRecord(30.5, 40.0, engine)]
    assert records[1].captions["eng"] == [CLOTHO_MOMENT[1]["query"], "Engine noise"]
    assert records[1].meta["qids"] == ["32695", "rwT_2"] and records[1].meta["duration"] == 60


def test_clotho_moment_rejects_other_layouts_and_reversed_windows(tmp_path: Path) -> None:
    audio = _audio(tmp_path, "Singapore_0.0_60.0.wav")
    with pytest.raises(DataError, match="lighthouse / QVHighlights layout"):
        convert_clotho_moment(_jsonl(tmp_path / "a.jsonl", [{"qid": 1, "query": "x"}]), audio_dir=audio, split="val")
    bad = [{**CLOTHO_MOMENT[0], "relevant_windows": [[48.1, 41.1]]}]
    with pytest.raises(DataError, match=r"a.jsonl:1: relevant_windows\[0\]: need 0 <= start <= end"):
        convert_clotho_moment(_jsonl(tmp_path / "a.jsonl", bad), audio_dir=audio, split="val")


def test_cli_convert_writes_moments_into_a_loadable_manifest(tmp_path: Path) -> None:
    (tmp_path / "en.json").write_text(json.dumps(CASTELLA_EN), encoding="utf-8")
    main = _jsonl(tmp_path / "cm.jsonl", CLOTHO_MOMENT)
    audio = _audio(tmp_path, "-0awng26xQ8.wav", "rwb6PSAee5Y.wav", "Singapore_0.0_60.0.wav", "Singapore_1.0_61.0.wav")
    parser = argparse.ArgumentParser()
    add_data_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "manifest.jsonl"
    for fmt, source, split, extra in (("castella", tmp_path / "en.json", "test", []),
                                      ("clotho-moment", main, "train", ["--append"])):
        args = parser.parse_args(["data", "convert", "--format", fmt, "--input", str(source), "--audio-dir",
                                  str(audio), "--split", split, "--out", str(out), *extra])
        assert args.handler(args) == 0
    records = load_manifest(out, languages=["eng"])
    assert [len(r.moments) for r in records] == [3, 0, 1, 3]
    assert records[0].moments[0] == MomentRecord(70.0, 76.0, {"eng": ["A man starts the car engine"]})
