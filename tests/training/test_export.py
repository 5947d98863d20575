"""`tonearm export`: bundle contents, ONNX-vs-PyTorch parity, options (index factory, int8 text encoder)."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from index.audio.decode import decode_audio
from index.bundle.evalset import MAX_EVAL_CLIPS
from index.bundle.format import read_manifest
from index.engines.faiss_index import IndexConfigError
from index.runtime.loader import OnnxEncoder
from index.runtime.verify import verify_bundle
from tonearm.cli import main
from tonearm.errors import BundleError, TonearmError
from training.bundle.export import (
    canonical_hash,
    catalogue_texts,
    check_text_parity,
    export_bundle,
    run_name,
)
from training.bundle.onnx_export import ExportError
from training.bundle.parts import held_out_records, make_bundle_id
from training.checkpoint import load_checkpoint
from training.data.manifest import ClipRecord, load_manifest

LANGS = ["eng", "fra", "deu", "spa", "nld", "cat", "jpn", "zho"]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint)


@pytest.fixture(scope="module")
def records(tiny_corpus):
    return load_manifest(tiny_corpus, languages=LANGS)


def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# ----------------------------------------------------------------------------- pure helpers


def record(i: int, split: str) -> ClipRecord:
    return ClipRecord(id=f"c{i}", audio=Path(f"/a/{i}.wav"), captions={"eng": [f"e{i}"], "fra": [f"f{i}", "g"]},
                      split=split)


def test_held_out_prefers_test_then_val_and_is_capped():
    split, chosen = held_out_records([record(0, "train"), record(1, "val"), record(2, "test")])
    assert (split, [r.id for r in chosen]) == ("test", ["c2"])
    assert held_out_records([record(0, "train"), record(1, "val")])[0] == "val"
    split, chosen = held_out_records([record(i, "test") for i in range(MAX_EVAL_CLIPS + 5)])
    assert len(chosen) == MAX_EVAL_CLIPS == 300 and chosen[-1].id == "c299"
    with pytest.raises(BundleError, match="neither a 'test' nor a 'val'"):
        held_out_records([record(0, "train")])


def test_caption_rows_are_grouped_by_language():
    items, ranges = catalogue_texts([record(0, "train"), record(1, "test")], ["fra", "eng", "deu"])
    assert [i["text"] for i in items] == ["f0", "g", "f1", "g", "e0", "e1"]
    assert ranges == {"fra": (0, 4), "eng": (4, 6), "deu": (6, 6)}
    assert items[2] == {"clip_id": "c1", "clip_row": 1, "lang": "fra", "text": "f1"}


def test_bundle_id_and_run_name(tmp_path):
    assert run_name(tmp_path / "runs" / "my run" / "best") == "my-run"
    assert run_name(tmp_path / "ckpt-7") == "ckpt-7"
    created = datetime(2025, 3, 4, 5, 6, 7, tzinfo=UTC)
    assert make_bundle_id("tiny", created=created, fingerprint="0123456789abcdef") == "tiny-20250304T050607Z-01234567"
    assert canonical_hash({"b": 1, "a": [1, 2]}) == canonical_hash({"a": [1, 2], "b": 1})


# ----------------------------------------------------------------------------- the tiny bundle


def test_manifest_describes_the_export(tiny_bundle, tiny_checkpoint, tiny_corpus, records):
    m = verify_bundle(tiny_bundle)
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert re.fullmatch(r"[A-Za-z0-9._-]+-\d{8}T\d{6}Z-[0-9a-f]{8}", m.bundle_id)
    assert m.source.checkpoint == str(tiny_checkpoint.resolve())
    assert m.source.config_hash == canonical_hash(config)
    assert m.train_config == config and m.objective == config["objective"] and m.frontend == config["frontend"]
    assert (m.embed_dim, m.languages, m.sample_rate, m.clip_samples) == (32, LANGS, 16000, 32000)
    assert m.audio_encoder.opset >= 18 and m.audio_encoder.parity_min_cosine >= 0.999
    assert m.text_encoder.parity_min_cosine >= 0.999 and m.text_encoder.quantization == "none"
    n_captions = sum(len(c) for r in records for c in r.captions.values())
    assert (m.audio_index.factory, m.audio_index.ntotal) == ("Flat", len(records))  # every split is indexed
    assert (m.text_index.factory, m.text_index.ntotal) == ("Flat", n_captions)
    assert m.audio_index.ann_recall_at_10 == 1.0
    n_test = sum(r.split == "test" for r in records)
    assert (m.eval_set.split, m.eval_set.n_clips) == ("test", n_test)
    assert set(m.evaluation.report) >= {"t2a_R@10_mean", "a2t_mAP@10_fra", "mrv_t2a", "gap_jpn"}
    assert m.evaluation.quantization_delta is None


def test_id_files_point_at_the_catalogue(tiny_bundle, tiny_corpus, records):
    audio = [json.loads(line) for line in (tiny_bundle / "audio_ids.jsonl").read_text().splitlines()]
    assert [a["id"] for a in audio] == [r.id for r in records]
    assert all((tiny_corpus.parent / a["uri"]).is_file() and not Path(a["uri"]).is_absolute() for a in audio)
    assert audio[3]["captions"] == records[3].captions
    text = [json.loads(line) for line in (tiny_bundle / "text_ids.jsonl").read_text().splitlines()]
    ranges = read_manifest(tiny_bundle).text_index.language_ranges
    for lang, (lo, hi) in ranges.items():
        assert {t["lang"] for t in text[lo:hi]} == {lang}
        assert hi - lo == sum(len(r.captions[lang]) for r in records)
    assert all(records[t["clip_row"]].id == t["clip_id"] for t in text)


def test_onnx_text_encoder_matches_pytorch_in_every_language(tiny_bundle, checkpoint, records):
    texts = []
    for lang in LANGS:
        pool = sorted({c for r in records for c in r.captions[lang]}, key=len)
        texts += [pool[0], pool[-1], " ".join(pool[-3:] * 4)]  # short, long, truncated at max_length
    ids, mask = checkpoint.tokenizer.encode(texts)
    assert mask[-1].all()  # the last one really is truncated
    with torch.no_grad():
        expected = checkpoint.model.encode_text(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    got = session(tiny_bundle / "text_encoder.onnx").run(["embedding"], {"input_ids": ids, "attention_mask": mask})[0]
    assert cosine(expected, got).min() >= 0.999


def test_onnx_audio_encoder_matches_pytorch_for_short_exact_and_long_clips(tiny_bundle, checkpoint, records):
    n = 32000
    wave = np.resize(decode_audio(records[5].audio, sample_rate=16000), 3 * n)
    onnx_audio = session(tiny_bundle / "audio_encoder.onnx")
    for batch in (wave[None, : n // 4], wave[None, :n], wave[None, : 2 * n + 1234], np.stack([wave[:n], wave[n : 2 * n]])):
        with torch.no_grad():
            expected = checkpoint.model.encode_audio(torch.from_numpy(np.ascontiguousarray(batch))).numpy()
        got = onnx_audio.run(["embedding"], {"waveform": np.ascontiguousarray(batch)})[0]
        assert got.shape == expected.shape and cosine(expected, got).min() >= 0.999


def test_parity_check_catches_a_different_model(tiny_bundle, tiny_checkpoint):
    other = load_checkpoint(tiny_checkpoint)
    with torch.no_grad():
        for p in other.model.text.parameters():
            p.add_(0.5 * torch.randn_like(p))
    encoder = OnnxEncoder.load(tiny_bundle / "text_encoder.onnx", inputs=["input_ids", "attention_mask"],
                               embed_dim=32, providers=["CPUExecutionProvider"], threads=1)
    worst = check_text_parity(other.model, other.tokenizer, encoder, ["a dog barks", "il pleut", "風が吹く"])
    assert worst < 0.999
    from training.bundle.export import _require

    with pytest.raises(ExportError, match="min cosine"):
        _require(worst, "text encoder")


# ----------------------------------------------------------------------------- options and errors


def test_cli_export_with_hnsw_and_int8_text_encoder(tiny_checkpoint, tiny_corpus, tmp_path):
    code = main(["export", str(tiny_checkpoint), "--data", str(tiny_corpus), "--out", str(tmp_path),
                 "--index", "HNSW16,Flat", "--quantize-text"])
    assert code == 0
    (path,) = list(tmp_path.iterdir())
    m = verify_bundle(path)
    assert m.audio_index.factory == m.text_index.factory == "HNSW16,Flat"
    # efSearch is raised until language-filtered caption search (one language of 8) also reaches the target
    assert m.text_index.search_params["efSearch"] >= 128 and 0.9 <= m.text_index.ann_recall_at_10 <= 1.0
    assert m.text_encoder.quantization == "dynamic-int8"
    ops = {node.op_type for node in onnx.load(str(path / "text_encoder.onnx")).graph.node}
    assert ops & {"DynamicQuantizeLinear", "MatMulInteger"}
    evaluation = m.evaluation
    assert evaluation.fp32_text_report is not None and evaluation.quantization_delta
    for key, delta in evaluation.quantization_delta.items():
        assert delta == pytest.approx(evaluation.report[key] - evaluation.fp32_text_report[key])
    assert "t2a_R@10_mean" in evaluation.quantization_delta


def test_unaccepted_factory_fails_before_writing_anything(tiny_checkpoint, tiny_corpus, tmp_path):
    with pytest.raises(IndexConfigError, match="PCA8,Flat"):
        export_bundle(tiny_checkpoint, manifest=tiny_corpus, out_dir=tmp_path / "b", index_factory="PCA8,Flat",
                      progress=False)
    assert not (tmp_path / "b").exists()


def test_missing_checkpoint_is_a_user_error(tiny_corpus, tmp_path, capsys):
    with pytest.raises(TonearmError, match="not found"):
        export_bundle(tmp_path / "nope", manifest=tiny_corpus, out_dir=tmp_path / "b", progress=False)
    assert main(["export", str(tmp_path / "nope"), "--data", str(tiny_corpus), "--out", str(tmp_path)]) == 2
    assert "nope" in capsys.readouterr().err
