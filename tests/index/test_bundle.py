"""Bundle format: manifest schema and self-hash, checksums, atomic publication, tamper detection."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from index.bundle import format as fmt
from index.bundle.format import (
    BundleManifest,
    manifest_bytes,
    publish,
    read_manifest,
    staged_bundle,
    verify_files,
)
from index.runtime.loader import LoadedBundle
from index.runtime.verify import verify_bundle
from tests.index.conftest import copy_bundle
from tonearm.errors import BundleError


def make_manifest(bundle_id: str = "run-20250101T000000Z-0123abcd", **overrides) -> BundleManifest:
    """A schema-valid manifest with placeholder contents (file checks are done on real bundles)."""
    encoder = {"opset": 18, "outputs": ["embedding"], "parity_min_cosine": 1.0}
    index = {"dim": 4, "ntotal": 2, "ann_recall_at_10": 1.0}
    body = {
        "bundle_id": bundle_id,
        "created": "2025-01-01T00:00:00Z",
        "source": {"checkpoint": "/runs/x/best", "run_name": "x", "config_hash": "a" * 64,
                   "weights_sha256": "b" * 64, "data_manifest": "/data/m.jsonl"},
        "train_config": {"seed": 0}, "objective": {"base": {"name": "infonce"}}, "frontend": {"n_mels": 64},
        "embed_dim": 4, "languages": ["eng", "fra"], "sample_rate": 16000, "clip_seconds": 1.0,
        "clip_samples": 16000,
        "audio_encoder": {"file": fmt.AUDIO_ENCODER, "inputs": ["waveform"], **encoder},
        "text_encoder": {"file": fmt.TEXT_ENCODER, "inputs": ["input_ids", "attention_mask"], **encoder},
        "tokenizer": {"file": fmt.TOKENIZER, "max_length": 8, "vocab_size": 300},
        "audio_index": {"file": fmt.AUDIO_INDEX, "ids_file": fmt.AUDIO_IDS, "factory": "Flat", **index},
        "text_index": {"file": fmt.TEXT_INDEX, "ids_file": fmt.TEXT_IDS, "factory": "Flat",
                       "language_ranges": {"eng": [0, 1], "fra": [1, 2]}, **index},
        "eval_set": {"split": "test", "n_clips": 1, "n_captions": 2, "max_clips": 300, "eval_crop": "chunk"},
        "evaluation": {"report": {"t2a_R@1_mean": 0.5}, "convention": "Mei et al."},
        "files": {},
    }
    body.update(overrides)
    return BundleManifest.model_validate(body)


def stage_and_publish(parent: Path, manifest: BundleManifest, files: dict[str, bytes]) -> Path:
    with staged_bundle(parent, manifest.bundle_id) as staging:
        for name, data in files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(data)
        return publish(staging, manifest)


def test_publish_writes_checksums_and_leaves_no_staging_dir(tmp_path):
    path = stage_and_publish(tmp_path, make_manifest(), {"a.bin": b"hello", "eval/b.txt": b"xyz"})
    assert path == tmp_path / "run-20250101T000000Z-0123abcd"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    manifest = verify_files(path)
    # sha256("hello"), computed independently
    assert manifest.files["a.bin"].sha256 == "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    assert manifest.files["a.bin"].size == 5 and set(manifest.files) == {"a.bin", "eval/b.txt"}
    assert not (path / "a.bin").stat().st_mode & 0o222  # published files are read-only


def test_manifest_round_trips_with_self_hash(tmp_path):
    manifest = make_manifest()
    raw = manifest_bytes(manifest)
    body = json.loads(raw)
    assert body["manifest_sha256"] != "0" * 64
    (tmp_path / fmt.MANIFEST_NAME).write_bytes(raw)
    assert read_manifest(tmp_path).model_dump(exclude={"manifest_sha256"}) == manifest.model_dump(
        exclude={"manifest_sha256"}
    )


def test_staging_dir_is_removed_when_building_fails(tmp_path):
    with pytest.raises(RuntimeError), staged_bundle(tmp_path, "b1") as staging:
        (staging / "partial").write_bytes(b"x")
        raise RuntimeError("export step failed")
    assert list(tmp_path.iterdir()) == []


def test_existing_bundle_is_never_overwritten(tmp_path):
    stage_and_publish(tmp_path, make_manifest(), {"a.bin": b"1"})
    with pytest.raises(BundleError, match="already exists"), staged_bundle(tmp_path, make_manifest().bundle_id):
        pass


@pytest.mark.parametrize("field", ["embed_dim", "bundle_id"])
def test_schema_violations_are_bundle_errors(tmp_path, field):
    body = json.loads(manifest_bytes(make_manifest()))
    body[field] = -3 if field == "embed_dim" else "../escape"
    body["manifest_sha256"] = "0" * 64
    raw = (json.dumps(body, indent=2) + "\n").encode()
    digest = hashlib.sha256(raw).hexdigest()
    (tmp_path / fmt.MANIFEST_NAME).write_bytes(raw.replace(b"0" * 64, digest.encode(), 1))
    with pytest.raises(BundleError, match=f"invalid manifest: {field}"):
        read_manifest(tmp_path)


def test_missing_directory_and_missing_manifest(tmp_path):
    with pytest.raises(BundleError, match="not found"):
        read_manifest(tmp_path / "nope")
    with pytest.raises(BundleError, match="manifest.json: missing"):
        read_manifest(tmp_path)


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def bundle_files(tiny_bundle: Path) -> list[str]:
    return sorted(p.relative_to(tiny_bundle).as_posix() for p in tiny_bundle.rglob("*") if p.is_file())


def test_the_tiny_bundle_has_the_spec_layout(tiny_bundle, bundle_files):
    assert set(bundle_files) == {
        "manifest.json", "audio_encoder.onnx", "text_encoder.onnx", "tokenizer.json", "audio.faiss",
        "audio_ids.jsonl", "text.faiss", "text_ids.jsonl", "eval/waveforms.npy", "eval/clips.jsonl",
        "eval/captions.jsonl",
    }
    assert verify_bundle(tiny_bundle).bundle_id == tiny_bundle.name


def test_one_flipped_byte_in_any_file_is_detected_and_named(tiny_bundle, bundle_files, tmp_path):
    copy = copy_bundle(tiny_bundle, tmp_path / tiny_bundle.name)
    for rel in bundle_files:
        target = copy / rel
        original = target.read_bytes()
        for offset in (0, len(original) // 2, len(original) - 1):
            flip_byte(target, offset)
            with pytest.raises(BundleError) as caught:
                verify_files(copy)
            assert str(target) in str(caught.value), rel
            target.write_bytes(original)
    verify_files(copy)  # restored


def test_loaded_bundle_refuses_a_tampered_bundle(tiny_bundle, tmp_path):
    copy = copy_bundle(tiny_bundle, tmp_path / tiny_bundle.name)
    flip_byte(copy / "text_ids.jsonl", 100)
    with pytest.raises(BundleError, match="text_ids.jsonl"):
        LoadedBundle.open(copy)


def test_extra_and_missing_files_are_reported(tiny_bundle, tmp_path):
    copy = copy_bundle(tiny_bundle, tmp_path / tiny_bundle.name)
    (copy / "eval" / "notes.txt").write_text("added later")
    with pytest.raises(BundleError, match=r"notes.txt: not listed"):
        verify_files(copy)
    (copy / "eval" / "notes.txt").unlink()
    (copy / "audio.faiss").unlink()
    with pytest.raises(BundleError, match=r"audio.faiss: listed in manifest.json but missing"):
        verify_files(copy)
