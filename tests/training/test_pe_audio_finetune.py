"""PE-Audio as a tower to train (issue 41 item 4): `tonearm train configs/real/pe_audio.yaml
model.audio.path=FOLDER` on a small random-weight ``PeAudioModel`` (tests/small_pe_audio.py; the codec
keeps PE-Audio's hop, so every length rule is the real one).

References are transformers' own: ``PeAudioFeatureExtractor`` + ``PeAudioModel.get_audio_embeds`` of the
whole clip (the model has no maximum length), and ``text_audio_embeds`` as ``PeAudioModel.forward``
computes them with the folder's tokenizer. Parity is judged on **centred** embeddings (the mean over the
set of different clips removed): at random weights unrelated clips embed close together, so a raw cosine
would pass real front-end errors. The negative cases (zero-padding a short clip instead of reflecting it,
the window-mean of a long clip instead of its whole-clip forward) are shown to fail the same check.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from index.audio.decode import eval_chunks
from tests.real_size_models import PRESETS, mini_manifest
from tests.small_pe_audio import RecordedEncoder, save_small_pe_audio, save_small_pe_audio_video
from training.config import ConfigError, load_train_config
from training.evaluate import embed_chunks
from training.models.dual_encoder import build_dual_encoder
from training.models.tokenizer import build_tokenizer

RATE = 48_000
WINDOW = 10 * RATE
SECONDS = (0.5, 3.0, 10.0, 14.0)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def small_pe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_small_pe_audio(tmp_path_factory.mktemp("pe_audio") / "pe_audio")


@pytest.fixture(scope="module")
def small_pe_av(small_pe: Path) -> Path:
    return save_small_pe_audio_video(small_pe.parent / "pe_av", small_pe)


def clips() -> list[np.ndarray]:
    """Two different clips per length: a chirp plus noise, and pulsed noise."""
    out = []
    for i, seconds in enumerate(SECONDS):
        t = np.arange(int(seconds * RATE)) / RATE
        rng = np.random.default_rng(i)
        out.append((0.3 * np.sin(2 * np.pi * (200 + 2000 * t / seconds) * t)
                    + 0.05 * rng.standard_normal(t.shape)).astype(np.float32))
        out.append((0.2 * rng.standard_normal(t.shape) * (np.sin(2 * np.pi * 3 * t) > 0)).astype(np.float32))
    return out


def step0(folder: Path) -> tuple[torch.nn.Module, object]:
    cfg = load_train_config(PRESETS / "pe_audio.yaml", [f"model.audio.path={folder}", "model.embed_dim=32"])
    tokenizer = build_tokenizer(cfg.model, [])
    return build_dual_encoder(cfg.model, cfg.frontend, vocab_size=tokenizer.vocab_size).eval(), tokenizer


def centred_cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a - a.mean(0), b - b.mean(0)
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


@torch.no_grad()
def reference_audio(folder: Path, waves: list[np.ndarray]) -> torch.Tensor:
    model = transformers.PeAudioModel.from_pretrained(folder).eval()
    extractor = transformers.PeAudioFeatureExtractor.from_pretrained(folder)
    out = []
    for wave in waves:
        inputs = extractor(wave, sampling_rate=RATE, return_tensors="pt")
        out.append(model.get_audio_embeds(inputs["input_values"], padding_mask=inputs["padding_mask"])[0])
    return torch.nn.functional.normalize(torch.stack(out), dim=-1)


def test_step0_is_the_model_at_every_length_and_the_wrong_rules_fail(small_pe: Path) -> None:
    model, _ = step0(small_pe)
    waves = clips()
    want = reference_audio(small_pe, waves)
    with torch.no_grad():  # the evaluation data path: eval_chunks with the preset's padding, embed_chunks
        got = embed_chunks(model, [eval_chunks(w, WINDOW, "reflect") for w in waves], batch_size=3, device=CPU)
        zero_padded = embed_chunks(model, [eval_chunks(w, WINDOW, "pad") for w in waves], batch_size=3, device=CPU)
    cos = centred_cos(got, want)
    assert cos.min() >= 0.999, dict(enumerate(cos.tolist()))
    # negative cases: a short clip zero-padded to the window; a long clip as the mean of its 10-s windows
    wrong = centred_cos(zero_padded, want)
    assert wrong[:4].max() < 0.99, wrong.tolist()  # the 0.5-s and 3-s clips
    assert wrong[6:].max() < 0.99, wrong.tolist()  # the 14-s clips (chunk-and-average)
    print(f"PE-Audio step 0 centred cosine {cos.min():.6f}; zero-pad/window-mean {np.round(wrong.numpy(), 3)}")


def test_run_time_step0_check_holds_for_pe_audio_and_stops_a_wrong_data_path(small_pe: Path) -> None:
    """``model.step0_check`` (training/bundle/step0.py) at the start of a PE-Audio fine-tune: the training towers on
    the probe clips of 0.5, 3, 10 and 14 s (the preset's 10-s window) as the evaluation data path gives them —
    short clips at their own length (the NaN marker), the 14-s clip whole — against the folder's own
    ``PeAudioFeatureExtractor`` + ``PeAudioModel.get_audio_embeds`` on each clip at its own length (the 14-s
    one whole: the extractor neither truncates nor windows) and ``PeAudioModel.forward``'s
    ``text_audio_embeds``, centred. The same check with the zero-pad of every other tower stops in one line;
    a wrong sample rate is refused before it."""
    from training.bundle.step0 import MIN_CENTRED_COS, check_step0, make_probe

    def check(*extra: str) -> list:  # type: ignore[type-arg]
        cfg = load_train_config(PRESETS / "pe_audio.yaml", [f"model.audio.path={small_pe}", "model.embed_dim=32",
                                                            *extra])
        tokenizer = build_tokenizer(cfg.model, [])
        model = build_dual_encoder(cfg.model, cfg.frontend, vocab_size=tokenizer.vocab_size)
        return check_step0(model, cfg, tokenizer, CPU)

    cfg = load_train_config(PRESETS / "pe_audio.yaml", [f"model.audio.path={small_pe}"])
    probe = make_probe(cfg, CPU)
    assert [len(c) / RATE for c in probe.seen] == [0.5, 3.0, 10.0, 14.0]  # the 14-s clip whole, not 10 s
    assert probe.windows.shape == (4, 14 * RATE)
    assert np.isnan(probe.windows[0, RATE // 2:]).all() and not np.isnan(probe.windows[0, : RATE // 2]).any()
    results = check()
    assert [(r.tower, r.kind) for r in results] == [("audio", "hf_pe_audio"), ("text", "hf_pe_audio")]
    assert min(r.worst for r in results) >= 0.999, results
    with pytest.raises(ConfigError) as caught:  # short clips zero-padded to the 10-s window
        check("frontend.short_clip_padding=pad")
    message = str(caught.value)
    assert message.startswith("model.step0_check: the audio tower (hf_pe_audio") and "\n" not in message, message
    assert f"< {MIN_CENTRED_COS}" in message, message
    with pytest.raises(ConfigError, match="frontend.sample_rate=16000 but the PE-Audio feature extractor"):
        check("frontend.sample_rate=16000")


def test_a_long_clip_off_the_hop_embeds_as_the_extractor_pads_it_alone_or_in_a_batch(small_pe: Path) -> None:
    """A clip longer than the window whose length is not a multiple of the hop (2.9 s at a 2-s window) is
    evaluated whole; alone in a batch (no NaN row) the tower reflect-pads it to the hop as
    ``PeAudioFeatureExtractor`` does — before, it ran unpadded there and only batches holding a short clip
    padded it. Reference: the extractor + ``get_audio_embeds``, per element."""
    model, _ = step0(small_pe)
    ref = transformers.PeAudioModel.from_pretrained(small_pe).eval()
    extractor = transformers.PeAudioFeatureExtractor.from_pretrained(small_pe)
    wave = clips()[7][: int(2.9 * RATE)]  # pulsed noise, 2.9 s: 72.5 hops
    assert wave.shape[0] == int(2.9 * RATE) and wave.shape[0] % 1920
    short = clips()[0]  # 0.5 s: a NaN-marked row in the same batch
    with torch.no_grad():
        inputs = extractor(wave, sampling_rate=RATE, return_tensors="pt")
        want = ref.get_audio_embeds(inputs["input_values"], padding_mask=inputs["padding_mask"])[0]
        alone = model.audio.tower(torch.from_numpy(eval_chunks(wave, 2 * RATE, "reflect")))[0]
        from training.evaluate import stack_windows

        both = stack_windows([eval_chunks(wave, 2 * RATE, "reflect"), eval_chunks(short, 2 * RATE, "reflect")])
        batched = model.audio.tower(torch.from_numpy(both))[0]
    # unpadded, the codec's last frame differs: 1e-4 off the reference where clips differ by ~2e-3
    torch.testing.assert_close(batched, want, rtol=0, atol=2e-5)
    torch.testing.assert_close(alone, want, rtol=0, atol=2e-5)


def test_text_step0_and_512_token_truncation(small_pe: Path) -> None:
    model, tokenizer = step0(small_pe)
    ref = transformers.PeAudioModel.from_pretrained(small_pe).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(small_pe)
    long = " ".join(f"a dog barks {i} times near a busy road" for i in range(120))
    texts = ["a dog barks twice", "rain falls on a tin roof", "犬が吠える", long]
    assert len(hf_tok(long)["input_ids"]) > 600  # longer than the 512 tokens kept
    ids, mask = tokenizer.encode(texts)
    assert ids.shape[1] == 512 and mask[3].sum() == 512
    batch = hf_tok(texts, padding=True, truncation=True, max_length=512, return_tensors="pt")
    np.testing.assert_array_equal(ids[3], batch["input_ids"][3].numpy())  # the same 512 ids, ending in </s>
    # float64: at random weights different captions embed at cosine ~1.0000 to one another, so a float32
    # centred comparison would be mostly rounding
    model, ref = model.double(), ref.double()
    with torch.no_grad():
        got = model.encode_text(torch.from_numpy(ids), torch.from_numpy(mask))
        out = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  input_values=torch.zeros(1, 1, 1920, dtype=torch.float64))
    want = torch.nn.functional.normalize(out.text_audio_embeds, dim=-1)
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min() >= 0.999, cos.tolist()
    centred = centred_cos(got, want)
    assert centred.min() >= 0.999, centred.tolist()


def test_pe_av_folders_train_from_their_audio_branch_and_other_pe_folders_are_refused(
    small_pe: Path, small_pe_av: Path, tmp_path: Path
) -> None:
    from_pe, _ = step0(small_pe)
    from_av, _ = step0(small_pe_av)
    wave = torch.from_numpy(clips()[2])[None]
    with torch.no_grad():
        torch.testing.assert_close(from_av.encode_audio(wave), from_pe.encode_audio(wave))
    encoder_only = tmp_path / "encoder"
    encoder_only.mkdir()
    (encoder_only / "config.json").write_text(json.dumps({"model_type": "pe_audio_encoder"}))
    (encoder_only / "model.safetensors").write_bytes(b"")
    cfg = load_train_config(PRESETS / "pe_audio.yaml", [f"model.audio.path={encoder_only}", "model.embed_dim=32"])
    with pytest.raises(ConfigError, match=r"holds a 'pe_audio_encoder' model, not a PE audio–text model") as err:
        build_dual_encoder(cfg.model, cfg.frontend, vocab_size=300)
    assert "\n" not in str(err.value) and "pe_audio_video" in str(err.value)
    with pytest.raises(ConfigError, match="both hf_pe_audio"):
        cfg = load_train_config(PRESETS / "pe_audio.yaml", [f"model.audio.path={small_pe}", "model.text.kind=builtin"])
        build_dual_encoder(cfg.model, cfg.frontend, vocab_size=300)


OBJECTIVES = {
    "infonce+random+svr": ["objective.base={name: infonce}", "objective.strategy={name: random}",
                           "objective.regularizers=[{name: svr}]"],
    "siglip+kcl+uwd": ["objective.base={name: siglip}", "objective.strategy={name: kcl}",
                       "objective.regularizers=[{name: uwd}]"],
    "iot+cacl": ["objective.base={name: iot}", "objective.strategy={name: cacl, anchor: eng}"],
    "infonce_reweight": ["objective.base={name: infonce_reweight}"],
    "triplet": ["objective.base={name: triplet}"],
    "distill": ["objective.distill={teachers: [TEACHER], mix_lambda: 0.5}"],
    "ask": ["objective.knowledge={n_clusters: 2, top_k: 2, refresh_epochs: 1}"],
}
"""Every base loss, strategy and regularizer of training/objectives/registry.py, in five runs; estimated-
correspondence distillation (``objective.distill``, from a PE-Audio teacher: TEACHER is :func:`pe_teacher`)
and ASK (``objective.knowledge``: knowledge bases built by the evaluation data path, long clips whole)."""
LOSS_KEYS = {"distill": "distill_loss", "ask": "ask_loss"}
"""The step record's own loss of the objectives beyond the registry's (``loss`` for the others)."""


def pe_run_overrides(folder: Path, manifest: Path, out_dir: Path) -> list[str]:
    """A small CPU run: one epoch of one step (batch 4 of the 4 training clips), 2-s crops, then evaluation.
    ``model.step0_check`` is off in the objective runs (it is tested on its own and in the export run)."""
    return [f"model.audio.path={folder}", "model.embed_dim=32", f"data.manifest={manifest}", f"out_dir={out_dir}",
            "device=cpu", "threads=2", "optim.epochs=1", "optim.batch_size=4", "optim.warmup_steps=0",
            "optim.amp=false", "optim.lr=1.0e-3", "eval.every_epochs=1", "eval.batch_size=4", "data.num_workers=0",
            "data.clip_seconds=2.0"]


@pytest.fixture(scope="module")
def pe_manifest(tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mini_manifest(tiny_corpus, tmp_path_factory.mktemp("pe_manifest") / "manifest.jsonl", per_split=1, train=4)


@pytest.fixture(scope="module")
def pe_teacher(small_pe: Path, pe_manifest: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stage-1 PE-Audio checkpoint (one InfoNCE step from the small folder): the distillation teacher,
    at the student's 48 kHz as teachers must be."""
    from training.loop import train

    run = train(load_train_config(PRESETS / "pe_audio.yaml", [
        *pe_run_overrides(small_pe, pe_manifest, tmp_path_factory.mktemp("pe_teacher")), "model.step0_check=false"]))
    return run / "last" if (run / "last").is_dir() else run


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_trains_with_every_objective(
    name: str, small_pe: Path, pe_manifest: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    from training.checkpoint import load_checkpoint
    from training.loop import train

    objective = OBJECTIVES[name]
    if name == "distill":
        objective = [o.replace("TEACHER", str(request.getfixturevalue("pe_teacher"))) for o in objective]
    overrides = [*pe_run_overrides(small_pe, pe_manifest, tmp_path), "model.step0_check=false", *objective]
    run = train(load_train_config(PRESETS / "pe_audio.yaml", overrides))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    (step,) = [r for r in records if r["kind"] == "step"]
    key = LOSS_KEYS.get(name, "loss")
    assert key in step and np.isfinite(step[key]) and np.isfinite(step["loss"]), step
    if name == "ask":
        assert [r["ask_kb_builds"] for r in records if r["kind"] == "epoch"] == [1.0]
    ckpt = load_checkpoint(run / "last" if (run / "last").is_dir() else run)
    before = transformers.PeAudioModel.from_pretrained(small_pe)
    trained, start = dict(ckpt.model.audio.tower.named_parameters()), before.state_dict()
    layer = "audio_encoder.layers.0.mlp.up_proj.weight"
    assert not torch.equal(trained[layer], start[layer]), "the audio transformer did not train"
    assert torch.isfinite(trained[layer]).all()
    codec = "audio_encoder.embedder.dac_encoder.conv1.weight"  # transformers runs the codec under no_grad
    assert torch.equal(trained[codec], start[codec])
    text = dict(ckpt.model.text.tower.named_parameters())["text_audio_head.proj.weight"]
    assert not torch.equal(text, start["text_audio_head.proj.weight"]), "the text head did not train"


def test_a_fine_tuned_pe_audio_exports_a_bundle_the_service_embeds_as_training_did(
    small_pe: Path, pe_manifest: Path, tmp_path: Path
) -> None:
    """The checkpoint's bundle records PE-Audio's rules (reflect to the hop, long clips whole) and the
    service's path (``LoadedBundle.encode_audio``) gives the checkpoint's own evaluation embeddings."""
    from index.bundle import format as fmt
    from index.runtime.loader import LoadedBundle
    from training.bundle.export import export_bundle
    from training.checkpoint import load_checkpoint
    from training.loop import train

    run = train(load_train_config(PRESETS / "pe_audio.yaml", pe_run_overrides(small_pe, pe_manifest, tmp_path / "run")))
    (check,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
                if '"step0_check"' in line]  # the run-time step-0 check ran before step 1 and passed
    assert check["audio_centred_cos"] >= 0.999 and check["text_centred_cos"] >= 0.999, check
    checkpoint = run / "last" if (run / "last").is_dir() else run
    bundle_dir = export_bundle(checkpoint, manifest=pe_manifest, out_dir=tmp_path / "bundles", progress=False)
    frontend = fmt.read_manifest(bundle_dir).audio_frontend
    assert frontend is not None
    assert (frontend.source, frontend.padding, frontend.pad_multiple, frontend.long_clips) == (
        "pe_audio_feature_extractor", "reflect", 1920, "whole")
    model = load_checkpoint(checkpoint).model.eval()
    waves = [w for w in clips() if w.shape[0] != WINDOW]  # 0.5, 3 and 14 s: shorter and longer than 2 s
    with torch.no_grad():
        want = embed_chunks(model, [eval_chunks(w, 2 * RATE, "reflect") for w in waves], batch_size=3, device=CPU)
    bundle = LoadedBundle.open(bundle_dir)
    got = torch.from_numpy(bundle.encode_audio(waves))
    bundle.close()
    cos = centred_cos(got, want)
    assert cos.min() >= 0.999, cos.tolist()


def test_export_pretrained_of_a_pe_av_folder_serves_its_audio_branch_with_long_clips_whole(
    small_pe: Path, small_pe_av: Path, pe_manifest: Path, tmp_path: Path
) -> None:
    """`tonearm export --pretrained` of the ``pe_audio_video`` layout; the reference is the ``PeAudioModel``
    the weights came from, fed by its own extractor over the whole clip (0.5, 3 and 14 s)."""
    from index.bundle import format as fmt
    from index.runtime.loader import LoadedBundle
    from tonearm.cli import main

    assert main(["export", "--pretrained", str(small_pe_av), "--data", str(pe_manifest), "--out",
                 str(tmp_path / "bundles"), "--languages", "eng"]) == 0
    (bundle_dir,) = [p for p in (tmp_path / "bundles").iterdir() if p.is_dir()]
    manifest = fmt.read_manifest(bundle_dir)
    assert manifest.audio_frontend is not None and manifest.audio_frontend.long_clips == "whole"
    assert manifest.audio_encoder.parity_min_cosine >= 0.999  # the export's own check includes a 10.5-s clip
    waves = [w for w in clips() if w.shape[0] != WINDOW]
    bundle = LoadedBundle.open(bundle_dir)
    got = torch.from_numpy(bundle.encode_audio(waves))
    # the codec's activation memory is bounded per call (index.runtime.loader.CODEC_CALL_SAMPLES): five 10-s clips
    # run two at a time, with the embeddings each clip gets alone
    from index.runtime.loader import CODEC_CALL_SAMPLES, encode_clips

    recorded = RecordedEncoder(bundle._need(bundle._audio_encoder))
    tens = [clips()[4 + i % 2] * (1 + i) for i in range(5)]
    together = encode_clips(recorded, tens, clip_samples=bundle.clip_samples, embed_dim=bundle.embed_dim,  # type: ignore[arg-type]
                            frontend=manifest.audio_frontend)
    calls = recorded.calls
    alone = np.concatenate([bundle.encode_audio([w]) for w in tens])
    bundle.close()
    assert [c[0] for c in calls] == [2, 2, 1] and all(c[0] * c[1] <= CODEC_CALL_SAMPLES for c in calls)
    np.testing.assert_allclose(together, alone, atol=1e-5)
    cos = centred_cos(got, reference_audio(small_pe, waves))
    assert cos.min() >= 0.999, cos.tolist()
