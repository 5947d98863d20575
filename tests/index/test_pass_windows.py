"""Long files are windowed in the catalogue pass (issue 54, part 5; :mod:`index.catalogue.pass_windows`): the
process that decodes a file for its clip vector also embeds its moment windows, so each file is decoded once;
the windows are checkpointed with the clip vectors and are the ones the old second pass wrote (the windows of
:func:`index.moments.windows.embed_windows` over the decoded recording, encoded by the bundle's encoder).

The decodes are counted for real: in this process by wrapping the pass's decode function, across the decode
workers and device processes of ``--devices`` by a ``sitecustomize`` on ``PYTHONPATH`` that logs every
``soundfile.SoundFile`` whose samples are read, in every process the pass starts (and the same wrapper here).

Cost: ~10-15 s on two cores (the session's tiny bundle; a folder of five files, two of them long: 5 s and
7.3 s against the tiny model's 2-s window; the split pass starts two spawn processes).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from index.audio.decode import decode_audio
from index.bundle.evalset import load_eval_waveform, prepare_waveform
from index.bundle.format import read_manifest
from index.catalogue import own_audio
from index.catalogue.embed_pass import PassOptions
from index.catalogue.own_audio import IndexedFolder, index_folder
from index.catalogue.pass_windows import WindowedDecode, WindowPlan
from index.moments.windows import HOP_FRACTION, SPANS_FILE, WINDOWS_FILE, embed_windows
from index.runtime.loader import LoadedBundle

FILES = {"a_short.wav": 1.3, "b_broken.wav": None, "c_long.wav": 5.0, "d_short.wav": 3.9, "e_long.wav": 7.3}
"""Seconds of each file (None: not audio). Long = more than two 2-s windows: c (4 windows) and e (7)."""
LONG = ("c_long.wav", "e_long.wav")
CHUNK = 2
"""Files per checkpointed chunk: [a, b], [c, d], [e] — an interruption at e keeps c's windows saved."""

READ_LOG = "TONEARM_TEST_READ_LOG"
SITECUSTOMIZE = f'''"""Test hook (tests/index/test_pass_windows.py): log each SoundFile whose samples are read."""
import os

import soundfile

_read = soundfile.SoundFile.read


def _logged_read(self, *args, **kwargs):
    if not getattr(self, "_read_logged", False):
        self._read_logged = True
        with open(os.environ["{READ_LOG}"], "a", encoding="utf-8") as log:
            log.write(os.path.basename(str(self.name)) + "\\n")
    return _read(self, *args, **kwargs)


soundfile.SoundFile.read = _logged_read
'''


def write_long_folder(root: Path, rate: int) -> Path:
    """:data:`FILES` under ``root`` at ``rate``: noise shaped by a slow envelope (distinct windows)."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(11)
    for name, seconds in FILES.items():
        if seconds is None:
            (root / name).write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt garbage")
            continue
        n = int(rate * seconds)
        envelope = 0.2 + 0.8 * np.abs(np.sin(np.linspace(0, 3 * seconds, n)))
        sf.write(root / name, (rng.uniform(-0.5, 0.5, n) * envelope).astype(np.float32), rate)
    return root


def bundle_windows_of(bundle: Path) -> tuple[np.ndarray, np.ndarray]:
    """(spans (W, 3): row, start, end; vectors (W, d)) as the bundle stores them."""
    return np.load(bundle / SPANS_FILE, allow_pickle=False), np.load(bundle / WINDOWS_FILE, allow_pickle=False)


def two_pass_windows(bundle: Path, folder: Path, clip_ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """What the old second pass (index_recordings, removed once the pass windowed in place) wrote: each long file decoded again and
    windowed by the source bundle's encoder, keyed by its row among ``clip_ids``."""
    source = LoadedBundle.open(bundle, verify=False)
    try:
        window = source.clip_samples
        spans, vectors = [], []
        for row, clip_id in enumerate(clip_ids):
            wave = own_audio.decode_file(folder / clip_id, source.sample_rate)
            if len(wave) <= 2 * window:
                continue
            found_spans, found = embed_windows(wave, sample_rate=source.sample_rate, window_samples=window,
                                               hop_samples=round(window * HOP_FRACTION), encode=source.encode_audio)
            spans.append(np.column_stack([np.full(len(found_spans), row, np.float64), found_spans]))
            vectors.append(found)
        return np.concatenate(spans), np.concatenate(vectors)
    finally:
        source.close()


@pytest.fixture(scope="module")
def long_folder(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_long_folder(tmp_path_factory.mktemp("long_sounds"), read_manifest(tiny_bundle).sample_rate)


@pytest.fixture(scope="module")
def one_pass(long_folder: Path, tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The in-process pass over the folder (chunks of two), its decodes counted and its log kept."""
    decoded: Counter[str] = Counter()
    real = own_audio.decode_file

    def counted(path: Path, rate: int, *limits: Any) -> np.ndarray:
        decoded[path.name] += 1
        return real(path, rate, *limits)

    logs: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(own_audio.__name__)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(own_audio, "decode_file", counted)
            done = index_folder(long_folder, tiny_bundle, tmp_path_factory.mktemp("one_pass") / "bundle",
                                chunk_files=CHUNK)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return {"done": done, "decoded": decoded, "logs": logs}


def test_the_in_process_pass_decodes_each_long_file_once(one_pass: dict[str, Any], long_folder: Path,
                                                          tiny_bundle: Path) -> None:
    done: IndexedFolder = one_pass["done"]
    assert one_pass["decoded"] == Counter(dict.fromkeys(FILES, 1))  # every file once: the long ones are not decoded a second time
    assert done.clip_ids == ["a_short.wav", "c_long.wav", "d_short.wav", "e_long.wav"]
    assert [c for c, _ in done.skipped] == ["b_broken.wav"]
    manifest = read_manifest(done.path)
    assert manifest.moments is not None and (manifest.moments.n_recordings, manifest.moments.n_windows) == (2, 11)
    spans, vectors = bundle_windows_of(done.path)
    assert sorted(set(spans[:, 0].astype(int).tolist())) == [1, 3]  # the audio index's rows, the skipped file left out
    old_spans, old_vectors = two_pass_windows(tiny_bundle, long_folder, done.clip_ids)
    np.testing.assert_array_equal(spans, old_spans)
    np.testing.assert_allclose(vectors, old_vectors, atol=1e-5)
    assert not np.allclose(vectors[0], vectors[1], atol=1e-3)  # distinct windows: the comparison can fail
    assert any("11 moment windows of 2 long files" in line for line in one_pass["logs"])  # the pass's progress


def test_a_pass_over_two_devices_decodes_each_long_file_once(
    one_pass: dict[str, Any], long_folder: Path, tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode workers and two device processes (CPU processes standing in for GPUs, as in
    tests/index/test_catalogue_pass.py): each process's reads are logged, this one's too."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
    log = tmp_path / "reads.log"
    log.touch()
    monkeypatch.setenv(READ_LOG, str(log))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))
    monkeypatch.setattr(sf.SoundFile, "read", sf.SoundFile.read)  # restored after the test
    exec(compile(SITECUSTOMIZE, "sitecustomize", "exec"), {})  # this process reads through the hook too
    done = index_folder(long_folder, tiny_bundle, tmp_path / "two", chunk_files=CHUNK,
                        pass_options=PassOptions(decode_workers=2, devices=(0, 1), batch_samples=40_000))
    reads = Counter(log.read_text(encoding="utf-8").split())
    assert reads == Counter({name: 1 for name, seconds in FILES.items() if seconds is not None})
    assert done.clip_ids == one_pass["done"].clip_ids
    spans, vectors = bundle_windows_of(done.path)
    want_spans, want_vectors = bundle_windows_of(one_pass["done"].path)
    np.testing.assert_array_equal(spans, want_spans)
    np.testing.assert_allclose(vectors, want_vectors, atol=1e-5)


def test_a_resumed_pass_keeps_the_windows_it_saved(one_pass: dict[str, Any], long_folder: Path, tiny_bundle: Path,
                                                   tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Interrupted at e_long.wav (Ctrl-C while decoding it), after the chunk holding c_long.wav was saved: the
    rerun decodes only e_long.wav and writes the uninterrupted pass's windows, c_long.wav's from the checkpoint."""
    real = own_audio.decode_file
    decoded: list[str] = []

    def interrupted(path: Path, rate: int, *limits: Any) -> np.ndarray:
        if path.name == "e_long.wav":
            raise KeyboardInterrupt
        return real(path, rate, *limits)

    out = tmp_path / "resumed"
    monkeypatch.setattr(own_audio, "decode_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        index_folder(long_folder, tiny_bundle, out, chunk_files=CHUNK)
    assert len(list((tmp_path / "resumed.partial").glob("chunk-*.npz"))) == 2
    monkeypatch.setattr(own_audio, "decode_file",
                        lambda path, rate, *limits: decoded.append(path.name) or real(path, rate, *limits))
    index_folder(long_folder, tiny_bundle, out, chunk_files=CHUNK)
    assert decoded == ["e_long.wav"]
    spans, vectors = bundle_windows_of(out)
    want_spans, want_vectors = bundle_windows_of(one_pass["done"].path)
    np.testing.assert_array_equal(spans, want_spans)
    np.testing.assert_allclose(vectors, want_vectors, atol=1e-6)


def _whole_decode_of(calls: list[str]) -> Any:
    """A whole-file decode that notes its calls (in this process: decode_workers 0)."""

    def whole(path: Path) -> np.ndarray:
        calls.append(Path(path).name)
        return decode_audio(path, sample_rate=16000)

    return whole


def test_a_center_crop_pass_decodes_a_long_file_whole_once_and_crops_it(tmp_path: Path) -> None:
    """A trained bundle with ``eval_crop: center`` embeds the center window of a clip, which its pass decodes
    alone; a long file is decoded whole once instead (its windows need it) and cropped in memory — the same
    samples as the window decode — while a short file keeps the window decode."""
    folder = write_long_folder(tmp_path / "sounds", 22050)  # resampled to 16 kHz: the crop lines up all the same
    window = 32000
    clip = partial(load_eval_waveform, sample_rate=16000, clip_samples=window, policy="center")
    calls: list[str] = []
    decode = WindowedDecode(clip, WindowPlan(16000, window), whole=_whole_decode_of(calls),
                            prepare=partial(prepare_waveform, clip_samples=window, policy="center"))
    long, short = decode(folder / "e_long.wav"), decode(folder / "d_short.wav")
    assert calls == ["e_long.wav"]  # the short file's header says it is short: its window decode only
    assert long.whole is not None and len(long.whole) > 2 * window
    np.testing.assert_allclose(long.clip, clip(folder / "e_long.wav"), atol=1e-6)
    assert short.whole is None and np.array_equal(short.clip, clip(folder / "d_short.wav"))
