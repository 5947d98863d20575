"""`tonearm bundle list|activate|rollback` against a real uvicorn server: hints and layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.app import create_app
from tests.service.conftest import UvicornServer, fake_opener, make_settings
from tonearm.cli import main as tonearm_main

TOKEN = "test-admin-token-123456"
LONG_IDS = ("demo-small-20261123T004500Z-0123456789abcdef", "demo-small-20261123T010000Z-fedcba9876543210")


@pytest.fixture(scope="module")
def bundles_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bundles")
    for name in LONG_IDS:
        (root / name).mkdir()
        (root / name / "manifest.json").write_text("{}")
    return root


@pytest.fixture(scope="module")
def admin_server(bundles_dir: Path):
    app = create_app(make_settings(bundles_dir=bundles_dir, bundle=LONG_IDS[0]), opener=fake_opener)
    with UvicornServer(app) as server:
        server.wait_ready()
        yield server


@pytest.fixture(scope="module")
def server_without_admin(bundles_dir: Path):
    app = create_app(make_settings(bundles_dir=bundles_dir, bundle=LONG_IDS[0], admin_token=None), opener=fake_opener)
    with UvicornServer(app) as server:
        server.wait_ready()
        yield server


@pytest.mark.parametrize("columns", ["30", "60", "200"])
def test_list_shows_whole_ids_in_any_width(admin_server, monkeypatch, capsys, columns):
    monkeypatch.setenv("TONEARM_ADMIN_TOKEN", TOKEN)
    monkeypatch.setenv("COLUMNS", columns)
    assert tonearm_main(["bundle", "list", "--url", admin_server.url]) == 0
    out = capsys.readouterr().out
    for bundle_id in LONG_IDS:
        assert bundle_id in out
    assert out.count("invalid") == 2  # each bundle's state (fake manifests do not verify)
    assert max(len(line) for line in out.splitlines()) <= max(int(columns), len(LONG_IDS[0]))


def test_list_json(admin_server, monkeypatch, capsys):
    monkeypatch.setenv("TONEARM_ADMIN_TOKEN", TOKEN)
    assert tonearm_main(["bundle", "list", "--json", "--url", admin_server.url]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["active"] == LONG_IDS[0]
    assert sorted(b["bundle_id"] for b in body["bundles"]) == sorted(LONG_IDS)


@pytest.mark.parametrize("command", [["list"], ["rollback"], ["activate", LONG_IDS[1]]])
def test_admin_routes_off_says_how_to_turn_them_on(server_without_admin, monkeypatch, capsys, command):
    monkeypatch.delenv("TONEARM_ADMIN_TOKEN", raising=False)
    assert tonearm_main(["bundle", *command, "--url", server_without_admin.url]) == 2
    err = capsys.readouterr().err
    assert "admin routes are off" in err and "TONEARM_ADMIN_TOKEN" in err and err.count("\n") == 1


def test_unknown_bundle_is_not_mistaken_for_admin_off(admin_server, monkeypatch, capsys):
    monkeypatch.setenv("TONEARM_ADMIN_TOKEN", TOKEN)
    assert tonearm_main(["bundle", "activate", "no-such-bundle", "--url", admin_server.url]) == 2
    err = capsys.readouterr().err
    assert "404" in err and "admin routes are off" not in err
