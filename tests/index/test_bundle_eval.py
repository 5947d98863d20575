"""`tonearm bundle eval` / `verify`: ONNX-only metrics agree with `tonearm evaluate` on the checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

from index.bundle.evalset import EvalSet
from index.runtime.evaluate import (
    evaluate_bundle,
    evaluate_eval_set,
    max_report_difference,
    retrieval_delta,
)
from index.runtime.loader import LoadedBundle
from tests.index.conftest import copy_bundle
from tonearm.cli import main


def one_hot(i: int, d: int = 4) -> np.ndarray:
    v = np.zeros(d, np.float32)
    v[i] = 1.0
    return v


def test_evaluate_eval_set_on_hand_made_encoders():
    """Audio i ↦ e_i; caption "clip j" ↦ e_j, except one French caption pointing at the wrong clip."""
    eval_set = EvalSet(
        clip_ids=["a", "b", "c"],
        waveforms=[np.full(10, i, np.float32) for i in range(3)],
        captions=["clip 0", "clip 0", "clip 1", "clip 2", "clip 2", "clip 0", "ignored"],
        clip=np.array([0, 0, 1, 1, 2, 2, 0]),
        lang=np.array(["eng", "fra", "eng", "fra", "eng", "fra", "deu"]),
        group=np.array([0, 0, 1, 1, 2, 2, 0]),
    )
    report = evaluate_eval_set(
        eval_set,
        encode_audio=lambda waves: np.stack([one_hot(int(w[0])) for w in waves]),
        encode_text=lambda texts: np.stack([one_hot(int(t.split()[1])) for t in texts]),
        languages=["eng", "fra"],
    )
    assert report["t2a_R@1_eng"] == 1.0
    # French: clip 1's caption ("clip 2") scores clip 2 first and ties clips 0 and 1 at 0, so with
    # pessimistic ties clip 1 is rank 3; likewise clip 2's caption ("clip 0"): ranks 1, 3, 3.
    assert report["t2a_R@1_fra"] == pytest.approx(1 / 3)
    assert report["t2a_mAP@10_fra"] == pytest.approx((1 + 1 / 3 + 1 / 3) / 3)
    assert report["n_captions"] == 6.0  # the German caption is outside the evaluated languages


def test_retrieval_delta_and_max_difference():
    new = {"t2a_R@1_mean": 0.5, "a2t_R@5_eng": 0.25, "mrv_t2a": 3.0, "only_new": 1.0}
    old = {"t2a_R@1_mean": 0.4, "a2t_R@5_eng": 0.5, "mrv_t2a": 1.0}
    assert retrieval_delta(new, old) == pytest.approx({"t2a_R@1_mean": 0.1, "a2t_R@5_eng": -0.25})
    assert max_report_difference(new, old) == pytest.approx(0.25)


def test_bundle_eval_reproduces_the_manifest_and_tonearm_evaluate(tiny_bundle, tiny_checkpoint, tiny_corpus):
    from training.checkpoint import load_checkpoint
    from training.evaluate import evaluate_model, load_split

    bundle = LoadedBundle.open(tiny_bundle)
    onnx_report = evaluate_bundle(bundle)
    assert max_report_difference(onnx_report, bundle.manifest.evaluation.report) == 0.0
    checkpoint = load_checkpoint(tiny_checkpoint)
    cfg = checkpoint.config
    records = load_split(tiny_corpus, data_cfg=cfg.data, split="test")
    torch_report = evaluate_model(
        checkpoint.model, checkpoint.tokenizer, records, data_cfg=cfg.data, frontend_cfg=cfg.frontend,
        batch_size=16, device="cpu",
    )
    recall_keys = [k for k in torch_report if "R@" in k]
    assert len(recall_keys) == 2 * 3 * 9  # both directions, R@1/5/10, 8 languages + mean
    for key in recall_keys:
        assert abs(onnx_report[key] - torch_report[key]) <= 0.005, key
    assert onnx_report["n_clips"] == torch_report["n_clips"] and onnx_report["n_captions"] == torch_report["n_captions"]


def test_cli_eval_prints_the_table(tiny_bundle, capsys):
    assert main(["bundle", "eval", str(tiny_bundle)]) == 0
    out = capsys.readouterr().out
    assert "zho" in out and "mean" in out and "R@10" in out


def test_cli_verify_passes_and_fails_naming_the_file(tiny_bundle, tmp_path, capsys):
    assert main(["bundle", "verify", str(tiny_bundle)]) == 0
    assert tiny_bundle.name in capsys.readouterr().out
    copy = copy_bundle(tiny_bundle, tmp_path / "copy")
    data = bytearray((copy / "eval" / "waveforms.npy").read_bytes())
    data[-1] ^= 0xFF
    (copy / "eval" / "waveforms.npy").write_bytes(bytes(data))
    assert main(["bundle", "verify", str(copy)]) == 2
    assert "waveforms.npy" in capsys.readouterr().err
