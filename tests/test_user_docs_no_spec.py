"""Users do not have SPEC.md: the CLI help, README, docs/ and presets must point to docs/*.md instead."""

from __future__ import annotations

import argparse
from pathlib import Path

from tonearm.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def _help_texts(parser: argparse.ArgumentParser) -> list[str]:
    texts = [parser.format_help()]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                texts.extend(_help_texts(sub))
    return texts


def test_cli_help_cites_no_spec_section() -> None:
    texts = _help_texts(build_parser())
    assert len(texts) > 10  # every subcommand was visited
    assert [t.splitlines()[0] for t in texts if "SPEC" in t] == []


def test_user_docs_cite_no_spec_section() -> None:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "configs").rglob("*.yaml"))]
    assert len(files) > 20
    offending = [str(f.relative_to(ROOT)) for f in files if "SPEC §" in f.read_text(encoding="utf-8")]
    assert offending == []
