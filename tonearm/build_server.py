"""Answer on the service port while the first demo bundle is being built.

The first ``tonearm serve`` builds the demo bundle (minutes). Meanwhile a minimal app listens on
the configured host and port: ``/healthz`` answers 200 (the process is alive) and every other
path — ``/readyz`` included — a 503 ``not-ready`` problem whose ``build`` member holds the
stage and progress (with ``Retry-After``), so orchestrators and people see what is happening.
A browser asking for ``/`` (``Accept: text/html``) gets a page instead
(:mod:`tonearm.building_page`): the stage, a progress bar and the build log's latest line,
refreshed from ``/readyz`` every 1.5 s, which reloads itself into the demo page once the
service answers ready. Everything else still gets the problem document.
When the build ends this server stops and the real service takes the port over (the port is
closed for the moment between the two, well under a second).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from service.errors import PROBLEM_MEDIA_TYPE, problem_body
from tonearm.building_page import building_page, log_tail, wants_html
from tonearm.demo_progress import BuildProgress, attached
from tonearm.errors import TonearmError

log = logging.getLogger(__name__)
T = TypeVar("T")
RETRY_AFTER_SECONDS = 10
ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
BUILD_LOGGERS = ("tonearm.demo", "training")


def building_app(progress: BuildProgress, *, log_file: Path | None = None) -> FastAPI:
    app = FastAPI(title="tonearm (building the demo bundle)", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.api_route("/{path:path}", methods=ALL_METHODS)
    async def building(request: Request, path: str) -> Response:
        status = progress.status()
        if log_file is not None:
            status["log"] = str(log_file)
            status["log_tail"] = log_tail(log_file)
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS), "Cache-Control": "no-store"}
        if path == "" and request.method in ("GET", "HEAD") and wants_html(request.headers.get("accept", "")):
            return HTMLResponse(building_page(status), status_code=503, headers=headers)
        detail = (
            f"building the demo bundle: step {status['step']}/{status['steps']} ({status['detail']}), "
            f"{100 * status['progress']:.0f} % after {status['elapsed_seconds']:.0f} s"
        )
        body = problem_body("not-ready", detail, instance=request.url.path, build=status)
        return JSONResponse(body, status_code=503, media_type=PROBLEM_MEDIA_TYPE, headers=headers)

    return app


def _collecting(progress: BuildProgress) -> AbstractContextManager[None]:
    """Feed the build's INFO records to ``progress``."""
    return attached(progress, [logging.getLogger(name) for name in BUILD_LOGGERS])


def answer_while_building(host: str, port: int, build: Callable[[], T], *, log_file: Path | None = None) -> T:
    """Run ``build()`` while a :func:`building_app` answers on ``host:port``; its result."""
    import uvicorn

    progress = BuildProgress()
    config = uvicorn.Config(building_app(progress, log_file=log_file), host=host, port=port, log_level="warning")
    server = uvicorn.Server(config)

    def run() -> None:
        try:
            server.run()
        except SystemExit:  # uvicorn exits when it cannot bind; reported below
            pass

    thread = threading.Thread(target=run, name="tonearm-build-server", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise TonearmError(f"cannot listen on {host}:{port} (in use?); pass --port or set TONEARM_PORT")
        thread.join(0.05)
    log.info(
        "building the demo bundle; http://%s:%d/readyz reports its progress (503 until ready)%s",
        host, port, f", log: {log_file}" if log_file else "",
    )
    try:
        with _collecting(progress):
            return build()
    finally:
        server.should_exit = True
        thread.join(timeout=30)
