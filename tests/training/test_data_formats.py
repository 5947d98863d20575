from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest

from tonearm.errors import DataError
from training.data.cli import add_data_parser, parse_lang_files
from training.data.formats import convert_audiocaps, convert_clotho, convert_wavcaps
from training.data.manifest import load_manifest


def _audio_dir(tmp_path: Path, *names: str) -> Path:
    directory = tmp_path / "audio"
    directory.mkdir(exist_ok=True)
    for name in names:
        (directory / name).write_bytes(b"x")
    return directory


# ------------------------------------------------------------------ Clotho


CLOTHO = (
    "file_name,caption_1,caption_2,caption_3,caption_4,caption_5,caption_1_fra\n"
    'Café terrace.wav,"People chat, cups clink",A busy café,Hélène talks,Spoons ring,Crowd noise,Des gens discutent\n'
    "rain.wav,Rain falls,Drops patter,,Steady rain,Water drips,La pluie tombe\n"
)


def test_clotho_latin1_file_with_accents_and_translation_column(tmp_path: Path) -> None:
    csv_path = tmp_path / "clotho_captions_evaluation.csv"
    csv_path.write_bytes(CLOTHO.encode("iso-8859-1"))
    audio = _audio_dir(tmp_path, "Café terrace.wav", "rain.wav")
    records = convert_clotho(csv_path, audio_dir=audio, split="test")
    assert [r.id for r in records] == ["Café terrace.wav", "rain.wav"]
    assert records[0].captions["eng"] == ["People chat, cups clink", "A busy café", "Hélène talks", "Spoons ring",
                                          "Crowd noise"]
    assert records[0].captions["fra"] == ["Des gens discutent"]
    assert records[1].captions["eng"] == ["Rain falls", "Drops patter", "Steady rain", "Water drips"]
    assert records[0].audio == audio.resolve() / "Café terrace.wav" and records[0].split == "test"


def test_clotho_utf8_side_file_per_language(tmp_path: Path) -> None:
    (tmp_path / "main.csv").write_text("file_name,caption_1,caption_2\nrain.wav,Rain falls,Drops\n",
                                       encoding="utf-8")
    (tmp_path / "deu.csv").write_text("file_name,caption_1,caption_2\nrain.wav,Regen fällt,Tropfen\n"
                                      "other.wav,Nicht da,Nein\n", encoding="utf-8")
    audio = _audio_dir(tmp_path, "rain.wav")
    (record,) = convert_clotho(tmp_path / "main.csv", audio_dir=audio, split="train",
                               lang_files={"deu": tmp_path / "deu.csv"})
    assert record.captions == {"eng": ["Rain falls", "Drops"], "deu": ["Regen fällt", "Tropfen"]}


def test_clotho_missing_column_and_missing_audio(tmp_path: Path) -> None:
    (tmp_path / "bad.csv").write_text("name,caption_1\nx.wav,hi\n", encoding="utf-8")
    audio = _audio_dir(tmp_path, "rain.wav")
    with pytest.raises(DataError, match=r"bad.csv: missing column\(s\) file_name"):
        convert_clotho(tmp_path / "bad.csv", audio_dir=audio, split="train")
    (tmp_path / "c.csv").write_bytes(CLOTHO.encode("iso-8859-1"))
    with pytest.raises(DataError, match=r"1 of 2 audio files are missing, e\.g\. .*Café terrace\.wav"):
        convert_clotho(tmp_path / "c.csv", audio_dir=audio, split="train")
    kept = convert_clotho(tmp_path / "c.csv", audio_dir=audio, split="train", skip_missing_audio=True)
    assert [r.id for r in kept] == ["rain.wav"]


# ------------------------------------------------------------------ AudioCaps


AUDIOCAPS_ORIGINAL = (
    "audiocap_id,youtube_id,start_time,caption\n"
    "91139,r1nicOVtvkQ,130,A woman talks nearby as water pours\n"
    "58146,UDGBjjwyaqE,20,Multiple clanging and clanking sounds\n"
    "91140,r1nicOVtvkQ,130,Water pours while a woman speaks\n"
)


def test_audiocaps_original_groups_rows_by_clip_with_default_pattern(tmp_path: Path) -> None:
    (tmp_path / "test.csv").write_text(AUDIOCAPS_ORIGINAL, encoding="utf-8")
    audio = _audio_dir(tmp_path, "r1nicOVtvkQ_130.wav", "UDGBjjwyaqE_20.wav")
    records = convert_audiocaps(tmp_path / "test.csv", audio_dir=audio, split="test")
    assert [r.id for r in records] == ["r1nicOVtvkQ_130", "UDGBjjwyaqE_20"]
    assert records[0].captions == {"eng": ["A woman talks nearby as water pours", "Water pours while a woman speaks"]}
    assert records[0].audio.name == "r1nicOVtvkQ_130.wav"
    assert records[0].meta == {"youtube_id": "r1nicOVtvkQ", "start_time": "130"}


def test_audiocaps_original_custom_pattern_other_extension_and_side_file(tmp_path: Path) -> None:
    (tmp_path / "test.csv").write_text(AUDIOCAPS_ORIGINAL.replace(",130,", ",130.0,"), encoding="utf-8")
    (tmp_path / "fra.csv").write_text(
        "audiocap_id,youtube_id,start_time,caption\n91139,r1nicOVtvkQ,130,Une femme parle\n"
        "91140,r1nicOVtvkQ,130,De l'eau coule\n", encoding="utf-8")
    audio = _audio_dir(tmp_path, "Yr1nicOVtvkQ.flac")
    with pytest.raises(DataError, match=r"1 of 2 audio files are missing, e\.g\. .*YUDGBjjwyaqE\.wav"):
        convert_audiocaps(tmp_path / "test.csv", audio_dir=audio, split="test", audio_pattern="Y{youtube_id}.wav")
    (record,) = convert_audiocaps(tmp_path / "test.csv", audio_dir=audio, split="test",
                                  audio_pattern="Y{youtube_id}.wav", skip_missing_audio=True,
                                  lang_files={"fra": tmp_path / "fra.csv"})
    assert record.audio.name == "Yr1nicOVtvkQ.flac"
    assert record.captions["fra"] == ["Une femme parle", "De l'eau coule"]
    with pytest.raises(DataError, match=r"--audio-pattern .*available fields: \{youtube_id\}"):
        convert_audiocaps(tmp_path / "test.csv", audio_dir=audio, split="test", audio_pattern="{video}.wav")


def test_audiocaps_converted_long_and_wide_layouts(tmp_path: Path) -> None:
    (tmp_path / "train.csv").write_text(
        "file_name,caption\nY1.wav,A dog barks\nY2.wav,An engine idles\nY1.wav,Barking dog\n", encoding="utf-8")
    (tmp_path / "val.csv").write_text(
        "file_name,caption_1,caption_2,caption_3,caption_4,caption_5\nY1.wav,a,b,c,d,e\n", encoding="utf-8")
    audio = _audio_dir(tmp_path, "Y1.wav", "Y2.wav")
    train = convert_audiocaps(tmp_path / "train.csv", audio_dir=audio, split="train")
    assert {r.id: r.captions["eng"] for r in train} == {"Y1.wav": ["A dog barks", "Barking dog"],
                                                        "Y2.wav": ["An engine idles"]}
    (val,) = convert_audiocaps(tmp_path / "val.csv", audio_dir=audio, split="val")
    assert val.captions["eng"] == ["a", "b", "c", "d", "e"]


# ------------------------------------------------------------------ WavCaps


def _wavcaps(tmp_path: Path) -> Path:
    doc = {"num_captions_per_audio": 1, "data": [
        {"id": "Y--0w1YA1Hm4.wav", "caption": "A vehicle engine revs.", "audio": "wav_path", "duration": 10.0,
         "caption_spa": "Un motor acelera."},
        {"id": "180913", "caption": "Birds sing in a forest.", "duration": 22.5, "tags": ["birds"]},
        {"id": "Ymissing.wav", "caption": "Not in the archive.", "duration": 10.0},
    ]}
    path = tmp_path / "as_final.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def test_wavcaps_resolves_flac_for_wav_ids_and_reports_missing_clips(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _wavcaps(tmp_path)
    audio = _audio_dir(tmp_path, "Y--0w1YA1Hm4.flac", "180913.flac")
    with pytest.raises(DataError, match=r"1 of 3 audio files are missing, e\.g\. .*Ymissing\.wav"):
        convert_wavcaps(path, audio_dir=audio, split="train")
    with caplog.at_level(logging.WARNING):
        records = convert_wavcaps(path, audio_dir=audio, split="train", skip_missing_audio=True)
    assert "1 of 3 audio files are missing" in caplog.text
    assert [(r.id, r.audio.name) for r in records] == [("Y--0w1YA1Hm4.wav", "Y--0w1YA1Hm4.flac"),
                                                       ("180913", "180913.flac")]
    assert records[0].captions == {"eng": ["A vehicle engine revs."], "spa": ["Un motor acelera."]}
    assert records[0].meta == {"audio": "wav_path", "duration": 10.0}
    assert records[1].meta == {"duration": 22.5, "tags": ["birds"]}


def test_wavcaps_bad_layout(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text('{"items": []}', encoding="utf-8")
    with pytest.raises(DataError, match=r'x.json: expected a WavCaps JSON object \{"data"'):
        convert_wavcaps(tmp_path / "x.json", audio_dir=_audio_dir(tmp_path), split="train")


# ------------------------------------------------------------------ CLI


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tonearm")
    add_data_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_convert_writes_a_loadable_manifest_and_appends(tmp_path: Path) -> None:
    (tmp_path / "dev.csv").write_bytes(CLOTHO.encode("iso-8859-1"))
    (tmp_path / "eval.csv").write_text("file_name,caption_1\nwind.wav,Wind blows\n", encoding="utf-8")
    (tmp_path / "eval_cat.csv").write_text("file_name,caption_1\nwind.wav,El vent bufa\n", encoding="utf-8")
    _audio_dir(tmp_path, "Café terrace.wav", "rain.wav", "wind.wav")
    out = tmp_path / "data" / "manifest.jsonl"
    base = ["data", "convert", "--format", "clotho", "--audio-dir", str(tmp_path / "audio"), "--out", str(out)]
    args = _parse([*base, "--input", str(tmp_path / "dev.csv"), "--split", "train"])
    assert args.handler(args) == 0
    args = _parse([*base, "--input", str(tmp_path / "eval.csv"), "--split", "test", "--append",
                   "--lang-file", f"cat={tmp_path / 'eval_cat.csv'}"])
    assert args.handler(args) == 0
    records = load_manifest(out, languages=["eng", "fra", "cat"])
    assert [(r.id, r.split) for r in records] == [("Café terrace.wav", "train"), ("rain.wav", "train"),
                                                  ("wind.wav", "test")]
    assert records[2].captions == {"eng": ["Wind blows"], "cat": ["El vent bufa"]}
    assert json.loads(out.read_text(encoding="utf-8").splitlines()[0])["audio"] == "../audio/Café terrace.wav"
    with pytest.raises(DataError, match="duplicate id 'wind.wav'"):
        args.handler(args)


def test_parse_lang_files_rejects_bad_values() -> None:
    assert parse_lang_files(["fra=a.csv"]) == {"fra": Path("a.csv")}
    with pytest.raises(DataError, match="expected LANG=PATH"):
        parse_lang_files(["fra"])
    with pytest.raises(DataError, match="not an ISO 639-3 code"):
        parse_lang_files(["fr=a.csv"])
