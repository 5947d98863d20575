"""`tonearm export --pretrained`: a real-size CLAP folder (random weights, saved here) as a bundle (SPEC §11).

The bundle's encoders must give the model's own ``get_audio_features`` (on ``ClapFeatureExtractor``
features) and ``get_text_features`` (on its own tokenizer's ids), cosine ≥ 0.999 per item, through
the loader the service uses; uploads at other sample rates are resampled to the bundle's 48 kHz.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr

from index.runtime.loader import LoadedBundle
from index.runtime.verify import verify_bundle
from tonearm.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the first test builds the session fixtures

TEXTS = [
    "a dog barks twice", "rain falls on a tin roof while a siren passes by in the distance",
    "un chien aboie", "犬が吠える", " ".join(["a very long caption that the tokenizer truncates"] * 80),
]


def signal(seconds: float, rate: int, seed: int) -> np.ndarray:
    """A chirp plus noise (energy in every mel band)."""
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(seed)
    chirp = np.sin(2 * np.pi * (200 + 2000 * t / max(seconds, 1e-3)) * t)
    return (0.3 * chirp + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.fixture(scope="module")
def clap(real_clap_dir: Path):
    from training.models.pretrained_clap import load_pretrained_clap

    return load_pretrained_clap(real_clap_dir)


@pytest.fixture(scope="module")
def bundle(real_clap_pretrained_bundle: Path):
    loaded = LoadedBundle.open(real_clap_pretrained_bundle)
    yield loaded
    loaded.close()


def test_the_model_is_clap_at_its_default_size(clap) -> None:
    audio = sum(p.numel() for p in clap.model.audio_model.parameters())
    text = sum(p.numel() for p in clap.model.text_model.parameters())
    assert (round(audio / 1e6, 1), round(text / 1e6, 1)) == (27.5, 124.6)
    assert clap.model.config.text_config.vocab_size == 50265 and clap.settings.sample_rate == 48000


def test_bundle_reproduces_get_audio_features(clap, bundle) -> None:
    """Short (repeat-padded), exactly 10 s, and long (chunk-and-average of the model's own 10-s features)."""
    from training.bundle.pretrained import reference_clip_features

    waves = [signal(3.3, 48000, 0), signal(10.0, 48000, 1), signal(23.0, 48000, 2), signal(0.2, 48000, 3)]
    got = bundle.encode_audio(waves)
    expected = np.stack([reference_clip_features(clap, w) for w in waves])
    assert cosines(got, expected).min() >= 0.999
    # A short clip is repeat-padded, not zero-padded: zero padding gives another embedding.
    zero_padded = bundle.encode_audio([np.pad(waves[0], (0, 480000 - len(waves[0])))])
    assert cosines(zero_padded, expected[:1])[0] < cosines(got[:1], expected[:1])[0]


def test_bundle_reproduces_get_text_features(clap, bundle) -> None:
    from training.models.pretrained_clap import reference_text_features

    expected = reference_text_features(clap, TEXTS).numpy()
    assert cosines(bundle.encode_text(TEXTS), expected).min() >= 0.999


def test_manifest_records_the_extractor_settings(real_clap_pretrained_bundle: Path) -> None:
    manifest = verify_bundle(real_clap_pretrained_bundle)
    assert (manifest.sample_rate, manifest.clip_samples, manifest.embed_dim) == (48000, 480000, 512)
    assert manifest.frontend["sampling_rate"] == 48000 and manifest.frontend["truncation"] == "rand_trunc"
    assert manifest.frontend["feature_extractor_type"] == "ClapFeatureExtractor"
    assert manifest.audio_frontend is not None and manifest.audio_frontend.padding == "repeatpad"
    assert manifest.audio_frontend.long_clips == "chunk"
    assert min(manifest.audio_encoder.parity_min_cosine, manifest.text_encoder.parity_min_cosine) >= 0.999
    assert manifest.tokenizer.max_length == 512 and manifest.evaluation is not None


def wav_bytes(wave: np.ndarray, rate: int) -> bytes:
    out = io.BytesIO()
    sf.write(out, wave, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def test_service_answers_uploads_at_16_and_44_1_khz(real_clap_pretrained_bundle: Path, bundle) -> None:
    """The service resamples an upload of any rate to the bundle's 48 kHz before the encoder: its hits
    are those of the upload decoded at 48 kHz (4 s of audio, whatever the upload's rate)."""
    from service.app import create_app
    from service.audio_input import AudioLimits, decode_upload
    from tests.service.conftest import make_settings, running_client

    reference = signal(4.0, 48000, 7)
    settings = make_settings(bundles_dir=real_clap_pretrained_bundle.parent, bundle=real_clap_pretrained_bundle.name,
                             gate_metric="t2a_R@10_mean")
    limits = AudioLimits(max_seconds=60, max_sample_rate=192000, max_channels=2)
    with running_client(create_app(settings)) as client:
        for rate in (16000, 44100):
            upload = wav_bytes(soxr.resample(reference, 48000, rate), rate)
            r = client.post("/v1/search/audio?k=3&lang=eng", content=upload)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["bundle_id"] == real_clap_pretrained_bundle.name and len(body["hits"]) == 3
            at_48k = decode_upload(upload, sample_rate=48000, limits=limits).waveform
            assert abs(len(at_48k) - len(reference)) < 48  # 4 s at 48 kHz, not 4 s at the upload's rate
            emb = bundle.encode_audio([at_48k])
            scores, rows = bundle.search_text(emb, 3, languages=["eng"])
            assert [h["text"] for h in body["hits"]] == [bundle.text_items[i]["text"] for i in rows[0]]
            assert np.allclose([h["score"] for h in body["hits"]], scores[0], atol=1e-4)
            if rate == 44100:  # all of CLAP's band (50 Hz–14 kHz) survives: the original's embedding
                assert cosines(emb, bundle.encode_audio([reference]))[0] >= 0.99
        r = client.post("/v1/search/text", json={"query": "a dog barks", "k": 2})
        assert r.status_code == 200 and len(r.json()["hits"]) == 2


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().err.strip()


def test_missing_or_wrong_folders_are_one_line_errors(
    real_clap_dir: Path, real_manifest: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "bundles")
    no_preprocessor = tmp_path / "no_preprocessor"
    no_preprocessor.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(real_clap_dir / name, no_preprocessor / name)
    (no_preprocessor / "model.safetensors").write_bytes(b"")
    fused = tmp_path / "fused"
    shutil.copytree(no_preprocessor, fused)
    shutil.copy(real_clap_dir / "preprocessor_config.json", fused)
    config = json.loads((fused / "config.json").read_text())
    config["audio_config"]["enable_fusion"] = True
    (fused / "config.json").write_text(json.dumps(config))
    fusion_extractor = tmp_path / "fusion_extractor"
    shutil.copytree(no_preprocessor, fusion_extractor)
    extractor = json.loads((real_clap_dir / "preprocessor_config.json").read_text())
    (fusion_extractor / "preprocessor_config.json").write_text(json.dumps({**extractor, "truncation": "fusion"}))
    not_clap = tmp_path / "not_clap"
    shutil.copytree(no_preprocessor, not_clap)
    shutil.copy(real_clap_dir / "preprocessor_config.json", not_clap)
    (not_clap / "config.json").write_text(json.dumps({"model_type": "bert"}))
    corrupt_weights = tmp_path / "corrupt_weights"
    shutil.copytree(no_preprocessor, corrupt_weights)
    shutil.copy(real_clap_dir / "preprocessor_config.json", corrupt_weights)
    (corrupt_weights / "model.safetensors").write_bytes(b"not safetensors")
    cases = {
        tmp_path / "nowhere": "does not exist",
        no_preprocessor: "no preprocessor_config.json in",
        fused: "is a fused CLAP (enable_fusion=true)",
        fusion_extractor: "truncation='fusion'",
        not_clap: "holds a 'bert' model, not a model of a supported family",
        corrupt_weights: "cannot load",
    }
    for folder, message in cases.items():
        code, err = run_cli(["export", "--pretrained", str(folder), "--data", str(real_manifest), "--out", out], capsys)
        assert code == 2 and message in err and err.startswith("error: --pretrained"), err
        assert "\n" not in err
    code, err = run_cli(["export", "--data", str(real_manifest), "--out", out], capsys)
    assert code == 2 and "CHECKPOINT directory or --pretrained" in err
    assert not Path(out).exists() or not any(Path(out).iterdir())


def test_the_ray_actor_embeds_short_clips_as_the_bundle_does(real_clap_pretrained_bundle: Path, bundle,
                                                             tmp_path: Path) -> None:
    """`tonearm index --ray` embeds a collection with ``AudioEmbedder`` actors; a short clip must get the
    bundle's own padding there (CLAP's repeatpad) exactly as the service's ``encode_audio`` gives it.
    The actor runs in-process here (the Ray Data plumbing is tests/index/test_ray_embed.py's)."""
    from index.catalogue.own_audio import decode_file
    from index.catalogue.ray_embed import AudioEmbedder

    manifest = bundle.manifest
    path = tmp_path / "short.wav"
    sf.write(path, signal(1.5, manifest.sample_rate, 7), manifest.sample_rate)
    model = (real_clap_pretrained_bundle / manifest.audio_encoder.file).read_bytes()
    batch = {"row": np.array([0]), "path": np.array([str(path)], dtype=object)}

    def actor(frontend):
        return AudioEmbedder(model, decode=decode_file, embed_dim=manifest.embed_dim, sample_rate=manifest.sample_rate,
                             clip_samples=manifest.clip_samples, policy="chunk", threads=1, frontend=frontend)

    served = bundle.encode_audio([decode_file(path, manifest.sample_rate)])
    assert manifest.audio_frontend is not None and manifest.audio_frontend.padding == "repeatpad"
    on_ray = actor(manifest.audio_frontend)(batch)["embedding"]
    assert cosines(on_ray, served).min() >= 0.99999
    zero_padded = actor(None)(batch)["embedding"]  # what the actor did before: the test can fail
    assert cosines(zero_padded, served).min() < 0.9999
