"""`tonearm export` indexes the manifest's long recordings as windows, and `tonearm evaluate --moments`
measures the sliding-window baseline on them (SPEC §19, docs/bundle.md and docs/metrics.md "Moments")."""

from __future__ import annotations

import json
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from index.audio.decode import decode_audio
from index.bundle.format import read_manifest
from index.languages import DEFAULT_LANGUAGES
from index.runtime.loader import LoadedBundle
from tonearm.cli import main as tonearm_main
from training.data.manifest import ClipRecord, MomentRecord, load_manifest, write_manifest

RATE = 16000


@pytest.fixture(scope="module")
def exported(tiny_checkpoint: Path, tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Three test clips, and one long recording of those clips three times over, with a moment per
    scene (the same caption on the three repeats: one query, three ground-truth windows). The catalogue
    pass's reads of each file are counted (``pass_reads``: the samples of a SoundFile read from the code of
    ``index/catalogue``, the held-out moment report's own decodes left out)."""
    from training.bundle.export import export_bundle

    tmp = tmp_path_factory.mktemp("export_moments")
    clips = load_manifest(tiny_corpus, languages=DEFAULT_LANGUAGES, split="test")[:3]
    waves = [decode_audio(c.audio, sample_rate=RATE) for c in clips]
    long_wave = np.concatenate(waves * 3)
    sf.write(tmp / "long.wav", long_wave, RATE)
    moments, t = [], 0.0
    for _ in range(3):
        for clip, wave in zip(clips, waves, strict=True):
            captions = {lang: texts[:1] for lang, texts in clip.captions.items()}
            moments.append(MomentRecord(round(t, 4), round(t + len(wave) / RATE, 4), captions))
            t += len(wave) / RATE
    long = ClipRecord("long", tmp / "long.wav", clips[1].captions, "test", {}, moments)
    write_manifest([*clips, long], tmp / "m.jsonl")
    pass_reads: Counter[str] = Counter()
    read = sf.SoundFile.read

    def counted(self: sf.SoundFile, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_counted", False):
            self._counted = True
            stack = [frame.filename for frame in traceback.extract_stack()]
            if (any("/index/catalogue/" in f for f in stack)
                    and not any(f.endswith("/index/moments/evaluate.py") for f in stack)):
                pass_reads[Path(self.name).name] += 1
        return read(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sf.SoundFile, "read", counted)
        path = export_bundle(tiny_checkpoint, manifest=tmp / "m.jsonl", out_dir=tmp / "out", progress=False)
    return {"bundle": path, "manifest": tmp / "m.jsonl", "wave": long_wave, "tmp": tmp, "pass_reads": pass_reads}


def test_the_catalogue_pass_decodes_the_long_recording_once(exported: dict) -> None:
    """Issue 54, part 5: its windows come from the decode of its clip vector (before, a second pass decoded it
    again after the clips pass)."""
    assert exported["pass_reads"]["long.wav"] == 1
    assert sorted(exported["pass_reads"].values()) == [1, 1, 1, 1]  # the three clips and the long recording


def test_export_stores_windows_of_long_recordings_only(exported: dict) -> None:
    path, long_wave = exported["bundle"], exported["wave"]
    manifest = read_manifest(path)
    assert manifest.moments is not None and manifest.moments.n_recordings == 1  # the 2–4 s clips are not long
    bundle = LoadedBundle.open(path, verify=True)
    windows = bundle.moment_windows()
    row = [item["id"] for item in bundle.audio_items].index("long")
    assert set(windows.rows.tolist()) == {row}
    assert windows.spans[-1, 1] == pytest.approx(len(long_wave) / RATE)
    # a window's vector is the encoder's embedding of that stretch of the recording
    start = int(round(windows.spans[3, 0] * RATE))
    direct = bundle.encode_audio([long_wave[start : start + manifest.clip_samples]])[0]
    np.testing.assert_allclose(windows.vectors[3], direct / np.linalg.norm(direct), atol=1e-5)


def test_evaluate_moments_reports_each_language_with_one_query_per_caption(exported: dict, capsys) -> None:
    out = exported["tmp"] / "report"
    assert tonearm_main(["evaluate", str(exported["bundle"]), "--data", str(exported["manifest"]), "--moments",
                         "--out", str(out)]) == 0
    report = json.loads((out / "moments.json").read_text())
    for lang in DEFAULT_LANGUAGES:
        assert report[f"moment_n_queries_{lang}"] == 3  # three scenes, each repeated under one caption
        for metric in ("R1@0.5", "R1@0.7", "mAP"):
            assert 0.0 <= report[f"moment_{metric}_{lang}"] <= 1.0
    assert report["moment_R1@0.7_mean"] <= report["moment_R1@0.5_mean"]
    assert "| eng | 3 |" in (out / "moments.md").read_text() and "| eng | 3 |" in capsys.readouterr().out
    # the bundle's held-out report (the long recording is in the test split): the same numbers, measured
    # at export with the staged encoders
    heldout = read_manifest(exported["bundle"]).moments.heldout
    assert heldout is not None and set(heldout) == set(report)
    for key, value in report.items():
        assert heldout[key] == pytest.approx(value, abs=1e-6), key
    assert tonearm_main(["evaluate", str(exported["manifest"].parent), "--data", str(exported["manifest"]),
                         "--moments"]) == 2  # not a bundle: export first
