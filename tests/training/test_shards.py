"""`tonearm data shard` (SPEC §13): webdataset shards keep every clip, caption, language and id,
corrupt files are skipped with their reason, and an interrupted run resumes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from training.data.manifest import read_manifest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus_with_corrupt(tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny corpus plus one train clip whose file is garbage after a FLAC signature."""
    folder = tmp_path_factory.mktemp("corrupt_corpus")
    (folder / "bad.flac").write_bytes(b"fLaC" + bytes(range(256)) * 8)
    lines = []
    for _, record in read_manifest(tiny_corpus, languages=None):
        lines.append({"id": record.id, "audio": str(record.audio), "split": record.split,
                      "captions": record.captions})
    lines.append({"id": "broken.clip", "audio": "bad.flac", "split": "train", "captions": {"eng": ["static"]}})
    manifest = folder / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return manifest


@pytest.fixture(scope="module")
def shards(corpus_with_corrupt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CLI's shards of `corpus_with_corrupt` at 16 kHz, 8 clips a shard, 2 processes."""
    out = tmp_path_factory.mktemp("shards")
    subprocess.run(
        [sys.executable, "-m", "tonearm.cli", "data", "shard", str(corpus_with_corrupt), "--out", str(out),
         "--shard-size", "8", "--workers", "2"],
        check=True, cwd=ROOT, capture_output=True,
    )
    return out


def test_round_trip_keeps_every_caption_language_and_id(corpus_with_corrupt: Path, shards: Path) -> None:
    import webdataset as wds

    expected = {r.id: r for _, r in read_manifest(corpus_with_corrupt, languages=None) if r.id != "broken.clip"}
    seen = {}
    index = json.loads((shards / "index.json").read_text())
    for split, summary in index["splits"].items():
        urls = [str(shards / s["name"]) for s in summary["shards"]]
        for sample in wds.WebDataset(urls, shardshuffle=False):
            meta = json.loads(sample["json"])
            assert meta["split"] == split and meta["id"] not in seen
            wave, rate = sf.read(__import__("io").BytesIO(sample["flac"]), dtype="float32")
            assert rate == 16_000 and wave.ndim == 1 and abs(len(wave) / rate - meta["seconds"]) < 1e-3
            seen[meta["id"]] = meta
    assert set(seen) == set(expected)
    for clip_id, meta in seen.items():
        assert meta["captions"] == expected[clip_id].captions
        assert meta["split"] == expected[clip_id].split
    train = index["splits"]["train"]
    assert train["clips"] == sum(r.split == "train" for r in expected.values())
    assert train["languages"] == sorted({lang for r in expected.values() for lang in r.captions})
    records = [json.loads(line) for line in (shards / "records.jsonl").read_text().splitlines()]
    assert {r["id"] for r in records} == set(expected) and index["complete"] is True


def test_corrupt_file_is_skipped_with_its_reason(shards: Path) -> None:
    index = json.loads((shards / "index.json").read_text())
    assert [s["id"] for s in index["skipped"]] == ["broken.clip"]
    assert "bad.flac" in index["skipped"][0]["reason"]


def test_interrupted_run_resumes_and_keeps_matching_shards(corpus_with_corrupt: Path, shards: Path,
                                                           tmp_path: Path) -> None:
    from training.data.shards import shard_manifest

    out = tmp_path / "copy"
    shutil.copytree(shards, out)
    index = json.loads((out / "index.json").read_text())
    names = [s["name"] for split in index["splits"].values() for s in split["shards"]]
    (out / names[0]).unlink()  # never finished
    (out / names[1]).write_bytes(b"partial")  # cut short: its checksum no longer matches
    kept = {name: (out / name).stat().st_mtime_ns for name in names[2:]}
    again = shard_manifest(corpus_with_corrupt, out, sample_rate=16_000, shard_size=8, workers=1, progress=False)
    assert {name: (out / name).stat().st_mtime_ns for name in names[2:]} == kept  # not rewritten
    assert again["splits"] == index["splits"]  # rewritten byte for byte (same sha256)
    assert again["skipped"] == index["skipped"]
    assert np.isclose(again["hours"], index["hours"])
