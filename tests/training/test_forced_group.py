"""``distributed.force_process_group``: one process runs DDP and every collective of the loop
(issue 39 item 5), and trains exactly as without them."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import TINY_CONFIG
from tests.training.test_distributed_runs import SMALL_RUN
from training import distributed
from training.config import load_train_config
from training.loop import train


def test_a_forced_group_at_world_size_one_runs_the_collectives_and_trains_the_same(
    tiny_corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def config(out: Path, *extra: str):  # noqa: ANN202
        return load_train_config(TINY_CONFIG, [f"data.manifest={tiny_corpus}", f"out_dir={out}", "threads=1",
                                               *SMALL_RUN, "optim.epochs=1", *extra])

    plain = train(config(tmp_path / "plain"))
    distributed.check_collectives(True)  # counts every tensor handed to a collective, on the group's device
    try:
        with caplog.at_level(logging.INFO):
            forced = train(config(tmp_path / "forced", "distributed.force_process_group=true"))
        sent = distributed.collectives_sent()
    finally:
        distributed.check_collectives(None)
    assert "distributed: rank 0 of 1 on cpu" in caplog.text  # a gloo group of one process
    assert not distributed.is_distributed()  # and it was left at the end
    # The training step's gathers and logged reductions, the data metrics' gather, the stop poll:
    assert {"all_gather", "all_reduce", "any_rank"} <= set(sent), sent
    assert sent["all_gather"] >= 6 * 2  # at least the audio and text embeddings of each of the 6 steps
    expected = load_file(str(plain / "last" / "model.safetensors"))
    got = load_file(str(forced / "last" / "model.safetensors"))
    for name, tensor in expected.items():  # DDP's mean over one rank and the gathers change nothing
        assert torch.equal(tensor, got[name]), name
