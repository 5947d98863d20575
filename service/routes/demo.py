"""The demo page at `/`: plain HTML/JS/CSS from service/web/, served by the service itself.

No build step and nothing from a CDN: the page talks to the /v1 API of the same origin
(text search, audio streaming, audio upload, consistency diagnostic). Only the fixed
files below are served, by name, so no request path ever reaches the file system.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from service.errors import ServiceError
from service.routes import ShallowJsonRoute

WEB_DIR = Path(__file__).resolve().parents[1] / "web"
ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}

router = APIRouter(include_in_schema=False, route_class=ShallowJsonRoute)


@router.get("/")
def page() -> FileResponse:
    return FileResponse(WEB_DIR / "index.html", media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache"})


@router.get("/demo/{name}")
def asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise ServiceError("not-found", f"no demo asset {name!r}")
    return FileResponse(WEB_DIR / name, media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})
