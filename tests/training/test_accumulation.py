"""``optim.accum_steps``: N micro-batches give the loss and gradients of one batch of N× the size.

For every objective family (InfoNCE, SigLIP, KCL, CACL, dynamic SVR, distillation, DART/IOT,
ASK) two consecutive steps on a batch of 8 in 4 micro-batches of 2 are compared with the same
steps on the whole batch in one pass (the tiny float64 encoders of the distributed
equivalence test, so only the order of float sums differs). Under DDP (2 gloo processes,
each 2 micro-batches of its 4 rows) the gradients still equal those of one process on the
global batch of 8. Dropout draws the same masks in the re-forward (RNG replay).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tests.ranks import spawn_ranks
from tests.training.test_distributed_equivalence import (
    ATOL,
    CASES,
    DIM,
    LANGUAGES,
    RTOL,
    PoolContext,
    TinyEncoders,
    free_port,
    make_batches,
    run_case,
    shard,
)
from training import distributed
from training.accumulate import accumulated_backward, micro_batches
from training.config import ConfigError, ObjectiveConfig, OptimConfig
from training.loop import TrainStep, unused_parameter_hint, wrap_for_training
from training.objectives import build_objective
from training.objectives.base import BuildEnv
from training.runtime import Runtime

FAMILIES = ["infonce", "siglip", "kcl", "cacl-local", "svr-dynamic", "distill", "dart", "ask"]
DISTRIBUTED = ["infonce-local", "siglip", "dart", "ask"]


def run_accumulated(name: str, *, rank: int, world: int, steps: int, model: nn.Module | None = None) -> list[dict[str, Any]]:
    """:func:`run_case` with each step's batch in `steps` micro-batches (training/accumulate.py)."""
    torch.set_default_dtype(torch.float64)
    spec, mode = CASES[name]
    torch.manual_seed(0)
    model = model or TinyEncoders()
    objective = build_objective(ObjectiveConfig(**spec), BuildEnv(languages=LANGUAGES, embed_dim=DIM))
    step_module = wrap_for_training(
        TrainStep(model, objective, loss_mode=mode),  # type: ignore[arg-type]
        Runtime(device=torch.device("cpu"), rank=rank, world_size=world),
    )
    batches, pool = make_batches()
    context = PoolContext(model, pool)  # type: ignore[arg-type]
    results = []
    for step, batch in enumerate(batches):
        context.step = step
        objective.on_step_start(context)
        inputs: dict[str, Tensor | None] = dict(shard(batch, rank, world, teachers="distill" in spec))
        _, loss = accumulated_backward(step_module, inputs, steps, autocast=contextlib.nullcontext)
        grads = {
            n.removeprefix("module."): (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in step_module.named_parameters()
        }
        step_module.zero_grad(set_to_none=True)
        results.append({"loss": distributed.all_reduce_mean(loss), "grads": grads})
    return results


def assert_same(name: str, got: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    for step, (ref, out) in enumerate(zip(reference, got, strict=True)):
        torch.testing.assert_close(out["loss"], ref["loss"], rtol=RTOL, atol=ATOL, msg=f"{name} step {step} loss")
        assert ref["grads"].keys() == out["grads"].keys()
        for param, grad in ref["grads"].items():
            torch.testing.assert_close(
                out["grads"][param], grad, rtol=RTOL, atol=ATOL, msg=f"{name} step {step} grad {param}"
            )


@contextlib.contextmanager
def float64() -> Any:
    default = torch.get_default_dtype()
    try:
        yield
    finally:
        torch.set_default_dtype(default)


@pytest.mark.parametrize("name", FAMILIES)
def test_four_micro_batches_give_the_whole_batch(name: str) -> None:
    with float64():
        reference = run_case(name, rank=0, world=1)
        got = run_accumulated(name, rank=0, world=1, steps=4)
    assert_same(name, got, reference)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    distributed.init_process_group(torch.device("cpu"), timeout_s=60)
    distributed.check_collectives(True)
    try:
        results: dict[str, Any] = {
            name: run_accumulated(name, rank=rank, world=world, steps=2) for name in DISTRIBUTED
        }
        results["unused"] = _unused_parameter_error(rank, world)
        if rank == 0:
            torch.save(results, out)
    finally:
        distributed.destroy_process_group()


class OneUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(2, 1), nn.Linear(2, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.used(x).sum()


def _unused_parameter_error(rank: int, world: int) -> str:
    """DDP without the unused-parameter search (the default) over a module that skips a parameter."""
    module = wrap_for_training(OneUnused(), Runtime(device=torch.device("cpu"), rank=rank, world_size=world))
    try:
        with unused_parameter_hint():
            for _ in range(2):  # DDP notices at the forward after the incomplete backward
                module(torch.ones(3, 2)).backward()
    except ConfigError as err:
        return str(err)
    return ""


def test_micro_batches_under_ddp_give_the_one_process_global_batch(tmp_path: Path) -> None:
    out = tmp_path / "accumulated.pt"
    spawn_ranks(_worker, args=(2, free_port(), str(out)), nprocs=2)
    results = torch.load(out)
    assert "set distributed.find_unused_parameters=true" in results["unused"]
    for name in DISTRIBUTED:
        with float64():
            reference = run_case(name, rank=0, world=1)
        assert_same(name, results[name], reference)


class DropoutEncoders(TinyEncoders):
    def __init__(self) -> None:
        super().__init__()
        self.audio = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, DIM))


def test_dropout_masks_are_replayed_in_the_re_forward() -> None:
    with float64():
        torch.set_default_dtype(torch.float64)
        torch.manual_seed(0)
        model = DropoutEncoders()
        objective = build_objective(ObjectiveConfig(), BuildEnv(languages=LANGUAGES, embed_dim=DIM))
        step = TrainStep(model, objective)  # type: ignore[arg-type]
        batch: dict[str, Tensor | None] = dict(shard(make_batches()[0][0], 0, 1, teachers=False))
        torch.manual_seed(7)
        accumulated_backward(step, batch, 2, autocast=contextlib.nullcontext)
        got = {n: p.grad.clone() for n, p in step.named_parameters() if p.grad is not None}
        step.zero_grad(set_to_none=True)
        # Reference: the micro-batches embedded with gradient in the same RNG order, one backward.
        torch.manual_seed(7)
        parts = [step.embed(**micro) for micro in micro_batches(batch, 2)]
        audio, text = torch.cat([a for a, _ in parts]), torch.cat([t for _, t in parts], 1)
        terms = step.score(audio, text, batch["text_mask"], batch["clip_index"])  # type: ignore[arg-type]
        sum(v for k, v in terms.items() if k.endswith("_loss")).backward()  # type: ignore[union-attr]
    for name, grad in got.items():
        torch.testing.assert_close(grad, step.get_parameter(name).grad, rtol=RTOL, atol=ATOL, msg=name)


def test_accum_steps_must_divide_the_batch() -> None:
    with pytest.raises(ValueError, match="must divide optim.batch_size"):
        OptimConfig(batch_size=10, accum_steps=4)
