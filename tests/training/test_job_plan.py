"""A run that refuses a plan its node cannot hold, and a deterministic failure that is not retried
(issue 48, deliverable 4): /dev/shm checked at start, and the multi-node Job's own script under a real
torchrun ending with the exit status its podFailurePolicy fails the Job on. The Job a pod can be
scheduled with (issue 55, part 4): requests from the node's allocatable, its config in a ConfigMap,
overrides passed as typed (brackets included), no export of a manifest a bucket-only run lacks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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

    job = next(d for d in yaml.safe_load_all((ROOT / "k8s/train-multinode/job.yaml").read_text()) if d["kind"] == "Job")
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


def emitted(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ConfigMap, Job) printed by ``tonearm train … --plan --emit-k8s`` on a metadata-only shard folder."""
    import yaml

    from tests.deploy.test_manifests import metadata_corpus
    from tonearm.cli import main

    folder = metadata_corpus(tmp_path / "shards")
    assert main(["train", *args, f"data.shards={folder}", "--plan", "--nodes", "4", "--gpus-per-node", "8",
                 "--cores-per-node", "96", "--memory-per-node", "480Gi", "--emit-k8s"]) == 0
    config_map, job = yaml.safe_load_all(capsys.readouterr().out)
    assert config_map["kind"] == "ConfigMap" and job["kind"] == "Job"
    return config_map, job


def test_the_job_requests_the_nodes_allocatable_and_carries_its_config_in_a_config_map(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The review: the Job requested the node's capacity (never schedulable: allocatable is lower) and
    ran its config by the path typed where it was rendered."""
    import yaml

    from training.config import read_config_tree
    from training.k8s_job import CONFIG_KEY, CONFIG_PATH

    config = tmp_path / "mine" / "run.yaml"  # a path the pod does not have, extending another file
    config.parent.mkdir()
    config.write_text(f"extends: {ROOT / 'configs' / 'default.yaml'}\noptim:\n  lr: 0.0002\n")
    config_map, job = emitted(tmp_path, capsys, str(config), "--allocatable-per-node", "cpu=95690m,memory=470Gi")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert container["resources"]["requests"]["cpu"] == "95" and container["resources"]["requests"]["memory"] == "470Gi"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["WORKERS"] == str(95 // 8 - 1)  # the plan made for the pod's 95 cores, not the node's 96
    assert env["CONFIG"] == CONFIG_PATH and str(config) not in str(job["spec"])  # only in the annotation
    shipped = yaml.safe_load(config_map["data"][CONFIG_KEY])
    assert shipped == read_config_tree(config) and shipped["optim"]["lr"] == 0.0002 and "extends" not in shipped
    assert {"name": "config", "configMap": {"name": config_map["metadata"]["name"]}} in job["spec"]["template"]["spec"][
        "volumes"]

    _, job = emitted(tmp_path, capsys, str(config))  # no --allocatable-per-node: the documented margin
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"]["cpu"] == "94"  # 96 less GKE's 0.31 and 1 for DaemonSets
    memory = container["resources"]["requests"]["memory"]
    assert memory.endswith("Mi") and 455 * 1024 < int(memory[:-2]) < 470 * 1024


def test_an_override_with_brackets_reaches_tonearm_train_as_typed_and_a_bucket_run_skips_the_export(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``data.languages=[eng,fra]`` was expanded unquoted from ``$EXTRA``: a bracket glob that a file such as
    ``data.languages=e`` in the pod's working directory turned into another argument. The Job's own script
    runs here with stand-ins for torchrun and tonearm that record their arguments."""
    typed = ["data.languages=[eng,fra]", "data.drop_other_languages=true", "eval.split=it's a b*"]
    _, job = emitted(tmp_path, capsys, str(ROOT / "configs" / "default.yaml"), *typed)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir()
    work.mkdir()
    for name in ("torchrun", "tonearm"):
        (bin_dir / name).write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > "{tmp_path}/{name}.args"\n')
        (bin_dir / name).chmod(0o755)
    for name in ("data.languages=e", "data.languages=a", "eval.split=it's a bc"):  # what the globs would match
        (work / name).touch()
    unquoted = subprocess.run(["/bin/bash", "-c", 'echo $EXTRA'], env={**os.environ, "EXTRA": " ".join(typed)},
                              cwd=work, capture_output=True, text=True, check=True)
    assert "data.languages=a data.languages=e" in unquoted.stdout  # the old script's expansion
    script = container["args"][0].replace("/shared/runs", str(tmp_path / "runs"))
    done = subprocess.run(["/bin/bash", "-ceu", script], cwd=work, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                               "TONEARM_FATAL_FILE": str(tmp_path / "fatal"), "JOB_COMPLETION_INDEX": "0"})
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "torchrun.args").read_text().splitlines()
    assert args[-len(typed):] == typed  # each one word, as typed
    assert not (tmp_path / "tonearm.args").exists()  # no export: CATALOGUE is empty for a bucket-only run
    assert "Not exported: tonearm export indexes a JSONL manifest" in done.stderr


# --- the processes' baseline, calibrated per machine (issue 55, part 4 f) ------------------------------


def test_the_calibration_fits_the_processes_from_two_runs_and_keeps_the_default_worker_within_noise() -> None:
    from training.memory_calibration import fit
    from training.memory_plan import WORKER_PSS

    mib = 2**20
    exact = [{"workers": 1, "residual": 400 * mib + 2 * 30 * mib}, {"workers": 3, "residual": 400 * mib + 6 * 30 * mib}]
    assert fit(exact)[:2] == (400 * mib, 30 * mib)
    noisy = [{"workers": 1, "residual": 810 * mib}, {"workers": 3, "residual": 706 * mib}]  # bench/plan_pss.py's
    main, worker, how = fit(noisy)
    assert worker == WORKER_PSS and "noise" in how and main == round((810 + 706) / 2 * mib - 4 * WORKER_PSS)


def test_the_plan_and_the_node_check_count_the_processes_of_a_calibration_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The review: the plan was 1.70–2.07× a run's PSS on another machine (an 800 MiB constant from one
    machine). A calibration file of that machine replaces the constant in `--plan` and in a run's node check."""
    import json

    from tests.deploy.test_manifests import metadata_corpus
    from tonearm.cli import main
    from training.config import ConfigError, load_train_config
    from training.data.node_fit import refuse_unless_node_fits

    mib = 2**20
    calibration = tmp_path / "baseline.json"
    calibration.write_text(json.dumps({"main_pss": 420 * mib, "worker_pss": 12 * mib, "machine": "test", "when": "now"}))
    folder = metadata_corpus(tmp_path / "shards")
    args = ["train", str(ROOT / "configs" / "default.yaml"), f"data.shards={folder}", "data.num_workers=2", "--plan",
            "--nodes", "1", "--gpus-per-node", "1"]
    assert main(args) == 0
    default = capsys.readouterr().out
    assert main([*args, "--process-baseline", str(calibration)]) == 0
    calibrated = capsys.readouterr().out

    def processes(text: str) -> str:
        line = next(line for line in text.splitlines() if "processes: training + 2 × 2" in line)
        return " ".join(line.split()[-2:])

    assert processes(default) == "864.0 MiB" and processes(calibrated) == "468.0 MiB"  # 800 + 4 × 16, 420 + 4 × 12
    assert f"calibrated: {calibration}" in calibrated and "default: measured on one machine" in default

    cfg = load_train_config(ROOT / "configs" / "tiny.yaml", ["data.num_workers=4"])

    def check() -> None:
        refuse_unless_node_fits(cfg, workers=4, buffer_bytes=0, crop=128_000, index=0, ranks_on_node=1, shm=2**34,
                                memory=700 * mib)

    with pytest.raises(ConfigError, match="memory"):
        check()  # the default: 800 + 2 × 4 × 16 MiB of processes alone are over 700 MiB
    monkeypatch.setenv("TONEARM_PROCESS_BASELINE", str(calibration))
    check()  # this machine's: 420 + 2 × 4 × 12 MiB and 16 MB of batches in flight fit


def test_the_job_carries_a_process_calibration_in_its_config_map_and_names_it_in_the_pod(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--emit-k8s --process-baseline FILE` (issue 55, part 4): the Job's pods check their node with the
    figure the plan used — the file as read in the ConfigMap, $TONEARM_PROCESS_BASELINE naming where the
    pod mounts it; without the option neither is there. Both renderings validate against the schema."""
    import json

    import kubernetes_validate

    from tests.deploy.test_manifests import KUBERNETES_VERSION
    from training.k8s_job import BASELINE_KEY, BASELINE_PATH, CONFIG_KEY
    from training.memory_plan import PROCESS_BASELINE_ENV, read_process_baseline

    mib = 2**20
    calibration = tmp_path / "node-baseline.json"
    text = json.dumps({"main_pss": 420 * mib, "worker_pss": 12 * mib, "machine": "a node", "when": "now"}, indent=1)
    calibration.write_text(text + "\n")
    config = str(ROOT / "configs" / "default.yaml")
    config_map, job = emitted(tmp_path, capsys, config, "--process-baseline", str(calibration))
    plain_map, plain_job = emitted(tmp_path, capsys, config)
    for obj in (config_map, job, plain_map, plain_job):
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)

    assert config_map["data"][BASELINE_KEY] == text + "\n" and set(config_map["data"]) == {CONFIG_KEY, BASELINE_KEY}
    assert config_map["metadata"]["annotations"]["tonearm.dev/process-baseline-source"] == str(calibration)
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[PROCESS_BASELINE_ENV] == BASELINE_PATH
    volume = next(v for v in pod["volumes"] if v.get("configMap"))
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    assert volume["configMap"]["name"] == config_map["metadata"]["name"] and "items" not in volume["configMap"]
    assert BASELINE_PATH == f"{mount['mountPath']}/{BASELINE_KEY}"
    mounted = tmp_path / "pod" / BASELINE_KEY  # what the pod reads there: the calibration the plan used
    mounted.parent.mkdir()
    mounted.write_text(config_map["data"][BASELINE_KEY])
    baseline = read_process_baseline(mounted)
    assert (baseline.main, baseline.worker) == (420 * mib, 12 * mib)

    # Without the option, nothing changes: the config alone, no variable.
    assert set(plain_map["data"]) == {CONFIG_KEY} and "tonearm.dev/process-baseline-source" not in plain_map[
        "metadata"]["annotations"]
    (plain,) = plain_job["spec"]["template"]["spec"]["containers"]
    assert PROCESS_BASELINE_ENV not in {e["name"] for e in plain["env"]}
    assert plain_job["spec"] == {**job["spec"], "template": plain_job["spec"]["template"]}
    assert plain["env"] == [e for e in container["env"] if e["name"] != PROCESS_BASELINE_ENV]
