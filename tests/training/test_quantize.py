"""`tonearm export --quantize`: int8 encoders, their measured agreement with fp32, and the refusal past the limit."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest

from index.bundle.format import read_manifest
from index.runtime.loader import LoadedBundle
from tonearm.cli import main
from tonearm.errors import TonearmError
from training.bundle.quantize import QuantizeConfig


def _export(checkpoint, corpus, out, *options: str) -> int:
    return main(["export", str(checkpoint), "--data", str(corpus), "--out", str(out), *options])


def test_both_encoders_int8_with_agreement_recorded(tiny_checkpoint, tiny_corpus, tmp_path, caplog):
    # A negative limit can never be met: with --quantize-on-loss warn the export still writes the bundle,
    # records the measurement and says it is past the limit.
    with caplog.at_level(logging.WARNING):
        code = _export(tiny_checkpoint, tiny_corpus, tmp_path, "--quantize", "both",
                       "--quantize-max-drop", "-1", "--quantize-on-loss", "warn")
    assert code == 0
    (path,) = list(tmp_path.iterdir())
    m = read_manifest(path)
    assert m.audio_encoder.quantization == m.text_encoder.quantization == "dynamic-int8"
    for name in ("audio_encoder.onnx", "text_encoder.onnx"):
        assert "MatMulInteger" in {node.op_type for node in onnx.load(str(path / name)).graph.node}
    q = m.quantization
    assert q is not None and q.precision == "int8" and sorted(q.encoders) == ["audio", "text"]
    assert q.max_r10_drop == -1 and q.on_loss == "warn" and q.within_limit is False
    assert q.agreement["text"].items == m.eval_set.n_captions and q.agreement["audio"].items == m.eval_set.n_clips
    for agreement in q.agreement.values():
        assert 0.9 < agreement.min_cosine <= agreement.mean_cosine <= 1.0 + 1e-6
    evaluation = m.evaluation
    assert evaluation.fp32_text_report is not None and evaluation.quantization_delta is not None
    for key in ("t2a_R@1_mean", "t2a_R@10_mean", "a2t_R@1_mean", "a2t_R@10_mean"):
        fp32_minus_int8 = 100 * (evaluation.fp32_text_report[key] - evaluation.report[key])
        assert q.recall_drop_points[key] == pytest.approx(fp32_minus_int8, abs=1e-3)
    assert "lose" in caplog.text and "limit -1" in caplog.text
    # The service loads and answers with the int8 encoders.
    bundle = LoadedBundle.open(path, intra_op_threads=1)
    text = bundle.encode_text(["a dog barks"])
    assert text.shape == (1, m.embed_dim) and np.isfinite(text).all()
    bundle.close()


def test_export_refuses_past_the_limit(tiny_checkpoint, tiny_corpus, tmp_path, capsys):
    code = _export(tiny_checkpoint, tiny_corpus, tmp_path / "out", "--quantize-text", "--quantize-max-drop", "-1")
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "held-out t2a_R@10_mean" in err or "held-out a2t_R@10_mean" in err
    assert "limit -1" in err and "--quantize-max-drop" in err and "Traceback" not in err
    # no bundle; only the catalogue pass's resume folder (.NAME.partial) is kept for a rerun (issue 49)
    left = list((tmp_path / "out").iterdir()) if (tmp_path / "out").exists() else []
    assert all(p.name.startswith(".") and p.name.endswith(".partial") for p in left), left


def test_choice_and_its_old_alias():
    assert QuantizeConfig.from_choice(None).encoders == ()
    assert QuantizeConfig.from_choice(None, quantize_text=True).encoders == ("text",)
    assert QuantizeConfig.from_choice("both").encoders == ("text", "audio")
    assert QuantizeConfig.from_choice("audio").label == "dynamic-int8"
    assert QuantizeConfig.from_choice("text", precision="fp16").label == "fp16"
    with pytest.raises(TonearmError, match="contradicts"):
        QuantizeConfig.from_choice("audio", quantize_text=True)
