"""Epoch order that does not depend on the world size, and resuming on another one.

Every epoch has one **global order**: ``torch.randperm(clips)`` seeded with
``seed + epoch`` (the order ``DistributedSampler`` draws). A run at any world size
``W`` reads it front to back, one global batch of ``W × optim.batch_size`` clips
per optimizer step; rank ``r`` takes every ``W``-th clip of what remains, starting
at ``r`` (``DistributedSampler``'s interleave, so a fresh epoch gives exactly the
batches it always gave). A checkpoint records how many clips of the global order
the epoch has consumed (``samples_in_epoch``), so a resume on ``W'`` processes
continues with exactly the clips not yet seen, in the same order, split ``W'``
ways. The tail of fewer than ``W'`` clips is skipped, as a fresh epoch skips it.

What changes with the world size (docs/training.md, "Resume and elastic world
size"): the global batch (``optim.batch_size`` is per rank), hence the steps per
epoch and the total steps the learning-rate schedule spans (the step counter
continues; the schedule is re-evaluated at that step over the new total), and the
per-rank RNG streams: ranks that existed keep their saved state, new ranks are
re-seeded from ``(seed, step, rank)``. Crops and caption picks are seeded by
``(seed, epoch, clip)`` and so do not change.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler, Sampler

log = logging.getLogger(__name__)


def epoch_order(clips: int, *, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The epoch's global clip order (the same for every world size)."""
    if not shuffle:
        return list(range(clips))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(clips, generator=generator).tolist()


def rank_share(order: list[int], *, offset: int, rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s clips of ``order[offset:]``: every ``world_size``-th, tail dropped."""
    remaining = order[offset:]
    usable = len(remaining) // world_size * world_size
    return remaining[rank:usable:world_size]


class EpochBatches(Sampler[list[tuple[int, int]]]):
    """Batches of this rank's share of a shuffled epoch, as ``(epoch, clip index)`` keys
    (the epoch reaches persistent loader workers with each item).

    Takes the world size, rank, seed and dataset from a ``DistributedSampler``; the
    order is :func:`epoch_order`, so it continues across world sizes. A trailing batch
    of one clip is dropped (no negatives). :meth:`set_epoch` starts at a position in
    the epoch: ``samples_in_epoch`` clips of the global order (any world size), or
    ``skip`` batches of this world size (the same position when it did not change).
    """

    def __init__(self, sampler: DistributedSampler, batch_size: int) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.clips = len(sampler.dataset)  # type: ignore[arg-type]
        self.world_size = int(sampler.num_replicas)
        self.rank = int(sampler.rank)
        self.epoch = 0
        self.offset = 0
        self._plan: list[list[tuple[int, int]]] = []
        self._plan_for: tuple[int, int] | None = None

    def set_epoch(self, epoch: int, *, skip: int = 0, samples_in_epoch: int | None = None) -> None:
        self.sampler.set_epoch(epoch)
        self.epoch = epoch
        offset = skip * self.batch_size * self.world_size if samples_in_epoch is None else samples_in_epoch
        self.offset = min(max(0, offset), self.clips)

    def plan(self) -> list[list[tuple[int, int]]]:
        """This rank's batches from the current position to the epoch's end."""
        if self._plan_for != (self.epoch, self.offset):
            order = epoch_order(
                self.clips, seed=self.sampler.seed, epoch=self.epoch, shuffle=self.sampler.shuffle
            )
            mine = rank_share(order, offset=self.offset, rank=self.rank, world_size=self.world_size)
            keys = [(self.epoch, index) for index in mine]
            batches = [keys[i : i + self.batch_size] for i in range(0, len(keys), self.batch_size)]
            self._plan = batches[:-1] if batches and len(batches[-1]) < 2 else batches
            self._plan_for = (self.epoch, self.offset)
        return self._plan

    def batches_before(self) -> int:
        """Batches of a full epoch (at this world size) that the current position has passed."""
        return len(self) - len(self.plan())

    def samples_consumed(self, batch_in_epoch: int) -> int:
        """Clips of the global order consumed once ``batch_in_epoch`` batches of the epoch ran."""
        done = max(0, batch_in_epoch - self.batches_before())
        if done >= len(self.plan()):
            return self.clips  # the epoch is over (its tail, if any, is skipped)
        return self.offset + self.world_size * sum(len(batch) for batch in self.plan()[:done])

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        yield from self.plan()

    def __len__(self) -> int:
        full, rest = divmod(self.clips // self.world_size, self.batch_size)
        return full + (1 if rest >= 2 else 0)


def resumed_rng_state(
    tensors: dict[str, torch.Tensor],
    scalars: dict[str, Any],
    *,
    saved_world: int,
    rank: int,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """This rank's saved RNG state, or ``None`` when the saving run had no such rank."""
    if rank == 0:
        return tensors, scalars
    if rank >= saved_world:
        return None
    prefix = f"rank{rank}/"
    own = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    return own, scalars["ranks"][str(rank)]


def rederived_seed(seed: int, *, step: int, rank: int) -> int:
    """Seed for a rank the checkpoint has no RNG state for (resume on more processes)."""
    return (seed * 1_000_003 + step * 7919 + rank) % 2**63
