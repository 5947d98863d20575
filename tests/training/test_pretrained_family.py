"""`tonearm export --pretrained`: the family is read from config.json, other families refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tonearm.cli import main
from training.bundle.pretrained_family import SUPPORTED, detect_family
from training.config import ConfigError


def folder_with(tmp_path: Path, name: str, config: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(config)
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def test_detects_clap_and_pe_audio_and_defers_missing_folders(tmp_path: Path) -> None:
    assert detect_family(folder_with(tmp_path, "clap", json.dumps({"model_type": "clap"}))) == "clap"
    assert detect_family(folder_with(tmp_path, "pe", json.dumps({"model_type": "pe_audio"}))) == "pe_audio"
    assert detect_family(folder_with(tmp_path, "pe_av", json.dumps({"model_type": "pe_audio_video"}))) == "pe_audio_video"
    assert detect_family(tmp_path / "nowhere") is None  # the loader says "does not exist"
    assert set(SUPPORTED) == {"clap", "pe_audio", "pe_audio_video"}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (json.dumps({"model_type": "bert"}), "holds a 'bert' model, not a model of a supported family"),
        (json.dumps({"architectures": ["X"]}), "holds a 'unknown' model"),
        ("{not json", "config.json cannot be read"),
        (json.dumps({"model_type": "pe_audio_encoder"}), "holds a 'pe_audio_encoder' model (PeAudioEncoder"),
        (json.dumps({"model_type": "pe_video"}), "holds a 'pe_video' model (PeVideoModel: video and text, no audio"),
    ],
)
def test_other_families_are_refused_in_one_line_naming_the_supported_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: str, message: str
) -> None:
    folder = folder_with(tmp_path, "model", config)
    with pytest.raises(ConfigError):
        detect_family(folder)
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("")
    code = main(["export", "--pretrained", str(folder), "--data", str(manifest), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: --pretrained") and message in err, err
    assert "\n" not in err
    if "cannot be read" not in message:
        assert "'clap' = ClapModel" in err and "'pe_audio' = PeAudioModel" in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
