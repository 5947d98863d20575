"""PE-Audio length buckets against one length a call, on the CPU (issue 49 item 1; docs/models.md, "PE-Audio:
length buckets").

Builds a random-weight PE-Audio folder (``--codec small``: tests/small_pe_audio.py, ~0.5 M parameters;
``--codec real``: PE-Audio's full-size codec — 64 channels at 48 kHz, 1,024 at the hop — under the small
transformer and text tower, the part that dominates PE-Audio's audio cost), exports its audio encoder twice
— the one-input graph bundles held before (one clip length a call) and the graph with ``padding_mask``
(length buckets) — and embeds one catalogue of mixed lengths with each, through ``index.runtime.loader.encode_clips``
in the clip groups the catalogue pass hands it (``index.catalogue.embed_pass``: windows of ``PREFETCH`` clips or
``BATCH_SAMPLES`` samples, cut by ``length_batches``). Prints calls, padded samples, seconds and clips/s
of each, and the largest difference between their embeddings.

    PYTHONPATH=. python bench/pe_audio_buckets.py [--codec small|real] [--clips 64] [--min-s 1] [--max-s 10]
        [--threads 1] [--repeats 2] [--out results/pe_audio_buckets.json]

``--parity`` instead compares, in torch, three ways of padding six clips of 21–40 hops into one call of
40 hops against ``get_audio_embeds`` of each clip alone: codec and transformer masked
(``masked_pooled``, the bundles), transformers' own batch ``padding_mask`` (the transformer only), and
no mask; prints 1 − the lowest plain and centred cosine of each.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from index.audio.frontend import prepare_whole_clip
from index.bundle import format as fmt
from index.catalogue.embed_pass import BATCH_SAMPLES, PREFETCH, length_batches
from index.catalogue.half_precision import probe_waves
from index.runtime.loader import AUDIO_INPUTS, OnnxEncoder, encode_clips
from tests.small_pe_audio import REAL_CODEC, RecordedEncoder, save_small_pe_audio

RATE, HOP = 48_000, 1920
FRONTEND = fmt.AudioFrontendInfo(source="pe_audio_feature_extractor", padding="reflect", pad_multiple=HOP,
                                 long_clips="whole", model_truncation="none")


def folder(codec: str, base: Path) -> Path:
    return save_small_pe_audio(base / "pe", audio=REAL_CODEC if codec == "real" else None)


def catalogue(n: int, low: float, high: float) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [probe_waves(RATE, int(rng.uniform(low, high) * RATE))[i % 4] for i in range(n)]


def pass_groups(clips: list[np.ndarray]) -> list[list[int]]:
    """The clip groups the catalogue pass hands its encode function (index.catalogue.embed_pass.clip_embedder)."""
    groups: list[list[int]] = []
    window: list[int] = []
    for i in range(len(clips)):
        window.append(i)
        if len(window) >= PREFETCH or sum(clips[j].shape[0] for j in window) >= BATCH_SAMPLES:
            groups += [[window[b] for b in batch] for batch in length_batches([clips[j].shape[0] for j in window],
                                                                              BATCH_SAMPLES)]
            window = []
    if window:
        groups += [[window[b] for b in batch] for batch in length_batches([clips[j].shape[0] for j in window],
                                                                          BATCH_SAMPLES)]
    return groups


def run(encoder: OnnxEncoder, clips: list[np.ndarray], repeats: int) -> dict[str, Any]:
    groups = pass_groups(clips)
    best, out, recorded = float("inf"), np.zeros(0), RecordedEncoder(encoder)
    for _ in range(repeats):
        recorded.calls.clear()
        began = time.perf_counter()
        parts = [encode_clips(recorded, [clips[i] for i in g], clip_samples=10 * RATE, embed_dim=32,  # type: ignore[arg-type]
                              frontend=FRONTEND) for g in groups]
        best = min(best, time.perf_counter() - began)
        order = [i for g in groups for i in g]
        out = np.zeros((len(clips), 32), np.float32)
        out[order] = np.concatenate(parts)
    audio = sum(prepare_whole_clip(c, HOP).shape[0] for c in clips)
    called = sum(n * w for n, w in recorded.calls)
    return {"calls": len(recorded.calls), "call_shapes": len(set(recorded.calls)), "seconds": round(best, 2),
            "clips_per_s": round(len(clips) / best, 2), "padding_fraction": round(1 - audio / called, 4), "_emb": out}


def parity(path: Path) -> dict[str, dict[str, float]]:
    import torch
    import transformers

    from index.catalogue.half_precision import centred_cosines
    from training.models.pretrained_pe_audio import masked_pooled

    model = transformers.PeAudioModel.from_pretrained(path).eval()
    hops = [21, 25, 30, 34, 38, 40]
    clips = [probe_waves(RATE, h * HOP)[i % 4] for i, h in enumerate(hops)]
    width = max(hops) * HOP
    wave, mask = torch.zeros(len(clips), width), torch.zeros(len(clips), width, dtype=torch.long)
    for i, clip in enumerate(clips):
        wave[i, : clip.shape[0]], mask[i, : clip.shape[0]] = torch.from_numpy(clip), 1
    with torch.no_grad():
        alone = np.stack([model.get_audio_embeds(torch.from_numpy(c)[None, None])[0].numpy() for c in clips])
        found = {"codec and transformer masked": model.audio_head(masked_pooled(model.audio_encoder, wave, mask)),
                 "transformer only (transformers' padding_mask)": model.get_audio_embeds(wave[:, None], padding_mask=mask),
                 "no mask": model.get_audio_embeds(wave[:, None])}
    out = {}
    for name, got in found.items():
        emb = got.numpy()
        plain = np.sum(emb * alone, 1) / np.linalg.norm(emb, axis=1) / np.linalg.norm(alone, axis=1)
        out[name] = {"1-plain": float(1 - plain.min()), "1-centred": float(1 - centred_cosines(emb, alone).min())}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codec", choices=["small", "real"], default="small")
    parser.add_argument("--clips", type=int, default=64)
    parser.add_argument("--min-s", type=float, default=1.0)
    parser.add_argument("--max-s", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--parity", action="store_true", help="the padding rules against each clip alone, in torch")
    args = parser.parse_args()
    from training.bundle.onnx_export import export_audio_encoder
    from training.models.pretrained_pe_audio import load_pretrained_pe_audio

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        if args.parity:
            print(json.dumps({"codec": args.codec, **parity(folder(args.codec, base))}, indent=2))
            return
        audio = load_pretrained_pe_audio(folder(args.codec, base)).audio
        encoders = {
            "one length a call (before)": export_audio_encoder(audio, base / "legacy.onnx", sample_rate=RATE),
            "length buckets": export_audio_encoder(audio, base / "masked.onnx", sample_rate=RATE, mask_multiple=HOP),
        }
        clips = catalogue(args.clips, args.min_s, args.max_s)
        results = {}
        for name, path in encoders.items():
            encoder = OnnxEncoder.load(path, inputs=AUDIO_INPUTS, embed_dim=32, providers=["CPUExecutionProvider"],
                                       threads=args.threads)
            results[name] = run(encoder, clips, args.repeats)
    before, after = results.values()
    report = {"codec": args.codec, "clips": args.clips, "seconds_range": [args.min_s, args.max_s],
              "threads": args.threads, "max_abs_difference": float(np.abs(before.pop("_emb") - after.pop("_emb")).max()),
              **results}
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
