"""Fine-tuning from a real-size ``ClapModel`` / ``ASTModel`` starts exactly where the model stands (issues 32
and 41, SPEC §11) — judged on what differs between clips, and shown to fail on every error found before.

The step-0 model is built as ``tonearm train configs/real/{clap,ast_xlmr}.yaml model.audio.path=FOLDER``
builds it (``load_train_config`` → ``build_dual_encoder``) and fed what training feeds it: four different
clips of 0.5, 3, 10 and 14 s written to WAV files and read by the training crop (``TrainClipDataset``:
short clips padded by the resolved ``frontend.short_clip_padding``, a random 10-s window of the 14-s clip).
The reference is the **transformers model's own** feature extractor + model (``ClapFeatureExtractor`` +
``get_audio_features``; ``ASTFeatureExtractor`` + ``ASTModel``), fed each raw clip (the 14-s clip: the
window the crop took) — never tonearm's front end.

Parity is judged per element on the features and on **centred** embeddings
(:func:`training.bundle.step0.centred_cosines`: rows L2-normalised, each set's mean removed): at random weights
unrelated 10-s signals embed at plain cosines of 0.9986–0.9999, so a plain ``cos ≥ 0.999`` passes a
front-end error of that size. The negative cases apply each error found before as a deliberately wrong
front end or data path and assert the measure — and the run-time check ``model.step0_check``
(training/bundle/step0.py), which stops a fine-tune before step 1 — rejects it: HTK instead of Slaney mel bank,
no bicubic stretch (1,024 silence-padded frames), zero-pad instead of repeatpad (CLAP), waveform zero-pad
instead of frame padding (AST). Measured here: every correct path ≥ 0.9999 centred, every error ≤ 0.66.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import torch
from transformers import ClapFeatureExtractor, ClapModel

from tests.real_size_models import PRESETS
from training.bundle.step0 import MIN_CENTRED_COS, centred_cosines, check_step0, probe_signal
from training.config import ConfigError, load_train_config
from training.models.dual_encoder import build_dual_encoder
from training.models.tokenizer import build_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the first test may build the session fixtures

SECONDS = (0.5, 3.0, 10.0, 14.0)
CPU = torch.device("cpu")


def signal(seconds: float, kind: int, rate: int) -> np.ndarray:
    """Four unrelated signals (:func:`training.bundle.step0.probe_signal`): inputs only, the reference is transformers'."""
    return probe_signal(kind, np.arange(int(seconds * rate)) / rate, seconds, np.random.default_rng(kind))


def training_crops(folder: Path, cfg: Any, rate: int, n: int, padding: str | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
    """(what the training crop feeds the tower (4, n), what the extractor is fed per clip): the four clips
    as WAV files through ``TrainClipDataset``; the long clip's reference is the window the crop took."""
    from training.data.dataset import TrainClipDataset
    from training.data.manifest import ClipRecord

    waves = [signal(s, k, rate) for k, s in enumerate(SECONDS)]
    records = []
    for k, wave in enumerate(waves):
        path = folder / f"clip{k}_{rate}.wav"
        if not path.exists():
            sf.write(path, wave, rate, subtype="FLOAT")
        records.append(ClipRecord(id=str(k), audio=path, captions={"eng": ["x"]}, split="train"))
    crops = TrainClipDataset(records, sample_rate=rate, clip_samples=n, seed=0,
                             padding=padding or cfg.frontend.short_clip_padding)  # type: ignore[arg-type]
    fed = np.stack([crops[k].waveform for k in range(len(records))])
    reference = []
    for wave, crop in zip(waves, fed, strict=True):
        if len(wave) <= n:
            reference.append(wave)
            continue
        candidates = np.flatnonzero(wave[: len(wave) - n + 1] == crop[0])
        starts = [int(o) for o in candidates if np.array_equal(wave[o : o + n], crop)]
        assert starts, "the crop of the long clip is a window of it"
        reference.append(wave[starts[0] : starts[0] + n])
    return fed, reference


# --- CLAP ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clap(real_clap_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The step-0 model of configs/real/clap.yaml, CLAP's own extractor + model, and the reference embeddings."""
    cfg = load_train_config(PRESETS / "clap.yaml", [f"model.audio.path={real_clap_dir}"])
    tokenizer = build_tokenizer(cfg.model, [])
    model = build_dual_encoder(cfg.model, cfg.frontend, vocab_size=tokenizer.vocab_size).eval()
    reference = ClapModel.from_pretrained(real_clap_dir).eval()
    extractor = ClapFeatureExtractor.from_pretrained(real_clap_dir)
    rate, n = int(extractor.sampling_rate), int(extractor.nb_max_samples)
    clip_dir = tmp_path_factory.mktemp("clap_clips")
    fed, raw = training_crops(clip_dir, cfg, rate, n)
    with torch.no_grad():
        features = extractor(raw, sampling_rate=rate, return_tensors="pt")["input_features"]
        want = reference.get_audio_features(input_features=features).pooler_output
    return {"cfg": cfg, "tokenizer": tokenizer, "model": model, "reference": reference, "extractor": extractor,
            "rate": rate, "n": n, "fed": fed, "features": features, "want": want, "clip_dir": clip_dir}


def test_clap_step0_equals_the_pretrained_model_on_what_differs(clap: dict[str, Any]) -> None:
    from training.bundle.export import checkpoint_audio_frontend

    model, tokenizer = clap["model"], clap["tokenizer"]
    assert clap["cfg"].frontend.short_clip_padding == "repeatpad"  # auto: the extractor's padding
    assert checkpoint_audio_frontend(clap["cfg"]) is not None  # a checkpoint bundle records it
    tower = model.audio.tower
    fed = torch.from_numpy(clap["fed"])
    with torch.no_grad():
        torch.testing.assert_close(tower.frontend(fed), clap["features"], rtol=0, atol=0.05)  # dB, per element
        got = model.encode_audio(fed)
        texts = ["a dog barks twice", "un chien aboie", "犬が吠える", "rain falls on a tin roof"]
        ids, mask = (torch.from_numpy(a) for a in tokenizer.encode(texts))
        text_got = model.encode_text(ids, mask)
        text_want = clap["reference"].get_text_features(input_ids=ids, attention_mask=mask).pooler_output
    audio_cos = torch.nn.functional.cosine_similarity(got, clap["want"], dim=-1)
    assert audio_cos.min() >= 0.999, dict(zip(SECONDS, audio_cos.tolist(), strict=True))
    assert centred_cosines(got, clap["want"]).min() >= 0.999, centred_cosines(got, clap["want"]).tolist()
    assert centred_cosines(text_got, text_want).min() >= 0.999, centred_cosines(text_got, text_want).tolist()
    # The run-time check of a fine-tune's start agrees (its own probes, the folder's model loaded afresh).
    results = check_step0(model, clap["cfg"], tokenizer, CPU)
    assert [r.tower for r in results] == ["audio", "text"] and min(r.worst for r in results) >= 0.999


@pytest.fixture()
def wrong_clap(clap: dict[str, Any], request: pytest.FixtureRequest) -> Iterator[tuple[str, Any, np.ndarray]]:
    """(error, the run's config, what training feeds) with one error found before applied to the step-0
    model's front end or data path; the model is restored after."""
    error = request.param
    mel = clap["model"].audio.tower.frontend.mel
    cfg, fed = clap["cfg"], clap["fed"]
    saved = mel.mel_fb, mel.frames
    if error == "htk mel bank":  # ClapFeatureExtractor's HTK bank (for fusion) instead of its Slaney one
        mel.mel_fb = torch.from_numpy(np.ascontiguousarray(clap["extractor"].mel_filters.T, dtype=np.float32))
    elif error == "no bicubic stretch":  # 1,001 frames padded with silence to 1,024 instead of HTS-AT's stretch
        audio_cfg = clap["reference"].config.audio_config
        mel.frames = int(audio_cfg.spec_size * (audio_cfg.spec_size // audio_cfg.num_mel_bins))
    elif error == "zero-pad":  # the data path zero-pads short clips instead of CLAP's repeatpad
        cfg = load_train_config(PRESETS / "clap.yaml", [f"model.audio.path={cfg.model.audio.path}",
                                                        "frontend.short_clip_padding=pad"])
        fed = training_crops(clap["clip_dir"], cfg, clap["rate"], clap["n"], padding="pad")[0]
    yield error, cfg, fed
    mel.mel_fb, mel.frames = saved


@pytest.mark.parametrize("wrong_clap", ["htk mel bank", "no bicubic stretch", "zero-pad"], indirect=True)
def test_clap_parity_rejects_the_errors_found_before(clap: dict[str, Any], wrong_clap: tuple[str, Any, np.ndarray]) -> None:
    error, cfg, fed = wrong_clap
    model = clap["model"]
    with torch.no_grad():
        features = model.audio.tower.frontend(torch.from_numpy(fed))
        got = model.encode_audio(torch.from_numpy(fed))
    if features.shape == clap["features"].shape:  # the features themselves, per element (not for 1,024 frames)
        assert (features - clap["features"]).abs().amax() > 1.0, f"{error}: the features must differ"
    centred = centred_cosines(got, clap["want"])
    assert centred.min() < MIN_CENTRED_COS, f"{error}: centred cosines {centred.tolist()} must reject it"
    with pytest.raises(ConfigError) as caught:  # the fine-tune's run-time check stops on it
        check_step0(model, cfg, clap["tokenizer"], CPU)
    message = str(caught.value)
    assert "\n" not in message and "the audio tower (hf_clap" in message, message
    assert "centred cosine" in message and f"< {MIN_CENTRED_COS}" in message, message


def test_fused_or_fusion_truncation_clap_is_refused_by_training_as_by_export(real_clap_dir: Path, tmp_path: Path) -> None:
    """CLAP's ``truncation`` and ``enable_fusion`` are read in training as in ``export --pretrained``
    (one shared check): both refuse in one line, before any weights load."""
    import json
    import shutil

    from training.models.pretrained_clap import load_pretrained_clap

    extractor = json.loads((real_clap_dir / "preprocessor_config.json").read_text())
    config = json.loads((real_clap_dir / "config.json").read_text())
    cases = {}
    for name, new_config, new_extractor, message in (
        ("fused", {**config, "audio_config": {**config["audio_config"], "enable_fusion": True}}, extractor,
         "is a fused CLAP (enable_fusion=true)"),
        ("fusion_truncation", config, {**extractor, "truncation": "fusion"}, "truncation='fusion'"),
    ):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(new_config))
        (folder / "preprocessor_config.json").write_text(json.dumps(new_extractor))
        (folder / "model.safetensors").write_bytes(b"")  # never read: the settings are refused first
        shutil.copy(real_clap_dir / "tokenizer.json", folder)
        cases[folder] = message
    for folder, message in cases.items():
        cfg = load_train_config(PRESETS / "clap.yaml", [f"model.audio.path={folder}"])
        with pytest.raises(ConfigError) as training:
            build_dual_encoder(cfg.model, cfg.frontend, vocab_size=10)
        with pytest.raises(ConfigError) as export:
            load_pretrained_clap(folder)
        for err, key in ((training.value, "model.audio.path"), (export.value, "--pretrained")):
            assert str(err).startswith(key) and message in str(err) and "\n" not in str(err), str(err)


# --- AST ----------------------------------------------------------------------------------------------


def test_ast_step0_equals_the_pretrained_model_and_rejects_waveform_zero_pad(real_ast_dir: Path, tmp_path: Path) -> None:
    """The ``hf_ast`` tower of configs/real/ast_xlmr.yaml against ``ASTFeatureExtractor`` + ``ASTModel``
    (pooled output; the projection head is new), through the training crop (the resolved padding is AST's
    frame padding after the fbank, issue 41). The waveform zero-pad of before fails per element and
    centred. (tests/training/test_ast_short_clips.py does the same on a 2-layer AST with the evaluation
    windows and the exported encoder; the run-time check on the full-size AST runs in every
    configs/real/ast_xlmr.yaml fine-tune, tests/training/test_real_size_presets.py.)"""
    from transformers import ASTFeatureExtractor, ASTModel

    from training.evaluate import clip_samples
    from training.models.hf import build_hf_audio_tower

    cfg = load_train_config(PRESETS / "ast_xlmr.yaml", [f"model.audio.path={real_ast_dir}"])
    assert cfg.frontend.short_clip_padding == "frames"
    tower, _ = build_hf_audio_tower("hf_ast", path=str(real_ast_dir), frontend_cfg=cfg.frontend, config=None)
    tower.eval()
    model = ASTModel.from_pretrained(real_ast_dir).eval()
    extractor = ASTFeatureExtractor()  # the folder has no preprocessor_config.json: the defaults
    rate, n = int(extractor.sampling_rate), clip_samples(cfg.data, cfg.frontend)
    fed, raw = training_crops(tmp_path, cfg, rate, n)
    zero_padded, _ = training_crops(tmp_path, cfg, rate, n, padding="pad")
    short = [k for k, s in enumerate(SECONDS) if s * rate < n]
    with torch.no_grad():
        feats = extractor(raw, sampling_rate=rate, return_tensors="pt")["input_values"]
        torch.testing.assert_close(tower.frontend(torch.from_numpy(fed)), feats, rtol=1e-3, atol=2e-3)
        want = model(input_values=feats).pooler_output
        got = tower(torch.from_numpy(fed))
        wrong_feats = tower.frontend(torch.from_numpy(zero_padded[short]))
        wrong = got.clone()  # the zero-pad changes only the short clips: only they are run again
        wrong[short] = tower(torch.from_numpy(zero_padded[short]))
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min() >= 0.999, cos.tolist()
    assert centred_cosines(got, want).min() >= 0.999, centred_cosines(got, want).tolist()
    assert (wrong_feats - feats[short]).abs().amax() > 1.0
    assert centred_cosines(wrong, want).min() < MIN_CENTRED_COS, centred_cosines(wrong, want).tolist()


# --- the run-time check inside `tonearm train` ---------------------------------------------------------


def test_a_fine_tune_that_does_not_start_as_its_model_stops_before_step_1(
    real_clap_dir: Path, real_train_manifest: Path, tmp_path: Path
) -> None:
    """``tonearm train configs/real/clap.yaml`` with a data path that is not CLAP's own (zero-pad) stops at
    the start, in one line, before any step or checkpoint; ``model.step0_check=false`` (or a resumed run,
    or ``init_checkpoint``) skips the check. (The presets' real-size runs pass it and record it in
    metrics.jsonl: tests/training/test_real_size_presets.py.)"""
    import json

    from training.bundle.step0 import applies
    from training.loop import train

    out = tmp_path / "run"
    overrides = [f"model.audio.path={real_clap_dir}", f"data.manifest={real_train_manifest}", f"out_dir={out}",
                 "device=cpu", "threads=2", "optim.batch_size=2", "optim.amp=false", "data.num_workers=0",
                 "frontend.short_clip_padding=pad"]
    cfg = load_train_config(PRESETS / "clap.yaml", overrides)
    with pytest.raises(ConfigError) as caught:
        train(cfg)
    message = str(caught.value)
    assert message.startswith("model.step0_check: the audio tower (hf_clap") and "\n" not in message, message
    assert f"< {MIN_CENTRED_COS}" in message and "frontend.short_clip_padding" in message, message
    assert not (out / "last").exists()
    metrics = out / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    assert not [row for row in rows if row.get("kind") == "step"]
    assert applies(cfg, resuming=False) and not applies(cfg, resuming=True)
    assert not applies(load_train_config(PRESETS / "clap.yaml", [*overrides, "model.step0_check=false"]), resuming=False)
    assert not applies(load_train_config(PRESETS / "clap.yaml", [*overrides, f"model.init_checkpoint={tmp_path}"]),
                       resuming=False)
