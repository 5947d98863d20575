"""While the first demo bundle builds, the port answers: /healthz 200, /readyz 503 with progress."""

from __future__ import annotations

import logging
import socket
import threading

import httpx
import pytest

from tests.service.conftest import free_port
from tonearm.build_server import answer_while_building
from tonearm.errors import TonearmError

demo_log = logging.getLogger("tonearm.demo")
loop_log = logging.getLogger("training.loop")


def test_port_answers_health_and_build_progress_until_the_build_ends(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    in_training, finish = threading.Event(), threading.Event()

    def build() -> str:
        demo_log.info("demo bundle [1/3]: corpus", extra={"demo_stage": 1})
        demo_log.info("demo bundle [2/3]: training", extra={"demo_stage": 2, "demo_epochs": 4})
        loop_log.info("epoch %d: loss %.4f (%.0f s)", 1, 3.2, 10.0)
        in_training.set()
        assert finish.wait(30)
        return "bundle-path"

    result: list[str] = []
    builder = threading.Thread(
        target=lambda: result.append(answer_while_building("127.0.0.1", port, build, log_file=tmp_path / "build.log"))
    )
    builder.start()
    try:
        assert in_training.wait(30)
        assert httpx.get(url + "/healthz", timeout=5).json() == {"status": "ok"}
        ready = httpx.get(url + "/readyz", timeout=5)
        assert ready.status_code == 503 and ready.headers["content-type"] == "application/problem+json"
        assert ready.headers["retry-after"] == "10"
        body = ready.json()
        assert body["type"] == "urn:tonearm:problem:not-ready"
        build = body["build"]
        assert build["stage"] == "training" and (build["step"], build["steps"]) == (2, 3)
        assert build["detail"] == "training: epoch 1/4 done"
        assert build["progress"] == pytest.approx(0.19 + 0.67 / 4, abs=1e-3)
        assert build["log"] == str(tmp_path / "build.log")
        assert "step 2/3" in body["detail"]
        search = httpx.post(url + "/v1/search/text", json={"query": "a dog"}, timeout=5)
        assert search.status_code == 503 and search.json()["build"]["step"] == 2
    finally:
        finish.set()
        builder.join(30)
    assert result == ["bundle-path"]
    with socket.socket() as s:  # the port is free again for the real service
        s.bind(("127.0.0.1", port))


def test_a_busy_port_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(TonearmError, match=f"cannot listen on 127.0.0.1:{port}"):
            answer_while_building("127.0.0.1", port, lambda: "never built")
