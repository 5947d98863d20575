"""Undecodable training clips are replaced, named and counted up to data.max_bad_fraction; loader
settings come from the machine; persistent workers see each epoch (SPEC §13)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from index.cpus import available_cores
from index.languages import DEFAULT_LANGUAGES
from tests.training.test_loop import _records, _rewrite, _train_cli
from training.data.dataset import TrainClipDataset
from training.data.loader import BadSampleBudget, loader_options, loader_workers
from training.data.manifest import load_manifest
from training.loop import EpochBatches


def _corrupt_one_train_clip(tiny_corpus: Path, tmp_path: Path) -> tuple[Path, Path]:
    bad = tmp_path / "broken.flac"
    bad.write_bytes(b"fLaC" + bytes(range(256)) * 4)  # a FLAC signature and garbage after it
    first_train: list[int] = []

    def corrupt(number: int, obj: dict) -> None:
        if obj["split"] == "train" and not first_train:
            first_train.append(number)
            obj["audio"] = str(bad)

    return _rewrite(tiny_corpus, tmp_path / "manifest.jsonl", corrupt), bad


def test_a_corrupt_clip_is_replaced_in_its_batch_and_carried_as_an_error(tiny_corpus: Path, tmp_path: Path) -> None:
    manifest, bad = _corrupt_one_train_clip(tiny_corpus, tmp_path)
    records = [r for r in load_manifest(manifest, languages=DEFAULT_LANGUAGES) if r.split == "train"]
    dataset = TrainClipDataset(records, sample_rate=16000, clip_samples=8000, seed=0)
    item = dataset[(3, 0)]
    assert item.index != 0 and item.epoch == 3 and item.waveform.shape == (8000,)
    assert len(item.skipped) == 1 and item.skipped[0].startswith(str(bad))
    # The replacement is the clip itself as its own key would give it (same crop, same captions).
    alone = dataset[(3, item.index)]
    np.testing.assert_array_equal(alone.waveform, item.waveform)
    assert alone.captions is item.captions and alone.skipped == ()


def test_a_run_skips_counts_and_names_a_corrupt_clip_within_the_budget(
    tiny_corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manifest, bad = _corrupt_one_train_clip(tiny_corpus, tmp_path)
    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        # 12 clips, 1 bad: 0.1 allows 1. Two persistent workers also exercise the epoch-carrying keys.
        assert _train_cli(manifest, run, "data.max_bad_fraction=0.1", "data.num_workers=2") == 0
    epochs = [r for r in _records(run) if r["kind"] == "epoch"]
    assert [r["bad_samples"] for r in epochs] == [1, 1]  # distinct clips: the same file again is not new
    assert str(bad) in caplog.text and "undecodable" in caplog.text


def test_past_the_budget_the_run_stops_in_one_line(
    tiny_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest, bad = _corrupt_one_train_clip(tiny_corpus, tmp_path)
    assert _train_cli(manifest, tmp_path / "run", "data.max_bad_fraction=0") == 2
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "max_bad_fraction" in line)
    assert "1 of 12 clips on this rank could not be decoded" in line and str(bad) in line


def test_budget_counts_distinct_errors() -> None:
    budget = BadSampleBudget(max_fraction=0.25, clips=8)  # allows 2
    budget.add(["a.flac: corrupt", "a.flac: corrupt", "b.wav: empty file"])
    assert budget.count == 2 and budget.first() == ["a.flac: corrupt", "b.wav: empty file"]
    with pytest.raises(Exception, match=r"3 of 8 clips .* allows \(2\); first: a.flac: corrupt"):
        budget.add(["c.ogg: not audio"])


def test_loader_defaults_follow_the_usable_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    cores = available_cores()
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert loader_workers("auto") == max(1, cores - 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 2))  # more ranks than cores: still one worker each
    assert loader_workers("auto") == 1
    assert loader_workers(0) == 0 and loader_workers(3) == 3
    options = loader_options(2, prefetch_factor=4, persistent=True, cuda=True)
    assert options == {"num_workers": 2, "pin_memory": True, "persistent_workers": True, "prefetch_factor": 4}
    assert loader_options(0, prefetch_factor=4, persistent=True, cuda=False) == {"num_workers": 0, "pin_memory": False}


def test_persistent_workers_draw_each_epoch_as_the_main_process_does(tiny_corpus: Path) -> None:
    records = [r for r in load_manifest(tiny_corpus, languages=DEFAULT_LANGUAGES) if r.split == "train"][:6]
    dataset = TrainClipDataset(records, sample_rate=16000, clip_samples=4000, seed=5)

    def epochs(workers: int) -> list[torch.Tensor]:
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=5)
        batches = EpochBatches(sampler, 3)
        loader = DataLoader(dataset, batch_sampler=batches, collate_fn=lambda items: items,
                            **loader_options(workers, prefetch_factor=2, persistent=True, cuda=False))
        waves = []
        for epoch in range(3):
            batches.set_epoch(epoch)
            waves.append(torch.stack([torch.from_numpy(i.waveform) for batch in loader for i in batch]))
        return waves

    in_process, persistent = epochs(0), epochs(2)
    for a, b in zip(in_process, persistent, strict=True):
        torch.testing.assert_close(a, b)
    assert not torch.equal(persistent[0], persistent[1])  # crops and order change with the epoch
    assert all(w.shape[0] == 6 for w in persistent)
