"""/docs and /redoc work offline: every asset they reference is served by the service itself."""

from __future__ import annotations

import re

import httpx
import pytest

from service.app import create_app
from tests.service.conftest import UvicornServer, fake_opener, make_settings

ASSET_REFERENCE = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']|url:\s*['"]([^'"]+)['"]""")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    bundles = tmp_path_factory.mktemp("bundles")
    (bundles / "fake-a").mkdir()
    (bundles / "fake-a" / "manifest.json").write_text("{}")
    with UvicornServer(create_app(make_settings(bundles_dir=bundles, bundle="fake-a"), opener=fake_opener)) as s:
        yield s


@pytest.mark.parametrize(("page", "script"), [("/docs", "swagger-ui-bundle.js"), ("/redoc", "redoc.standalone.js")])
def test_manual_pages_reference_only_local_assets_that_load(server, page, script):
    html = httpx.get(server.url + page, timeout=10)
    assert html.status_code == 200 and html.headers["content-type"].startswith("text/html")
    references = [a or b for a, b in ASSET_REFERENCE.findall(html.text)]
    assert any(r.endswith(script) for r in references), references
    assert "//" not in html.text.replace("://127.0.0.1", ""), "a page must not load anything from another host"
    for reference in references:
        assert reference.startswith("/"), f"{page} references a non-local asset: {reference}"
        asset = httpx.get(server.url + reference, timeout=10)
        assert asset.status_code == 200, reference
        if reference.endswith(".js"):
            assert asset.headers["content-type"].split(";")[0] in ("text/javascript", "application/javascript")
            assert len(asset.content) > 100_000  # the real bundle, not a stub
    assert "/openapi.json" in references or "'/openapi.json'" in html.text or '"/openapi.json"' in html.text


def test_manual_pages_are_not_part_of_the_api_schema(server):
    paths = httpx.get(server.url + "/openapi.json", timeout=10).json()["paths"]
    assert not [p for p in paths if p.startswith(("/docs", "/redoc", "/api-docs-assets"))]
