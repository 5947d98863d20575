"""Process setup of a training run: device, seeds, threads, mixed precision, process group.

Kept apart from the loop so that the loop reads as setup → build → loop → teardown.
Random-number-generator state is captured as (tensors, JSON scalars) so it can be
saved without pickle (safetensors + JSON) and restored for an exact resume.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from index.errors import TonearmError
from training import distributed
from training.config import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runtime:
    """Where and how this process trains."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    amp_dtype: torch.dtype | None = None
    """bf16/fp16 autocast dtype on CUDA when AMP is enabled; None = full precision."""
    forced_group: bool = False
    """A process group at world size 1 (``distributed.force_process_group``): DDP and every
    collective of the loop run, as under torchrun."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether a process group is in use (several processes, or one forced)."""
        return self.world_size > 1 or self.forced_group


def resolve_device(name: Literal["auto", "cpu", "cuda"], *, local_rank: int = 0) -> torch.device:
    """``auto`` → CUDA when available, else CPU; ``cuda`` without a GPU is a config error."""
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            "device: 'cuda' requested but no CUDA device is available (use device=cpu or auto)"
        )
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"device: process LOCAL_RANK={local_rank} needs GPU {local_rank} but this node has "
            f"{torch.cuda.device_count()}; use --nproc-per-node {torch.cuda.device_count()} or fewer"
        )
    return torch.device("cuda", local_rank)


def amp_dtype_for(
    device: torch.device, *, enabled: bool, choice: Literal["auto", "bf16", "fp16"] = "auto"
) -> torch.dtype | None:
    """AMP only on CUDA: bf16 (``auto`` where supported) or fp16 (which needs a GradScaler)."""
    if not enabled or device.type != "cuda":
        return None
    if choice == "fp16" or (choice == "auto" and not torch.cuda.is_bf16_supported()):
        return torch.float16
    return torch.bfloat16


def autocast(runtime: Runtime) -> contextlib.AbstractContextManager[Any]:
    """Autocast context for the forward pass (a no-op without AMP)."""
    if runtime.amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=runtime.device.type, dtype=runtime.amp_dtype)


def make_grad_scaler(runtime: Runtime) -> torch.amp.GradScaler:
    """Loss scaling is needed for fp16 only; disabled (pass-through) otherwise."""
    return torch.amp.GradScaler(runtime.device.type, enabled=runtime.amp_dtype == torch.float16)


def set_threads(threads: int | None) -> None:
    """Intra-op threads for torch (None keeps torch's default, i.e. OMP_NUM_THREADS or all cores)."""
    if threads is not None:
        torch.set_num_threads(threads)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def setup_runtime(
    *,
    device: Literal["auto", "cpu", "cuda"],
    amp: bool,
    threads: int | None,
    amp_dtype: Literal["auto", "bf16", "fp16"] = "auto",
    timeout_s: float = 600.0,
    force_group: bool = False,
) -> Runtime:
    """Initialise the process group when launched by torchrun (``WORLD_SIZE > 1``), or at world
    size 1 with `force_group` (``distributed.force_process_group``).

    NCCL on CUDA, gloo on CPU (training.distributed); each rank uses GPU ``LOCAL_RANK``.
    """
    set_threads(threads)
    world_size = distributed.launched_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    resolved = resolve_device(device, local_rank=local_rank)
    rank = 0
    forced = force_group and world_size == 1
    if world_size > 1 or forced:
        if resolved.type == "cuda":
            torch.cuda.set_device(resolved)
        rank = distributed.init_process_group(resolved, timeout_s=timeout_s)
        log.info("distributed: rank %d of %d on %s", rank, world_size, resolved)
        if rank != 0:  # rank 0 logs for everyone; the others only warn
            logging.getLogger().setLevel(logging.WARNING)
    return Runtime(
        device=resolved,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        amp_dtype=amp_dtype_for(resolved, enabled=amp, choice=amp_dtype),
        forced_group=forced,
    )


def teardown_runtime(
    runtime: Runtime, *, owners: list[Any] | None = None, error: BaseException | None = None,
    together: bool | None = None,
) -> None:
    """Free ``owners`` (the run: DDP model, optimizer, loaders — held by the caller only through
    this list), then leave the process group: after a barrier when the run ended the same way on
    every rank, at once when `error` is propagating (training.distributed, "the order of the end"
    and "failing well")."""
    if not runtime.distributed:
        if owners is not None:
            owners.clear()  # loader workers end here too, as they would under a group
        return
    distributed.release_and_leave(owners if owners is not None else [], error=error, together=together)


def barrier(runtime: Runtime) -> None:
    if runtime.distributed:
        distributed.barrier()


# --- RNG state without pickle ------------------------------------------------------------


def capture_rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors for safetensors, JSON-able scalars) describing every global RNG."""
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{index}"] = state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["rng.numpy.keys"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    version, py_state, gauss = random.getstate()
    scalars = {
        "numpy": {
            "name": name,
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "python": {"version": version, "state": list(py_state), "gauss": gauss},
    }
    return tensors, scalars


def restore_rng_state(tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state` (CUDA states only when the device count matches)."""
    torch.set_rng_state(tensors["rng.torch"])
    cuda_states = [tensors[k] for k in sorted(tensors) if k.startswith("rng.cuda.")]
    if cuda_states and torch.cuda.is_available() and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda_states)
    numpy = scalars["numpy"]
    keys = tensors["rng.numpy.keys"].numpy().astype(np.uint32)
    np.random.set_state((numpy["name"], keys, numpy["pos"], numpy["has_gauss"], numpy["cached"]))
    python = scalars["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss"]))


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """Switch `module` to eval mode (and no grad) for the block, restoring its previous mode."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        module.train(was_training)


# --- resumable trainer state (safetensors + JSON, no pickle) --------------------------------

TRAINER_TENSORS = "trainer_state.safetensors"
TRAINER_JSON = "trainer_state.json"


def flatten_optimizer_state(
    state: dict[str, Any],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``optimizer.state_dict()`` into ``optim.{param}.{name}`` tensors and JSON scalars."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for param_id, entries in state["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{param_id}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(param_id), {})[name] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def unflatten_optimizer_state(
    tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> dict[str, Any]:
    """Inverse of :func:`flatten_optimizer_state` (ready for ``optimizer.load_state_dict``)."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, param_id, name = key.split(".", 2)
            state.setdefault(int(param_id), {})[name] = value
    for param_id, entries in meta["scalars"].items():
        state.setdefault(int(param_id), {}).update(entries)
    groups = [
        {k: tuple(v) if k == "betas" else v for k, v in group.items()}
        for group in meta["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def save_trainer_state(
    directory: Path, *, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> None:
    """Write the two trainer-state files into `directory`, each atomically (tmp + rename)."""
    from safetensors.torch import save_file

    tmp = directory / f".{TRAINER_TENSORS}.tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    tmp.replace(directory / TRAINER_TENSORS)
    tmp_json = directory / f".{TRAINER_JSON}.tmp"
    tmp_json.write_text(json.dumps(meta) + "\n", encoding="utf-8")
    tmp_json.replace(directory / TRAINER_JSON)


def load_trainer_state(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read what :func:`save_trainer_state` wrote; a clear error when it is missing."""
    from safetensors.torch import load_file

    tensors_path, json_path = directory / TRAINER_TENSORS, directory / TRAINER_JSON
    if not tensors_path.is_file() or not json_path.is_file():
        raise TonearmError(
            f"{directory} has no trainer state ({TRAINER_TENSORS}, {TRAINER_JSON}); cannot resume "
            "exactly — start a new run or set model.init_checkpoint to reuse the weights"
        )
    return load_file(str(tensors_path)), json.loads(json_path.read_text(encoding="utf-8"))
