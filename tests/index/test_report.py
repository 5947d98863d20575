"""Markdown and rich views of a retrieval report."""

from __future__ import annotations

import numpy as np
from rich.console import Console
from rich.table import Table

from index.metrics.report import METRIC_CONVENTION, format_report_markdown, format_report_rich
from index.metrics.retrieval import retrieval_report

# The worked example of test_metrics (audio = identity, text rows = scores).
SCORES = np.array(
    [
        [0.90, 0.10, 0.25],
        [0.30, 0.75, 0.40],
        [0.60, 0.70, 0.10],
        [0.80, 0.20, 0.15],
        [0.35, 0.30, 0.20],
        [0.00, 0.05, 0.95],
    ]
)
LANGUAGES = ["eng", "fra"]


def _report() -> dict[str, float]:
    return retrieval_report(
        audio_emb=np.eye(3),
        text_emb=SCORES,
        caption_clip=[0, 0, 1, 1, 2, 2],
        caption_lang=["eng", "fra"] * 3,
        caption_group=[0, 0, 1, 1, 2, 2],
        languages=LANGUAGES,
    )


def _table_rows(markdown: str) -> list[list[str]]:
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_markdown_table_rows_and_values() -> None:
    rows = _table_rows(format_report_markdown(_report(), LANGUAGES))
    header, _, eng, fra, mean = rows
    assert header == [
        "Language",
        *[f"T→A {m}" for m in ("R@1", "R@5", "R@10", "mAP@10")],
        *[f"A→T {m}" for m in ("R@1", "R@5", "R@10", "mAP@10")],
        "Gap",
        "Dis",
    ]
    # eng: t2a R@1 2/3, mAP 7/9; a2t R@1 2/3, mAP 5/6 (in %); no Gap/Dis against itself.
    assert eng == [
        "eng",
        "66.7",
        "100.0",
        "100.0",
        "77.8",
        "66.7",
        "100.0",
        "100.0",
        "83.3",
        "—",
        "—",
    ]
    assert fra[:2] == ["fra", "33.3"] and fra[4] == "61.1" and fra[8] == "66.7"
    assert fra[9] == "0.405"  # ‖mean eng − mean fra‖ = ‖(0.75, 0.1, −0.95)/3‖ = 0.40483
    assert mean[0] == "mean" and mean[1] == "50.0" and mean[8] == "75.0"
    assert mean[9] == fra[9] and mean[10] == fra[10]  # one non-English language


def test_markdown_rank_lines_and_convention() -> None:
    text = format_report_markdown(_report(), LANGUAGES)
    assert "- MRV text→audio: 0.75" in text
    assert "- MRV audio→text: 0.25" in text
    assert "- mean rank std audio→text: 0.50" in text
    assert "- clips: 3, captions: 6" in text
    assert METRIC_CONVENTION in text
    assert "DCASE" in METRIC_CONVENTION and "not comparable" in METRIC_CONVENTION.lower()


def test_missing_consistency_metrics_show_na() -> None:
    report = {k: v for k, v in _report().items() if not k.startswith(("mrv", "gap", "dis"))}
    text = format_report_markdown(report, LANGUAGES)
    assert "- MRV text→audio: n/a" in text
    fra = _table_rows(text)[3]
    assert fra[9:] == ["n/a", "n/a"]


def test_rich_table_renders_every_language_and_the_mean() -> None:
    table = format_report_rich(_report(), LANGUAGES).table
    assert isinstance(table, Table)
    assert len(table.columns) == 11
    assert table.row_count == len(LANGUAGES) + 1
    console = Console(record=True, width=250, color_system=None)
    console.print(table)
    rendered = console.export_text()
    for text in ("eng", "fra", "mean", "66.7", "83.3", "0.405", "MRV text→audio: 0.75", "DCASE"):
        assert text in rendered


def test_convention_says_json_values_are_fractions() -> None:
    """The JSON report holds fractions; the convention travelling with it must say so."""
    report = _report()
    recalls = [v for k, v in report.items() if k.startswith(("t2a_R@", "a2t_R@", "t2a_mAP", "a2t_mAP"))]
    assert recalls and all(0.0 <= v <= 1.0 for v in recalls) and max(recalls) == 1.0
    assert "fractions in [0, 1] in JSON" in METRIC_CONVENTION
    assert "shown in %" not in METRIC_CONVENTION
