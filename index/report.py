"""Human-readable views of a ``index.metrics.retrieval_report`` dict (Markdown, rich).

Both views show one row per language plus the mean over languages, the
text→audio and audio→text R@1/5/10 and mAP@10 (as percentages, like the papers'
tables), Gap/Dis against English, the rank-consistency lines and the metric
convention. A key missing from the report (an undefined consistency metric)
is shown as ``n/a``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich.table import Table

from index.languages import ENGLISH
from index.metrics import DIRECTIONS, RETRIEVAL_METRICS

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


def format_report_rich(report: Mapping[str, float], languages: Sequence[str]) -> Table:
    """The report as a ``rich`` table for the CLI; consistency lines and convention as caption."""
    table = Table(
        title="Retrieval (R@k, mAP@10 in %) and cross-language consistency",
        caption="\n".join([*_rank_lines(report), METRIC_CONVENTION]),
        caption_justify="left",
    )
    for index, column in enumerate(_header()):
        table.add_column(column, justify="left" if index == 0 else "right")
    body = _rows(report, languages)
    for index, row in enumerate(body):
        table.add_row(*row, end_section=index == len(body) - 2)
    return table
