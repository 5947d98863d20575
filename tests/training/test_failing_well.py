"""A failing rank ends a torchrun job in seconds with its own error (issue 39 item 5,
docs/training.md "Training on a large corpus"): real 2-process gloo jobs under torchrun's agent."""

from __future__ import annotations

import json
import re
import time
from datetime import datetime
from pathlib import Path

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

