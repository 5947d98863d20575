"""The catalogue pass's decode side (issue 49): decode cost per core by format and length, and the whole
pass's clips/s against decode worker count with an encoder of known cost (docs/BENCHMARKS.md,
"Catalogue pass: decoding beside the encoder").

1. **Decode, one core.** 44.1-kHz stereo FLAC, 44.1-kHz stereo MP3 (libsndfile's encoder, 192 kbit/s VBR-ish
   default) and 48-kHz mono WAV, 10 s and 30 s, decoded and resampled to 48 kHz mono by the pass's own decode
   function (:func:`index.catalogue.own_audio.decode_file`, what `tonearm index` runs); ms per clip and clips/s per core.
2. **The pass.** :func:`index.catalogue.embed_pass.clip_embedder` over N FLAC clips with an "encoder" that sleeps
   ``--encoder-ms`` per clip (a GPU's cost per clip: the CPU is free while it waits, as it is while a GPU
   runs), for 0, 1, 2, … decode workers: clips/s, the decode wait and the encoder's busy fraction.

Run under the shared lock: ``flock /tmp/tonearm-heavy.lock python bench/catalogue_pass.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf

from index.catalogue.embed_pass import DecodeCall, Decoder, PassClock, PassOptions, clip_embedder
from index.catalogue.own_audio import decode_file

RATE = 48_000


def write_clips(folder: Path, kind: str, seconds: float, n: int) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        if kind == "wav48":
            rate, channels, name, fmt = 48_000, 1, f"{kind}-{seconds:g}-{i}.wav", {"subtype": "PCM_16"}
        elif kind == "flac44":
            rate, channels, name, fmt = 44_100, 2, f"{kind}-{seconds:g}-{i}.flac", {"subtype": "PCM_16"}
        else:
            rate, channels, name, fmt = 44_100, 2, f"{kind}-{seconds:g}-{i}.mp3", {"format": "MP3",
                                                                                   "subtype": "MPEG_LAYER_III"}
        t = np.arange(int(rate * seconds)) / rate
        tone = 0.2 * np.sin(2 * np.pi * (220 + 40 * i) * t) + 0.05 * rng.standard_normal(t.shape)
        wave = np.stack([tone, np.roll(tone, 7)], axis=1) if channels == 2 else tone
        path = folder / name
        sf.write(path, wave.astype(np.float32), rate, **fmt)
        paths.append(path)
    return paths


def decode_cost(paths: list[Path]) -> float:
    decode_file(paths[0], RATE)  # warm
    began = time.perf_counter()
    for path in paths:
        decode_file(path, RATE)
    return (time.perf_counter() - began) / len(paths)


def pass_rate(paths: list[Path], workers: int, encoder_ms: float) -> dict[str, float]:
    clock = PassClock()
    decode = DecodeCall(decode_file, args=(RATE,))

    def encode(waves: list[np.ndarray]) -> np.ndarray:
        time.sleep(encoder_ms / 1000 * len(waves))
        return np.zeros((len(waves), 4), np.float32)

    with Decoder(decode, PassOptions(decode_workers=workers), clock) as decoder:
        embed = clip_embedder([p.name for p in paths], paths, decode, encode, dim=4, decoder=decoder)
        embed([0], lambda _n: None)  # pool start-up out of the measurement
        clock.__init__()  # type: ignore[misc]
        began = time.perf_counter()
        embed(list(range(len(paths))), lambda _n: None)
        wall = time.perf_counter() - began
    return {"workers": workers, "clips_per_s": len(paths) / wall, "encoder_busy": clock.encode_busy / wall,
            "decode_wait": clock.decode_wait / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=12, help="clips per format and length (decode)")
    parser.add_argument("--pass-clips", type=int, default=96)
    parser.add_argument("--encoder-ms", type=float, default=15.0, help="the stand-in encoder's cost per clip")
    parser.add_argument("--workers", default="0,1,2,3")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    found: dict[str, object] = {"cpu": next((line.split(":", 1)[1].strip() for line in
                                             Path("/proc/cpuinfo").read_text().splitlines()
                                             if line.startswith("model name")), "?"),
                                "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        decode = {}
        for kind in ("flac44", "mp3", "wav48"):
            for seconds in (10.0, 30.0):
                cost = decode_cost(write_clips(folder, kind, seconds, args.clips))
                decode[f"{kind} {seconds:g} s"] = {"ms_per_clip": round(1000 * cost, 2),
                                                   "clips_per_s_per_core": round(1 / cost, 1)}
                print(f"decode {kind} {seconds:g} s: {1000 * cost:.1f} ms/clip, {1 / cost:.1f} clips/s per core",
                      flush=True)
        found["decode"] = decode
        paths = write_clips(folder, "flac44", 10.0, args.pass_clips)
        runs = []
        for workers in (int(w) for w in args.workers.split(",")):
            run = pass_rate(paths, workers, args.encoder_ms)
            runs.append({k: round(v, 3) for k, v in run.items()})
            print(f"pass, {workers} decode workers, encoder {args.encoder_ms:g} ms/clip: {run['clips_per_s']:.1f} "
                  f"clips/s, encoder busy {100 * run['encoder_busy']:.0f} %, decode wait "
                  f"{100 * run['decode_wait']:.0f} %", flush=True)
        found["pass"] = {"encoder_ms_per_clip": args.encoder_ms, "clip": "10 s 44.1-kHz stereo FLAC", "runs": runs}
    found["load_after"] = os.getloadavg()
    print(json.dumps(found, indent=1))
    if args.out:
        args.out.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
