"""AST step 0 on clips shorter and longer than its window (issue 41): the training data path feeds
the ``hf_ast`` tower what ``ASTFeatureExtractor`` would give the model.

The extractor pads a short clip's fbank *frames* with zeros before its normalisation (0.467 after
it); a data path that zero-pads the waveform instead gives frames of log(floor) (−1.28). The
reference is transformers' own ``ASTFeatureExtractor`` (and ``ASTModel`` fed by it), never
tonearm's front end: per element on the features, and on *centred* pooled outputs (the mean over
the set of clips removed — at random weights unrelated signals pool to nearly the same vector,
so an uncentred cosine would pass almost anything). Clips of 0.5, 3, 10 and 14 s at 16 kHz go
through the data path as training (``decode_window``, a WAV file) and evaluation
(``prepare_waveform`` / ``eval_chunks``) read them; the 14-s clip's window is its first 10 s in
evaluation, and the extractor is fed that window. The negative cases show the old waveform
zero-padding fails both checks.

Cost: ~5 s (a 2-layer, 64-wide random ``ASTModel`` at the real 128 × 1024 input size); one test
checks the exported ONNX encoder (what a bundle serves) on NaN-tailed clips against the tower,
another the run-time step-0 check (training/bundle/step0.py) passes frame padding and stops the waveform zero-pad.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from transformers import ASTConfig, ASTFeatureExtractor, ASTModel

from index.audio.decode import decode_window, eval_chunks
from tests.real_size_models import PRESETS
from training.config import load_train_config, short_clip_padding
from training.evaluate import clip_samples
from training.models.hf import build_hf_audio_tower

RATE = 16000
SECONDS = (0.5, 3.0, 10.0, 14.0)


def signal(seconds: float, seed: int) -> np.ndarray:
    """A chirp plus noise (energy in every mel band), a different one per seed."""
    t = np.arange(int(seconds * RATE)) / RATE
    rng = np.random.default_rng(seed)
    chirp = np.sin(2 * np.pi * (150 + 300 * seed + 2500 * t / seconds) * t)
    return (0.3 * chirp + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


@pytest.fixture(scope="module")
def small_ast(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer ASTModel with AST-base's input (128 mels × 1024 frames)."""
    folder = tmp_path_factory.mktemp("small_ast")
    torch.manual_seed(0)
    ASTModel(ASTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
             ).save_pretrained(folder)
    return folder


def _windows(folder: Path, tmp_path: Path, padding: str | None = None) -> tuple[list[np.ndarray], list[np.ndarray], int]:
    """(what the data path gives the tower, what the extractor is fed, samples per window) per clip:
    the training crop (decode_window of a WAV) for clips up to the window, the first evaluation
    chunk (eval_chunks) for longer ones."""
    cfg = load_train_config(PRESETS / "ast_xlmr.yaml", [f"model.audio.path={folder}"])
    assert short_clip_padding(cfg.frontend) == "frames"  # auto resolves to the extractor's rule
    pad = padding or short_clip_padding(cfg.frontend)
    n = clip_samples(cfg.data, cfg.frontend)
    fed, reference = [], []
    for i, seconds in enumerate(SECONDS):
        wave = signal(seconds, i)
        if wave.shape[0] <= n:
            sf.write(tmp_path / f"c{i}.wav", wave, RATE, subtype="FLOAT")
            fed.append(decode_window(tmp_path / f"c{i}.wav", sample_rate=RATE, n=n, mode="random",
                                     rng=np.random.default_rng(0), padding=pad))  # type: ignore[arg-type]
            reference.append(wave)
        else:
            fed.append(eval_chunks(wave, n, pad)[0])  # type: ignore[arg-type]
            reference.append(wave[:n])
    return fed, reference, n


def test_ast_data_path_gives_the_extractor_features(small_ast: Path, tmp_path: Path) -> None:
    cfg = load_train_config(PRESETS / "ast_xlmr.yaml", [f"model.audio.path={small_ast}"])
    tower, _ = build_hf_audio_tower("hf_ast", path=str(small_ast), frontend_cfg=cfg.frontend, config=None)
    extractor = ASTFeatureExtractor()
    fed, reference, _ = _windows(small_ast, tmp_path)
    want = extractor(reference, sampling_rate=RATE, return_tensors="pt")["input_values"]
    with torch.no_grad():
        got = tower.frontend(torch.from_numpy(np.stack(fed)))  # one batch, as training stacks crops
    assert not torch.isnan(got).any()
    for k, seconds in enumerate(SECONDS):
        torch.testing.assert_close(got[k], want[k], rtol=1e-3, atol=2e-3, msg=f"{seconds} s")

    old, _, _ = _windows(small_ast, tmp_path, padding="pad")  # the waveform zero-pad of before
    with torch.no_grad():
        before = tower.frontend(torch.from_numpy(np.stack(old)))
    for k, seconds in enumerate(SECONDS[:2]):  # the short clips: their tail is 1.28 + 0.467 off
        assert (before[k] - want[k]).abs().max() > 1.0, f"{seconds} s: the negative case must fail"


def test_ast_step0_centred_embeddings_match_the_model(small_ast: Path, tmp_path: Path) -> None:
    cfg = load_train_config(PRESETS / "ast_xlmr.yaml", [f"model.audio.path={small_ast}"])
    tower, _ = build_hf_audio_tower("hf_ast", path=str(small_ast), frontend_cfg=cfg.frontend, config=None)
    tower.eval()
    model = ASTModel.from_pretrained(small_ast).eval()
    extractor = ASTFeatureExtractor()
    fed, reference, _ = _windows(small_ast, tmp_path)
    old, _, _ = _windows(small_ast, tmp_path, padding="pad")
    with torch.no_grad():
        want = model(input_values=extractor(reference, sampling_rate=RATE, return_tensors="pt")["input_values"]
                     ).pooler_output
        got = tower(torch.from_numpy(np.stack(fed)))
        before = tower(torch.from_numpy(np.stack(old)))

    def centred_cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cosine_similarity(a - a.mean(0), b - b.mean(0), dim=-1)

    assert centred_cos(got, want).min() >= 0.999, centred_cos(got, want).tolist()
    assert centred_cos(before, want)[:2].max() < 0.99, centred_cos(before, want).tolist()


def test_exported_ast_encoder_pads_frames_as_the_tower(small_ast: Path, tmp_path: Path) -> None:
    """The ONNX audio encoder (what a bundle serves) given a NaN-tailed clip, as the service pads it
    for a bundle whose ``audio_frontend.padding`` is ``frames``, equals the torch tower."""
    import onnxruntime as ort

    from index.audio.frontend import pad_short_clip
    from training.bundle.onnx_export import export_audio_encoder

    cfg = load_train_config(PRESETS / "ast_xlmr.yaml", [f"model.audio.path={small_ast}"])
    tower, _ = build_hf_audio_tower("hf_ast", path=str(small_ast), frontend_cfg=cfg.frontend, config=None)
    tower.eval()
    path = export_audio_encoder(tower, tmp_path / "audio.onnx", sample_rate=RATE)
    n = clip_samples(cfg.data, cfg.frontend)
    waves = np.stack([pad_short_clip(signal(s, i), n, "frames") for i, s in enumerate(SECONDS[:2])])
    assert np.isnan(waves).any()
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"waveform": waves})[0]
    with torch.no_grad():
        want = tower(torch.from_numpy(waves)).numpy()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


def test_run_time_step0_check_passes_frame_padding_and_stops_waveform_zero_pad(small_ast: Path) -> None:
    """``model.step0_check`` (training/bundle/step0.py) at the start of an AST fine-tune: the folder's own
    ``ASTModel`` + ``ASTFeatureExtractor`` against the training tower on four probe clips, centred; the
    resolved frame padding passes, the waveform zero-pad of before stops the run in one line."""
    from training.bundle.step0 import MIN_CENTRED_COS, check_step0
    from training.config import ConfigError
    from training.models.dual_encoder import build_dual_encoder
    from training.models.tokenizer import build_tokenizer

    def step0(*extra: str) -> list:  # type: ignore[type-arg]
        cfg = load_train_config(PRESETS / "ast_xlmr.yaml", [f"model.audio.path={small_ast}", "model.text.kind=builtin",
                                                            *extra])
        tokenizer = build_tokenizer(cfg.model, ["a dog barks", "rain on a roof"])
        torch.manual_seed(0)
        model = build_dual_encoder(cfg.model, cfg.frontend, vocab_size=tokenizer.vocab_size)
        return check_step0(model, cfg, tokenizer, torch.device("cpu"))

    results = step0()
    assert [r.tower for r in results] == ["audio"] and results[0].worst >= 0.999, results
    with pytest.raises(ConfigError) as caught:
        step0("frontend.short_clip_padding=pad")
    message = str(caught.value)
    assert message.startswith("model.step0_check: the audio tower (hf_ast") and "\n" not in message, message
    assert f"< {MIN_CENTRED_COS}" in message, message
