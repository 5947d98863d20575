"""`tonearm serve` as a real process, and the demo-bundle cache and lock."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT
from tests.service.conftest import free_port, wait_until
from tonearm import demo


def test_serve_subprocess_answers_with_the_given_bundle(real_bundles, tmp_path):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TONEARM_HOME": str(tmp_path / "home")}
    env.pop("TONEARM_BUNDLE", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "tonearm.cli", "serve", "--bundle", str(real_bundles.a), "--port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
        try:
            return httpx.get(url + "/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, timeout=120, interval=0.2, what="tonearm serve to be ready")
        r = httpx.post(url + "/v1/search/text", json={"query": "un chien aboie", "k": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["bundle_id"] == real_bundles.id("a")
        assert httpx.get(url + "/v1/bundles", timeout=5).status_code == 404  # no token → admin off
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_serve_rejects_a_directory_that_is_not_a_bundle(tmp_path):
    from tonearm.cli import main

    assert main(["serve", "--bundle", str(tmp_path)]) == 2


def _fake_build(calls: list, delay: float):
    def build(root: Path) -> Path:
        calls.append(root)
        time.sleep(delay)  # long enough for the second caller to hit the lock
        bundle = root / "bundles" / f"demo-{len(calls)}"
        bundle.mkdir(parents=True)
        (bundle / "manifest.json").write_text("{}")
        return bundle

    return build


def test_demo_bundle_is_built_once_and_cached(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(demo, "_build", _fake_build(calls, 0.3))
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(demo.ensure_demo_bundle(tmp_path))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results[0] == results[1] == (tmp_path / "demo" / "bundles" / "demo-1").resolve()
    assert demo.ensure_demo_bundle(tmp_path) == results[0] and len(calls) == 1
    assert demo.cached_demo_bundle(tmp_path) == results[0]


def test_demo_rebuilds_when_the_cached_bundle_vanished(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(demo, "_build", _fake_build(calls, 0.0))
    first = demo.ensure_demo_bundle(tmp_path)
    (first / "manifest.json").unlink()
    assert demo.cached_demo_bundle(tmp_path) is None
    second = demo.ensure_demo_bundle(tmp_path)
    assert second.name == "demo-2" and len(calls) == 2


def test_real_demo_build_on_the_tiny_corpus_gives_a_servable_bundle(tmp_path):
    """The same synth → train → export path `tonearm serve` runs, with the tiny corpus and config."""
    from index.runtime.loader import LoadedBundle
    from tonearm.build_server import _collecting
    from tonearm.demo_progress import BuildProgress

    progress = BuildProgress()
    (tmp_path / "demo").mkdir()
    with demo._logging_to(tmp_path / "demo" / "build.log"), _collecting(progress):
        bundle_dir = demo._build(tmp_path / "demo", size="tiny", config=ROOT / "configs" / "tiny.yaml")
    log_text = (tmp_path / "demo" / "build.log").read_text()
    for line in ("demo bundle [1/3]", "synth progress: rendered clips", "demo bundle [2/3]", "epoch 1: loss", "export progress: embedding clips",
                 "export progress: embedding captions", "demo bundle ready"):
        assert line in log_text, line  # the whole build, export progress included, is in the log file
    status = progress.status()
    assert status["step"] == 3 and status["progress"] == pytest.approx(1.0)
    bundle = LoadedBundle.open(bundle_dir)  # verifies checksums, dimensions, ONNX interfaces
    assert bundle.manifest.audio_index.ntotal == len(bundle.audio_items) > 0
    scores, rows = bundle.search_audio(bundle.encode_text(["un chien aboie"]), 3)
    assert (rows >= 0).all() and scores[0, 0] >= scores[0, 2]


def test_a_changed_demo_config_rebuilds(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(demo, "_build", _fake_build(calls, 0.0))
    first = demo.ensure_demo_bundle(tmp_path)
    monkeypatch.setattr(demo, "config_fingerprint", lambda config=demo.DEMO_CONFIG: "another-recipe")
    assert demo.cached_demo_bundle(tmp_path) is None
    second = demo.ensure_demo_bundle(tmp_path)
    assert second != first and len(calls) == 2
    assert "demo-2" in (tmp_path / "demo" / "bundle-another-recipe.path").read_text()


def test_readyz_progress_moves_during_corpus_synthesis():
    """Synthesis logs every tenth of its clips, so the build's progress is not frozen at 0 % for a minute."""
    import logging

    from tonearm.demo_progress import STAGE_WEIGHTS, BuildProgress

    progress = BuildProgress()
    start = logging.LogRecord("tonearm.demo", logging.INFO, __file__, 0, "demo bundle [1/3]", None, None)
    start.demo_stage = 1
    progress.emit(start)
    progress.emit(logging.LogRecord("training.data.synth", logging.INFO, __file__, 0,
                                    "synth progress: rendered clips %d/%d", (300, 3000), None))
    status = progress.status()
    assert status["step"] == 1 and "300/3000" in status["detail"]
    assert status["progress"] == pytest.approx(round(STAGE_WEIGHTS[0] * 0.1, 3))
