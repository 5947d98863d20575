"""A run that refuses a plan its node cannot hold, and a deterministic failure that is not retried
(issue 48, deliverable 4): /dev/shm checked at start, and the multi-node Job's own script under a real
torchrun ending with the exit status its podFailurePolicy fails the Job on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def small_shards(tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from training.data.shards import shard_manifest

    out = tmp_path_factory.mktemp("job_plan_shards")
    shard_manifest(tiny_corpus, out, sample_rate=16_000, shard_size=8, workers=1, progress=False)
    return out


def shard_run(shards: Path, out: Path, *extra: str) -> list[str]:
    return ["data.manifest=null", f"data.shards={shards}", "optim.epochs=1", f"out_dir={out}",
            "data.languages=[eng,fra]", "data.drop_other_languages=true", "eval.select_metric=t2a_R@10_eng", *extra]


def test_a_run_whose_batches_in_flight_outgrow_dev_shm_is_refused_at_start_naming_the_settings(
        small_shards: Path, tmp_path: Path) -> None:
    from training.config import ConfigError, load_train_config
    from training.data.node_fit import shm_size
    from training.loop import train

    shm = shm_size()
    if shm is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true: no /dev/shm on this machine (every Linux CI machine here has one)")
        pytest.skip("no /dev/shm here")
    crop = 2 * 16_000 * 4  # tiny.yaml: 2-s crops at 16 kHz, float32
    factor = shm // (2 * 8 * crop) + 1  # 2 workers × batch 8: just over /dev/shm
    cfg = load_train_config(ROOT / "configs" / "tiny.yaml", shard_run(small_shards, tmp_path / "run",
                            "data.num_workers=2", f"data.prefetch_factor={factor}"))
    with pytest.raises(ConfigError, match=r"/dev/shm holds .*data\.prefetch_factor=.*data\.num_workers=2"):
        train(cfg)
    assert not (tmp_path / "run" / "last").exists()  # refused before any step


def test_the_plan_refuses_host_memory_it_cannot_hold() -> None:
    from training.config import ConfigError, load_train_config
    from training.data.node_fit import refuse_unless_node_fits

    cfg = load_train_config(ROOT / "configs" / "tiny.yaml", ["data.num_workers=4"])
    def check(memory: int) -> None:
        refuse_unless_node_fits(cfg, workers=4, buffer_bytes=2**20, crop=128_000, index=2**20, ranks_on_node=8,
                                shm=2**34, memory=memory)

    check(2**35)  # 8 × (1 + 4 + 0.5 × 4 × 8 ... MiB + 800 + 128 MiB of processes) fits in 32 GiB
    with pytest.raises(ConfigError, match=r"memory .*data\.num_workers=4"):
        check(2**30)


@pytest.mark.slow  # ~20 s: torchrun and three training processes
def test_a_data_error_under_the_jobs_torchrun_fails_once_and_exits_with_the_fatal_status(tmp_path: Path) -> None:
    """The Job's script (k8s/train-multinode/job.yaml), its rendezvous pointed at this machine: a run
    from a folder with no shards fails with a DataError, torchrun's restarts end at once on the
    recorded failure, and the pod's exit status is the one its podFailurePolicy marks FailJob."""
    import socket

    import yaml

    from training.fatal import FATAL_EXIT

    job = yaml.safe_load((ROOT / "k8s/train-multinode/job.yaml").read_text())
    (container,) = job["spec"]["template"]["spec"]["containers"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = (container["args"][0].replace("tonearm-train-mn-0.tonearm-train-mn:29400", f"127.0.0.1:{port}")
              .replace("/shared/runs", str(tmp_path / "runs")).replace("torchrun ", f"{sys.executable} -m "
                                                                      "torch.distributed.run "))
    env = {**os.environ, **{e["name"]: e["value"] for e in container["env"] if "value" in e},
           "CONFIG": str(ROOT / "configs" / "tiny.yaml"), "SHARDS": str(tmp_path / "no-shards"), "NODES": "1",
           "MIN_NODES": "1", "GPUS": "1", "WORKERS": "0", "TONEARM_FATAL_FILE": str(tmp_path / "fatal"),
           "JOB_COMPLETION_INDEX": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["/bin/bash", "-ceu", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == FATAL_EXIT, done.stderr[-3000:]
    assert "deterministic failure, not retried" in done.stderr and "DataError" in done.stderr
    assert done.stderr.count("not restarted: this launch already failed deterministically") == 2  # --max-restarts 2
    assert "tonearm export" not in done.stderr
