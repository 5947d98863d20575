"""The PNG plots of docs/results/: recall and MRV per method (error bars = std over seeds),
per-language R@1, validation curves. Matplotlib with the Agg backend (no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.quality_jobs import QualityConfig, stats  # noqa: E402

Table = dict[tuple[str, str], list[dict[str, Any]]]


def _methods(cfg: QualityConfig, table: Table) -> list[str]:
    return [name for name in cfg.methods if any(table.get((c, name)) for c in cfg.conditions)]


def _bars(cfg: QualityConfig, table: Table, key: str, *, scale: float, ax: Any, title: str) -> None:
    names = _methods(cfg, table)
    conditions = list(cfg.conditions)
    width = 0.8 / len(conditions)
    x = np.arange(len(names))
    for i, condition in enumerate(conditions):
        values = [stats(table.get((condition, n), []), key) for n in names]
        means = [scale * v[0] if v[2] else np.nan for v in values]
        stds = [scale * v[1] if v[2] else 0.0 for v in values]
        ax.bar(x + (i - (len(conditions) - 1) / 2) * width, means, width, yerr=stds, capsize=2, label=condition)
    ax.set_xticks(x, [cfg.methods[n].label for n in names], rotation=60, ha="right", fontsize=7)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)


def _color(cfg: QualityConfig, name: str) -> Any:
    """One colour per method, the same in every panel (tab20, then cycling markers' colours)."""
    return plt.get_cmap("tab20")(list(cfg.methods).index(name) % 20)


def _style(cfg: QualityConfig, name: str) -> str:
    """Solid for the first 20 methods, dashed after, so colours that repeat stay distinguishable."""
    return "-" if list(cfg.methods).index(name) < 20 else "--"


def _legend(fig: Any, axes: Any) -> None:
    """One legend for the figure: every method that appears in any panel."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, handle)
    if seen:
        fig.legend(list(seen.values()), list(seen), fontsize=7, ncol=1, loc="outside right center")


def _mark_if_empty(ax: Any, condition: str) -> None:
    """An axis with no finished run says so, rather than showing an empty frame."""
    if not ax.lines:
        ax.text(0.5, 0.5, f"no finished runs yet ({condition})", ha="center", va="center",
                transform=ax.transAxes, color="0.4")


def plot_all(cfg: QualityConfig, table: Table, languages: list[str], out: Path) -> None:
    fig, axes = plt.subplots(2, 1, figsize=(12, 9), constrained_layout=True)
    _bars(cfg, table, "r1", scale=100, ax=axes[0], title="R@1, mean of text→audio and audio→text (%, ± std over seeds)")
    _bars(cfg, table, "t2a_R@10_mean", scale=100, ax=axes[1], title="text→audio R@10 (%, ± std over seeds)")
    fig.savefig(out / "recall.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(12, 5), constrained_layout=True)
    _bars(cfg, table, "mrv_t2a", scale=1, ax=ax, title="MRV text→audio (lower = more consistent across languages)")
    ax.set_yscale("symlog", linthresh=1.0)
    fig.savefig(out / "mrv.png", dpi=110)
    plt.close(fig)

    conditions = list(cfg.conditions)
    fig, axes = plt.subplots(1, len(conditions), figsize=(7 * len(conditions), 5), constrained_layout=True,
                             squeeze=False)
    for ax, condition in zip(axes[0], conditions, strict=True):
        for name in _methods(cfg, table):
            results = table.get((condition, name), [])
            if not results:
                continue
            means = [100 * stats(results, f"t2a_R@1_{lang}")[0] for lang in languages]
            ax.plot(languages, means, marker="o", label=cfg.methods[name].label, linewidth=1, color=_color(cfg, name),
                    linestyle=_style(cfg, name))
        _mark_if_empty(ax, condition)
        ax.set_title(f"text→audio R@1 per language ({condition})")
        ax.set_ylabel("%")
        ax.grid(alpha=0.3)
    _legend(fig, axes[0])
    fig.savefig(out / "languages.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(conditions), figsize=(7 * len(conditions), 5), constrained_layout=True,
                             squeeze=False)
    for ax, condition in zip(axes[0], conditions, strict=True):
        for name in _methods(cfg, table):
            curves = [r.get("curve", []) for r in table.get((condition, name), [])]
            curves = [c for c in curves if c]
            if not curves:
                continue
            length = min(len(c) for c in curves)
            epochs = [p["epoch"] for p in curves[0][:length]]
            values = np.array([[100 * p["r1"] for p in c[:length]] for c in curves])
            ax.errorbar(epochs, values.mean(0), yerr=values.std(0), marker="o", capsize=2, linewidth=1,
                        label=cfg.methods[name].label, color=_color(cfg, name), linestyle=_style(cfg, name))
        _mark_if_empty(ax, condition)
        ax.set_title(f"validation r1 during training ({condition})")
        ax.set_xlabel("epoch")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylabel("%")
        ax.grid(alpha=0.3)
    _legend(fig, axes[0])
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)
