"""Safe reruns: a previous run is never replaced silently; Ctrl-C saves a state a resume continues exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import ROOT, TINY_CONFIG
from tonearm.cli import main

# 32 training clips in batches of 2: 16 steps per epoch, 2 epochs; one thread so that the
# subprocess and this process compute bit-identical numbers.
SIGINT_RUN = ["optim.batch_size=2", "optim.warmup_steps=1", "threads=1"]
SMALL_RUN = ["optim.epochs=1", "optim.batch_size=4", "data.max_clips=8", "optim.warmup_steps=1"]


def _cli(manifest: Path, out_dir: Path, *extra: str) -> int:
    return main(["train", str(TINY_CONFIG), f"data.manifest={manifest}", f"out_dir={out_dir}", *SMALL_RUN, *extra])


def test_existing_run_is_refused_with_both_commands(
    tiny_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert _cli(tiny_corpus, out) == 0
    before = (out / "last" / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert _cli(tiny_corpus, out, "optim.lr=1e-3") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    command = f"tonearm train {TINY_CONFIG} data.manifest={tiny_corpus} out_dir={out} {' '.join(SMALL_RUN)} optim.lr=0.001"
    assert f"{out} already holds a training run (last/ at epoch 1, step 2)" in err
    assert f"resume it: {command.replace('0.001', '1e-3')} resume=true" in err
    assert f"{command.replace('0.001', '1e-3')} --overwrite" in err
    assert (out / "last" / "model.safetensors").read_bytes() == before  # untouched
    # Several processes: the launcher refuses once, before starting any, quoting its own flag.
    assert _cli(tiny_corpus, out, "--nproc-per-node", "2") == 2
    assert "resume it: tonearm train --nproc-per-node 2 " in capsys.readouterr().err
    # --overwrite starts afresh: a different learning rate gives different weights.
    assert _cli(tiny_corpus, out, "optim.lr=1e-3", "--overwrite") == 0
    assert (out / "last" / "model.safetensors").read_bytes() != before
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()][0] == 1


def _train_subprocess(manifest: Path, out_dir: Path, *extra: str) -> subprocess.Popen[str]:
    code = "import sys; from tonearm.cli import main; sys.exit(main(sys.argv[1:]))"
    args = ["train", str(TINY_CONFIG), f"data.manifest={manifest}", f"out_dir={out_dir}", *SIGINT_RUN, *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
    )


def test_sigint_mid_epoch_then_resume_is_bit_identical(tiny_corpus: Path, tmp_path: Path) -> None:
    from training.config import load_train_config
    from training.loop import train

    full = train(load_train_config(TINY_CONFIG, [f"data.manifest={tiny_corpus}", f"out_dir={tmp_path / 'full'}", *SIGINT_RUN]))
    split = tmp_path / "split"
    process = _train_subprocess(tiny_corpus, split)
    metrics = split / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().strip()):  # step 1 is logged
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before step 1 was logged"
        time.sleep(0.002)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    saved = json.loads((split / "last" / "trainer_state.json").read_text())["loop"]
    assert saved["epoch"] == 0 and 0 < saved["batch_in_epoch"] < 16, saved  # stopped mid-epoch 1
    assert f"Resume with: tonearm train {TINY_CONFIG}" in err and "resume=true" in err

    resumed = _train_subprocess(tiny_corpus, split, "resume=true")
    _, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err
    for name in ("model.safetensors", "trainer_state.safetensors"):  # weights, BatchNorm stats, AdamW, RNG
        expected, got = load_file(str(full / "last" / name)), load_file(str(split / "last" / name))
        assert expected.keys() == got.keys()
        for key, tensor in expected.items():
            assert tensor.dtype == got[key].dtype and (tensor == got[key]).all(), f"{name}: {key}"
    assert json.loads((split / "last" / "trainer_state.json").read_text())["loop"] == json.loads(
        (full / "last" / "trainer_state.json").read_text()
    )["loop"]
