"""The quality gate over the real demo, through the real admin route (uvicorn HTTP + the admin CLI).

The case of issue 24: the near-random bundle (configs/tiny.yaml: 2 epochs on the 48-clip
`tiny` corpus, 32-dim — the shared ``tiny_bundle``) was once activated over the demo because
each bundle was judged on the candidate's 8 held-out clips. Judged on the demo's held-out set
(300 clips) it must be refused and the demo must keep serving; the demo republished under
another id (the same model) must pass.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from service.app import create_app
from tests.service.bundle_factory import copy_bundle, renamed_copy
from tests.service.conftest import ADMIN, make_settings
from tonearm.cli import main as tonearm_main
from tonearm.demo import cached_demo_bundle

pytestmark = [pytest.mark.slow]
TOKEN = ADMIN["Authorization"].removeprefix("Bearer ")
FRENCH = "Un oiseau chante tout près deux fois, avec des pauses."


def _search(url: str) -> dict:
    r = httpx.post(url + "/v1/search/text", json={"query": FRENCH, "lang": "fra", "k": 3}, timeout=60)
    r.raise_for_status()
    return r.json()


def test_the_near_random_bundle_is_refused_over_the_demo_and_an_equal_one_passes(
    demo_home: Path, tiny_bundle: Path, tmp_path: Path, uvicorn_runner, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("TONEARM_ADMIN_TOKEN", TOKEN)
    demo = cached_demo_bundle(demo_home)
    assert demo is not None
    candidates = tmp_path / "bundles"
    candidates.mkdir()
    near_random = copy_bundle(tiny_bundle, candidates).name
    equal = renamed_copy(demo, candidates, "demo-republished").name
    app = create_app(make_settings(bundle=str(demo), bundles_dir=candidates, gate_min_clips=100))
    with uvicorn_runner(app) as server:
        server.wait_ready()
        before = _search(server.url)
        assert before["bundle_id"] == demo.name

        assert tonearm_main(["bundle", "activate", near_random, "--url", server.url]) == 1
        out = capsys.readouterr().out
        assert "rejected" in out and f"held-out set of the active bundle {demo.name}" in out
        r = httpx.post(server.url + "/v1/bundles/activate", json={"bundle_id": near_random}, headers=ADMIN,
                       timeout=600)
        assert r.status_code == 409, r.text
        verdict = r.json()["verdict"]
        assert verdict["set"]["source"] == "active-held-out" and verdict["set"]["n_clips"] == 300
        assert verdict["set"]["n_queries"] >= 300 * 8
        interval = verdict["interval"]
        assert interval["metric"] == "t2a_R@10_mean" and interval["high"] < -0.5  # far worse, and sure of it
        assert verdict["candidate"]["t2a_R@10_mean"] < 0.2 < 0.8 < verdict["active"]["t2a_R@10_mean"]
        after = _search(server.url)  # the demo keeps serving, with the same answers
        assert after["bundle_id"] == demo.name and after["hits"] == before["hits"]

        assert tonearm_main(["bundle", "activate", equal, "--url", server.url]) == 0
        out = capsys.readouterr().out
        assert "gate: passed" in out and "[+0.0000, +0.0000]" in out
        assert _search(server.url)["bundle_id"] == equal
