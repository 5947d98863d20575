"""`tonearm export` indexes the manifest's long recordings as windows (SPEC §19, docs/bundle.md "Moments")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from index.audio import decode_audio
from index.bundle import read_manifest
from index.languages import DEFAULT_LANGUAGES
from index.loader import LoadedBundle
from training.data.manifest import ClipRecord, MomentRecord, load_manifest, write_manifest


def test_export_stores_windows_of_long_recordings_only(tiny_checkpoint: Path, tiny_corpus: Path, tmp_path: Path) -> None:
    from training.export import export_bundle

    rate = 16000
    clips = load_manifest(tiny_corpus, languages=DEFAULT_LANGUAGES, split="test")[:3]
    long_wave = np.concatenate([decode_audio(c.audio, sample_rate=rate) for c in clips] * 3)
    sf.write(tmp_path / "long.wav", long_wave, rate)
    moment = MomentRecord(0.0, 2.0, {"eng": [clips[0].captions["eng"][0]]})
    long = ClipRecord("long", tmp_path / "long.wav", clips[1].captions, "test", {}, [moment])
    write_manifest([*clips, long], tmp_path / "m.jsonl")
    path = export_bundle(tiny_checkpoint, manifest=tmp_path / "m.jsonl", out_dir=tmp_path / "out", progress=False)
    manifest = read_manifest(path)
    assert manifest.moments is not None and manifest.moments.n_recordings == 1  # the 2–4 s clips are not long
    bundle = LoadedBundle.open(path, verify=True)
    windows = bundle.moment_windows()
    row = [item["id"] for item in bundle.audio_items].index("long")
    assert set(windows.rows.tolist()) == {row}
    assert windows.spans[-1, 1] == pytest.approx(len(long_wave) / rate)
    # a window's vector is the encoder's embedding of that stretch of the recording
    start = int(round(windows.spans[3, 0] * rate))
    direct = bundle.encode_audio([long_wave[start : start + manifest.clip_samples]])[0]
    np.testing.assert_allclose(windows.vectors[3], direct / np.linalg.norm(direct), atol=1e-5)
