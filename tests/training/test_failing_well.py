"""A failing rank ends a torchrun job in seconds with its own error (issue 39 item 5,
docs/training.md "Training on a large corpus"): real 2-process gloo jobs under torchrun's agent."""

from __future__ import annotations

import json
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY_CONFIG
from tests.training.test_bad_samples import _corrupt_one_train_clip
from tests.training.test_distributed_runs import tonearm

# A hang would last this long (the old teardown's barrier waited for it, then reported its own
# timeout instead of the rank's error); the job must end long before.
TIMEOUT_S = 300
FAILED_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ERROR .*rank (\d) of 2 failed: DataError", re.M)


def _failed_job(*args: str) -> tuple[str, float, float]:
    """(stderr, seconds the whole job took, seconds from the failing rank's error to the job's end)."""
    started = time.monotonic()
    done = tonearm("train", "--nproc-per-node", "2", str(TINY_CONFIG), "optim.epochs=1",
                   "data.max_bad_fraction=0", f"distributed.timeout_s={TIMEOUT_S}", *args)
    ended = datetime.now()
    total = time.monotonic() - started
    assert done.returncode != 0, done.stderr[-3000:]
    failed = FAILED_LINE.findall(done.stderr)
    assert len(failed) == 1, done.stderr[-4000:]  # exactly one rank failed of its own
    at = datetime.strptime(failed[0][0], "%Y-%m-%d %H:%M:%S,%f")
    return done.stderr, total, (ended - at).total_seconds()


def _assert_fast_and_own(stderr: str, total: float, after_error: float, *words: str) -> None:
    assert after_error < 15, (after_error, stderr[-4000:])  # the job ends within seconds of the error
    assert total < TIMEOUT_S / 2, total
    assert "Timed out" not in stderr, stderr[-4000:]
    error = next(line for line in stderr.splitlines() if line.startswith("error: "))  # the rank's own line
    for word in words:
        assert word in error, error
    # torchrun's summary names the rank that failed first, with exit code 2 (a tonearm error)
    failing_rank = FAILED_LINE.findall(stderr)[0][1]
    root = stderr.split("Root Cause (first observed failure):", 1)[1]
    assert re.search(rf"rank\s*: {failing_rank} ", root) and "exitcode  : 2" in root, root[:800]


def test_a_rank_that_raises_ends_the_job_in_seconds_with_its_own_error(tiny_corpus: Path, tmp_path: Path) -> None:
    manifest, bad = _corrupt_one_train_clip(tiny_corpus, tmp_path)  # on one rank only (the sampler's split)
    stderr, total, after_error = _failed_job(f"data.manifest={manifest}", f"out_dir={tmp_path / 'run'}")
    _assert_fast_and_own(stderr, total, after_error, "clips on this rank could not be decoded", str(bad))


def test_a_rank_reading_a_corrupted_shard_ends_the_job_in_seconds(tiny_corpus: Path, tmp_path: Path) -> None:
    import webdataset as wds

    from training.data.shards import shard_manifest

    shards = tmp_path / "shards"
    shard_manifest(tiny_corpus, shards, sample_rate=16_000, shard_size=8, workers=1, progress=False)
    victim = shards / "train-000001.tar"  # audio bytes corrupted after the shard was written
    samples = list(wds.WebDataset(str(victim), shardshuffle=False))
    bad_id = json.loads(samples[3]["json"])["id"]
    victim.unlink()
    with wds.TarWriter(str(victim)) as writer:
        for i, sample in enumerate(samples):
            writer.write({"__key__": sample["__key__"], "json": sample["json"],
                          "flac": b"fLaC" + bytes(512) if i == 3 else sample["flac"]})
    stderr, total, after_error = _failed_job(
        "data.manifest=null", f"data.shards={shards}", f"out_dir={tmp_path / 'run'}")
    _assert_fast_and_own(stderr, total, after_error, "clips on this rank could not be decoded", bad_id,
                         victim.name)



# --- a peer lost without a word (issue 55, part 4 e) -------------------------------------------------

PEER_SCRIPT = """
import logging, os, signal, sys, time
import torch
import torch.distributed as dist
from training import distributed
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
rank = distributed.init_process_group(torch.device("cpu"), timeout_s=60)
distributed.barrier()
if rank == 1:
    time.sleep(1.0)  # a few beats, then killed as the out-of-memory killer would
    os.kill(os.getpid(), signal.SIGKILL)
try:
    dist.all_reduce(torch.ones(4))  # waits for rank 1, which never comes
    dist.all_reduce(torch.ones(4))
except RuntimeError as err:
    distributed.leave_after_error(err)
    print("NOTES:", getattr(err, "__notes__", []), flush=True)
    sys.exit(1)
"""


def test_a_survivor_names_the_peer_killed_with_sigkill_not_its_own_collective(tmp_path: Path) -> None:
    """Two gloo processes; rank 1 dies of SIGKILL while rank 0 waits in a collective: rank 0 names rank 1
    (host and pid, from the rendezvous store's register) as lost, not its collective."""
    import os
    import subprocess
    import sys

    from tests.training.test_distributed_runs import WORKER_ENV, free_port

    env = {**WORKER_ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    script = tmp_path / "peer.py"
    script.write_text(PEER_SCRIPT)
    ranks = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    out0, _ = ranks[0].communicate(timeout=120)
    ranks[1].communicate(timeout=30)
    assert ranks[1].returncode == -9
    line = next((x for x in out0.splitlines() if x.startswith("ERROR training.distributed")), "")
    assert f"lost rank 1 ({os.uname().nodename} pid {ranks[1].pid})" in line, out0[-3000:]
    assert "a collective failed without it" in line and "failed: RuntimeError" not in out0
    notes = next(x for x in out0.splitlines() if x.startswith("NOTES:"))
    assert "rank 0 of 2: lost rank 1" in notes  # under the traceback's last line too


def test_the_lost_peer_message_names_the_silent_peer_and_spares_those_that_said_they_left() -> None:
    """The mapping alone, on a store whose beats the test sets: rank 2 stopped beating without a word,
    rank 3 stopped after saying it left, rank 1 still beats."""
    from training.distributed import PeerWatch, lost_peer_message

    class Store:
        def __init__(self) -> None:
            self.keys: dict[str, Any] = {}

        def add(self, key: str, n: int) -> int:
            self.keys[key] = int(self.keys.get(key, 0)) + n
            return int(self.keys[key])

        def set(self, key: str, value: str) -> None:
            self.keys[key] = value

        def get(self, key: str) -> bytes:
            return str(self.keys[key]).encode()

        def check(self, keys: list[str]) -> bool:
            return all(k in self.keys for k in keys)

    store, prefix = Store(), PeerWatch._prefix()
    for r in range(4):
        store.set(f"{prefix}who/{r}", f"node-{r // 2} pid {100 + r}")
    store.set(f"{prefix}left/3", "left after RuntimeError: Connection closed by peer")
    saved = PeerWatch._store, PeerWatch._rank, PeerWatch._world
    PeerWatch._store, PeerWatch._rank, PeerWatch._world = store, 0, 4
    try:
        lost = PeerWatch.lost(sleep=lambda _: store.add(f"{prefix}beat/1", 1))  # only rank 1 beats meanwhile
    finally:
        PeerWatch._store, PeerWatch._rank, PeerWatch._world = saved
    assert lost == ["rank 2 (node-1 pid 102)"]
    killed = RuntimeError("DataLoader worker (pid 7) is killed by signal: Terminated. ")
    message = lost_peer_message(0, 4, killed, lost)
    assert message is not None and message.startswith("rank 0 of 4: lost rank 2 (node-1 pid 102)")
    assert "loader workers were stopped with it by the launcher" in message and "DataLoader worker (pid 7)" in message
    assert lost_peer_message(0, 4, killed, []) is None  # nobody lost: the loader's own failure stands
    assert "rendezvous store" in (lost_peer_message(0, 4, killed, None) or "")  # the store went with the peer


@pytest.mark.slow  # ~40 s: torchrun, two ranks with a loader worker each, a few epochs before the kill
def test_under_torchrun_the_survivor_of_a_sigkilled_rank_names_it_not_its_loader_worker(
        tiny_corpus: Path, tmp_path: Path) -> None:
    """The review's case: torchrun stops the survivor's process group with SIGTERM when a peer dies;
    its loader worker died of it, and the survivor blamed that worker."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    from tests.training.test_distributed_runs import WORKER_ENV

    out = tmp_path / "run"
    job = subprocess.Popen([sys.executable, "-m", "tonearm", "train", "--nproc-per-node", "2", str(TINY_CONFIG),
                            f"data.manifest={tiny_corpus}", f"out_dir={out}", "optim.epochs=200",
                            "data.num_workers=1", "distributed.timeout_s=120"], env=WORKER_ENV,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(job.stdout or []), daemon=True).start()
    deadline = time.monotonic() + 240
    victim = None
    while victim is None and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.3)
        if sum("INFO training.loop: epoch" in line for line in lines) >= 2:
            victim = _rank_process(1, str(out))
    assert victim is not None, "".join(lines)[-3000:]
    os.kill(victim, signal.SIGKILL)
    job.wait(timeout=120)
    text = "".join(lines)
    mine = [line for line in text.splitlines() if "ERROR training.distributed" in line]
    assert mine and f"lost rank 1 ({os.uname().nodename} pid {victim})" in mine[0], text[-4000:]
    assert not any("failed: RuntimeError: DataLoader worker" in line for line in mine)


def _rank_process(rank: int, marker: str) -> int | None:
    """The pid of torchrun's worker of ``rank`` whose command line holds ``marker``."""
    import os

    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            parent = Path(f"/proc/{pid}/stat").read_text().split()[3]
            if (f"RANK={rank}".encode() in environ and marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
                    and b"torch.distributed.run" in Path(f"/proc/{parent}/cmdline").read_bytes()):
                return int(pid)
        except OSError:
            continue
    return None
