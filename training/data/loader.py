"""Loader settings from the machine, and the budget of undecodable training clips (SPEC §13).

``data.num_workers: auto`` (the default) gives each rank the cores it can use (affinity
capped by the cgroup quota, :func:`index.cpus.available_cores`) divided among the ranks
of the node, less one for the rank's own process, which feeds the accelerator (or, on a
CPU, computes the step). Workers persist across epochs and prefetch
``data.prefetch_factor`` batches each; batches are pinned on CUDA.

A clip that cannot be decoded is replaced in its batch (:class:`TrainClipDataset`; from
``data.shards`` it is left out instead, training/data/stream.py); the
loop hands the errors to :class:`BadSampleBudget`, which names the first ones, counts
them into the epoch records and stops the run in one line when more distinct clips than
``data.max_bad_fraction`` of this rank's share have failed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any, Literal

from index.cpus import available_cores
from index.errors import DataError

log = logging.getLogger(__name__)

NAMED_BAD_SAMPLES = 10
"""How many undecodable clips are named in the log (all are counted)."""


def local_world_size() -> int:
    """Ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``; 1 outside torchrun)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def loader_workers(setting: int | Literal["auto"], *, ranks_on_node: int | None = None) -> int:
    """Worker processes per rank: ``setting`` itself, or for ``auto`` the usable cores per rank
    less the rank's own process (at least 1)."""
    if setting != "auto":
        return int(setting)
    per_rank = available_cores() // (ranks_on_node or local_world_size())
    return max(1, per_rank - 1)


def loader_options(
    num_workers: int | Literal["auto"], *, prefetch_factor: int, persistent: bool, cuda: bool
) -> dict[str, Any]:
    """Keyword arguments of the training ``DataLoader`` (workers, persistence, prefetch, pinning)."""
    workers = loader_workers(num_workers)
    options: dict[str, Any] = {"num_workers": workers, "pin_memory": cuda}
    if workers > 0:  # torch refuses both options without workers
        options.update(persistent_workers=persistent, prefetch_factor=prefetch_factor)
    return options


class BadSampleBudget:
    """Distinct undecodable clips seen by this rank, against ``data.max_bad_fraction``."""

    def __init__(self, *, max_fraction: float, clips: int, replaced: bool = True) -> None:
        self.max_fraction = max_fraction
        self.fate = "replaced in its batch" if replaced else "left out of its batch"
        self.clips = clips
        self.allowed = int(max_fraction * clips)
        self.seen: dict[str, None] = {}  # insertion-ordered set of error messages

    def add(self, errors: Iterable[str]) -> None:
        """Count these decode errors; raise :class:`DataError` once past the budget."""
        for error in errors:
            if error in self.seen:
                continue
            self.seen[error] = None
            if len(self.seen) <= NAMED_BAD_SAMPLES:
                log.warning("skipped an undecodable clip (%s): %s", self.fate, error)
            elif len(self.seen) == NAMED_BAD_SAMPLES + 1:
                log.warning("more undecodable clips: counted in metrics.jsonl (bad_samples), no longer named")
        if len(self.seen) > self.allowed:
            first = next(iter(self.seen))
            raise DataError(
                f"{len(self.seen)} of {self.clips} clips on this rank could not be decoded, more than "
                f"data.max_bad_fraction={self.max_fraction:g} allows ({self.allowed}); first: {first}"
            )

    @property
    def count(self) -> int:
        return len(self.seen)

    def gather_state(self) -> dict[str, Any]:
        """Every rank's errors (one gather; every rank calls it), for rank 0 to checkpoint."""
        from training import distributed

        return {"max_fraction": self.max_fraction, "per_rank": distributed.gather_objects(list(self.seen))}

    def restore_state(self, state: dict[str, Any] | None, *, rank: int, world: int) -> None:
        """Take up a checkpoint's errors (:meth:`gather_state`): each rank its own on the same world size;
        on another, the run's distinct errors dealt round-robin over the ranks (every one counted once).
        The allowance stays this run's (``data.max_bad_fraction`` of this rank's clips)."""
        if not state:
            return
        per_rank = [list(errors) for errors in state.get("per_rank", [])]
        if len(per_rank) == world:
            mine = per_rank[rank]
        else:
            every = list(dict.fromkeys(error for errors in per_rank for error in errors))
            mine = every[rank::world]
        self.seen = dict.fromkeys(mine)
        if mine:
            log.info("resume: %d bad sample(s) already met on this rank count against data.max_bad_fraction "
                     "(%d allowed)", len(mine), self.allowed)

    def first(self, n: int = NAMED_BAD_SAMPLES) -> list[str]:
        """The first ``n`` errors, in the order they were met."""
        return list(self.seen)[:n]


SHUFFLE_MEMORY_SHARE = 0.2
"""Share of the node's memory the shuffle buffers of all its loader workers take by default."""
MAX_SHUFFLE_ENTRIES = 1000
MIN_SHUFFLE_ENTRIES = 16


def node_memory() -> int:
    """Bytes of memory this node gives the job: the cgroup's limit (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``) where set, else the physical memory."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as handle:
                text = handle.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < physical:
            return int(text)
    return int(physical)


def shuffle_entries(setting: int | Literal["auto"], budget: int | None, *, entry_bytes: int, workers: int,
                    ranks_on_node: int | None = None) -> tuple[int, int]:
    """(entries, bytes) of each loader worker's shuffle buffer: ``setting`` itself, or for ``auto``
    what ``budget`` bytes hold (default: :data:`SHUFFLE_MEMORY_SHARE` of :func:`node_memory` over
    every loader worker of the node), between :data:`MIN_SHUFFLE_ENTRIES` and :data:`MAX_SHUFFLE_ENTRIES`."""
    if setting != "auto":
        return int(setting), int(setting) * entry_bytes
    if budget is None:
        processes = max(1, workers) * (ranks_on_node or local_world_size())
        budget = int(node_memory() * SHUFFLE_MEMORY_SHARE) // processes
    entries = max(MIN_SHUFFLE_ENTRIES, min(MAX_SHUFFLE_ENTRIES, budget // max(1, entry_bytes)))
    return entries, entries * entry_bytes
