"""End to end through the CLI: synth tiny → train configs/tiny.yaml → evaluate (python -m tonearm.cli)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, TINY_CONFIG
from tonearm.cli import main


def test_synth_train_evaluate(tmp_path: Path) -> None:
    corpus, run = tmp_path / "tiny", tmp_path / "run"
    assert main(["synth", "--size", "tiny", "--seed", "1", "--out", str(corpus)]) == 0
    manifest = corpus / "manifest.jsonl"
    assert (
        main(
            [
                "train",
                str(TINY_CONFIG),
                f"data.manifest={manifest}",
                f"out_dir={run}",
                "optim.max_steps=3",
            ]
        )
        == 0
    )
    assert (run / "best" / "model.safetensors").is_file() and (
        run / "last" / "model.safetensors"
    ).is_file()

    out = tmp_path / "report"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tonearm.cli",
            "evaluate",
            str(run / "best"),
            "--data",
            str(manifest),
            "--split",
            "test",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    for name in ("report.json", "report.md", "languages.png"):
        assert (out / name).is_file(), name
    metrics = json.loads((out / "report.json").read_text())["metrics"]
    recall_keys = [k for k in metrics if k.startswith(("t2a_", "a2t_"))]
    assert len(recall_keys) >= 4 * 2 * 9  # 4 metrics × 2 directions × (8 languages + mean)
    for key in recall_keys:
        assert math.isfinite(metrics[key]) and 0.0 <= metrics[key] <= 1.0, key
    assert math.isfinite(metrics["mrv_t2a"]) and metrics["mrv_t2a"] >= 0.0
