"""Metrics that describe the data are every rank's (issue 39 item 5): a rank starved by its loader
shows in rank 0's record as the worst data wait, bad samples are counted over all ranks."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from tests.ranks import spawn_ranks
from tests.training.test_distributed_runs import free_port

SLOW_RANK_WAIT_S = 0.05


def _starved_worker(rank: int, world: int, port: int, out: str) -> None:
    from training import distributed
    from training.config import LogConfig
    from training.observe import Observer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    distributed.init_process_group(torch.device("cpu"), timeout_s=60)
    try:
        def loader():  # rank 1's loader is slow, rank 0's instant
            for _ in range(8):
                if rank == 1:
                    time.sleep(SLOW_RANK_WAIT_S)
                yield SimpleNamespace(waveform=torch.zeros(2, 4))

        observer = Observer(LogConfig(tensorboard=False), out_dir=Path(out), enabled=rank == 0,
                            device=torch.device("cpu"), world_size=world)
        for _batch in observer.batches(loader()):
            time.sleep(0.005)  # the "step"
            observer.step_end()
        own = {"wait": observer._wait, "wall": observer._wall, "samples": observer._samples}
        window = observer.window()
        seen = distributed.distinct_over_ranks(["a.flac: bad", "b.flac: bad"] if rank == 0 else ["b.flac: bad", "c.ogg"])
        Path(f"{out}/rank{rank}.json").write_text(json.dumps({"own": own, "window": window, "seen": seen}))
    finally:
        distributed.destroy_process_group()


def test_rank_zero_logs_the_mean_and_the_starved_ranks_data_wait(tmp_path: Path) -> None:
    spawn_ranks(_starved_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # The reference: each rank's own measure, computed here from its raw counters.
    waits = [r["own"]["wait"] / r["own"]["wall"] for r in ranks]
    rates = [r["own"]["samples"] / r["own"]["wall"] for r in ranks]
    assert waits[1] > 0.7 > 0.3 > waits[0]  # rank 1 is starved, rank 0 is not
    for rank in ranks:  # every rank gets the same reduction; rank 0 writes it
        window = rank["window"]
        assert abs(window["data_wait_fraction"] - sum(waits) / 2) < 1e-9
        assert abs(window["data_wait_fraction_max"] - waits[1]) < 1e-9
        assert abs(window["samples_per_s"] - sum(rates) / 2) < 1e-6 * max(rates)
        assert rank["seen"] == 3  # a.flac, b.flac (both ranks), c.ogg
