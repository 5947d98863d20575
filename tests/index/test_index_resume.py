"""`tonearm index` resumes an interrupted pass (issue 41): the pass checkpoints its vectors in chunks
(``<out>.partial/``, :mod:`index.catalogue.checkpoint`); a run interrupted after some chunks, then run
again, embeds only the files of the chunks not yet written and publishes the bundle its
uninterrupted twin publishes — same ids row by row, same skipped files, same vectors.

The interruption is a KeyboardInterrupt raised by the decoder at the 11th file (what Ctrl-C does
mid-pass); the decoder is otherwise the real one, and the twin is a fresh, uninterrupted
`index_folder` of the same folder. Cost: ~2 s (the session's tiny bundle, 14 short files).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from index.bundle.format import read_manifest
from index.catalogue import own_audio
from index.catalogue.own_audio import index_folder
from index.engines.faiss_index import all_vectors, load_index, parse_factory

CHUNK = 4
REAL_DECODE = own_audio.decode_file


def _vectors(bundle: Path) -> np.ndarray:
    info = read_manifest(bundle).audio_index
    return all_vectors(load_index(bundle / info.file, spec=parse_factory(info.factory, info.dim), search_params={}))


@pytest.fixture
def folder(tiny_bundle: Path, tmp_path: Path) -> Path:
    rate = read_manifest(tiny_bundle).sample_rate
    root = tmp_path / "sounds"
    root.mkdir()
    rng = np.random.default_rng(3)
    for i in range(13):
        n = int(rate * (0.2 + 0.1 * i))
        sf.write(root / f"c{i:02d}.wav", (rng.uniform(-0.5, 0.5, n) * np.hanning(n)).astype(np.float32), rate)
    (root / "c05b.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt garbage")  # skipped, in chunk 1
    return root


def test_an_interrupted_pass_resumes_and_equals_its_uninterrupted_twin(
    folder: Path, tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    twin = index_folder(folder, tiny_bundle, tmp_path / "twin", chunk_files=CHUNK)
    real = own_audio.decode_file
    decoded: list[str] = []

    def interrupted(path: Path, rate: int, *limits: Any) -> np.ndarray:
        if len(decoded) == 10:
            raise KeyboardInterrupt
        decoded.append(path.name)
        return real(path, rate, *limits)

    out = tmp_path / "resumed"
    monkeypatch.setattr(own_audio, "decode_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        index_folder(folder, tiny_bundle, out, chunk_files=CHUNK)
    partial = tmp_path / "resumed.partial"
    assert sorted(p.name for p in partial.glob("chunk-*.npz")) == ["chunk-000000.npz", "chunk-000001.npz"]
    assert not out.exists()

    decoded.clear()
    monkeypatch.setattr(own_audio, "decode_file", lambda path, rate, *limits: decoded.append(path.name) or real(path, rate, *limits))
    resumed = index_folder(folder, tiny_bundle, out, chunk_files=CHUNK)
    assert len(decoded) == 14 - 2 * CHUNK  # only the chunks not checkpointed were decoded again
    assert not partial.exists()  # removed once the bundle is published
    assert resumed.clip_ids == twin.clip_ids and resumed.skipped == twin.skipped
    assert (out / "audio_ids.jsonl").read_text() == (twin.path / "audio_ids.jsonl").read_text()
    np.testing.assert_allclose(_vectors(out), _vectors(twin.path), atol=1e-6)
    assert len(twin.clip_ids) == 13 and [s[0] for s in twin.skipped] == ["c05b.wav"]


def _interrupt_after(folder: Path, tiny_bundle: Path, out: Path, monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    real = own_audio.decode_file
    calls: list[str] = []

    def interrupted(path: Path, rate: int, *limits: Any) -> np.ndarray:
        if len(calls) == n:
            raise KeyboardInterrupt
        calls.append(path.name)
        return real(path, rate, *limits)

    monkeypatch.setattr(own_audio, "decode_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        index_folder(folder, tiny_bundle, out, chunk_files=CHUNK)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    real = REAL_DECODE
    calls: list[str] = []
    monkeypatch.setattr(own_audio, "decode_file", lambda path, rate, *limits: calls.append(path.name) or real(path, rate, *limits))
    return calls


def test_a_changed_folder_reuses_what_did_not_change(folder: Path, tiny_bundle: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Chunks are keyed by content (issue 49): a touched mtime reuses every clip, a removed file
    reuses the rest, one added file is the only one embedded, and the log says how many were reused."""
    out = tmp_path / "out"
    _interrupt_after(folder, tiny_bundle, out, monkeypatch, 9)  # chunks 0 and 1 saved (8 files), c07 decoded
    for path in folder.glob("c0[0-3].wav"):  # chunk 0's files touched: bytes unchanged
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    (folder / "c07.wav").unlink()  # a file of chunk 1 removed
    rate = read_manifest(tiny_bundle).sample_rate
    sf.write(folder / "a-new.wav", np.sin(np.arange(rate) * 0.05).astype(np.float32), rate)  # one added
    calls = _counting(monkeypatch)
    with caplog.at_level("INFO", logger="index.catalogue.checkpoint"):
        result = index_folder(folder, tiny_bundle, out, chunk_files=CHUNK)
    # 14 files: 8 reused (chunk 0's c00-c03 touched, chunk 1's c04, c05, c05b, c06), c07 (decoded before the
    # interruption, in no saved chunk) removed, 6 embedded: the added file and c08-c12
    assert sorted(calls) == ["a-new.wav", "c08.wav", "c09.wav", "c10.wav", "c11.wav", "c12.wav"]
    assert "resume: 8 of 14 files reused" in caplog.text
    assert "new or changed content" in caplog.text
    twin = index_folder(folder, tiny_bundle, tmp_path / "twin", chunk_files=CHUNK)
    assert result.clip_ids == twin.clip_ids and result.skipped == twin.skipped
    np.testing.assert_allclose(_vectors(out), _vectors(twin.path), atol=1e-6)
    assert [s.id for s in read_manifest(out).skipped_clips or []] == ["c05b.wav"]  # counted in the manifest


def test_another_encoder_starts_over_and_says_why(folder: Path, tiny_bundle: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "out"
    _interrupt_after(folder, tiny_bundle, out, monkeypatch, 5)
    plan = tmp_path / "out.partial" / "pass.json"
    body = json.loads(plan.read_text())
    body["digest"], body["describe"]["encoder"] = "0" * 64, "another"  # as if another bundle's encoder ran
    plan.write_text(json.dumps(body))
    calls = _counting(monkeypatch)
    with caplog.at_level("INFO", logger="index.catalogue.checkpoint"):
        index_folder(folder, tiny_bundle, out, chunk_files=CHUNK)
    assert len(calls) == 14
    assert "not reused: another pass (encoder changed)" in caplog.text
