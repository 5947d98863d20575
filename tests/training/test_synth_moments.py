"""`tonearm synth --moments`: the moments' boundaries are where the rendered audio's energy is.

The checks read the WAV files written to disk (frame energy against the recording's own noise
floor), never the generator's internals; the manifest's claimed boundaries are what is tested.
One tiny corpus (12 recordings of 20–30 s, ~2 s) is shared by the module.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from index.languages import DEFAULT_LANGUAGES
from tonearm.cli import main
from training.data.manifest import load_manifest

FRAME = 0.01
EDGE = 0.05
"""An edge is tested within 50 ms (five 10-ms frames)."""
QUIET = 0.3
"""... and the 300 ms outside it must be bed only."""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("moments")
    assert main(["synth", "--moments", "--size", "tiny", "--seed", "3", "--out", str(out)]) == 0
    return out / "manifest.jsonl"


def _rows(manifest: Path) -> list[dict]:
    return [json.loads(line) for line in manifest.read_text(encoding="utf-8").splitlines()]


def _frame_rms(path: Path) -> tuple[np.ndarray, float]:
    wave, sr = sf.read(str(path), dtype="float64")
    n = int(FRAME * sr)
    frames = wave.size // n
    rms = np.sqrt(np.mean(wave[: frames * n].reshape(frames, n) ** 2, axis=1))
    return rms, float(np.percentile(rms, 10))


def _edge_ok(rms: np.ndarray, floor: float, edge: float, inside: int) -> bool:
    """Loud within EDGE on the moment's side of ``edge``, bed-level over QUIET on the other side."""
    e = int(round(edge / FRAME))
    k, q = int(EDGE / FRAME), int(QUIET / FRAME)
    near = rms[e : e + k] if inside > 0 else rms[max(0, e - k) : e]
    outside = rms[max(0, e - q) : max(0, e - 1)] if inside > 0 else rms[e + 1 : e + q]
    return bool(near.size and near.max() > 4.0 * floor and (outside.size == 0 or outside.max() < 3.5 * floor))


def _free(edge: float, moments: list[dict], duration: float) -> bool:
    """No other moment within QUIET + EDGE of this edge (and the edge is inside the recording)."""
    margin = QUIET + EDGE
    if edge - margin < 0 or edge + margin > duration:
        return False
    hits = [m for m in moments if m["start"] - margin < edge < m["end"] + margin]
    return len(hits) == 1


def test_boundaries_are_the_audio_energy(corpus: Path) -> None:
    checked = 0
    for row in _rows(corpus):
        rms, floor = _frame_rms(corpus.parent / row["audio"])
        moments, duration = row["moments"], row["meta"]["duration"]
        assert abs(rms.size * FRAME - duration) < 0.02
        for m in moments:
            assert 0 <= m["start"] < m["end"] <= duration
            for edge, inside in ((m["start"], 1), (m["end"], -1)):
                if _free(edge, moments, duration):
                    assert _edge_ok(rms, floor, edge, inside), (row["id"], m, edge)
                    checked += 1
                    # the check can fail: the same edge 0.2 s off is not where the energy is
                    assert not _edge_ok(rms, floor, edge + 0.2 * inside, inside), (row["id"], m, edge)
                    assert not _edge_ok(rms, floor, edge - 0.2 * inside, inside), (row["id"], m, edge)
    assert checked >= 12


def test_manifest_moments_captions_and_splits(corpus: Path) -> None:
    rows = _rows(corpus)
    records = load_manifest(corpus, languages=DEFAULT_LANGUAGES)
    assert {r.split for r in records} == {"train", "val", "test"}
    overlapping = 0
    for row, record in zip(rows, records, strict=True):
        moments = row["moments"]
        assert len(record.moments) == len(moments) == len(row["meta"]["moment_events"]) >= 1
        for i, m in enumerate(moments):  # one caption per moment in each of the eight languages
            assert sorted(m["captions"]) == sorted(DEFAULT_LANGUAGES)
            for lang in DEFAULT_LANGUAGES:
                assert m["captions"][lang] == [row["captions"][lang][i]]
        spans = sorted((m["start"], m["end"]) for m in moments)
        overlapping += sum(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False))
    assert overlapping >= 1  # "overlapping sometimes"


def test_same_seed_same_bytes(corpus: Path, tmp_path: Path) -> None:
    from training.data.synth_moments import generate_moment_corpus

    again = generate_moment_corpus(size="tiny", seed=3, out_dir=tmp_path, progress=False, workers=2)
    assert again.read_bytes() == corpus.read_bytes()
    first = sorted((corpus.parent / "audio").rglob("*.wav"))
    assert [p.read_bytes() for p in first] == [(tmp_path / p.relative_to(corpus.parent)).read_bytes() for p in first]


def test_one_recording_in_four_holds_a_long_moment(corpus: Path, tmp_path: Path) -> None:
    """Recordings 3, 7, 11 (LONG_EVENT_SHARE 0.25) hold one moment over most of the recording — its written span,
    the audio's own, covers a large part of it (edges checked by the test above) — the others are the corpus
    without long moments, byte for byte (``long_share=0``)."""
    from training.data.synth_moments import generate_moment_corpus

    rows = _rows(corpus)
    long_rows = []
    for i, row in enumerate(rows):
        marked = [m for m, e in zip(row["moments"], row["meta"]["moment_events"], strict=True) if e.get("long")]
        assert len(marked) == (1 if i % 4 == 3 else 0), row["id"]
        if marked:
            long_rows.append(row["id"])
            cover = (marked[0]["end"] - marked[0]["start"]) / row["meta"]["duration"]
            assert 0.3 <= cover <= 0.85, (row["id"], cover)
            others = [m for m in row["moments"] if m is not marked[0]]
            assert all(m["end"] - m["start"] <= 10.0 for m in others)
        else:
            assert all(m["end"] - m["start"] <= 10.0 for m in row["moments"])
    assert len(long_rows) == 3
    without = generate_moment_corpus(size="tiny", seed=3, out_dir=tmp_path, progress=False, long_share=0.0)
    for row, old in zip(rows, _rows(without), strict=True):
        same = row == old and (corpus.parent / row["audio"]).read_bytes() == (without.parent / old["audio"]).read_bytes()
        assert same == (row["id"] not in long_rows), row["id"]
