"""SPEC property of distributed training: N processes on N shards = 1 process on the concatenated batch.

Two gloo processes (CPU) each embed half of a batch with the real :class:`TrainStep`
under DDP (:func:`training.loop.wrap_for_training`); the objective runs on the batch
gathered by :mod:`training.distributed`. Their loss and every parameter gradient
(encoders and the objective's own parameters) must equal those of one process on the
whole batch, for two consecutive steps (the second sees DART's reliability EMA and
ASK's knowledge bases as left by the first). Beyond the InfoNCE, SigLIP, KCL, DART and
ASK cases the issue asks for, CACL (local loss), SupCLAP's dynamic SVR and distillation
(with teacher embeddings in the batch) are checked the same way.

Everything runs in float64, so the tolerance is ``rtol = 1e-9, atol = 1e-12``: only the
order of floating-point sums differs. ASK's knowledge bases are float32 FAISS indices on
both sides, built from the same embeddings (encoded shard by shard and gathered on the
two processes, at once on one).
"""

from __future__ import annotations

import os
import socket
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor, nn

from tests.ranks import spawn_ranks
from training import distributed
from training.config import ConfigError, ObjectiveConfig
from training.loop import TrainStep, wrap_for_training
from training.objectives import build_objective, total_loss
from training.objectives.base import BuildEnv
from training.runtime import Runtime

RTOL, ATOL = 1e-9, 1e-12
LANGUAGES = ("en", "de")
BATCH = 8  # global rows; 4 per process
FEATURES, VOCAB, LENGTH, DIM = 12, 40, 5, 8
POOL = 24  # knowledge-base source pairs for ASK

CASES: dict[str, tuple[dict[str, Any], distributed.LossMode]] = {
    "infonce": ({"base": {"name": "infonce"}}, "global"),
    "infonce-local": ({"base": {"name": "infonce"}}, "local"),
    "siglip": ({"base": {"name": "siglip"}}, "global"),
    "siglip-local": ({"base": {"name": "siglip"}}, "local"),
    "kcl": ({"base": {"name": "infonce"}, "strategy": {"name": "kcl"}}, "global"),
    "kcl-local": ({"base": {"name": "infonce"}, "strategy": {"name": "kcl"}}, "local"),
    "cacl-local": ({"base": {"name": "siglip"}, "strategy": {"name": "cacl", "anchor": "en"}}, "local"),
    "svr-dynamic": (
        {"base": {"name": "infonce"}, "regularizers": [{"name": "svr", "radius": "dynamic", "width": 16}]},
        "global",
    ),
    "distill": ({"base": {"name": "infonce"}, "distill": {"teachers": ["unused"], "mix_lambda": 0.3}}, "global"),
    "dart": (
        {"base": {"name": "iot"}, "regularizers": [{"name": "uwd", "marginals": "ram"}]},
        "global",
    ),
    "ask": (
        {
            "base": {"name": "infonce"},
            "knowledge": {"n_clusters": 6, "top_k": 3, "refresh_steps": 1, "refresh_epochs": None},
        },
        "global",
    ),
}


class TinyEncoders(nn.Module):
    """A dual encoder small enough for a unit test (no batch norm, no dropout)."""

    embed_dim = DIM

    def __init__(self) -> None:
        super().__init__()
        self.audio = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, DIM))
        self.tokens = nn.Embedding(VOCAB, 16)
        self.text = nn.Linear(16, DIM)

    def encode_audio(self, waveform: Tensor) -> Tensor:
        return F.normalize(self.audio(waveform), dim=-1)

    def encode_text(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        mask = attention_mask.unsqueeze(-1).to(self.tokens.weight.dtype)
        pooled = (self.tokens(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return F.normalize(self.text(pooled), dim=-1)


class PoolContext:
    """The training-set embeddings ASK asks for: a fixed pool encoded shard by shard, then gathered.

    The same sharding as :class:`training.context.LoopContext` (contiguous shards,
    :func:`distributed.all_gather_rows`), over in-memory inputs instead of audio files.
    """

    def __init__(self, model: TinyEncoders, pool: dict[str, Tensor]) -> None:
        self.model, self.pool = model, pool
        self.epoch, self.step, self.device = 0, 0, torch.device("cpu")

    def embed_training_pairs_local(self) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's shard (ASK's partitioned knowledge bases, the default under 2 processes)."""
        shard = distributed.shard_range(POOL)
        rows = slice(shard.start, shard.stop)
        with torch.no_grad():
            audio = self.model.encode_audio(self.pool["waveform"][rows])
            text = self.model.encode_text(self.pool["input_ids"][rows], self.pool["attention_mask"][rows])
        return audio, text, torch.arange(shard.start, shard.stop)

    def embed_training_pairs(self) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(distributed.all_gather_rows(x) for x in self.embed_training_pairs_local())  # type: ignore[return-value]


def make_batches() -> tuple[list[dict[str, Tensor]], dict[str, Tensor]]:
    """Two global batches (each clip lacks its German caption with some probability) and the KB pool."""
    generator = torch.Generator().manual_seed(1)
    views = len(LANGUAGES)
    batches = []
    for step in range(2):
        text_mask = torch.ones(views, BATCH, dtype=torch.bool)
        text_mask[1, torch.tensor([1, 6]) if step == 0 else torch.tensor([3])] = False
        teachers = 2  # frozen-teacher embeddings (distillation only), masked like the texts
        teacher_text = F.normalize(torch.randn(teachers, views, BATCH, DIM, generator=generator, dtype=torch.float64), dim=-1)
        batches.append(
            {
                "waveform": torch.randn(BATCH, FEATURES, generator=generator, dtype=torch.float64),
                "input_ids": torch.randint(1, VOCAB, (views, BATCH, LENGTH), generator=generator),
                "attention_mask": torch.ones(views, BATCH, LENGTH, dtype=torch.long),
                "text_mask": text_mask,
                "clip_index": torch.arange(BATCH) + step * BATCH,
                "teacher_audio": F.normalize(
                    torch.randn(teachers, BATCH, DIM, generator=generator, dtype=torch.float64), dim=-1
                ),
                "teacher_text": teacher_text * text_mask[None, :, :, None],
            }
        )
    pool = {
        "waveform": torch.randn(POOL, FEATURES, generator=generator, dtype=torch.float64),
        "input_ids": torch.randint(1, VOCAB, (POOL, LENGTH), generator=generator),
        "attention_mask": torch.ones(POOL, LENGTH, dtype=torch.long),
    }
    return batches, pool


BATCH_DIM = {"input_ids": 1, "attention_mask": 1, "text_mask": 1, "teacher_audio": 1, "teacher_text": 2}


def shard(batch: dict[str, Tensor], rank: int, world: int, *, teachers: bool) -> dict[str, Tensor]:
    """This process's rows of every input (teacher embeddings only for distillation)."""
    rows = BATCH // world
    return {
        k: v.narrow(BATCH_DIM.get(k, 0), rank * rows, rows)
        for k, v in batch.items()
        if teachers or not k.startswith("teacher_")
    }


def run_case(name: str, *, rank: int, world: int) -> list[dict[str, Any]]:
    """Loss and gradients of two steps of `name` on this process's shards."""
    torch.set_default_dtype(torch.float64)
    spec, mode = CASES[name]
    torch.manual_seed(0)
    model = TinyEncoders()
    objective = build_objective(ObjectiveConfig(**spec), BuildEnv(languages=LANGUAGES, embed_dim=DIM))
    distributed.loss_mode_for(mode, objective, world)
    step_module = wrap_for_training(
        TrainStep(model, objective, loss_mode=mode),
        Runtime(device=torch.device("cpu"), rank=rank, world_size=world),
    )
    batches, pool = make_batches()
    context = PoolContext(model, pool)
    results = []
    for step, batch in enumerate(batches):
        context.step = step
        objective.on_step_start(context)
        loss = total_loss(step_module(**shard(batch, rank, world, teachers="distill" in spec)))
        loss.backward()
        grads = {
            n.removeprefix("module."): (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in step_module.named_parameters()
        }
        step_module.zero_grad(set_to_none=True)
        results.append({"loss": distributed.all_reduce_mean(loss.detach()), "grads": grads})
    return results


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    distributed.init_process_group(torch.device("cpu"), timeout_s=60)
    distributed.check_collectives(True)  # every tensor sent from the group's device (test_collective_devices)
    try:
        gathered = distributed.all_gather_rows(torch.arange(rank + 1))  # shards of unequal length
        results = {name: run_case(name, rank=rank, world=world) for name in CASES}
        if rank == 0:
            torch.save({"rows": gathered, "cases": results}, Path(out_dir) / "distributed.pt")
    finally:
        distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both ranks' results. A rank killed by a *signal* (not a Python error) gets one more run:
    once in CI (2026-11-24) rank 1 died of SIGABRT ("terminate called without an active
    exception", inside gloo) right after its first DDP backward, and 12 runs since — 5 of them
    with both cores busy — did not reproduce it. A second crash, or any Python error, fails."""
    for attempt in (1, 2):
        out = tmp_path_factory.mktemp("ddp")
        try:
            spawn_ranks(_worker, args=(2, free_port(), str(out)), nprocs=2)
            break
        except mp.ProcessExitedException as err:
            if err.signal_name is None or attempt == 2:
                raise
            warnings.warn(f"two-process run: rank {err.error_index} died of {err.signal_name}; running it once more",
                          stacklevel=1)
    return torch.load(out / "distributed.pt")


def test_rows_of_unequal_shards_come_back_in_rank_order(two_process_results: dict[str, Any]) -> None:
    assert two_process_results["rows"].tolist() == [0, 0, 1]


@pytest.mark.parametrize("name", list(CASES))
def test_two_processes_give_the_one_process_loss_and_gradients(
    name: str, two_process_results: dict[str, Any]
) -> None:
    default = torch.get_default_dtype()
    try:
        reference = run_case(name, rank=0, world=1)
    finally:
        torch.set_default_dtype(default)
    for step, (ref, got) in enumerate(zip(reference, two_process_results["cases"][name], strict=True)):
        torch.testing.assert_close(got["loss"], ref["loss"], rtol=RTOL, atol=ATOL, msg=f"{name} step {step} loss")
        assert ref["grads"].keys() == got["grads"].keys()
        moved = 0
        for param, grad in ref["grads"].items():
            torch.testing.assert_close(
                got["grads"][param], grad, rtol=RTOL, atol=ATOL, msg=f"{name} step {step} grad {param}"
            )
            moved += int(grad.abs().sum() > 0)
        assert moved >= 4, f"{name}: too few parameters received a gradient to compare"


def test_local_loss_is_refused_for_objectives_that_couple_all_rows() -> None:
    for spec in (CASES["dart"][0], CASES["ask"][0], CASES["svr-dynamic"][0], CASES["distill"][0]):
        objective = build_objective(ObjectiveConfig(**spec), BuildEnv(languages=LANGUAGES, embed_dim=DIM))
        with pytest.raises(ConfigError, match="distributed.loss=local"):
            distributed.loss_mode_for("local", objective, 2)
