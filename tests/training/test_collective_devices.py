"""Collectives are NCCL-correct: every tensor they send lives on the process group's device.

NCCL communicates CUDA tensors only. This machine has no GPU, so the check is made on
CPU in two ways that can fail here (training/distributed.py, "the collective boundary"):

* the real training loop runs on 2 gloo processes with the device check on: every tensor
  handed to a collective must be on the group's device, and every tensor a collective
  helper builds without naming that device lands on ``meta`` and is refused — the
  ``torch.tensor([...])`` host tensor that broke NCCL at the first logged step;
* a one-process gloo group shows that the check fires on such a host tensor.

Where a GPU exists, a group whose only backend is for CUDA tensors (``cuda:gloo``) runs the
collectives for real and shows torch's own error for the old host-tensor code.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, TINY_CONFIG
from tests.ranks import spawn_ranks
from tests.training.test_distributed_runs import free_port
from training import distributed


def _loop_worker(rank: int, world: int, port: int, manifest: str, out_dir: str) -> None:
    from training.config import load_train_config
    from training.loop import train

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
    )
    distributed.check_collectives(True)
    cfg = load_train_config(
        TINY_CONFIG,
        [
            f"data.manifest={manifest}", f"out_dir={out_dir}", "threads=1", "optim.epochs=1",
            "optim.batch_size=4", "optim.accum_steps=2", "data.max_clips=8", "optim.warmup_steps=1",
            "distributed.timeout_s=120",
        ],
    )
    train(cfg)
    (Path(out_dir) / f"sent.{rank}.json").write_text(json.dumps(distributed.collectives_sent()))


def test_training_loop_sends_every_collective_from_the_group_device(tiny_corpus: Path, tmp_path: Path) -> None:
    """The real loop (with optim.accum_steps=2: the accumulated step under DDP) on 2 gloo processes."""
    spawn_ranks(_loop_worker, args=(2, free_port(), str(tiny_corpus), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        sent = json.loads((tmp_path / f"sent.{rank}.json").read_text())
        # Gathers of the embedding batch, logged terms, stop flags and the RNG states of last/.
        assert sent.get("all_gather", 0) > 0 and sent.get("all_reduce", 0) > 0, sent
        assert sent.get("any_rank", 0) > 0, sent


@pytest.fixture
def one_process_group(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A gloo group of one process in this process, with the device check on."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    distributed.check_collectives(True)
    try:
        yield
    finally:
        distributed.check_collectives(None)
        dist.destroy_process_group()


def test_the_check_fires_on_a_host_tensor(one_process_group: None) -> None:
    # What every helper now does: tensors built on the group's device pass.
    assert distributed.reduce_logged({"loss": torch.tensor(2.0), "lr": 0.5}) == {"loss": 2.0, "lr": 0.5}
    assert distributed.any_rank(True) is True
    assert distributed.gather_objects({"a": 1}) == [{"a": 1}]
    assert distributed.all_gather_rows(torch.arange(3)).tolist() == [0, 1, 2]
    # The old average_scalars: a float64 tensor built without a device (a host tensor under NCCL).
    with pytest.raises(distributed.CollectiveDeviceError, match="a tensor on meta was handed to a collective of a group on cpu"):
        with distributed._helper_scope():
            distributed.all_reduce_mean(torch.tensor([1.0, 2.0], dtype=torch.float64))
    # A tensor on another device than the group's is refused at the boundary itself.
    with pytest.raises(distributed.CollectiveDeviceError, match="group on cpu"):
        distributed._send("all_reduce", torch.zeros(1, device="meta"))


def test_only_training_distributed_imports_torch_distributed() -> None:
    """Every collective goes through training/distributed.py (DDP's own collectives excepted)."""
    offenders = []
    for package in ("training", "index", "service", "tonearm"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "training" / "distributed.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = (
                    [alias.name for alias in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                )
                if isinstance(node, ast.ImportFrom) and node.module == "torch":
                    names = [f"torch.{alias.name}" for alias in node.names]
                if isinstance(node, ast.Attribute) and node.attr == "distributed" and ast.unparse(node) == "torch.distributed":
                    names = ["torch.distributed"]
                offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith("torch.distributed")]
    assert not offenders, offenders


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: a group whose only backend is for CUDA tensors")
def test_cuda_only_group_runs_every_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                       "WORLD_SIZE": "1", distributed.BACKEND_ENV: "cuda:gloo"}.items():
        monkeypatch.setenv(key, value)
    try:
        distributed.init_process_group(torch.device("cuda", 0), timeout_s=60)
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            dist.all_reduce(torch.tensor([1.0], dtype=torch.float64))  # the old average_scalars
        assert distributed.reduce_logged({"loss": torch.tensor(2.0, device="cuda"), "lr": 0.5})["loss"] == 2.0
        assert distributed.any_rank(False) is False
        assert distributed.gather_objects([1, 2]) == [[1, 2]]
        assert distributed.all_gather_rows(torch.arange(3)).device.type == "cpu"  # sent from the GPU and back
        distributed.barrier()
    finally:
        distributed.destroy_process_group()
