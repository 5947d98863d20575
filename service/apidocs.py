"""The interactive API manuals (/docs: Swagger UI, /redoc: ReDoc) served without any network.

FastAPI's defaults load Swagger UI and ReDoc from a CDN (and ReDoc's fonts from Google), so the
manual is blank offline or behind a firewall. The assets come instead from the
``fastapi-offline`` package (MIT; it ships Swagger UI's and ReDoc's release bundles) and are
served by the service under :data:`ASSETS_PATH`; only the HTML shells come from FastAPI.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

ASSETS_PATH = "/api-docs-assets"
ASSET_FILES = ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png")


def assets_dir() -> Path:
    """The directory holding :data:`ASSET_FILES` (inside the installed fastapi-offline package)."""
    return Path(str(files("fastapi_offline") / "static"))


def install_api_docs(app: FastAPI) -> None:
    """Mount the local assets and the /docs, /docs/oauth2-redirect and /redoc pages.

    The app must be created with ``docs_url=None, redoc_url=None`` (FastAPI's CDN pages)."""
    app.mount(ASSETS_PATH, StaticFiles(directory=assets_dir()), name="api-docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"
    title = f"{app.title} API"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=title,
            swagger_js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_PATH}/favicon.png",
            oauth2_redirect_url="/docs/oauth2-redirect",
        )

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=openapi_url,
            title=title,
            redoc_js_url=f"{ASSETS_PATH}/redoc.standalone.js",
            redoc_favicon_url=f"{ASSETS_PATH}/favicon.png",
            with_google_fonts=False,
        )
