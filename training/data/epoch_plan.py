"""How an epoch of ``data.shards`` is cut across ranks and loader workers (docs/training.md,
"Training on a large corpus"). Pure functions of counts and seeds: no I/O, no torch.

**The epoch's sequence.** The train shards are put in an order drawn from ``(seed, epoch)`` and
dealt into groups of :data:`MIX_SHARDS` consecutive ones; the epoch's sequence is every *usable*
sample (a clip with a caption in ``data.languages``, known from ``records.jsonl`` before any audio
is read) of the first group, then of the next, … — ``N`` positions ``(shard, ordinal in the
shard)``. Within a group the shards' samples are interleaved evenly, each shard's in its own order
(sample ``i`` of a shard of ``n`` sits at ``(i + ½) / n`` of the group's stretch), so any stretch of
the sequence — a loader worker's chunk, its shuffle buffer's window — draws from up to
:data:`MIX_SHARDS` shards at once, not one or two, while each shard is still read front to back
(with byte offsets: one range request per run of adjacent samples, training/data/stream.py).

**A segment** is the part of an epoch run under one layout ``(world, workers, batch, shuffle
buffer)``. A fresh
epoch is one segment over the whole sequence; a resume on another layout starts a new segment
over the positions the earlier segments did not serve (:func:`remaining`), so an epoch never
serves a clip twice whatever happened to the job.

**The cut** (:func:`segment_cut`) of ``n`` positions: each rank takes ``M = n // world``
consecutive ones (a rank batch of one clip is avoided: ``M`` drops by one when ``M % batch ==
1``), so every rank has the same number of batches — ``ceil(M / batch)``, the last one shorter —
and ranks stay in lockstep; at most ``2 × world - 1`` positions of a segment are left out.
The DataLoader yields a rank's batches round-robin from its workers, so batch ``t`` is worker
``t % workers``'s batch ``t // workers``; each worker's batches are one contiguous *chunk* of
the rank's range (it reads pieces of one or a few groups of interleaved shards, each shard front to
back).

**Draws** (:func:`draw_order`): a worker emits its chunk through a shuffle buffer of ``buffer``
entries that starts serving after one batch's worth and grows by one entry per draw up to
``buffer``; the order depends only on the chunk's length and the seed, never on the audio, so
a resume replays it without reading the samples already served (with the draws each worker took
in place of lost samples, recorded per segment: ``Segment.extra``).

**The reserve** (``Layout.reserve``, ``data.bad_sample_reserve``): ``floor(reserve × M)`` of a rank's
``M`` positions are not in its batches but at the end of the rank's range, **shared by all its
workers** (:meth:`SegmentCut.reserve_range`). A worker whose batch lost a sample fills it with its
next draw, so its *last* batch comes up short; the rank's main process tops every short batch up
from the rank's reserve, in batch order (deterministic: it depends only on which batches lost how
many), so one rank's bad samples cost no other rank a clip as long as the *rank's* losses fit its
reserve — not each worker's losses a worker's slice of it. What a segment took of it is recorded
per rank (``Segment.reserve_used``). A layout written before the reserve was shared
(``Layout.shared`` false: per-worker spares at the end of each worker's chunk) is still cut its way
to work out what its segments served.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def _seed(*parts: int) -> int:
    """A 64-bit seed from integers (the same derivation as training.data.dataset._rng_seed)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1, dtype=np.uint64)[0])


@dataclass(frozen=True)
class Layout:
    """What the cut of an epoch depends on besides the corpus and the seed."""

    world: int
    workers: int
    batch_size: int
    buffer: int = 1000
    """Shuffle-buffer entries of each worker (the draw order depends on it)."""
    reserve: float = 0.0
    """Fraction of each rank's positions kept as its workers' reserve (``data.bad_sample_reserve``):
    drawn only to fill a batch that lost a sample, so one rank's bad sample never holds the others back."""
    shared: bool = True
    """The reserve is the rank's, shared by its workers (module doc); false: a layout of a checkpoint
    written before, whose workers each had a slice of it at the end of their chunks."""

    def __post_init__(self) -> None:
        if not self.reserve and not self.shared:  # without a reserve both cuts are one: one layout
            object.__setattr__(self, "shared", True)

    @property
    def slots(self) -> int:
        return max(1, self.workers)


@dataclass(frozen=True)
class Segment:
    """A finished or interrupted part of an epoch: its layout and the batches each rank ran."""

    layout: Layout
    batches: int

    extra: tuple[tuple[int, ...], ...] = ()
    """Per rank, per worker: entries drawn beyond the batches' sizes (samples lost and replaced by the
    worker's next draws) by the segment's first ``batches`` batches; empty = none."""
    reserve_used: tuple[int, ...] = ()
    """Per rank: entries of the rank's shared reserve its first ``batches`` batches took (to fill the
    batches that came up short; a reserve entry that was itself bad counts too); empty = none."""

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"world": self.layout.world, "workers": self.layout.workers,
                               "batch_size": self.layout.batch_size, "shuffle_buffer": self.layout.buffer,
                               "batches": self.batches}
        if self.layout.reserve:
            obj["reserve"] = self.layout.reserve
            obj["reserve_shared"] = self.layout.shared
        if any(any(row) for row in self.extra):
            obj["extra_draws"] = [list(row) for row in self.extra]
        if any(self.reserve_used):
            obj["reserve_used"] = list(self.reserve_used)
        return obj

    @staticmethod
    def from_json(obj: dict[str, Any]) -> Segment:
        layout = Layout(int(obj["world"]), int(obj["workers"]), int(obj["batch_size"]), int(obj["shuffle_buffer"]),
                        float(obj.get("reserve", 0.0)), bool(obj.get("reserve_shared", False)))
        extra = tuple(tuple(int(x) for x in row) for row in obj.get("extra_draws", []))
        return Segment(layout, int(obj["batches"]), extra, tuple(int(x) for x in obj.get("reserve_used", [])))

    def extra_of(self, rank: int, worker: int) -> int:
        return self.extra[rank][worker] if rank < len(self.extra) and worker < len(self.extra[rank]) else 0

    def reserve_used_of(self, rank: int) -> int:
        return self.reserve_used[rank] if rank < len(self.reserve_used) else 0


MIX_SHARDS = 8
"""Shards whose samples the epoch's sequence interleaves (module doc)."""


def epoch_sequence(usable: Sequence[Sequence[int] | np.ndarray], *, seed: int, epoch: int,
                   mix: int = MIX_SHARDS) -> tuple[np.ndarray, np.ndarray]:
    """(shard number, ordinal in the shard) of each position of the epoch's sequence (module doc)."""
    order = list(range(len(usable)))
    random.Random(_seed(seed, epoch, 7)).shuffle(order)
    shard_parts, ordinal_parts = [], []
    for first in range(0, len(order), max(1, mix)):
        group = order[first:first + max(1, mix)]
        counts = np.array([len(usable[s]) for s in group], dtype=np.int64)
        shards = np.repeat(np.array(group, dtype=np.int64), counts)
        ordinals = (np.concatenate([np.asarray(usable[s], dtype=np.int64) for s in group]) if group
                    else np.zeros(0, dtype=np.int64))
        place = np.concatenate([(np.arange(n) + 0.5) / n for n in counts]) if counts.sum() else np.zeros(0)
        turn = np.argsort(place, kind="stable")  # ties: the group's order
        shard_parts.append(shards[turn])
        ordinal_parts.append(ordinals[turn])
    if not shard_parts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(shard_parts), np.concatenate(ordinal_parts)


@dataclass(frozen=True)
class WorkerChunk:
    """One loader worker's share of a segment: positions ``[start, stop)`` of the segment's
    remaining sequence and the sizes of its batches, in the order it yields them."""

    start: int
    stop: int
    sizes: tuple[int, ...]
    reserve: int = 0
    """Entries of ``[start, stop)`` beyond ``sum(sizes)``: drawn only in place of lost samples."""


@dataclass(frozen=True)
class SegmentCut:
    per_rank: int
    """Positions each rank takes (``M``: its batches' clips and its reserve)."""
    steps: int
    """Batches per rank."""
    ranks: tuple[tuple[WorkerChunk, ...], ...]

    reserve: int = 0
    """Of ``per_rank``, the positions held in reserve (all workers of a rank together)."""
    shared: bool = True
    """The reserve is the rank's (``Layout.shared``), not slices of its workers' chunks."""

    @property
    def in_batches(self) -> int:
        """Positions each rank's batches serve when no sample is lost."""
        return self.per_rank - self.reserve

    def reserve_range(self, rank: int) -> range:
        """Positions of ``rank``'s shared reserve: the end of its range, after its workers' chunks."""
        if not self.shared:
            return range(0)
        end = (rank + 1) * self.per_rank
        return range(end - self.reserve, end)

    def batch_size(self, step: int) -> int:
        """The planned clips of a rank's batch ``step`` (the same on every rank)."""
        slots = len(self.ranks[0]) if self.ranks else 1
        return self.ranks[0][step % slots].sizes[step // slots]

    def left_out(self, n: int) -> int:
        return n - self.per_rank * len(self.ranks)


def segment_cut(n: int, layout: Layout) -> SegmentCut:
    """The cut of ``n`` positions (module doc): ``floor(reserve × M)`` of a rank's ``M`` positions are
    its workers' shared reserve at the end of its range (``Layout.shared``; before: split as evenly as
    the workers, each slice at the end of a worker's chunk), the rest its batches."""
    world, slots, batch = layout.world, layout.slots, layout.batch_size
    per_rank = n // world
    reserve = int(layout.reserve * per_rank)
    served = per_rank - reserve
    if served % batch == 1:  # no batch of one clip (no negatives)
        served -= 1
        per_rank -= 1
    steps = -(-served // batch) if served >= 2 else 0
    if steps == 0:
        per_rank, reserve = 0, 0
    sizes = [batch] * steps
    if steps:
        sizes[-1] = served - batch * (steps - 1)
    ranks = []
    for rank in range(world):
        start, chunks = rank * per_rank, []
        for worker in range(slots):
            mine = tuple(sizes[worker::slots])
            spare = 0 if layout.shared else reserve // slots + (worker < reserve % slots)
            chunks.append(WorkerChunk(start, start + sum(mine) + spare, mine, spare))
            start += sum(mine) + spare
        ranks.append(tuple(chunks))
    return SegmentCut(per_rank, steps, tuple(ranks), reserve, layout.shared)


def draw_order(length: int, *, buffer: int, first: int, seed: int) -> list[int]:
    """The order in which a worker emits the ``length`` entries of its chunk (module doc): the
    buffer is filled to ``first`` entries before the first draw and grows by one per draw up to
    ``buffer``; each draw takes a uniformly random entry of it."""
    rng = random.Random(seed)
    pool: list[int] = []
    read, out = 0, []
    for drawn in range(length):
        target = min(length, drawn + min(max(1, buffer), max(1, first) + drawn))
        while read < target:
            pool.append(read)
            read += 1
        pick = rng.randrange(len(pool))
        pool[pick], pool[-1] = pool[-1], pool[pick]
        out.append(pool.pop())
    return out


def slot_seed(seed: int, epoch: int, segment: int, rank: int, worker: int) -> int:
    return _seed(seed, epoch, segment, rank, worker, 3)


def served_in_segment(cut: SegmentCut, layout: Layout, batches: int, *, seed: int, epoch: int,
                      segment: int, extra: Segment | None = None) -> np.ndarray:
    """Positions (of the segment's remaining sequence) served by the first ``batches`` batches of
    every rank: the samples drawn for them, served or found undecodable (with ``extra``'s draws
    beyond the batches' sizes — the workers' next draws in place of lost samples — and the entries
    of each rank's shared reserve its batches took)."""
    served = []
    for rank, chunks in enumerate(cut.ranks):
        for worker, chunk in enumerate(chunks):
            done = len(range(worker, min(batches, cut.steps), layout.slots))
            if done == 0:
                continue
            order = draw_order(chunk.stop - chunk.start, buffer=layout.buffer, first=layout.batch_size,
                               seed=slot_seed(seed, epoch, segment, rank, worker))
            drawn = sum(chunk.sizes[:done]) + (extra.extra_of(rank, worker) if extra is not None else 0)
            served.append(chunk.start + np.asarray(order[:drawn], dtype=np.int64))
        used = extra.reserve_used_of(rank) if extra is not None else 0
        if used:  # the rank's shared reserve, taken in order
            reserve = cut.reserve_range(rank)
            served.append(np.arange(reserve.start, reserve.start + min(used, len(reserve)), dtype=np.int64))
    return np.concatenate(served) if served else np.zeros(0, dtype=np.int64)


def remaining(total: int, segments: Sequence[Segment], *, seed: int, epoch: int) -> np.ndarray:
    """Positions of the epoch's sequence (0 … total-1) that ``segments`` did not serve, in order."""
    left = np.arange(total, dtype=np.int64)
    for number, segment in enumerate(segments):
        cut = segment_cut(len(left), segment.layout)
        served = served_in_segment(cut, segment.layout, segment.batches, seed=seed, epoch=epoch, segment=number,
                                   extra=segment)
        keep = np.ones(len(left), dtype=bool)
        keep[served] = False
        left = left[keep]
    return left


@dataclass(frozen=True)
class Coverage:
    """What one full epoch of a layout serves (printed at the start of a run)."""

    clips: int
    """Clips in the train split."""
    usable: int
    """Of which have a caption in ``data.languages``."""
    served: int
    steps: int
    left_out: int
    """Usable clips a full epoch does not serve: the cut's tail and the ranks' reserve."""
    reserve: int = 0
    """Of ``left_out``, the reserve of every rank (drawn only in place of lost samples)."""

    @property
    def fraction(self) -> float:
        return self.served / self.usable if self.usable else 0.0

    def line(self, layout: Layout) -> str:
        return (f"epoch plan: {self.served} of {self.usable} usable clips an epoch ({100 * self.fraction:.2f} %; "
                f"{self.left_out} left out by the cut ({self.reserve} of them the ranks' reserve for lost samples, "
                f"data.bad_sample_reserve), {self.clips - self.usable} without a caption in "
                f"data.languages), {layout.world} rank(s) × {layout.slots} loader worker(s), {self.steps} steps of "
                f"{layout.batch_size} clips per rank")


def coverage(usable: int, clips: int, layout: Layout) -> Coverage:
    cut = segment_cut(usable, layout)
    served = cut.in_batches * layout.world
    return Coverage(clips=clips, usable=usable, served=served, steps=cut.steps, left_out=usable - served,
                    reserve=cut.reserve * layout.world)


@dataclass(frozen=True)
class LossOutcome:
    """What an epoch serves when some positions cannot be used (:func:`simulate_losses`)."""

    served: list[int]
    """Positions trained, every rank's, in step order."""
    held_back: int
    """Clips ranks drew but did not train so that every rank trains the smallest batch of a step."""
    held_back_worst_rank: int
    reserve_drawn: int
    """Entries of the ranks' reserves taken to fill short batches."""


def simulate_losses(usable: int, layout: Layout, bad: set[int] | frozenset[int], *, seed: int = 0,
                    epoch: int = 0) -> LossOutcome:
    """An epoch of ``usable`` positions at ``layout`` where the positions ``bad`` cannot be used, without
    audio: every (rank, worker) draws as the stream does (a lost sample replaced by the worker's next
    draw), each rank tops its short batches up from its shared reserve in batch order
    (training/data/stream.py ``StreamBatches``; a layout with ``shared`` false: each worker draws on into
    its own slice instead), then the loop's lockstep (every rank trains the smallest batch of a step, a
    step where some rank has fewer than 2 clips is skipped). What docs/BENCHMARKS.md
    ``bad_sample_coverage`` computes at 400 k clips and the tests check against the real stream."""
    cut = segment_cut(usable, layout)
    per_rank: list[list[list[int]]] = []
    drawn_reserve = 0
    for rank, chunks in enumerate(cut.ranks):
        by_worker = []
        for worker, chunk in enumerate(chunks):
            order = draw_order(chunk.stop - chunk.start, buffer=layout.buffer, first=layout.batch_size,
                               seed=slot_seed(seed, epoch, 0, rank, worker))
            draw, batches = 0, []
            for size in chunk.sizes:
                rows: list[int] = []
                while len(rows) < size and draw < len(order):
                    position = chunk.start + order[draw]
                    draw += 1
                    if position not in bad:
                        rows.append(position)
                batches.append(rows)
            by_worker.append(batches)
        steps = [by_worker[t % layout.slots][t // layout.slots] for t in range(cut.steps)]
        reserve = iter(cut.reserve_range(rank))
        for t, batch in enumerate(steps):  # the rank's top-up, in batch order
            while len(batch) < cut.batch_size(t):
                spare = next(reserve, None)
                if spare is None:
                    break
                drawn_reserve += 1
                if spare not in bad:
                    batch.append(spare)
        per_rank.append(steps)
    served: list[int] = []
    held = [0] * len(per_rank)
    for t in range(cut.steps):
        agreed = min(len(steps[t]) for steps in per_rank)
        take = agreed if agreed >= 2 else 0
        for rank, steps in enumerate(per_rank):
            served += steps[t][:take]
            held[rank] += len(steps[t]) - take
    return LossOutcome(served, sum(held), max(held, default=0), drawn_reserve)
