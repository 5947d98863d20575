"""`tonearm synth --noise P`: a fraction of training captions swapped, test split untouched, recorded."""

from __future__ import annotations

from pathlib import Path

import pytest

from index.languages import DEFAULT_LANGUAGES
from tonearm.cli import main
from training.data.manifest import load_manifest
from training.data.noise import inject_caption_noise, noisy_positions
from training.data.synth import plan_corpus


def test_noise_replaces_the_requested_fraction_of_train_slots_only(tmp_path: Path) -> None:
    clean, _ = plan_corpus(size="tiny", seed=1, out_dir=tmp_path)
    noisy, _ = plan_corpus(size="tiny", seed=1, out_dir=tmp_path)
    count = inject_caption_noise(noisy, 0.25, seed=1)
    train_slots = sum(3 for r in clean if r.split == "train")
    assert count == round(0.25 * train_slots)
    changed = 0
    by_id = {r.id: r for r in clean}
    for before, after in zip(clean, noisy, strict=True):
        positions = noisy_positions(after)
        if before.split != "train":
            assert after.captions == before.captions and not positions
            continue
        for position in range(3):
            swapped = position in positions
            if not swapped:
                assert all(after.captions[k][position] == before.captions[k][position] for k in DEFAULT_LANGUAGES)
            else:
                changed += 1
                source = by_id[_source(after, position)]
                assert source.meta["family"] != before.meta["family"]
                entry = next(e for e in after.meta["noisy_captions"] if e["position"] == position)
                # the whole query group comes from one donor slot, so translations stay aligned
                for lang in DEFAULT_LANGUAGES:
                    assert after.captions[lang][position] == source.captions[lang][entry["source_position"]]
    assert changed == count


def _source(record, position: int) -> str:
    return next(e["source"] for e in record.meta["noisy_captions"] if e["position"] == position)


def test_cli_noise_is_recorded_in_the_manifest_and_keeps_the_audio(tmp_path: Path) -> None:
    assert main(["synth", "--size", "tiny", "--seed", "2", "--out", str(tmp_path / "clean")]) == 0
    assert main(["synth", "--size", "tiny", "--seed", "2", "--noise", "0.2", "--out", str(tmp_path / "noisy")]) == 0
    clean = load_manifest(tmp_path / "clean" / "manifest.jsonl", languages=DEFAULT_LANGUAGES)
    noisy = load_manifest(tmp_path / "noisy" / "manifest.jsonl", languages=DEFAULT_LANGUAGES)
    assert sum(len(noisy_positions(r)) for r in noisy) == round(0.2 * 32 * 3)
    for a, b in zip(clean, noisy, strict=True):
        assert a.audio.read_bytes() == b.audio.read_bytes()


def test_noise_fraction_out_of_range_is_a_clear_cli_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["synth", "--noise", "1.5", "--out", str(tmp_path)])
    assert "--noise must be in [0, 1)" in capsys.readouterr().err
