from __future__ import annotations

import pytest

from service.gate import GateThresholds, judge, run_gate
from tests.service.fakes import KeywordBundle

T = GateThresholds(metric="t2a_R@10_mean", max_recall_drop=0.02, max_mrv_ratio=1.1, mrv_slack=1.0, min_clips=1)


def test_judge_passes_within_thresholds():
    active = {"t2a_R@10_mean": 0.50, "mrv_t2a": 10.0}
    assert judge({"t2a_R@10_mean": 0.49, "mrv_t2a": 12.0}, active, T) == []  # 12 ≤ 10·1.1 + 1


def test_judge_rejects_recall_drop_and_mrv_rise_with_numbers():
    active = {"t2a_R@10_mean": 0.50, "mrv_t2a": 10.0}
    reasons = judge({"t2a_R@10_mean": 0.47, "mrv_t2a": 12.5}, active, T)
    assert len(reasons) == 2
    assert "0.5000 to 0.4700" in reasons[0]
    assert "limit 12.000" in reasons[1]


def test_run_gate_compares_both_bundles_on_the_candidates_eval_set(tmp_path):
    good = KeywordBundle(tmp_path, bundle_id="good")
    worse = KeywordBundle(tmp_path, bundle_id="worse", degrade=True)
    t = GateThresholds(metric="t2a_R@1_mean", max_recall_drop=0.02, max_mrv_ratio=1.1, mrv_slack=1.0, min_clips=1)
    verdict = run_gate(worse, good, t, force=False)
    assert not verdict.passed and verdict.compared_to == "good"
    assert verdict.active["t2a_R@1_mean"] == 1.0
    assert verdict.candidate["t2a_R@1_mean"] < 0.5
    assert verdict.languages == ["eng", "fra", "jpn"]
    forced = run_gate(worse, good, t, force=True)
    assert forced.passed and forced.forced and forced.reasons
    assert run_gate(good, worse, t, force=False).passed


def test_run_gate_uses_only_shared_languages(tmp_path):
    cand = KeywordBundle(tmp_path, bundle_id="c", languages=("eng", "jpn"))
    active = KeywordBundle(tmp_path, bundle_id="a", languages=("eng", "fra"))
    verdict = run_gate(cand, active, T, force=False)
    assert verdict.passed and verdict.languages == ["eng"]
    none_shared = run_gate(KeywordBundle(tmp_path, languages=("jpn",)), active, T, force=False)
    assert not none_shared.passed


@pytest.mark.parametrize("force", [False, True])
def test_first_activation_has_nothing_to_compare(tmp_path, force):
    verdict = run_gate(KeywordBundle(tmp_path), None, T, force=force)
    assert verdict.passed and verdict.compared_to is None
