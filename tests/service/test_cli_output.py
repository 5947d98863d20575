"""Quiet, complete CLI output (issue 24 item 6): no library INFO lines, report tables that never
cut a value at 80 columns or in a pipe, `serve --help` naming every option's environment variable.
(`tonearm index` listing each skipped file once: tests/service/test_own_audio.py.)"""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys

import pytest
from rich.console import Console

from index.metrics.report import format_report_rich
from service.settings import Settings
from tests.conftest import ROOT
from tests.service.conftest import fake_bundles_server
from tonearm.cli import OwnInfoOnly, build_parser

LANGUAGES = ["eng", "fra", "deu", "spa", "nld", "cat", "jpn", "zho"]


def _report() -> dict[str, float]:
    """A full 8-language report with values of every width (0.0, 9.9, 100.0)."""
    report: dict[str, float] = {}
    for i, lang in enumerate([*LANGUAGES, "mean"]):
        for d in ("t2a", "a2t"):
            for j, m in enumerate(("R@1", "R@5", "R@10", "mAP@10")):
                report[f"{d}_{m}_{lang}"] = [0.0, 0.099, 0.9523, 1.0][(i + j) % 4]
        if lang != "eng":
            report[f"gap_{lang}"], report[f"dis_{lang}"] = 0.123 + i / 100, 1.234 + i / 100
    report |= {"mrv_t2a": 4.52, "mrv_a2t": 3.1, "mean_rank_std_t2a": 1.2, "mean_rank_std_a2t": 0.9,
               "n_clips": 300, "n_captions": 12000}
    return report


def _cells() -> set[str]:
    view = format_report_rich(_report(), LANGUAGES)
    return {cell for row in view.body for cell in row}


@pytest.mark.parametrize("width", [60, 80, 100, 250, None])  # None: a pipe (rich's default 80 columns)
def test_report_tables_show_every_value_whole(width):
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None)
    console.print(format_report_rich(_report(), LANGUAGES))
    text = out.getvalue()
    assert "…" not in text
    assert all(len(line) <= console.width for line in text.splitlines())
    tokens = set(re.findall(r"[^\s│┃┆|]+", text))
    missing = {cell for cell in _cells() if cell not in tokens}
    assert not missing, (width, missing, text)
    for language in LANGUAGES:  # one row per language in each table part
        assert re.search(rf"│ {language}\s", text)
    assert "MRV text→audio: 4.52" in text and "DCASE" in text


def test_report_is_one_table_when_wide_and_one_per_direction_when_narrow():
    view = format_report_rich(_report(), LANGUAGES)
    assert len(view.parts(250)) == 1 and len(view.table.columns) == 11
    narrow = view.parts(80)
    assert [len(t.columns) for t in narrow] == [7, 5]
    assert [c.header for c in narrow[1].columns] == ["Language", "R@1", "R@5", "R@10", "mAP@10"]


# ------------------------------------------------------------------ no library INFO lines


def _record(name: str, level: int, pathname: str = "/somewhere/site-packages/lib.py") -> logging.LogRecord:
    return logging.LogRecord(name, level, pathname, 1, "message", None, None)


def test_library_info_lines_are_dropped_and_ours_kept():
    keep = OwnInfoOnly().filter
    assert not keep(_record("httpx", logging.INFO))
    assert not keep(_record("faiss.loader", logging.INFO))
    assert keep(_record("httpx", logging.WARNING))
    for own in ("tonearm.demo", "training.loop", "index.catalogue.own_audio", "service.app", "__main__"):
        assert keep(_record(own, logging.INFO))
    assert keep(_record("quality_diagnostics", logging.INFO, str(ROOT / "bench" / "quality_diagnostics.py")))


@pytest.fixture(scope="module")
def admin_server(tmp_path_factory):
    with fake_bundles_server(tmp_path_factory.mktemp("bundles")) as server:
        yield server


@pytest.mark.parametrize("command", [["list"], ["list", "--json"], ["rollback"]])
def test_admin_cli_prints_no_library_log_lines(admin_server, command):
    env = {**os.environ, "TONEARM_ADMIN_TOKEN": "test-admin-token-123456", "COLUMNS": "80"}
    done = subprocess.run(
        [sys.executable, "-m", "tonearm.cli", "bundle", *command, "--url", admin_server.url],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    output = done.stdout + done.stderr
    assert "httpx" not in output and "HTTP Request" not in output, output
    assert not re.search(r"\bINFO\b", output), output
    if command == ["list"]:
        assert done.returncode == 0 and "fake-a" in done.stdout


# ------------------------------------------------------------------ serve --help


def _serve_parser():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["serve"]


def test_serve_help_names_the_environment_variable_of_every_option():
    parser = _serve_parser()
    fields = set(Settings.model_fields)
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help and f"TONEARM_{action.dest.upper()}" in action.help, action.option_strings
        assert action.dest in fields, action.dest  # the variable exists: a Settings field
    text = parser.format_help()
    for option in ("--port", "--host", "--workers", "--bundle"):
        assert option in text
    for name in fields:  # every setting, with its default, in the epilog
        assert f"TONEARM_{name.upper()}=" in text, name
    assert "TONEARM_PORT=8000" in text and "TONEARM_HOST=127.0.0.1" in text


def test_serve_help_from_the_command_line():
    done = subprocess.run([sys.executable, "-m", "tonearm.cli", "serve", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert "TONEARM_PORT" in done.stdout and "--port" in done.stdout and "docs/service.md" in done.stdout


# ------------------------------------------------------------------ the gate's refusal


def test_a_refusal_before_any_evaluation_names_the_flag_and_prints_no_empty_table():
    """An index-only candidate is refused before the gate evaluates anything: no table "on -",
    and the way out is the CLI's ``--force`` flag (service/gate.py words it; the CLI prints it)."""
    from service.admin_client import _print_verdict
    from service.gate import FORCE_HINT

    verdict = {"passed": False, "forced": False, "compared_to": "run-a", "languages": [],
               "candidate": {}, "active": {}, "reasons": [f"the candidate has no held-out set; {FORCE_HINT}"]}
    out = io.StringIO()
    _print_verdict(Console(file=out, width=80, color_system=None), verdict)
    text = out.getvalue()
    assert "--force" in text and "force=true" not in text
    assert "on -" not in text and "┏" not in text and "metric" not in text
    assert "gate: rejected" in text
