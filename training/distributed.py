"""Every collective of the project lives here; objectives never import torch.distributed.

When the process group is not initialised each function is the identity, so the
same objective code runs on one CPU process and on many GPUs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def is_main_process() -> bool:
    return rank() == 0


def all_gather_with_grad(tensor: Tensor) -> Tensor:
    """Concatenate `tensor` from every rank along dim 0, keeping this rank's gradient path.

    Other ranks' slices are constants here; each rank back-propagates through its own
    slice (the open_clip ``gather_with_grad=False`` + local-loss convention).
    """
    if not is_distributed():
        return tensor
    gathered = [torch.zeros_like(tensor) for _ in range(world_size())]
    dist.all_gather(gathered, tensor.detach().contiguous())
    gathered[rank()] = tensor
    return torch.cat(gathered, dim=0)


def all_reduce_mean(tensor: Tensor) -> Tensor:
    """Mean of `tensor` over ranks (no gradient); identity on one process."""
    if not is_distributed():
        return tensor
    reduced = tensor.detach().clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    return reduced / world_size()
