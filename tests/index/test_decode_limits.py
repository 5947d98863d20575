"""Every catalogue pass decodes under limits (issue 55, part 1): a source rate floor, the samples and the bytes
one file may cost (:class:`index.audio.decode.DecodeLimits`), and a budget of the bytes the pass's decoding
holds at once (:class:`index.catalogue.embed_pass.Decoder`). `tonearm index` over a folder with a 60-KB WAV that
declares 2 Hz peaked at 3.3 GiB and 41 s before: every frame of it resampled into 8,000 samples at 16 kHz.

Cost on two loaded cores: the RSS test ~15-30 s (a child process running four `tonearm index` passes of the
session's tiny bundle over five files), the others a few seconds each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from index.audio.decode import DecodeLimits, decode_audio, decode_estimate
from index.bundle.format import read_manifest
from index.catalogue import own_audio
from index.catalogue.embed_pass import DecodeCall, Decoder, PassClock, PassOptions
from index.catalogue.own_audio import decode_file, index_folder
from index.errors import AudioDecodeError

ROOT = Path(__file__).resolve().parents[2]


def write_resampling_bomb(path: Path, frames: int = 30_000) -> Path:
    """A 60-KB 16-bit WAV declaring 2 Hz: decoded to 16 kHz without a floor it is 240 M samples (~1.9 GB to
    decode), to 48 kHz 720 M."""
    sf.write(path, np.zeros(frames, np.int16), 2, subtype="PCM_16")
    return path


def _clips(folder: Path, rate: int, n: int = 4) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(3)
    for i in range(n):
        samples = int(rate * (0.4 + 0.3 * i))
        sf.write(folder / f"clip{i}.wav", (rng.uniform(-0.5, 0.5, samples) * np.hanning(samples)).astype(np.float32),
                 rate)
    return folder


def test_a_file_below_the_rate_floor_is_refused_from_its_header(tmp_path: Path) -> None:
    bomb = write_resampling_bomb(tmp_path / "bomb.wav")
    with pytest.raises(AudioDecodeError, match="sample rate 2 Hz is below the floor of 1000 Hz"):
        decode_file(bomb, 16_000)
    assert DecodeLimits().estimate(bomb, 16_000) < 2 << 20  # refused by its header: counted as one block
    lifted = DecodeLimits(min_sample_rate=None)
    assert lifted.estimate(bomb, 16_000) == decode_estimate(30_000, 1, 2, 16_000) > 1 << 30  # what it would cost


def test_the_samples_and_bytes_limits_skip_a_file_with_the_reason(tmp_path: Path, tiny_bundle: Path) -> None:
    rate = read_manifest(tiny_bundle).sample_rate
    folder = _clips(tmp_path / "sounds", rate)
    sf.write(folder / "long.wav", np.zeros(400_000, np.float32), 1000)  # a legal rate, 400 s: 6.4 M samples at 16 kHz
    options = PassOptions(limits=DecodeLimits(max_bytes=16 << 20))
    done = index_folder(folder, tiny_bundle, tmp_path / "bytes", pass_options=options)
    assert [rel for rel, _ in done.skipped] == ["long.wav"] and len(done.clip_ids) == 4
    assert "decoding needs ~" in done.skipped[0][1] and "the limit is 16777216" in done.skipped[0][1]
    manifest = read_manifest(done.path)
    assert [(s.id, s.reason) for s in manifest.skipped_clips or []] == done.skipped
    options = PassOptions(limits=DecodeLimits(max_samples=100_000))
    done = index_folder(folder, tiny_bundle, tmp_path / "samples", pass_options=options)
    assert [rel for rel, _ in done.skipped] == ["long.wav"] and "exceed the limit of 100000" in done.skipped[0][1]


def test_the_decoding_holds_at_most_its_budget_and_keeps_the_order(tmp_path: Path) -> None:
    folder = tmp_path / "sounds"
    folder.mkdir()
    for i in range(12):
        sf.write(folder / f"c{i:02d}.wav", np.full(48_000 + 1000 * i, 0.01 * i, np.float32), 48_000)
    paths = sorted(folder.iterdir())
    decode = DecodeCall(decode_file, args=(16_000,), sample_rate=16_000)
    one = DecodeLimits().estimate(paths[-1], 16_000)
    budget = int(2.5 * one)
    with Decoder(decode, PassOptions(decode_workers=2, decode_memory=budget), PassClock()) as pooled:
        got = list(pooled.imap(paths))
        assert 0 < pooled.most_held <= budget and pooled.held == 0
    want = [decode_audio(p, sample_rate=16_000) for p in paths]
    assert all(r == "" and np.array_equal(w, x) for (w, r), x in zip(got, want, strict=True))
    with Decoder(decode, PassOptions(decode_workers=2, decode_memory=1), PassClock()) as alone:
        assert len(list(alone.imap(paths))) == 12 and alone.most_held == max(  # one file at a time, never stuck
            DecodeLimits().estimate(p, 16_000) for p in paths)


def test_skips_are_tried_again_when_the_limits_change(tmp_path: Path, tiny_bundle: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A file refused under lower limits is embedded once they are raised; every saved vector is reused."""
    rate = read_manifest(tiny_bundle).sample_rate
    folder = _clips(tmp_path / "sounds", rate)
    sf.write(folder / "long.wav", np.zeros(40_000, np.float32), 1000)
    out = tmp_path / "bundle"
    low = PassOptions(limits=DecodeLimits(max_samples=30_000))
    with monkeypatch.context() as patch:  # interrupted after the pass: the chunks stay
        patch.setattr(own_audio, "_write_bundle", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            index_folder(folder, tiny_bundle, out, chunk_files=2, pass_options=low)
    decoded: list[str] = []
    real = own_audio.decode_file

    def counting(path: Path, *args: object, **kwargs: object) -> np.ndarray:
        decoded.append(path.name)
        return real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(own_audio, "decode_file", counting)
    again = index_folder(folder, tiny_bundle, out, chunk_files=2, pass_options=PassOptions())
    assert again.skipped == [] and "long.wav" in again.clip_ids and len(again.clip_ids) == 5
    assert set(decoded) == {"long.wav"}, decoded  # the four vectors came from the checkpoint (and its windows)

CHILD = """
import json, resource, sys
from pathlib import Path
from index.catalogue.embed_pass import PassOptions
from index.catalogue.own_audio import index_folder

bundle, clean, bombed, out = map(Path, sys.argv[1:5])
found = {}
for workers in (0, 1):
    options = PassOptions(decode_workers=workers)
    index_folder(clean, bundle, out / f"clean{workers}", pass_options=options)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    done = index_folder(bombed, bundle, out / f"bombed{workers}", pass_options=options)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    found[workers] = {"before_kib": before, "after_kib": after, "skipped": done.skipped, "kept": len(done.clip_ids)}
print(json.dumps(found))
"""


def test_a_resampling_bomb_in_a_catalogue_is_skipped_named_and_costs_no_memory(tmp_path: Path,
                                                                              tiny_bundle: Path) -> None:
    """The pass's peak RSS (the process's VmHWM, and its decode workers' with one worker) after the pass over
    the folder with the bomb is within 64 MiB of the pass over the same folder without it; decoding the
    bomb alone would take ~1.9 GB at the tiny bundle's 16 kHz."""
    rate = read_manifest(tiny_bundle).sample_rate
    clean = _clips(tmp_path / "clean", rate)
    bombed = _clips(tmp_path / "bombed", rate)
    write_resampling_bomb(bombed / "bomb.wav")
    child = subprocess.run([sys.executable, "-c", CHILD, str(tiny_bundle), str(clean), str(bombed), str(tmp_path)],
                           cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                           timeout=600, check=False)
    assert child.returncode == 0, child.stderr[-3000:]
    found = json.loads(child.stdout.splitlines()[-1])
    for workers, run in found.items():
        assert run["kept"] == 4, run
        ((name, reason),) = run["skipped"]
        assert name == "bomb.wav" and "sample rate 2 Hz is below the floor of 1000 Hz" in reason, run
        grew = [(after - before) / 1024 for before, after in zip(run["before_kib"], run["after_kib"], strict=True)]
        assert max(grew) < 64, (workers, grew)  # MiB: the process, and (workers=1) its decode worker
