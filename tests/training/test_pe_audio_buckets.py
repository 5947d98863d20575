"""PE-Audio clips of mixed lengths padded into length buckets (issue 49 item 1, docs/models.md "PE-Audio:
length buckets").

A PE-Audio bundle embeds every clip whole. Its audio encoder now takes a ``padding_mask``
(:func:`training.models.pretrained_pe_audio.masked_pooled`), so :func:`index.runtime.loader.encode_clips` runs clips
of different lengths in one call, each zero-padded to its :func:`index.audio.frontend.bucket_length`. The
reference is independent of that path: transformers' ``PeAudioFeatureExtractor`` + ``PeAudioModel.get_audio_embeds``
of each clip alone (the model loaded afresh from the folder). The small random-weight model keeps PE-Audio's
hop (1,920 samples), so every length rule is the real one.

* bucketed embeddings of uneven lengths (none a hop multiple) equal the clip alone within the export's
  parity thresholds (plain 0.999, centred 0.99) — and in fact to float rounding;
* the negative case: the same buckets, the same check, through the graph without the mask (zero padding
  the model attends to) fail it;
* a mixed-length catalogue takes far fewer encoder calls, of a few fixed lengths; a bundle exported before
  (the one-input graph) still runs one length a call, with the same embeddings.

Costs ~17 s wall (19 s of CPU) on this machine's 2 cores at load 1 (~50 s at load 6–8): the folder, two
exports of the small model and the transformers reference (a module fixture), then ~4 s of ONNX calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from index.audio.frontend import bucket_length, prepare_whole_clip
from index.bundle import format as fmt
from index.catalogue.half_precision import centred_cosines, probe_waves
from index.runtime.loader import AUDIO_INPUTS, CODEC_CALL_SAMPLES, OnnxEncoder, encode_clips
from tests.small_pe_audio import RecordedEncoder, save_small_pe_audio
from training.bundle.onnx_export import MIN_COSINE, export_audio_encoder
from training.bundle.pretrained import MIN_CENTRED_COSINE
from training.models.pretrained_pe_audio import load_pretrained_pe_audio

RATE, HOP, DIM = 48_000, 1920, 32
FRONTEND = fmt.AudioFrontendInfo(source="pe_audio_feature_extractor", padding="reflect", pad_multiple=HOP,
                                 long_clips="whole", model_truncation="none")
CPU = ["CPUExecutionProvider"]


@pytest.fixture(scope="module")
def pe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The small folder, and its audio encoder exported with the mask (``masked``) and without (``legacy``:
    what bundles exported before issue 49 hold)."""
    base = tmp_path_factory.mktemp("pe_buckets")
    folder = save_small_pe_audio(base / "pe")
    audio = load_pretrained_pe_audio(folder).audio
    paths = {"masked": export_audio_encoder(audio, base / "masked.onnx", sample_rate=RATE, mask_multiple=HOP),
             "legacy": export_audio_encoder(audio, base / "legacy.onnx", sample_rate=RATE)}
    found: dict[str, Any] = {"folder": folder}
    for name, path in paths.items():
        found[name] = OnnxEncoder.load(path, inputs=AUDIO_INPUTS, embed_dim=DIM, providers=CPU, threads=None)
    return found


def mixed_clips(hops: list[float], seed: int = 0) -> list[np.ndarray]:
    """Unrelated signals (so centred cosines have power) of ``hops`` hops less 1–1,900 samples each: no
    length is a hop multiple (each is reflect-padded to ``ceil(hops)`` hops first)."""
    rng = np.random.default_rng(seed)
    clips = []
    for i, h in enumerate(hops):
        n = int(np.ceil(h)) * HOP - int(rng.integers(1, HOP - 20))
        clips.append(probe_waves(RATE, n)[i % 4] * np.float32(0.5 + rng.random()))
    return clips


def reference(folder: Path, clips: list[np.ndarray]) -> np.ndarray:
    """transformers' own forward of each clip alone, through its own extractor."""
    import torch
    import transformers

    model = transformers.PeAudioModel.from_pretrained(folder).eval()
    extractor = transformers.PeAudioFeatureExtractor.from_pretrained(folder)
    out = []
    with torch.no_grad():
        for clip in clips:
            inputs = extractor(clip, sampling_rate=RATE, return_tensors="pt")
            out.append(model.get_audio_embeds(inputs["input_values"], padding_mask=inputs["padding_mask"])[0].numpy())
    return np.stack(out)


def plain_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def passes_parity(got: np.ndarray, want: np.ndarray) -> bool:
    """The export's audio parity rule (training.bundle.pretrained.check_parity)."""
    return bool(plain_cosines(got, want).min() >= MIN_COSINE and centred_cosines(got, want).min() >= MIN_CENTRED_COSINE)


HOPS = [9, 19, 20, 37, 38, 40, 66, 70, 71]
"""0.36–2.8 s, in the buckets of 9, 20, 40 and 72 hops (index.audio.frontend.bucket_length)."""


@pytest.fixture(scope="module")
def mixed(pe: dict[str, Any]) -> tuple[list[np.ndarray], np.ndarray]:
    """Clips of :data:`HOPS` and their reference embeddings."""
    clips = mixed_clips(HOPS)
    return clips, reference(pe["folder"], clips)


def test_bucketed_calls_equal_each_clip_alone(pe: dict[str, Any], mixed: tuple[list[np.ndarray], np.ndarray]) -> None:
    clips, want = mixed
    recorded = RecordedEncoder(pe["masked"])
    got = encode_clips(recorded, clips, clip_samples=10 * RATE, embed_dim=DIM, frontend=FRONTEND)  # type: ignore[arg-type]
    # padding happened: calls hold several clips, zero-padded to bucket lengths longer than some of them
    prepared = sorted(prepare_whole_clip(c, HOP).shape[0] for c in clips)
    assert len(recorded.calls) == 4 and all(recorded.masked)
    assert {width for _, width in recorded.calls} == {bucket_length(n, HOP) for n in prepared}
    assert sum(n * w for n, w in recorded.calls) > sum(prepared)
    assert passes_parity(got, want)
    assert centred_cosines(got, want).min() > 0.9999 and plain_cosines(got, want).min() > 0.99999  # to rounding


def test_the_same_buckets_without_the_mask_fail_the_check(
        pe: dict[str, Any], mixed: tuple[list[np.ndarray], np.ndarray]) -> None:
    """The graph bundles held before (no ``padding_mask``): fed the same zero-padded bucket calls, the model
    attends to the padding, and the parity check that the buckets pass rejects it."""
    clips, want = mixed
    prepared = [prepare_whole_clip(c, HOP) for c in clips]
    widths = np.asarray([bucket_length(p.shape[0], HOP) for p in prepared])
    got = np.zeros((len(clips), DIM), np.float32)
    for width in np.unique(widths):
        rows = np.flatnonzero(widths == width)
        batch = np.zeros((len(rows), int(width)), np.float32)
        for r, i in enumerate(rows):
            batch[r, : prepared[i].shape[0]] = prepared[i]
        got[rows] = pe["legacy"].run({"waveform": batch})
    assert not passes_parity(got, want)
    assert centred_cosines(got, want).min() < MIN_CENTRED_COSINE


def test_a_mixed_catalogue_takes_few_calls_of_fixed_lengths_and_old_bundles_run_as_before(
        pe: dict[str, Any]) -> None:
    rng = np.random.default_rng(3)
    clips = mixed_clips(list(rng.uniform(40, 80, 30)), seed=3)  # 1.6–3.2 s
    hop_lengths = {prepare_whole_clip(c, HOP).shape[0] for c in clips}
    legacy, masked = RecordedEncoder(pe["legacy"]), RecordedEncoder(pe["masked"])
    old = encode_clips(legacy, clips, clip_samples=10 * RATE, embed_dim=DIM, frontend=FRONTEND)  # type: ignore[arg-type]
    new = encode_clips(masked, clips, clip_samples=10 * RATE, embed_dim=DIM, frontend=FRONTEND)  # type: ignore[arg-type]
    # the one-input graph: one exact length a call, no mask (as every bundle did before)
    assert len(legacy.calls) == len(hop_lengths) and not any(legacy.masked)
    # buckets: at most 8 lengths per octave, each call within the memory budget
    buckets = {bucket_length(n, HOP) for n in hop_lengths}
    assert {w for _, w in masked.calls} == buckets and len(buckets) <= 8 + 1  # one octave: 8 buckets (+ its end)
    widths = [bucket_length(prepare_whole_clip(c, HOP).shape[0], HOP) for c in clips]
    assert len(masked.calls) == sum(-(-widths.count(b) // (CODEC_CALL_SAMPLES // b)) for b in buckets)
    assert len(masked.calls) <= len(legacy.calls) / 2, (len(masked.calls), len(legacy.calls))
    assert all(n * w <= CODEC_CALL_SAMPLES for n, w in masked.calls)
    np.testing.assert_allclose(new, old, atol=1e-5)


LONG_SECONDS = [10.3, 10.9, 12.5]
"""Clips over 10 s (none a hop multiple): 10.3 and 10.9 s share the bucket of 288 hops (11.52 s), 12.5 s is
alone in that of 320."""


def test_long_clips_share_calls_by_bucket_when_the_pass_gives_the_budget(pe: dict[str, Any]) -> None:
    """Issue 55: a clip over 10 s ran alone in its call whatever the pass — a bucket of it holds one clip in the
    service's :data:`CODEC_CALL_SAMPLES`. With a catalogue pass's budget (`--codec-call-samples`, the CUDA
    default) the long clips of one bucket share a call, padded behind the mask, and equal each clip alone."""
    from index.catalogue.embed_pass import CUDA_CODEC_CALL_SAMPLES

    clips = mixed_clips([s * RATE / HOP for s in LONG_SECONDS], seed=5)
    want = reference(pe["folder"], clips)
    service, catalogue = RecordedEncoder(pe["masked"]), RecordedEncoder(pe["masked"])
    alone = encode_clips(service, clips, clip_samples=10 * RATE, embed_dim=DIM, frontend=FRONTEND)  # type: ignore[arg-type]
    got = encode_clips(catalogue, clips, clip_samples=10 * RATE, embed_dim=DIM, frontend=FRONTEND,  # type: ignore[arg-type]
                       max_call_samples=CUDA_CODEC_CALL_SAMPLES)
    prepared = [prepare_whole_clip(c, HOP).shape[0] for c in clips]
    assert sorted(service.calls) == sorted((1, n) for n in prepared)  # the service: one long clip a call, unpadded
    assert sorted(catalogue.calls) == [(1, 320 * HOP), (2, 288 * HOP)] and all(catalogue.masked)
    for found in (got, alone):
        assert passes_parity(found, want)
        assert centred_cosines(found, want).min() > 0.9999 and plain_cosines(found, want).min() > 0.99999


@pytest.fixture(scope="module")
def real_codec() -> Any:
    """The audio encoder of a random PE-Audio with the full-size codec (tests.small_pe_audio.REAL_CODEC: a
    ~22,000-sample receptive field) under the small transformer, in memory. With the small codec a padding
    the codec reads moves an embedding by ~5e-7 only (bench/pe_audio_buckets.py --parity): too little to tell."""
    import torch
    from transformers import PeAudioModel

    from tests.small_pe_audio import REAL_CODEC, small_pe_audio_config

    torch.manual_seed(0)
    return PeAudioModel(small_pe_audio_config(REAL_CODEC)).eval().audio_encoder


def test_either_half_of_the_padding_mask_dropped_fails(real_codec: Any) -> None:
    """Issue 55: no test failed when the codec half of the mask (every codec activation zeroed past a clip's
    end) was removed — with the small model it moves nothing measurable. On the full codec, clips of 5-12 hops
    padded into one call equal each alone to float rounding (< 1e-6) only with both halves: without the codec
    half (transformers' own batch mask) they differ by ~1e-2, without the transformer half by ~4e-2."""
    import torch

    from training.models.pretrained_pe_audio import masked_pooled

    clips = [torch.from_numpy(c) for c in mixed_clips([5, 8, 12], seed=7)]
    clips = [c[: (c.shape[0] // HOP) * HOP] for c in clips]  # hop multiples: the loader's reflect padding done
    width = max(c.shape[0] for c in clips)
    wave, mask = torch.zeros(len(clips), width), torch.zeros(len(clips), width, dtype=torch.int64)
    for row, clip in enumerate(clips):
        wave[row, : clip.shape[0]], mask[row, : clip.shape[0]] = clip, 1
    with torch.no_grad():
        alone = torch.cat([masked_pooled(real_codec, c[None], torch.ones(1, c.shape[0], dtype=torch.int64))
                           for c in clips])

        def worst(**halves: bool) -> float:
            return float((masked_pooled(real_codec, wave, mask, **halves) - alone).abs().max())

        both, no_codec, no_transformer = worst(), worst(codec=False), worst(transformer=False)
    assert both < 1e-6, both
    assert no_codec > 1e-4 and no_transformer > 1e-4, (no_codec, no_transformer)


def test_manifest_refuses_a_padding_mask_without_whole_clips() -> None:
    from pydantic import ValidationError

    encoder = fmt.EncoderInfo(file="audio.onnx", opset=18, inputs=["waveform", "padding_mask"], outputs=["embedding"],
                              parity_min_cosine=1.0)
    chunked = FRONTEND.model_copy(update={"long_clips": "chunk"})
    with pytest.raises(ValidationError, match="padding_mask"):
        fmt.BundleManifest.model_validate(_manifest_body(encoder, chunked))
    fmt.BundleManifest.model_validate(_manifest_body(encoder, FRONTEND))


def _manifest_body(audio: fmt.EncoderInfo, frontend: fmt.AudioFrontendInfo) -> dict[str, Any]:
    text = fmt.EncoderInfo(file="text.onnx", opset=18, inputs=["input_ids", "attention_mask"], outputs=["embedding"],
                           parity_min_cosine=1.0)
    return {"bundle_id": "b", "created": "2026-01-01T00:00:00Z",
            "source": {"checkpoint": "x", "run_name": "r", "config_hash": "0" * 64, "weights_sha256": "0" * 64,
                       "data_manifest": "m"},
            "train_config": {}, "objective": {}, "frontend": {}, "embed_dim": DIM, "languages": ["eng"],
            "sample_rate": RATE, "clip_seconds": 10.0, "clip_samples": 10 * RATE,
            "audio_encoder": audio.model_dump(), "text_encoder": text.model_dump(),
            "tokenizer": {"file": "tokenizer.json", "max_length": 8, "vocab_size": 10},
            "audio_index": {"file": "a.faiss", "ids_file": "a.jsonl", "factory": "Flat", "dim": DIM, "ntotal": 0,
                            "ann_recall_at_10": 1.0},
            "audio_frontend": frontend.model_dump(), "files": {}}
