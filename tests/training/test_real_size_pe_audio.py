"""`tonearm export --pretrained` of Meta PE-Audio at its FULL default size (random weights, 606 M).

One fp32 export is shared by every assert (`--quantize` is family-independent code,
``training.bundle.export.quantization_records``, exercised at full size on CLAP by
tests/training/test_pretrained_quantize.py; quantizing this 1.3-GB text tower here would add
minutes to the suite). The references are the transformers model itself: ``PeAudioFeatureExtractor`` +
``get_audio_embeds`` of the clip (clips longer than the window are embedded whole, the bundle's
recorded ``long_clips = "whole"``; the export's own check includes a 10.5-s clip) and ``text_audio_embeds`` as
``PeAudioModel.forward`` computes them. The bundle side is the service's own path:
``LoadedBundle.encode_audio`` / ``encode_text`` (decode-free: waveforms at 48 kHz).

* audio: cosine ≥ 0.999 per clip of 0.5 s and 3 s (reflect-padded to the hop multiple, embedded
  at their own length); the exactly-one-window clip is the export's own parity check (recorded in
  the manifest, asserted here); longer clips are the loader's chunk-and-average, family-independent;
* text: cosine ≥ 0.999 per caption, including one past ModernBERT's usual lengths.

Costs ~1 s of CPU per second of audio in each of torch and onnxruntime; the clips are few.
"""

from __future__ import annotations

import gc
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from index.bundle import format as fmt
from index.runtime.loader import LoadedBundle
from tests.real_size_models import (
    cache_root,
    cached_export,
    cached_model_dir,
    mini_manifest,
    only_bundle,
)
from tonearm.cli import main

pytestmark = pytest.mark.timeout(1800)  # the first test's setup builds the model and its export on a cold cache
RATE = 48_000


@pytest.fixture(scope="module")
def real_pe_audio_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The full-size random-weight folder (2.4 GB) from the per-machine cache (tests/model_cache.py; built
    when its builder or a library changed), for this module only: its view (hard links) is deleted when
    the module ends."""
    base = tmp_path_factory.mktemp("pe_audio_model")
    yield cached_model_dir("pe_audio", base, root=cache_root(tmp_path_factory))
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def pe_bundle(real_pe_audio_dir: Path, tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The fp32 `tonearm export --pretrained` of the full-size folder over three clips (one per split;
    2.3 GB), cached per machine (tests/real_size_models.py ``cached_export``): exported again whenever the
    export code, the model's key, the clips or a library changed. Its view is deleted when the module ends."""
    base = tmp_path_factory.mktemp("pe_audio")
    manifest = mini_manifest(tiny_corpus, base / "manifest.jsonl", per_split=1)

    def build(directory: Path) -> None:
        code = main(["export", "--pretrained", str(real_pe_audio_dir), "--data", str(manifest), "--out",
                     str(directory / "bundles"), "--languages", "eng"])
        assert code == 0
        gc.collect()

    view = cached_export("pe_audio_bundle", build, tmp_path_factory, models=["pe_audio"], manifests=[manifest])
    path = only_bundle(view / "bundles")
    yield path
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(view, ignore_errors=True)


def test_pe_audio_bundle_matches_the_model_through_the_service_path(real_pe_audio_dir: Path, pe_bundle: Path) -> None:
    import torch
    import transformers

    manifest = fmt.read_manifest(pe_bundle)
    frontend = manifest.audio_frontend
    assert frontend is not None and frontend.source == "pe_audio_feature_extractor"
    assert (frontend.padding, frontend.pad_multiple, frontend.long_clips) == ("reflect", 1920, "whole")
    assert manifest.sample_rate == RATE and manifest.clip_samples == 10 * RATE and manifest.embed_dim == 1024
    assert manifest.audio_encoder.quantization == "none" and manifest.audio_encoder.parity_min_cosine >= 0.999
    assert manifest.text_encoder.quantization == "none" and manifest.text_encoder.parity_min_cosine >= 0.999

    rng = np.random.default_rng(0)
    clips = [(0.1 * rng.standard_normal(int(s * RATE))).astype(np.float32) for s in (0.5, 3.0)]
    texts = ["a dog barks twice", "rain falls on a tin roof", "犬が吠える", "people talk in a busy cafe " * 6]
    bundle = LoadedBundle.open(pe_bundle)
    got_audio, got_text = bundle.encode_audio(clips), bundle.encode_text(texts)
    bundle.close()

    model = transformers.PeAudioModel.from_pretrained(real_pe_audio_dir).eval()
    extractor = transformers.PeAudioFeatureExtractor.from_pretrained(real_pe_audio_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(real_pe_audio_dir)
    n = manifest.clip_samples
    with torch.no_grad():
        expected_audio = []
        for clip in clips:
            windows = [clip] if clip.shape[0] <= n else [clip[:n], clip[-n:]]
            embeds = []
            for window in windows:
                inputs = extractor(window, sampling_rate=RATE, return_tensors="pt")
                embeds.append(torch.nn.functional.normalize(
                    model.get_audio_embeds(inputs["input_values"], padding_mask=inputs["padding_mask"])[0], dim=-1))
            expected_audio.append(torch.stack(embeds).mean(0).numpy())
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    input_values=torch.zeros(1, 1, 1920))
        expected_text = out.text_audio_embeds.numpy()
    del model, out
    gc.collect()

    def cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)

    audio_cos, text_cos = cos(got_audio, np.stack(expected_audio)), cos(got_text, expected_text)
    print(f"PE-Audio bundle vs model: audio {np.round(audio_cos, 6)}, text {np.round(text_cos, 6)}")
    assert (audio_cos >= 0.999).all(), audio_cos
    assert (text_cos >= 0.999).all(), text_cos


def test_pe_audio_finetune_step0_at_full_size_is_the_model(real_pe_audio_dir: Path) -> None:
    """`tonearm train configs/real/pe_audio.yaml model.audio.path=FOLDER` at step 0, forward only, on the
    full-size folder: the evaluation data path (0.5 s and 3 s reflect-padded by the tower; the whole
    14-s clip is held by the small-config tests, a full-size 14-s forward twice cost ~25 s of the suite)
    against ``PeAudioFeatureExtractor`` + ``get_audio_embeds``, and the captions against ``text_audio_embeds``
    (cosine >= 0.999; the small-config tests in test_pe_audio_finetune.py hold the centred comparisons
    and the negative cases). The two models are loaded one after the other (2.4 GB each)."""
    import torch
    import transformers

    from index.audio.decode import eval_chunks
    from tests.real_size_models import PRESETS
    from training.config import load_train_config
    from training.evaluate import embed_chunks
    from training.models.dual_encoder import build_dual_encoder
    from training.models.tokenizer import build_tokenizer

    rng = np.random.default_rng(1)
    clips = [(0.1 * rng.standard_normal(int(s * RATE))).astype(np.float32) for s in (0.5, 3.0)]
    texts = ["a dog barks twice", "rain falls on a tin roof"]
    cfg = load_train_config(PRESETS / "pe_audio.yaml", [f"model.audio.path={real_pe_audio_dir}"])
    tokenizer = build_tokenizer(cfg.model, [])
    model = build_dual_encoder(cfg.model, cfg.frontend, vocab_size=tokenizer.vocab_size).eval()
    ids, mask = tokenizer.encode(texts)
    with torch.no_grad():
        got_audio = embed_chunks(model, [eval_chunks(c, 10 * RATE, "reflect") for c in clips], batch_size=2,
                                 device=torch.device("cpu"))
        got_text = model.encode_text(torch.from_numpy(ids), torch.from_numpy(mask))
    del model
    gc.collect()
    ref = transformers.PeAudioModel.from_pretrained(real_pe_audio_dir).eval()
    extractor = transformers.PeAudioFeatureExtractor.from_pretrained(real_pe_audio_dir)
    with torch.no_grad():
        want_audio = []
        for clip in clips:
            inputs = extractor(clip, sampling_rate=RATE, return_tensors="pt")
            want_audio.append(ref.get_audio_embeds(inputs["input_values"], padding_mask=inputs["padding_mask"])[0])
        out = ref(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                  input_values=torch.zeros(1, 1, 1920))
    del ref
    gc.collect()
    audio_cos = torch.nn.functional.cosine_similarity(got_audio, torch.stack(want_audio), dim=-1)
    text_cos = torch.nn.functional.cosine_similarity(got_text, out.text_audio_embeds, dim=-1)
    print(f"PE-Audio full-size step 0: audio {audio_cos.tolist()}, text {text_cos.tolist()}")
    assert audio_cos.min() >= 0.999 and text_cos.min() >= 0.999
