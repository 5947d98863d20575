"""The presets tables of README.md and docs/training.md agree with configs/ (issue 24 item 5).

Fails when a table names a preset file that does not exist, when a preset with its own
objective is in neither table, when a README row lists a preset whose objective is not the
row's, or when docs/training.md states epochs, learning rate or objective of a preset that the
preset file does not have (its demo.yaml row once said 6 epochs of the default objective while
the file trains KCL for 8 epochs at lr 2e-3).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from training.config import load_train_config

CONFIGS = ROOT / "configs"


def _table(text: str, header: str) -> list[list[str]]:
    """Rows (cells stripped) of the Markdown table whose header line starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _expand(pattern: str) -> list[Path]:
    """Files matching a README path pattern: ``*`` globs and ``{a,b,c}`` alternatives."""
    parts = re.split(r"\{([^}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    files: list[Path] = []
    for combo in itertools.product(*choices):
        files += sorted(ROOT.glob("".join(combo)))
    return files


def _objective(path: Path) -> dict[str, Any]:
    return load_train_config(path, []).objective.model_dump()


def _all_presets() -> list[Path]:
    return sorted(CONFIGS.rglob("*.yaml"))


def _readme_rows() -> dict[str, list[Path]]:
    """README's "objective (paper) | presets" table: objective → preset files."""
    rows = _table((ROOT / "README.md").read_text(encoding="utf-8"), "| objective (paper) | presets |")
    out = {}
    for objective, presets in rows:
        patterns = re.findall(r"`([^`]+)`", presets)
        files = [f for pattern in patterns for f in _expand(pattern)]
        for pattern in patterns:
            assert _expand(pattern), f"README presets table: {pattern!r} matches no file"
        out[objective] = files
    return out


def _training_rows() -> dict[str, list[str]]:
    rows = _table((ROOT / "docs" / "training.md").read_text(encoding="utf-8"), "| file | what |")
    return {row[0].strip("`"): row for row in rows}


def _names(objective: dict[str, Any]) -> set[str]:
    names = {objective["base"]["name"], (objective.get("strategy") or {}).get("name")}
    names |= {r["name"] for r in objective.get("regularizers") or []}
    if objective.get("distill"):
        names.add("distill")
    if objective.get("knowledge"):
        names.add("knowledge")
    return names - {None}


ROW_CHECKS: dict[str, Callable[[dict[str, Any]], bool]] = {
    "InfoNCE / SigLIP": lambda o: o["base"]["name"] in {"infonce", "siglip"},
    "SupCLAP SVR": lambda o: bool({"svr", "infonce_reweight"} & _names(o)) or o["base"]["name"] == "siglip",
    "ATRI 1-to-K, co-anchor": lambda o: bool({"kcl", "cacl"} & _names(o)),
    "Estimated correspondences": lambda o: "distill" in _names(o) or o["base"]["tau"] == 0.05,
    "DART": lambda o: bool({"iot", "uwd", "triplet"} & _names(o)),
    "ASK": lambda o: "knowledge" in _names(o),
}


def test_readme_rows_list_presets_of_their_objective():
    rows = _readme_rows()
    for prefix, check in ROW_CHECKS.items():
        matching = [name for name in rows if name.startswith(prefix)]
        assert len(matching) == 1, f"README presets table: no single row starting {prefix!r} ({list(rows)})"
        for path in rows[matching[0]]:
            assert check(_objective(path)), f"{path.relative_to(ROOT)} is listed under {matching[0]!r}"
    assert len(rows) == len(ROW_CHECKS), f"a README row without a check here: {set(rows)}"


def test_every_preset_with_its_own_objective_is_in_a_table():
    listed = {p.resolve() for files in _readme_rows().values() for p in files}
    listed |= {(CONFIGS / name).resolve() for name in _training_rows()}
    default = _objective(CONFIGS / "default.yaml")
    unlisted = [p.relative_to(ROOT).as_posix() for p in _all_presets()
                if p.resolve() not in listed and _objective(p) != default]
    assert not unlisted, f"presets with an objective of their own in neither README nor docs/training.md: {unlisted}"


def test_training_md_rows_name_existing_presets():
    for name in _training_rows():
        assert (CONFIGS / name).is_file(), f"docs/training.md presets table: configs/{name} does not exist"


@pytest.mark.parametrize("name", sorted(_training_rows()))
def test_training_md_states_what_the_preset_trains(name):
    what = _training_rows()[name][1]
    cfg = load_train_config(CONFIGS / name, [])
    epochs = re.search(r"(\d+) epochs", what)
    if epochs:
        assert int(epochs[1]) == cfg.optim.epochs, (name, what, cfg.optim.epochs)
    lr = re.search(r"\blr (\d(?:\.\d+)?e-\d+)", what)
    if lr:
        assert float(lr[1]) == cfg.optim.lr, (name, what, cfg.optim.lr)
    names = _names(cfg.objective.model_dump())
    for word, objective in (("KCL", "kcl"), ("CACL", "cacl"), ("SigLIP", "siglip"), ("InfoNCE", "infonce")):
        if word in what:
            assert objective in names, (name, word, names)
    if name == "demo.yaml":  # the service's demo: its row must say what it trains
        assert epochs and lr and "KCL" in what
