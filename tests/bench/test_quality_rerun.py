"""`tonearm bench quality_rerun`: a rerun compared run by run with the published results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.quality_rerun import main


def _results(path: Path, runs: dict[str, list[dict[str, float]]]) -> Path:
    path.write_text(json.dumps({"command": "tonearm bench quality --seeds 0", "runs": runs}), encoding="utf-8")
    return path


def _run(seed: int, r1: float, mrv: float = 100.0) -> dict[str, float]:
    return {"seed": seed, "r1": r1, "t2a_R@10_mean": 0.5, "mrv_t2a": mrv}


def test_differences_are_measured_in_published_seed_spreads(tmp_path: Path) -> None:
    published = _results(tmp_path / "published.json", {
        "clean/infonce": [_run(0, 0.12), _run(1, 0.14), _run(2, 0.13)],      # population std of r1: 0.816 points
        "clean/distill_m3": [_run(0, 0.15), _run(1, 0.15), _run(2, 0.15)],
    })
    rerun = _results(tmp_path / "rerun.json", {
        "clean/infonce": [_run(0, 0.10, mrv=110.0)],
        "clean/kcl": [_run(0, 0.28)],
    })
    out = tmp_path / "rerun.md"
    assert main([str(rerun), "--published", str(published), "--out", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert "| clean/infonce/seed0 | r1 (%) | 12.00 | 10.00 | -2.00 | 2.4 |" in text
    assert "| clean/infonce/seed0 | MRV t2a | 100.00 | 110.00 | +10.00 | – |" in text  # no spread: all seeds equal
    assert "r1 within 2 published spreads: 0 of 1" in text
    assert "not compared" in text and "clean/kcl/seed0" in text  # not published: listed, not compared
    assert "tonearm bench quality --seeds 0" in text


def test_a_rerun_of_fewer_seeds_does_not_compare_the_students_of_every_seeds_teachers(tmp_path: Path) -> None:
    """`--seeds 0` trains distillation M=3 from one teacher: another student than the published one."""
    seeds = [_run(0, 0.14), _run(1, 0.15), _run(2, 0.15)]
    published = tmp_path / "published.json"
    published.write_text(json.dumps({"seeds": [0, 1, 2], "runs": {"clean/distill_m3": seeds, "clean/infonce": seeds}}))
    rerun = tmp_path / "rerun.json"
    rerun.write_text(json.dumps({"seeds": [0], "runs": {"clean/distill_m3": [_run(0, 0.11)],
                                                       "clean/infonce": [_run(0, 0.14)]}}))
    out = tmp_path / "rerun.md"
    assert main([str(rerun), "--published", str(published), "--out", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert "| clean/infonce/seed0 | r1 (%)" in text and "| clean/distill_m3/seed0 |" not in text
    assert "not compared (not published, or a student of every seed's teachers): clean/distill_m3/seed0" in text


def test_no_common_run_is_an_error(tmp_path: Path) -> None:
    published = _results(tmp_path / "a.json", {"clean/infonce": [_run(0, 0.1)]})
    rerun = _results(tmp_path / "b.json", {"noisy/infonce": [_run(0, 0.1)]})
    with pytest.raises(SystemExit, match="no run in common"):
        main([str(rerun), "--published", str(published), "--out", "-"])
