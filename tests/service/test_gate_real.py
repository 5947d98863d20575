"""The quality gate on real bundles through the real admin route (uvicorn HTTP + `tonearm bundle activate`).

Fast half (tiny bundles): the minimum set size, the verdict's set / interval, a better candidate
passing. Slow half (tests/service/test_demo_gate.py): the near-random tiny bundle refused over the
real demo, an equal one passing.
"""

from __future__ import annotations

import httpx

from service.app import create_app
from tests.service.conftest import ADMIN, make_settings
from tonearm.cli import main as tonearm_main

TOKEN = ADMIN["Authorization"].removeprefix("Bearer ")


def _settings(bundles, active: str, **extra):
    return make_settings(bundles_dir=bundles.root, bundle=active, **extra)


def _serving(url: str) -> str:
    return httpx.post(url + "/v1/search/text", json={"query": "a dog barks", "k": 1}, timeout=30).json()["bundle_id"]


def test_a_set_below_the_minimum_is_refused_without_force(real_bundles, uvicorn_runner, monkeypatch, capsys):
    """Tiny bundles hold 8 held-out clips: R@10 over 8 clips is 1 for any model, so the gate refuses to judge."""
    monkeypatch.setenv("TONEARM_ADMIN_TOKEN", TOKEN)
    a, b = real_bundles.id("a"), real_bundles.id("b")
    app = create_app(_settings(real_bundles, a, gate_min_clips=100))
    with uvicorn_runner(app) as server:
        server.wait_ready()
        r = httpx.post(server.url + "/v1/bundles/activate", json={"bundle_id": b}, headers=ADMIN, timeout=300)
        assert r.status_code == 409, r.text
        verdict = r.json()["verdict"]
        assert verdict["set"] == {"source": "active-held-out", "name": f"held-out set of the active bundle {a}",
                                  "n_clips": 8, "n_queries": verdict["set"]["n_queries"],
                                  "languages": verdict["languages"]}
        assert verdict["set"]["n_queries"] == 8 * 3 * len(verdict["languages"])  # 3 captions per clip and language
        assert any("8 clips, fewer than the minimum 100" in reason and "--force" in reason
                   for reason in verdict["reasons"])
        assert set(verdict["candidate"]) == set(verdict["active"]) >= {"t2a_R@10_mean", "mrv_t2a"}
        interval = verdict["interval"]
        assert interval["metric"] == "t2a_R@10_mean" and interval["low"] <= interval["delta"] <= interval["high"]
        assert _serving(server.url) == a

        assert tonearm_main(["bundle", "activate", b, "--url", server.url]) == 1
        out = capsys.readouterr().out
        assert f"held-out set of the active bundle {a}" in out and "8 clips" in out and "interval" in out
        assert "rejected" in out and _serving(server.url) == a

        assert tonearm_main(["bundle", "activate", b, "--url", server.url, "--force"]) == 0
        assert "forced" in capsys.readouterr().out and _serving(server.url) == b


def test_a_better_candidate_passes_and_the_verdict_is_reproducible(real_bundles, uvicorn_runner):
    """Active: the collapsed copy of a (every clip embedded alike); candidate: a, judged on the worse one's set."""
    worse, a = real_bundles.id("worse"), real_bundles.id("a")
    app = create_app(_settings(real_bundles, worse, gate_min_clips=8, gate_metric="t2a_R@5_mean"))
    with uvicorn_runner(app) as server:
        server.wait_ready()
        r = httpx.post(server.url + "/v1/bundles/activate", json={"bundle_id": a}, headers=ADMIN, timeout=300)
        assert r.status_code == 200, r.text
        verdict = r.json()["verdict"]
        assert verdict["passed"] and not verdict["forced"] and verdict["reasons"] == []
        assert verdict["interval"]["low"] > 0  # clearly better on the same queries
        assert _serving(server.url) == a
        httpx.post(server.url + "/v1/bundles/rollback", headers=ADMIN, timeout=30).raise_for_status()
        again = httpx.post(server.url + "/v1/bundles/activate", json={"bundle_id": a}, headers=ADMIN, timeout=300)
        assert again.json()["verdict"] == verdict  # seeded bootstrap: the same verdict every time
