"""Resume on another world size and mid-epoch checkpoints (training/elastic.py, docs/training.md)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from tests.conftest import TINY_CONFIG
from tests.ranks import spawn_ranks
from tests.training.test_distributed_runs import SMALL_RUN, _train_worker, free_port
from training.config import load_train_config
from training.elastic import EpochBatches
from training.loop import train


def _batches(clips: int, world: int, batch: int, seed: int = 3) -> list[EpochBatches]:
    data = list(range(clips))
    return [
        EpochBatches(DistributedSampler(data, num_replicas=world, rank=r, shuffle=True, seed=seed, drop_last=True), batch)  # type: ignore[arg-type]
        for r in range(world)
    ]


def _seen(ranks: list[EpochBatches], steps: int | None = None) -> list[int]:
    """Clips of the first `steps` global batches, in global order (rank r holds positions r::W)."""
    plans = [r.plan()[:steps] for r in ranks]
    return [key[1] for step in zip(*plans, strict=True) for keys in zip(*step, strict=True) for key in keys]


def test_a_fresh_epoch_gives_the_distributed_sampler_batches() -> None:
    for world in (1, 2, 3):
        for rank, batches in enumerate(_batches(13, world, 2)):
            batches.set_epoch(1)
            sampler = DistributedSampler(list(range(13)), num_replicas=world, rank=rank, shuffle=True, seed=3, drop_last=True)
            sampler.set_epoch(1)
            order = list(sampler)
            expected = [order[i : i + 2] for i in range(0, len(order), 2)]
            expected = expected[:-1] if len(expected[-1]) < 2 else expected
            assert [[k for _, k in b] for b in batches.plan()] == expected
            assert len(batches) == len(expected)


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 3)])
def test_a_resume_on_another_world_size_continues_with_the_clips_not_yet_seen(before: int, after: int) -> None:
    clips, batch, steps = 24, 2, 2
    old = _batches(clips, before, batch)
    for r in old:
        r.set_epoch(4)
    seen = _seen(old, steps)
    consumed = old[0].samples_consumed(steps)
    assert consumed == len(seen) == steps * batch * before
    assert all(r.samples_consumed(steps) == consumed for r in old)  # every rank agrees
    new = _batches(clips, after, batch)
    for r in new:
        r.set_epoch(4, samples_in_epoch=consumed)
    rest = _seen(new)
    one = _batches(clips, 1, batch)[0]  # world size 1, from the epoch's start
    one.set_epoch(4)
    full_order = _seen([one])
    assert not set(seen) & set(rest)
    assert seen + rest == full_order[: len(seen) + len(rest)]  # the same global order, continued
    assert len(rest) >= clips - consumed - after * 2  # only a tail (< world size, odd batch) skipped
    assert new[0].batches_before() == len(new[0]) - len(new[0].plan())


def _events(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _loop_state(out: Path) -> dict[str, object]:
    return dict(json.loads((out / "last" / "trainer_state.json").read_text())["loop"])


def test_two_processes_resume_on_one_and_one_on_two(
    tiny_corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 12 clips, batches of 2 per rank: 3 steps/epoch on 2 processes, 6 on 1.
    two_to_one, one_to_two = tmp_path / "two_to_one", tmp_path / "one_to_two"
    spawn_ranks(_train_worker, args=(2, str(tiny_corpus), [(str(two_to_one), 4, False, free_port())]), nprocs=2)
    state = _loop_state(two_to_one)
    assert (state["epoch"], state["batch_in_epoch"], state["samples_in_epoch"]) == (1, 1, 4)

    def config(out: Path, *extra: str):  # type: ignore[no-untyped-def]
        return load_train_config(TINY_CONFIG, [f"data.manifest={tiny_corpus}", f"out_dir={out}", "threads=1", *SMALL_RUN, *extra])

    with caplog.at_level(logging.INFO):
        train(config(two_to_one, "resume=true"))
    assert "world size changed 2 -> 1: epoch 2 continues at clip 4" in caplog.text
    assert "6 steps/epoch, run ends at step 8" in caplog.text
    # Epoch 2 had 8 clips left: 4 steps of 2 on one process.
    assert [e["step"] for e in _events(two_to_one) if e["kind"] == "epoch"] == [3, 8]

    train(config(one_to_two), interrupt_after_steps=8)  # epoch 2, batch 2 of 6: 4 clips consumed
    assert _loop_state(one_to_two)["samples_in_epoch"] == 4
    spawn_ranks(_train_worker, args=(2, str(tiny_corpus), [(str(one_to_two), None, True, free_port())]), nprocs=2)
    # 8 clips left over 2 processes: 2 steps.
    assert [e["step"] for e in _events(one_to_two) if e["kind"] == "epoch"] == [6, 10]
    assert torch.isfinite(torch.tensor([e["loss"] for e in _events(one_to_two) if e["kind"] == "epoch"])).all()


def test_save_every_steps_writes_a_mid_epoch_last_checkpoint(
    tiny_corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "run"
    cfg = load_train_config(
        TINY_CONFIG,
        [f"data.manifest={tiny_corpus}", f"out_dir={out}", "threads=1", *SMALL_RUN, "optim.epochs=1", "save_every_steps=4"],
    )
    with caplog.at_level(logging.INFO):
        train(cfg)
    assert f"saved {out / 'last'} at step 4 (epoch 1, batch 4 of 6)" in caplog.text
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no partial directory left
    assert _loop_state(out)["step"] == 6
