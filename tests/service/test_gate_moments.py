"""The quality gate compares moment metrics like it compares R@10 (SPEC §20, docs/service.md "Quality gate").

Real bundles, judged by :func:`service.gate.run_gate` as an activation judges them: ``trained`` is the shared
tiny bundle plus a moment head from `tonearm train-moments` (which keeps the test split's recordings and
moment queries in ``eval/``: the gate's moment set); ``trained-again`` the same bundle under another id;
``degenerate`` the tiny bundle plus a head whose spans have no length (every moment query misses); ``plain``
the tiny bundle itself (no windows, no head: it answers no moment query). Cost: ~15 s beside the shared
tiny bundle (a `synth --moments --size tiny` corpus, a 60-step head, the tiny encoders over 4 recordings).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from index.bundle.evalset import MomentSet, read_moment_set
from index.bundle.format import encoder_digests, publish_with_moment_head, read_manifest
from index.runtime.loader import LoadedBundle
from service.gate import GateThresholds, evaluate_moments, run_gate
from service.settings import Settings
from tests.service.bundle_factory import copy_bundle, renamed_copy
from tonearm.cli import main as tonearm_main
from training.models.moment_head import MomentHead
from training.moment_head import export_head

METRIC = "moment_R1@0.5_mean"


def _degenerate_head(folder: Path, bundle: Path) -> Path:
    """A head whose every proposal is a point (softplus(−30) ≈ 0 s each side): no span overlaps a moment."""
    manifest = read_manifest(bundle)
    head = MomentHead(manifest.embed_dim, hidden=8, layers=1, window_seconds=manifest.clip_seconds).eval()
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.bias.copy_(torch.tensor([0.0, -30.0, -30.0]))
    export_head(head, folder, window_seconds=manifest.clip_seconds, hop_seconds=manifest.clip_seconds / 2,
                extra={"encoder_sha256": encoder_digests(manifest)})
    return folder


@pytest.fixture(scope="module")
def gate_bundles(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LoadedBundle]]:
    work = tmp_path_factory.mktemp("gate_moments")
    corpus = work / "corpus"
    assert tonearm_main(["synth", "--moments", "--size", "tiny", "--seed", "1", "--out", str(corpus)]) == 0
    root = work / "bundles"
    assert tonearm_main(["train-moments", "--bundle", str(tiny_bundle), "--manifest", str(corpus / "manifest.jsonl"),
                         "--out", str(root / "trained"), "--steps", "60"]) == 0
    renamed_copy(root / "trained", root, "trained-again")
    publish_with_moment_head(tiny_bundle, _degenerate_head(work / "head", tiny_bundle), root, "degenerate")
    plain = copy_bundle(tiny_bundle, root)
    opened = {name: LoadedBundle.open(root / name) for name in ("trained", "trained-again", "degenerate")}
    opened["plain"] = LoadedBundle.open(plain)
    yield opened
    for bundle in opened.values():
        bundle.close()


def _thresholds(*, max_moment_drop: float = 0.05, max_recall_drop: float = 0.02) -> GateThresholds:
    return GateThresholds(metric="t2a_mAP@10_mean", max_recall_drop=max_recall_drop, max_mrv_ratio=1.1,
                          mrv_slack=1.0, min_clips=1, bootstrap_samples=200, moment_metric=METRIC,
                          max_moment_drop=max_moment_drop)


def test_the_gate_settings_default_to_recall1_at_0_7_with_a_5_point_drop() -> None:
    settings = Settings()
    assert (settings.gate_moment_metric, settings.gate_max_moment_drop) == ("moment_R1@0.7_mean", 0.05)
    with pytest.raises(ValueError, match="gate_moment_metric"):
        Settings(gate_moment_metric="t2a_R@10_mean")


def test_an_equal_candidate_passes_with_both_moment_numbers_shown(gate_bundles: dict[str, LoadedBundle]) -> None:
    verdict = run_gate(gate_bundles["trained-again"], gate_bundles["trained"], _thresholds(max_moment_drop=0.0),
                       force=False)
    assert verdict.passed and verdict.reasons == []
    moments = verdict.as_dict()["moments"]
    assert moments["metric"] == METRIC and moments["candidate_scorer"] == moments["active_scorer"] == "head"
    assert moments["n_recordings"] == 4 and moments["n_queries"] > 0
    assert moments["candidate"] == moments["active"] and METRIC in moments["active"]


def test_a_candidate_worse_beyond_the_allowed_drop_is_refused(gate_bundles: dict[str, LoadedBundle]) -> None:
    """The degenerate head misses every moment; refused when the active's lead exceeds the allowed drop,
    passed when it does not (the same numbers, another threshold)."""
    trained, degenerate = gate_bundles["trained"], gate_bundles["degenerate"]
    moment_set = run_gate(trained, trained, _thresholds(), force=False)  # warm: the active's report, remembered
    assert moment_set.moments is not None
    active = moment_set.moments["active"][METRIC]
    assert active > 0.0, "the trained head must find some moments for the comparison to mean anything"
    refused = run_gate(degenerate, trained, _thresholds(max_moment_drop=active / 2), force=False)
    assert not refused.passed
    assert refused.moments is not None and refused.moments["candidate"][METRIC] == 0.0
    assert [r for r in refused.reasons if r.startswith(f"{METRIC} drops from {active:.4f} to 0.0000")]
    allowed = run_gate(degenerate, trained, _thresholds(max_moment_drop=min(1.0, active + 0.01)), force=False)
    assert allowed.passed and allowed.reasons == []
    # the remembered report is the active bundle's own: recomputed, it is the same
    again = evaluate_moments(trained, _moment_set_of(trained), ["eng", "fra"])
    assert set(again) >= {f"moment_{m}_eng" for m in ("R1@0.5", "R1@0.7", "mAP")}


def test_a_candidate_without_moments_is_refused_unless_forced(gate_bundles: dict[str, LoadedBundle]) -> None:
    plain, trained = gate_bundles["plain"], gate_bundles["trained"]
    refused = run_gate(plain, trained, _thresholds(), force=False)
    assert not refused.passed and refused.moments is None
    assert any("neither moment windows nor a moment head" in r and "--force" in r for r in refused.reasons)
    forced = run_gate(plain, trained, _thresholds(), force=True)
    assert forced.passed and forced.forced
    # the other way round there is nothing to lose: a bundle with moments may replace one without
    assert run_gate(trained, plain, _thresholds(max_recall_drop=1.0), force=False).moments is None


def _moment_set_of(bundle: LoadedBundle) -> MomentSet:
    found = read_moment_set(bundle.path / "eval")
    assert found is not None
    return found
