"""The page at `/` while the first demo bundle builds, in headless chromium, on a real build.

A real `tonearm serve` process on a fresh home builds the demo by the path `make serve`
takes, with the tiny recipe (tiny corpus, configs/tiny.yaml: a minute, not five). The test
first holds the home's build lock — as a concurrent build in another process would — so
the page is seen in its first state; then it lets the build run and watches the same page
follow the stages by itself and turn into the demo page when the service is ready. API
clients get the 503 problem document throughout.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import TINY_CONFIG
from tests.service.conftest import free_port, wait_until
from tests.service.test_demo_page import browser  # noqa: F401 - the chromium fixture
from tonearm.demo import demo_root

SERVE_TINY = (
    "import sys; from pathlib import Path; import tonearm.demo as demo; "
    "demo.DEMO_SIZE = 'tiny'; demo.DEMO_CONFIG = Path(sys.argv[1]); "
    "from tonearm.cli import main; raise SystemExit(main(['serve']))"
)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_only_a_browser_asking_for_the_root_gets_the_page(tmp_path: Path) -> None:
    import logging

    from fastapi.testclient import TestClient

    from tonearm.build_server import building_app
    from tonearm.demo_progress import BuildProgress

    progress = BuildProgress()
    progress.handle(logging.makeLogRecord({"name": "tonearm.demo", "levelno": logging.INFO, "msg": "[2/3]",
                                           "demo_stage": 2, "demo_epochs": 8}))
    log = tmp_path / "build.log"
    log.write_text("first line\nepoch 3: loss <1.0> & more\n\n")
    client = TestClient(building_app(progress, log_file=log))
    page = client.get("/", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
    assert page.status_code == 503 and page.headers["content-type"].startswith("text/html")
    assert page.headers["retry-after"] == "10" and page.headers["cache-control"] == "no-store"
    assert "Step 2/3: training" in page.text and 'value="0.190"' in page.text
    assert "epoch 3: loss &lt;1.0&gt; &amp; more" in page.text and "<1.0>" not in page.text  # escaped
    assert "__" not in page.text  # every placeholder filled
    for path, accept in (("/", "application/json"), ("/", "*/*"), ("/readyz", "text/html"),
                         ("/v1/search/text", "text/html")):
        r = client.get(path, headers={"Accept": accept})
        assert r.status_code == 503 and r.headers["content-type"] == "application/problem+json", (path, accept)
        assert r.json()["build"]["log_tail"] == "epoch 3: loss <1.0> & more"


@pytest.mark.slow  # a real (tiny) build: under a minute on two idle cores
def test_building_page_follows_a_real_build_and_becomes_the_demo(browser, tmp_path: Path) -> None:  # noqa: F811
    home, port = tmp_path / "home", free_port()
    url = f"http://127.0.0.1:{port}"
    demo_root(home).mkdir(parents=True)
    lock = open(demo_root(home) / ".lock", "w")  # noqa: SIM115 - released below to let the build start
    fcntl.flock(lock, fcntl.LOCK_EX)
    env = {k: v for k, v in os.environ.items() if k not in ("TONEARM_BUNDLE", "TONEARM_BUNDLES_DIR")}
    env.update(TONEARM_HOME=str(home), TONEARM_HOST="127.0.0.1", TONEARM_PORT=str(port))
    with open(tmp_path / "serve.log", "wb") as out:
        process = subprocess.Popen([sys.executable, "-c", SERVE_TINY, str(TINY_CONFIG)], env=env,
                                   stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: _healthy(url), timeout=120, interval=0.2, what="the building server")
        for accept in ("application/json", "*/*"):  # API clients: the problem document, not a page
            r = httpx.get(url + "/", headers={"Accept": accept}, timeout=5)
            assert r.status_code == 503 and r.headers["content-type"] == "application/problem+json"
            assert r.json()["type"] == "urn:tonearm:problem:not-ready" and "build" in r.json()
        ready = httpx.get(url + "/readyz", headers={"Accept": "text/html"}, timeout=5)
        assert ready.status_code == 503 and ready.headers["content-type"] == "application/problem+json"

        page = browser.new_page(viewport={"width": 800, "height": 700})
        errors: list[str] = []
        page.on("pageerror", lambda err: errors.append(str(err)))
        response = page.goto(url + "/")
        assert response is not None and response.status == 503 and response.headers["retry-after"] == "10"
        assert page.title() == "tonearm — building the demo"
        assert page.inner_text("#stage") == "Starting: waiting for the build lock"
        assert page.get_attribute("#progress", "value") == "0.000"
        assert page.locator("#steps li").count() == 3

        lock.close()  # the build starts; the page must follow it without being reloaded by us
        seen: list[str] = []
        deadline = time.monotonic() + 540
        while time.monotonic() < deadline and page.locator("#query").count() == 0:
            try:
                stage = page.inner_text("#stage", timeout=1000)
                progress = float(page.get_attribute("#progress", "value", timeout=1000) or 0)
                if not seen or seen[-1] != stage:
                    seen.append(stage)
                assert 0.0 <= progress <= 1.0
            except Exception:  # the page is reloading into the demo page
                pass
            time.sleep(0.2)
        page.wait_for_selector("#query", timeout=30_000)  # reloaded itself into the demo page
        assert page.title() == "tonearm — multilingual audio search"
        steps = [s for s in seen if s.startswith("Step ")]
        assert steps, seen  # the page showed the build's stages as they came
        assert steps == sorted(steps), seen  # in order
        assert errors == []
        assert httpx.get(url + "/readyz", timeout=5).status_code == 200
    finally:
        lock.close()
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
