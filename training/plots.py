"""PNG figures of a run (curves from ``metrics.jsonl``) and of an evaluation report.

Pure functions of already-computed numbers; matplotlib is imported lazily with
the non-interactive Agg backend so that nothing needs a display.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

VALIDATION_KEYS = ("t2a_R@1_mean", "t2a_R@10_mean", "a2t_R@1_mean", "a2t_R@10_mean")
_EPOCH_BOOKKEEPING = {"kind", "epoch", "step", "seconds", "lr"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(
    records: Sequence[Mapping[str, Any]], kind: str, key: str, x: str = "step"
) -> tuple[list, list]:
    xs, ys = [], []
    for record in records:
        value = record.get(key)
        if record.get("kind") == kind and isinstance(value, int | float) and math.isfinite(value):
            xs.append(record[x])
            ys.append(value)
    return xs, ys


def _keys(records: Sequence[Mapping[str, Any]], kind: str, *, exclude: set[str]) -> list[str]:
    keys: dict[str, None] = {}
    for record in records:
        if record.get("kind") == kind:
            keys.update(
                (k, None)
                for k, v in record.items()
                if k not in exclude and isinstance(v, int | float)
            )
    return list(keys)


def plot_training_curves(records: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Loss terms and learning rate per step, validation R@k, and every per-epoch scalar."""
    plt = _pyplot()
    loss_keys = [k for k in _keys(records, "step", exclude={"step", "epoch"}) if k.endswith("loss")]
    epoch_keys = _keys(records, "epoch", exclude=_EPOCH_BOOKKEEPING)
    panels = 3 + len(epoch_keys)
    cols = min(3, panels)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    flat = list(axes.flat)
    for key in loss_keys:
        flat[0].plot(*_series(records, "step", key), label=key)
    flat[0].set(title="training loss", xlabel="step")
    flat[1].plot(*_series(records, "step", "lr"))
    flat[1].set(title="learning rate", xlabel="step")
    for key in VALIDATION_KEYS:
        flat[2].plot(*_series(records, "eval", key), marker="o", label=key)
    flat[2].set(title="validation", xlabel="step", ylim=(0, 1))
    for axis, key in zip(flat[3:], epoch_keys, strict=False):
        axis.plot(*_series(records, "epoch", key, x="epoch"), marker="o")
        axis.set(title=key, xlabel="epoch")
    for axis in flat[:3]:
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    for axis in flat[panels:]:
        axis.axis("off")
    fig.tight_layout()
    _save(fig, path, plt)


def plot_language_report(report: Mapping[str, float], languages: Sequence[str], path: Path) -> None:
    """Grouped bars of t2a/a2t R@1 and R@10 per language, with MRV in the title."""
    plt = _pyplot()
    bars = ("t2a_R@1", "t2a_R@10", "a2t_R@1", "a2t_R@10")
    groups = [*languages, "mean"]
    width = 0.8 / len(bars)
    fig, axis = plt.subplots(figsize=(max(6.0, 1.1 * len(groups)), 3.8))
    for offset, bar in enumerate(bars):
        heights = [float(report.get(f"{bar}_{group}", float("nan"))) for group in groups]
        positions = [i + (offset - (len(bars) - 1) / 2) * width for i in range(len(groups))]
        axis.bar(positions, heights, width=width, label=bar)
    axis.set_xticks(range(len(groups)), groups)
    mrv = report.get("mrv_t2a", float("nan"))
    mrv_a2t = report.get("mrv_a2t", float("nan"))
    axis.set(
        ylim=(0, 1),
        ylabel="recall",
        title=f"per-language recall (MRV t2a {mrv:.2f}, a2t {mrv_a2t:.2f})",
    )
    axis.legend(fontsize=7, ncols=len(bars))
    fig.tight_layout()
    _save(fig, path, plt)


def _save(fig: Any, path: Path, plt: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
