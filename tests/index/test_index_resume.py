"""`tonearm index` resumes an interrupted pass (issue 41): the pass checkpoints its vectors in chunks
(``<out>.partial/``, :mod:`index.embed_checkpoint`); a run interrupted after some chunks, then run
again, embeds only the files of the chunks not yet written and publishes the bundle its
uninterrupted twin publishes — same ids row by row, same skipped files, same vectors.

The interruption is a KeyboardInterrupt raised by the decoder at the 11th file (what Ctrl-C does
mid-pass); the decoder is otherwise the real one, and the twin is a fresh, uninterrupted
`index_folder` of the same folder. Cost: ~2 s (the session's tiny bundle, 14 short files).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from index import own_audio
from index.bundle import read_manifest
from index.faiss_index import all_vectors, load_index, parse_factory
from index.own_audio import index_folder

CHUNK = 4


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

    def interrupted(path: Path, rate: int) -> np.ndarray:
        if len(decoded) == 10:
            raise KeyboardInterrupt
        decoded.append(path.name)
        return real(path, rate)

    out = tmp_path / "resumed"
    monkeypatch.setattr(own_audio, "decode_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        index_folder(folder, tiny_bundle, out, chunk_files=CHUNK)
    partial = tmp_path / "resumed.partial"
    assert sorted(p.name for p in partial.glob("chunk-*.npz")) == ["chunk-000000.npz", "chunk-000001.npz"]
    assert not out.exists()

    decoded.clear()
    monkeypatch.setattr(own_audio, "decode_file", lambda path, rate: decoded.append(path.name) or real(path, rate))
    resumed = index_folder(folder, tiny_bundle, out, chunk_files=CHUNK)
    assert len(decoded) == 14 - 2 * CHUNK  # only the chunks not checkpointed were decoded again
    assert not partial.exists()  # removed once the bundle is published
    assert resumed.clip_ids == twin.clip_ids and resumed.skipped == twin.skipped
    assert (out / "audio_ids.jsonl").read_text() == (twin.path / "audio_ids.jsonl").read_text()
    np.testing.assert_allclose(_vectors(out), _vectors(twin.path), atol=1e-6)
    assert len(twin.clip_ids) == 13 and [s[0] for s in twin.skipped] == ["c05b.wav"]


def test_a_changed_folder_starts_over(folder: Path, tiny_bundle: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    real = own_audio.decode_file
    calls: list[str] = []

    def interrupted(path: Path, rate: int) -> np.ndarray:
        if len(calls) == 6:
            raise KeyboardInterrupt
        calls.append(path.name)
        return real(path, rate)

    monkeypatch.setattr(own_audio, "decode_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        index_folder(folder, tiny_bundle, tmp_path / "out", chunk_files=CHUNK)
    (folder / "c00.wav").unlink()  # the plan changed: the chunk written before must not be reused
    calls.clear()
    monkeypatch.setattr(own_audio, "decode_file", lambda path, rate: calls.append(path.name) or real(path, rate))
    result = index_folder(folder, tiny_bundle, tmp_path / "out", chunk_files=CHUNK)
    assert len(calls) == 13 and "c00.wav" not in result.clip_ids
