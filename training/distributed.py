"""Every collective of the project lives here; objectives and the loop never import torch.distributed.

When no process group is initialised each function is the identity (or a plain local
computation), so the same code trains on one CPU process and on many GPUs.

How a global batch is formed (docs/training.md, "Distributed"): each rank embeds its own
shard of the batch; :func:`gather_embedding_batch` concatenates every rank's embeddings
(rank order) so that the objective sees the global batch. Two gradient conventions:

* ``global`` (default, every objective): every rank computes the loss of the whole global
  batch, identical on all ranks. The gather keeps only the local slice's gradient (the
  other ranks' slices are constants here: open_clip's ``gather_with_grad=False``) and
  multiplies it by the world size, so that DDP's *mean* of the parameter gradients equals
  the gradient of the 1-process loss on the concatenated batch. Logits are B_global².
* ``local`` (InfoNCE and SigLIP bases only): each rank scores only its own rows against the
  global batch (B_local × B_global logits, open_clip's ``local_loss=True``). A rank's loss
  then depends on other ranks' embeddings, so the gather sends gradients back
  (backward = all-reduce of the gathered gradient, then this rank's slice:
  ``gather_with_grad=True``); losses are scaled so that their mean over ranks is the
  1-process loss. Objectives whose loss couples all rows (Sinkhorn plans, column
  statistics) cannot be split by rows and refuse this mode (:func:`check_local_loss`).
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import logging
import os
import pickle
import time
import traceback
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from index.errors import DataError, TonearmError
from training.config import ConfigError

log = logging.getLogger(__name__)

LossMode = Literal["global", "local"]
T = TypeVar("T")


# --- process group ------------------------------------------------------------------------


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def launched_world_size() -> int:
    """``WORLD_SIZE`` set by torchrun (1 when launched as a plain process)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes; ``TONEARM_DIST_BACKEND`` overrides.

    The override takes torch's ``device:backend`` form too: ``cuda:gloo`` gives a group
    whose only backend is for CUDA tensors (as NCCL's), so any host tensor handed to a
    collective fails as it would under NCCL — without NCCL (docs/training.md).
    """
    return os.environ.get(BACKEND_ENV) or ("nccl" if device.type == "cuda" else "gloo")


def init_process_group(device: torch.device, *, timeout_s: float) -> int:
    """Join the torchrun process group (env:// rendezvous); returns this process's rank.

    `device` becomes the group's device (:func:`group_device`): every tensor a collective
    sends lives there. A rendezvous that does not complete within ``timeout_s`` (a peer
    never started, a previous run still holds ``MASTER_PORT``, nodes disagree on
    ``--nnodes``) fails with one clear line instead of hanging.
    """
    global _GROUP_DEVICE
    if is_distributed():
        return dist.get_rank()
    address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    rank_env, size = os.environ.get("RANK", "?"), launched_world_size()
    extra: dict[str, Any] = {}
    if size == 1 and "MASTER_ADDR" not in os.environ:  # one plain process (a forced group): a private store
        address = f"127.0.0.1:{_free_port()}"
        extra = {"init_method": f"tcp://{address}", "rank": 0, "world_size": 1}
    try:
        dist.init_process_group(backend=backend_for(device), timeout=timedelta(seconds=timeout_s), **extra)
    except (RuntimeError, ValueError, OSError) as err:  # DistStoreError/DistNetworkError are RuntimeErrors
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TonearmError(
            f"distributed rendezvous at {address} failed for rank {rank_env} of {size} within "
            f"{timeout_s:.0f} s (distributed.timeout_s): {first_line} — a stale run may hold the port "
            "or a peer did not start; check that no old tonearm/torchrun processes remain, that every "
            "node runs the same command with the same --nnodes/--rdzv-id, or use another port"
        ) from err
    _GROUP_DEVICE = device
    if dist.get_world_size() > 1:
        PeerWatch.start(dist.get_rank(), dist.get_world_size())
    return dist.get_rank()


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# --- the group's device and the collective boundary ------------------------------------------
#
# NCCL communicates CUDA tensors only: a host tensor handed to any collective fails
# ("No backend type associated with device type cpu"). Every collective of the project
# therefore passes :func:`_send`, which places its tensors on :func:`group_device` — the
# training device given to :func:`init_process_group` — and, with the check on
# (``TONEARM_CHECK_COLLECTIVES=1`` or :func:`check_collectives`), refuses any tensor that is
# not there. While checking, the body of every collective helper runs with ``meta`` as
# torch's default device, so a helper that builds a tensor without naming the group's
# device (``torch.tensor([...])``, a host tensor under NCCL) hands a ``meta`` tensor to the
# boundary and fails *on a CPU machine too* (tests/training/test_collective_devices.py).

BACKEND_ENV = "TONEARM_DIST_BACKEND"
CHECK_ENV = "TONEARM_CHECK_COLLECTIVES"
_GROUP_DEVICE: torch.device | None = None
_CHECK: bool | None = None
_SENT: Counter[str] = Counter()


class CollectiveDeviceError(TonearmError, RuntimeError):
    """A tensor handed to a collective is not on the process group's device."""


def group_device() -> torch.device:
    """Where this process group's collectives run: the device given to :func:`init_process_group`
    (a group made elsewhere: the current CUDA device under NCCL, else the CPU)."""
    if _GROUP_DEVICE is not None:
        return _GROUP_DEVICE
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_collectives(enabled: bool | None) -> None:
    """Turn the device check on or off (None: follow ``TONEARM_CHECK_COLLECTIVES``); resets the counts."""
    global _CHECK
    _CHECK = enabled
    _SENT.clear()


def _checking() -> bool:
    return _CHECK if _CHECK is not None else os.environ.get(CHECK_ENV, "") not in ("", "0")


def collectives_sent() -> dict[str, int]:
    """Tensors that passed the boundary while checking, by collective (what a test asserts was covered)."""
    return dict(_SENT)


@contextlib.contextmanager
def _helper_scope() -> Iterator[None]:
    """While checking: tensors built without an explicit device land on ``meta`` (module note)."""
    if not _checking():
        yield
        return
    with torch.device("meta"):
        yield


def _send(name: str, *tensors: Tensor) -> None:
    """The boundary: every tensor a collective sends or receives into must be on the group's device."""
    if not _checking():
        return
    expected = group_device()
    for tensor in tensors:
        if tensor.device != expected:
            raise CollectiveDeviceError(
                f"{name}: a tensor on {tensor.device} was handed to a collective of a group on "
                f"{expected}; NCCL would fail here (build it with device=distributed.group_device())"
            )
        _SENT[name] += 1


def _to_group(tensor: Tensor) -> Tensor:
    """`tensor` on the group's device (no copy when it is already there).

    A caller's tensor on another device is moved (a CPU tensor reaches NCCL from the GPU);
    while checking, a ``meta`` tensor — one a helper built without naming the group's
    device — is refused here, before any copy.
    """
    if tensor.device.type == "meta" and _checking():
        _send("to_group", tensor)
    device = group_device()
    return tensor.to(device, non_blocking=device.type == "cuda")  # host → GPU only: safe to overlap


def _barrier_kwargs() -> dict[str, Any]:
    """NCCL's barrier on this rank's GPU (without it NCCL guesses the device and warns)."""
    device = group_device()
    nccl = is_distributed() and dist.get_backend() == "nccl"
    return {"device_ids": [device.index]} if nccl and device.type == "cuda" and device.index is not None else {}


def destroy_process_group() -> None:
    """Leave the group on the way every rank takes: a barrier first, so no rank tears down while
    a peer still sends. After an error use :func:`leave_after_error` instead (no barrier).
    Free what holds the group first: :func:`release_and_leave`."""
    global _GROUP_DEVICE
    if is_distributed():
        dist.barrier(**_barrier_kwargs())
        PeerWatch.leave("ended with the others")
        dist.destroy_process_group()
    _GROUP_DEVICE = None


# --- the order of the end -------------------------------------------------------------------
#
# DDP's C++ Reducer holds a reference to the process group. When the Reducer is the last owner
# and dies *after* ``destroy_process_group`` (a ``Run`` still alive in ``train()``'s frame, freed
# when the function returns), the group's destructor runs on the main thread with the GIL held
# and joins gloo's worker threads — one of which may still be releasing the barrier's work and
# needs the GIL: a deadlock (pytorch#56297; py-spy: ``~ProcessGroupGloo`` ← ``~Reducer`` on the
# main thread, ``gil_scoped_acquire`` ← ``~AsyncBarrierWork`` on the gloo thread). So the run —
# DDP model, optimizer, loaders and their persistent workers — is freed and collected *before*
# the barrier and the destroy, on every path (tests/training/test_teardown.py).


def release_and_leave(
    owners: list[Any], *, error: BaseException | None = None, together: bool | None = None
) -> None:
    """End a run in the one safe order: free ``owners`` (the run objects: DDP model, optimizer,
    loaders; the caller holds them only through this list), drop the locals of the finished frames
    of ``error``'s traceback (which hold the run too), collect, then leave the group — after a
    barrier when every rank ends alike (``together``; default: no ``error``; an interruption
    every rank agreed on is together), at once after an error (:func:`leave_after_error`)."""
    owners.clear()
    if error is not None:
        traceback.clear_frames(error.__traceback__)
    gc.collect()
    if is_distributed() and log.isEnabledFor(logging.DEBUG):
        alive = live_ddp_modules()
        if alive:
            log.debug("%d DDP module(s) still alive when leaving the process group", alive)
    if (error is None) if together is None else together:
        destroy_process_group()
    else:
        leave_after_error(error if error is not None else RuntimeError("the run ended on this rank alone"))


def live_ddp_modules() -> int:
    """DistributedDataParallel modules alive in this process (what :func:`release_and_leave` frees)."""
    from torch.nn.parallel import DistributedDataParallel

    return sum(isinstance(obj, DistributedDataParallel) for obj in gc.get_objects())


# --- failing well ---------------------------------------------------------------------------
#
# A rank that raises must end the job in seconds, with its own error (docs/training.md,
# "Training on a large corpus"). Its peers are then blocked in the next collective: a barrier
# on this rank's way out would be a collective they never join, so the job would hang until
# ``distributed.timeout_s`` and the barrier's timeout would replace the rank's error. Instead
# the failing rank leaves the group at once and its process exits non-zero; torchrun's agent
# (or ``torch.multiprocessing.spawn``) then stops the other ranks. Under gloo a peer blocked in
# a collective also fails by itself as soon as the connection closes ("Connection closed by
# peer"); such a rank says that another rank failed first and lingers a few seconds before it
# exits, so that the launcher observes the rank that caused the failure first and names it as
# the root cause (it is stopped by the launcher meanwhile).

PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")
"""Texts of a collective that failed because another rank left (gloo and NCCL)."""
PEER_GRACE_S = 3.0
"""How long a rank whose collective failed because of a peer waits before it exits."""
LOADER_KILLED = ("DataLoader worker (pid", "killed by signal")
"""The text of a loader worker killed by a signal (torch's SIGCHLD handler). Under torchrun it is what a
survivor meets when a peer is lost: the launcher stops the survivor's whole process group with SIGTERM,
the loader workers die of it at once while the main process only notes the stop request — so the
survivor's error used to name its own loader worker, not the peer."""


def caused_by_a_peer(err: BaseException) -> bool:
    """Whether ``err`` is a collective that failed because another rank left, not this rank's own error."""
    text = str(err)
    return isinstance(err, RuntimeError) and any(mark in text for mark in PEER_GONE)


def loader_worker_killed(err: BaseException) -> bool:
    """Whether ``err`` is a DataLoader worker killed by a signal (:data:`LOADER_KILLED`)."""
    text = str(err)
    return isinstance(err, RuntimeError) and all(mark in text for mark in LOADER_KILLED)


class PeerWatch:
    """Which peer was lost, for the error a survivor prints (docs/training.md, "When a rank fails").

    Every rank of a group of more than one writes ``who/RANK`` (host, pid) once into the rendezvous
    store (``MASTER_ADDR:MASTER_PORT``: torchrun's agent store, or rank 0's for a plain env://
    group) and, from a daemon thread, adds 1 to ``beat/RANK`` every :data:`BEAT_S` seconds; a rank
    that leaves the group — with an error of its own, or at the end with the others — writes
    ``left/RANK`` first. A peer killed without a word (SIGKILL, the out-of-memory killer, a lost
    node) does neither: when a rank's collective or loader fails in a way a lost peer causes,
    :meth:`lost` reads the beats twice, :data:`DETECT_S` apart, and names the ranks whose beats
    stopped and who did not say they left. One small store write per rank every half second.
    """

    BEAT_S = 0.5
    DETECT_S = 2.0
    _store: Any = None
    _rank = -1
    _world = 0
    _stop: Any = None

    @classmethod
    def _prefix(cls) -> str:  # a torchrun restart reuses the agent's store: keep each attempt's keys apart
        return f"tonearm/peers/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"

    @classmethod
    def _connect(cls) -> Any:
        address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not address or not port:
            return None
        return dist.TCPStore(address, int(port), is_master=False, timeout=timedelta(seconds=5),
                             wait_for_workers=False)

    @classmethod
    def start(cls, rank: int, world: int) -> None:
        """Register this rank and start its beats (a no-op where no store can be reached)."""
        import socket
        import threading

        cls.stop()
        try:
            store = cls._connect()
            if store is None:
                return
            store.set(f"{cls._prefix()}who/{rank}", f"{socket.gethostname()} pid {os.getpid()}")
        except Exception as err:  # noqa: BLE001 - the watch only names a lost peer; training goes on without it
            log.debug("no peer watch: %s", err)
            return
        cls._store, cls._rank, cls._world = store, rank, world
        stop = threading.Event()
        cls._stop = stop
        key = f"{cls._prefix()}beat/{rank}"

        def beat() -> None:
            while not stop.wait(cls.BEAT_S):
                try:
                    store.add(key, 1)
                except Exception:  # noqa: BLE001 - the store is gone: nothing left to tell
                    return

        store.add(key, 1)
        threading.Thread(target=beat, name="tonearm-peer-watch", daemon=True).start()

    @classmethod
    def stop(cls) -> None:
        if cls._stop is not None:
            cls._stop.set()
        cls._stop = None

    @classmethod
    def leave(cls, why: str) -> None:
        """Say this rank leaves on purpose (``why``: its own error, or the end) before it stops beating."""
        if cls._store is None:
            return
        try:
            cls._store.set(f"{cls._prefix()}left/{cls._rank}", why[:300])
        except Exception as err:  # noqa: BLE001
            log.debug("peer watch: %s", err)
        cls.stop()

    @classmethod
    def lost(cls, *, wait: float | None = None, sleep: Any = time.sleep) -> list[str] | None:
        """The peers lost without a word, each as ``rank R (HOST pid P)``; ``None`` when the store cannot
        be read (it lived in the lost process: rank 0's store outside torchrun)."""
        if cls._store is None:
            return []
        prefix = cls._prefix()
        peers = [r for r in range(cls._world) if r != cls._rank]
        try:
            before = [cls._store.add(f"{prefix}beat/{r}", 0) for r in peers]
            sleep(cls.DETECT_S if wait is None else wait)
            after = [cls._store.add(f"{prefix}beat/{r}", 0) for r in peers]
            stopped = [r for r, a, b in zip(peers, before, after, strict=True) if a == b]
            said = {r for r in stopped if cls._store.check([f"{prefix}left/{r}"])}
            names = []
            for r in stopped:
                if r in said:
                    continue
                who = cls._store.get(f"{prefix}who/{r}").decode() if cls._store.check([f"{prefix}who/{r}"]) else "?"
                names.append(f"rank {r} ({who})")
            return names
        except Exception as err:  # noqa: BLE001 - the store went with the lost process
            log.debug("peer watch: the store cannot be read: %s", err)
            return None


def lost_peer_message(rank_: int, size: int, err: BaseException, lost: list[str] | None) -> str | None:
    """What a rank whose failure followed a lost peer says (``None``: no peer was lost, the error is its own)."""
    first_line = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
    if lost is None:
        address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        return (f"rank {rank_} of {size}: the rendezvous store at {address} is gone with a peer — the process "
                f"that hosted it (rank 0, or node 0's torchrun agent) was lost; this rank's failure follows from it "
                f"({type(err).__name__}: {first_line})")
    if not lost:
        return None
    what = ("its loader workers were stopped with it by the launcher, not by a fault of their own"
            if loader_worker_killed(err) else "a collective failed without it")
    return (f"rank {rank_} of {size}: lost {', '.join(lost)} — stopped without an error of its own (SIGKILL, the "
            f"out-of-memory killer, a lost node: its node's log or `kubectl describe pod` tells which); this "
            f"rank stops because of it: {what} ({type(err).__name__}: {first_line})")


def leave_after_error(err: BaseException) -> None:
    """The error path of a distributed run: name the failure, leave the group without a barrier.

    An error a lost peer causes — a collective that failed because another rank left, or this rank's
    loader workers killed by a signal (the launcher stopping this rank because a peer died) — names
    the lost peer when :class:`PeerWatch` finds one (its rank, host and pid), as a log line and a
    note on the exception, instead of blaming this rank's own collective or loader.
    NCCL's communicators are aborted (a destroy would wait for the collectives in flight); gloo's
    group is destroyed, which closes its connections so that blocked peers fail at once.
    """
    global _GROUP_DEVICE
    if not is_distributed():
        _GROUP_DEVICE = None
        return
    rank_, size = dist.get_rank(), dist.get_world_size()
    first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    peer = caused_by_a_peer(err)
    started = time.monotonic()
    if peer or loader_worker_killed(err):
        PeerWatch.leave(f"left after {type(err).__name__}: {first_line}")  # not itself the lost one
        message = lost_peer_message(rank_, size, err, PeerWatch.lost())
    else:
        PeerWatch.leave(f"failed: {type(err).__name__}: {first_line}")
        message = None
    if message is not None:
        log.error("%s", message)
        err.add_note(message)  # printed under the traceback's last line
        peer = True
    elif peer:
        log.error("rank %d of %d: a collective failed because another rank left; that rank's error, printed "
                  "by it, is the cause of the failure (%s)", rank_, size, first_line[:300])
    else:
        log.error("rank %d of %d failed: %s: %s — leaving the process group without waiting for the other "
                  "ranks; the launcher stops them", rank_, size, type(err).__name__, first_line)
    nccl = dist.get_backend() == "nccl"
    try:
        if nccl:
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    except Exception as teardown:  # noqa: BLE001 - the original error is the one to report
        log.debug("leaving the process group after an error: %s", teardown)
    _GROUP_DEVICE = None
    if peer and size > 1:  # let the launcher see the failing rank first (comment above)
        time.sleep(max(0.0, PEER_GRACE_S - (time.monotonic() - started)))


def barrier() -> None:
    if is_distributed():
        dist.barrier(**_barrier_kwargs())


# --- gathers with gradients ----------------------------------------------------------------


def _gather_detached(tensor: Tensor) -> list[Tensor]:
    """Every rank's `tensor` (equal shapes), on `tensor`'s device; sent from the group's device."""
    sent = _to_group(tensor.detach()).contiguous()
    parts = [torch.empty_like(sent) for _ in range(world_size())]
    _send("all_gather", sent, *parts)
    dist.all_gather(parts, sent)
    return [part.to(tensor.device) for part in parts]


class _GatherKeepLocal(torch.autograd.Function):
    """Forward: concatenation over ranks. Backward: this rank's slice × world size (see module doc)."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:  # type: ignore[override]
        ctx.rows = tensor.shape[0]
        return torch.cat(_gather_detached(tensor), dim=0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        start = rank() * ctx.rows
        return grad[start : start + ctx.rows] * world_size()


class _GatherFullGrad(_GatherKeepLocal):
    """Forward: concatenation over ranks. Backward: the sum over ranks of the gradient of this rank's slice."""

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        summed = _to_group(grad).clone(memory_format=torch.contiguous_format)
        _send("all_reduce(grad)", summed)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        start = rank() * ctx.rows
        return summed[start : start + ctx.rows].to(grad.device)


def all_gather_with_grad(tensor: Tensor, *, mode: LossMode = "global", dim: int = 0) -> Tensor:
    """Concatenate `tensor` from every rank along `dim` (equal shapes on every rank), differentiably."""
    if not is_distributed():
        return tensor
    moved = tensor.movedim(dim, 0)
    function = _GatherKeepLocal if mode == "global" else _GatherFullGrad
    with _helper_scope():
        gathered: Tensor = function.apply(moved)
    return gathered.movedim(0, dim)


def all_gather_no_grad(tensor: Tensor, *, dim: int = 0) -> Tensor:
    """Concatenate `tensor` (equal shapes) from every rank along `dim`, without gradient."""
    if not is_distributed():
        return tensor
    moved = tensor.detach().movedim(dim, 0)
    with _helper_scope():
        if moved.dtype == torch.bool:  # gloo has no bool all_gather
            return torch.cat(_gather_detached(moved.to(torch.uint8)), 0).bool().movedim(0, dim)
        return torch.cat(_gather_detached(moved), 0).movedim(0, dim)


def all_gather_rows(tensor: Tensor) -> Tensor:
    """Concatenate tensors of *different* lengths along dim 0 in rank order (no gradient).

    Used for shards of the training set (ASK knowledge bases, teacher caches): rank r's
    rows follow rank r−1's, so contiguous shards (:func:`shard_range`) come back in order.
    """
    if not is_distributed():
        return tensor
    with _helper_scope():
        local = _to_group(tensor.detach()).contiguous()
        sizes = all_gather_no_grad(torch.tensor([local.shape[0]], device=group_device())).tolist()
        longest = max(sizes)
        padded = local.new_zeros((longest, *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = _gather_detached(padded)
        rows = torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)], dim=0)
    return rows.to(tensor.device)


def gather_rows_to(tensor: Tensor, *, dst: int = 0) -> Tensor | None:
    """Rank ``dst``: every rank's rows (dim 0, lengths may differ) concatenated in rank order;
    the other ranks: None (they hold nothing extra). On one process: `tensor`.

    For inputs only one rank needs (the coarse KB's K-Means runs on rank 0 alone).
    """
    if not is_distributed():
        return tensor
    with _helper_scope():
        local = _to_group(tensor.detach()).contiguous()
        sizes = all_gather_no_grad(torch.tensor([local.shape[0]], device=group_device())).tolist()
        padded = local.new_zeros((max(sizes), *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in sizes] if rank() == dst else None
        _send("gather", padded, *(parts or []))
        dist.gather(padded, gather_list=parts, dst=dst)
        if parts is None:
            return None
        rows = torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)], dim=0)
    return rows.to(tensor.device)


def shard_range(count: int) -> range:
    """This rank's contiguous share of ``range(count)`` (sizes differ by at most one)."""
    size, rank_ = world_size(), rank()
    start = count * rank_ // size
    return range(start, count * (rank_ + 1) // size)


def balanced_assignment(costs: Sequence[float], parts: int) -> list[list[int]]:
    """Split item indices into ``parts`` lists of near-equal total cost (longest first, greedy).

    Deterministic (ties broken by index), so every rank computes the same split without a
    collective. Each list is sorted. The greedy LPT rule is within 4/3 of the best makespan.
    """
    loads = [(0.0, part) for part in range(parts)]
    heapq.heapify(loads)
    assigned: list[list[int]] = [[] for _ in range(parts)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, part = heapq.heappop(loads)
        assigned[part].append(index)
        heapq.heappush(loads, (load + float(costs[index]), part))
    return [sorted(items) for items in assigned]


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """Sum of `tensor` over ranks (no gradient); identity on one process."""
    if not is_distributed():
        return tensor
    with _helper_scope():
        reduced = _to_group(tensor.detach()).clone()
        _send("all_reduce", reduced)
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    return reduced.to(tensor.device)


def all_reduce_max(tensor: Tensor) -> Tensor:
    """Element-wise maximum of `tensor` over ranks (no gradient); identity on one process."""
    if not is_distributed():
        return tensor
    with _helper_scope():
        reduced = _to_group(tensor.detach()).clone()
        _send("all_reduce(max)", reduced)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    return reduced.to(tensor.device)


def broadcast(tensor: Tensor, *, src: int = 0) -> Tensor:
    """Rank `src`'s `tensor` on every rank (every rank passes a tensor of the same shape and dtype;
    the others' values are ignored); identity on one process."""
    if not is_distributed():
        return tensor
    with _helper_scope():
        sent = _to_group(tensor.detach()).clone(memory_format=torch.contiguous_format)
        _send("broadcast", sent)
        dist.broadcast(sent, src=src)
    return sent.to(tensor.device)


def all_reduce_mean(tensor: Tensor) -> Tensor:
    """Mean of `tensor` over ranks (no gradient); identity on one process."""
    return all_reduce_sum(tensor) / world_size()


def gather_objects(obj: T) -> list[T]:
    """Every rank's `obj` (picklable), in rank order; ``[obj]`` on one process."""
    if not is_distributed():
        return [obj]
    with _helper_scope():  # pickled bytes travel as a uint8 tensor on the group's device
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = all_gather_no_grad(torch.tensor([payload.numel()], device=group_device())).tolist()
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=group_device())
        padded[: payload.numel()] = payload.to(group_device())
        parts = _gather_detached(padded)
        blobs = [part[:size].cpu().numpy().tobytes() for part, size in zip(parts, sizes, strict=True)]
    return [pickle.loads(blob) for blob in blobs]  # noqa: S301 - our own ranks' objects


# --- the embedding batch -----------------------------------------------------------------


def gather_embedding_batch(batch: Any, *, mode: LossMode = "global") -> Any:
    """The global :class:`~training.objectives.base.EmbeddingBatch` from every rank's shard.

    Embeddings are gathered with gradient (per `mode`), masks, clip indices and teacher
    embeddings without. In ``local`` mode ``batch.local_rows`` marks this rank's rows.
    """
    if not is_distributed():
        return batch
    local_rows = None
    if mode == "local":
        rows = batch.audio.shape[0]
        local_rows = torch.zeros(rows * world_size(), dtype=torch.bool, device=batch.audio.device)
        local_rows[rank() * rows : (rank() + 1) * rows] = True
    return replace(
        batch,
        audio=all_gather_with_grad(batch.audio, mode=mode),
        text=all_gather_with_grad(batch.text, mode=mode, dim=1),
        text_mask=all_gather_no_grad(batch.text_mask, dim=1),
        clip_index=all_gather_no_grad(batch.clip_index),
        teacher_audio=None if batch.teacher_audio is None else all_gather_no_grad(batch.teacher_audio, dim=1),
        teacher_text=None if batch.teacher_text is None else all_gather_no_grad(batch.teacher_text, dim=2),
        local_rows=local_rows,
        replicas=world_size() if mode == "local" else 1,
    )


def check_local_loss(terms: Sequence[Any]) -> None:
    """Raise when `distributed.loss: local` is asked of an objective whose loss couples all rows."""
    refusing = [type(term).__name__ for term in terms if not getattr(term, "supports_local_loss", False)]
    if refusing:
        raise ConfigError(
            f"distributed.loss=local: {', '.join(refusing)} needs the whole global batch on every rank "
            "(its loss couples all rows); use distributed.loss=global (docs/training.md, Distributed)"
        )


def reduce_logged(values: Mapping[str, Tensor | float]) -> dict[str, float]:
    """Every logged number averaged over ranks: ONE device tensor, ONE all-reduce, ONE host transfer.

    Tensor values stay on their device until the single ``tolist`` (no ``.item()`` per
    term); on one process the mean is the value itself. In local-loss mode each rank's
    loss covers its own rows, so the mean is the global loss.
    """
    if not values:
        return {}
    keys = list(values)
    with _helper_scope():
        device = group_device() if is_distributed() else _first_device(values)
        packed = torch.stack(
            [
                v.detach().reshape(()).to(device, torch.float32)
                if isinstance(v, Tensor)
                else torch.tensor(float(v), dtype=torch.float32, device=device)
                for v in values.values()
            ]
        )
        if is_distributed():
            packed = all_reduce_mean(packed)
        return dict(zip(keys, packed.tolist(), strict=True))


WORST_OF = {"data_wait_fraction": "data_wait_fraction_max"}
"""Window metrics whose worst rank is logged beside the mean (a starved rank slows every rank)."""
MAX_OF = frozenset({"peak_memory_mib"})
"""Window metrics logged as their largest value over ranks (the rank that runs out first)."""


def _gathered_rows(values: Mapping[str, float]) -> tuple[list[str], list[list[float]]]:
    """``values``' keys and every rank's row of them (one all-gather; one row on one process)."""
    keys = list(values)
    if not is_distributed():
        return keys, [[float(values[k]) for k in keys]]
    with _helper_scope():
        local = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=group_device())
        return keys, all_gather_no_grad(local.unsqueeze(0)).tolist()


def reduce_window(values: Mapping[str, float]) -> dict[str, float]:
    """A logging window's data metrics over every rank, for rank 0 to log: ONE all-gather.

    Each value becomes its mean over ranks (``samples_per_s``: each rank counts the global batch,
    so the mean is the job's throughput), except :data:`MAX_OF` (largest); ``data_wait_fraction``
    also gets ``data_wait_fraction_max``, the worst rank's. On one process: the values, with the
    worst equal to the mean.
    """
    keys, rows = _gathered_rows(values)
    out: dict[str, float] = {}
    for column, key in enumerate(keys):
        per_rank = [row[column] for row in rows]
        out[key] = max(per_rank) if key in MAX_OF else sum(per_rank) / len(per_rank)
        if key in WORST_OF:
            out[WORST_OF[key]] = max(per_rank)
    return out


def reduce_counts(values: Mapping[str, float], *, worst: Mapping[str, str]) -> dict[str, float]:
    """Per-rank counts of the job as rank 0 logs them: ONE all-gather; each key becomes its total over
    ranks, and ``KEY_worst_rank`` the worst rank's value (``worst[KEY]``: ``"min"`` or ``"max"``), e.g.
    the rank that served the fewest clips or held back the most. On one process: the values themselves."""
    keys, rows = _gathered_rows(values)
    out: dict[str, float] = {}
    for column, key in enumerate(keys):
        per_rank = [row[column] for row in rows]
        out[key] = sum(per_rank)
        if key in worst:
            out[f"{key}_worst_rank"] = min(per_rank) if worst[key] == "min" else max(per_rank)
    return out


def distinct_over_ranks(items: Sequence[str]) -> int:
    """How many distinct ``items`` every rank together holds (e.g. bad samples): one gather."""
    if not is_distributed():
        return len(set(items))
    return len({item for part in gather_objects(list(items)) for item in part})


def _first_device(values: Mapping[str, Tensor | float]) -> torch.device:
    return next((v.device for v in values.values() if isinstance(v, Tensor)), torch.device("cpu"))


def loss_mode_for(choice: LossMode, objective: Any, processes: int) -> LossMode:
    """The gather convention of this run; ``local`` is checked against the objective's terms."""
    if choice == "local" and processes > 1:
        check_local_loss(objective.terms)
    return choice


def check_clips_per_rank(clips: int, processes: int) -> None:
    """Every rank needs at least two clips (one batch with a negative) after the even split."""
    if clips // processes < 2:
        raise DataError(
            f"data: {clips} training clips cannot feed {processes} processes (--nproc-per-node × "
            f"nodes = WORLD_SIZE): each rank needs at least 2 clips; use at most {max(1, clips // 2)} "
            "processes or more data"
        )


# --- per-rank random state (exact resume) ---------------------------------------------------

_RANK_PREFIX = "rank{}/"


def rank_rng_states(
    local: tuple[dict[str, Tensor], dict[str, Any]],
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Every rank's RNG state in one (tensors, scalars) pair, for rank 0 to save.

    Rank 0's entries keep their plain names (a 1-process checkpoint looks as before);
    rank r's tensors are prefixed ``rank{r}/`` and its scalars sit under ``ranks[r]``.
    """
    states = gather_objects(local)
    tensors, scalars = dict(states[0][0]), dict(states[0][1])
    for index, (rank_tensors, rank_scalars) in enumerate(states[1:], start=1):
        tensors.update({_RANK_PREFIX.format(index) + k: v for k, v in rank_tensors.items()})
        scalars.setdefault("ranks", {})[str(index)] = rank_scalars
    return tensors, scalars


def own_rng_state(
    tensors: dict[str, Tensor], scalars: dict[str, Any]
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """This rank's part of what :func:`rank_rng_states` saved."""
    if rank() == 0:
        return tensors, scalars
    prefix = _RANK_PREFIX.format(rank())
    own = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    return own, scalars["ranks"][str(rank())]


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on at least one (e.g. a stop request)."""
    if not is_distributed():
        return flag
    with _helper_scope():
        value = torch.tensor([int(flag)], device=group_device())
        _send("any_rank", value)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())
