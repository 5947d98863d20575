"""The end of a DDP run over gloo, repeated: the pattern of pytorch#56297 (issue 48).

``python -m tests.training.teardown_stress --order old|fixed --iterations N``: two forked gloo ranks
each build a process group and a DDP model, take one step, then end — ``old``: barrier and
``destroy_process_group`` first, the model (DDP's Reducer, the group's last owner) freed after
(what ``train()`` did: the ``Run`` outlived the group); ``fixed``: the loop's own
:func:`training.distributed.release_and_leave` (free, collect, then barrier and destroy). The old
order deadlocks a rank within a few iterations on a loaded machine (``~ProcessGroupGloo`` ← ``~Reducer``
holding the GIL while a gloo thread waits for it); the caller's timeout is the verdict. Prints
``ended N iterations`` when every rank finished.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn


def _rank(rank: int, order: str, iterations: int, folder: str, spin_thread: bool, inflight: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from training import distributed

    torch.set_num_threads(1)
    if spin_thread:  # a Python thread beside the loop (as tqdm's monitor or a pin-memory thread): the GIL is contended
        threading.Thread(target=_spin, daemon=True).start()
    for i in range(iterations):
        dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous.{i}", rank=rank, world_size=2)
        model: Any = DistributedDataParallel(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(8, 16)).sum().backward()
        optimizer.step()
        for _ in range(inflight):  # works whose last owner is a gloo thread (their tensors dropped here)
            dist.all_reduce(torch.ones(64), async_op=True)
        if order == "old":
            distributed.destroy_process_group()  # barrier + destroy while the Reducer still holds the group
            del model, optimizer  # the Reducer frees the group here, GIL held
        else:
            owners = [model, optimizer]
            del model, optimizer
            distributed.release_and_leave(owners)


def _spin() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--order", choices=("old", "fixed"), required=True)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--busy", type=int, default=1, help="busy-loop processes beside the ranks (CPU load)")
    parser.add_argument("--spin-thread", action="store_true", help="a busy Python thread in each rank")
    parser.add_argument("--inflight", type=int, default=0, help="async all-reduces left in flight before the end")
    args = parser.parse_args(argv)
    context = mp.get_context("fork")
    busy = [context.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for process in busy:
        process.start()
    try:
        with tempfile.TemporaryDirectory() as folder:
            mp.start_processes(_rank, args=(args.order, args.iterations, folder, args.spin_thread, args.inflight), nprocs=2, join=True,
                               start_method="fork")
    finally:
        for process in busy:
            process.kill()
            process.join()
    print(f"ended {args.iterations} iterations ({args.order} order)", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
