"""Human-readable views of a ``index.metrics.retrieval.retrieval_report`` dict (Markdown, rich).

Both views show one row per language plus the mean over languages, the
text→audio and audio→text R@1/5/10 and mAP@10 (as percentages, like the papers'
tables), Gap/Dis against English, the rank-consistency lines and the metric
convention. A key missing from the report (an undefined consistency metric)
is shown as ``n/a``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from index.languages import ENGLISH
from index.metrics.retrieval import DIRECTIONS, RETRIEVAL_METRICS

METRIC_CONVENTION = (
    "Convention (Mei et al., WavCaps, ML-CLAP, LAION-CLAP; the one the papers' tables use): "
    "text→audio: every caption is a query, its own clip the one relevant item, all clips the "
    "gallery; mAP@10 = 1/rank if rank ≤ 10 else 0. "
    "Audio→text: every clip is a query, a hit at k when any of its captions is in the top k; "
    "mAP@10 = Σ_{j: r_j ≤ 10} j/r_j over the sorted ranks r_j of its captions, divided by "
    "min(number of its captions, 10). "
    "Per language, text→audio queries are that language's captions and audio→text searches "
    "only that language's captions; 'mean' is the unweighted mean over languages. "
    "Ranks are 1-based with pessimistic ties (a non-relevant item scoring equal to a relevant "
    "one ranks above it). R@k and mAP@10 are fractions in [0, 1] in JSON reports and API "
    "responses; the tables print them in %. "
    "MRV = mean over query groups (a caption and its translations; for audio→text, a clip "
    "with its best-ranked caption per language) of the population variance of the target's "
    "rank across languages (ATRI Eq. 16); mean rank std = mean of the per-group population "
    "standard deviations (CCRK). Groups use the languages they have; groups with fewer than "
    "two are skipped. Lower is more consistent. "
    "Gap = ‖mean eng − mean lang‖ and Dis = mean ‖eng − lang‖ of the text embeddings of "
    "translation pairs (ATRI Eq. 14–15); the 'mean' row averages the non-English languages. "
    "Not comparable with other conventions, e.g. DCASE's audio→text 'true recall' (fraction "
    "of a clip's captions retrieved) or results computed with optimistic tie-breaking."
)

_DIRECTION_TITLES = {"t2a": "T→A", "a2t": "A→T"}
_RANK_LINES = (
    ("mrv_t2a", "MRV text→audio"),
    ("mrv_a2t", "MRV audio→text"),
    ("mean_rank_std_t2a", "mean rank std text→audio"),
    ("mean_rank_std_a2t", "mean rank std audio→text"),
)


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100.0 * value:.1f}"


def _plain(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _mean_of(report: Mapping[str, float], keys: list[str]) -> float | None:
    values = [report[key] for key in keys if key in report]
    return sum(values) / len(values) if values else None


def _consistency(report: Mapping[str, float], name: str, row: str, languages: Sequence[str]) -> str:
    """Gap or Dis cell: '—' for English, the mean over non-English languages on the mean row."""
    if row == ENGLISH:
        return "—"
    if row == "mean":
        keys = [f"{name}_{lang}" for lang in languages if lang != ENGLISH]
        return _plain(_mean_of(report, keys), 3)
    return _plain(report.get(f"{name}_{row}"), 3)


def _header() -> list[str]:
    columns = [f"{_DIRECTION_TITLES[d]} {m}" for d in DIRECTIONS for m in RETRIEVAL_METRICS]
    return ["Language", *columns, "Gap", "Dis"]


def _rows(report: Mapping[str, float], languages: Sequence[str]) -> list[list[str]]:
    """Cells of the table body: one row per language, then the mean row."""
    rows = []
    for row in [*languages, "mean"]:
        cells = [
            _percent(report.get(f"{d}_{m}_{row}")) for d in DIRECTIONS for m in RETRIEVAL_METRICS
        ]
        gap_dis = [_consistency(report, name, row, languages) for name in ("gap", "dis")]
        rows.append([row, *cells, *gap_dis])
    return rows


def _rank_lines(report: Mapping[str, float]) -> list[str]:
    lines = [f"{label}: {_plain(report.get(key), 2)}" for key, label in _RANK_LINES]
    clips, captions = report.get("n_clips"), report.get("n_captions")
    lines.append(f"clips: {_plain(clips, 0)}, captions: {_plain(captions, 0)}")
    return lines


def format_report_markdown(report: Mapping[str, float], languages: Sequence[str]) -> str:
    """The report as a Markdown table, the rank-consistency lines and the convention."""
    header = _header()
    table = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
        *("| " + " | ".join(row) + " |" for row in _rows(report, languages)),
    ]
    lines = ["- " + line for line in _rank_lines(report)]
    return "\n".join([*table, "", *lines, "", f"_{METRIC_CONVENTION}_", ""])


TITLE = "Retrieval (R@k, mAP@10 in %) and cross-language consistency"


def _table(title: str, header: list[str], body: list[list[str]], caption: str | None = None) -> Table:
    """Cells fold rather than end in '…' if the terminal is narrower still: a value is never cut."""
    table = Table(title=title, caption=caption, caption_justify="left")
    for index, column in enumerate(header):
        table.add_column(column, justify="left" if index == 0 else "right", overflow="fold")
    for index, row in enumerate(body):
        table.add_row(*row, end_section=index == len(body) - 2)
    return table


def _natural_width(header: list[str], body: list[list[str]]) -> int:
    """Columns a table needs with every cell on one line (borders and padding included)."""
    widths = [max(cell_len(cell) for cell in column) for column in zip(header, *body, strict=True)]
    return sum(widths) + 3 * len(widths) + 1


@dataclass
class ReportView:
    """A rich renderable: one table when the console is wide enough for every value on one
    line, else one table per direction (each about 70 columns: it fits an 80-column terminal
    or a pipe), so no value is ever cut to fit the width."""

    header: list[str]
    body: list[list[str]]
    caption: str

    @property
    def table(self) -> Table:
        return _table(TITLE, self.header, self.body, self.caption)

    def parts(self, width: int) -> list[Table]:
        if _natural_width(self.header, self.body) <= width:
            return [self.table]
        per_direction = len(RETRIEVAL_METRICS)
        tables = []
        for number, direction in enumerate(DIRECTIONS):
            columns = [0, *range(1 + number * per_direction, 1 + (number + 1) * per_direction)]
            if number == 0:
                columns += [len(self.header) - 2, len(self.header) - 1]  # Gap, Dis
            name = "text→audio" if direction == "t2a" else "audio→text"
            tables.append(_table(
                f"{name} retrieval (R@k, mAP@10 in %)" + (" and cross-language consistency" if number == 0 else ""),
                [self.header[c].removeprefix(_DIRECTION_TITLES[direction] + " ") for c in columns],
                [[row[c] for c in columns] for row in self.body],
            ))
        return tables

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        parts = self.parts(options.max_width)
        yield from parts
        if len(parts) > 1:  # the wide table carries it as its caption
            yield Text(self.caption)


def format_report_rich(report: Mapping[str, float], languages: Sequence[str]) -> ReportView:
    """The report for the CLI (``Console().print(...)``): the table(s), consistency lines and convention."""
    return ReportView(
        header=_header(),
        body=_rows(report, languages),
        caption="\n".join([*_rank_lines(report), METRIC_CONVENTION]),
    )
