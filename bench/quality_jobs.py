"""What `tonearm bench quality` runs, shared by the runner and everything that reads its results.

The benchmark's config (bench/quality.yaml's schema, :func:`load_quality_config`), one :class:`Job`
per (condition, method, seed) with its ``result.json``, and a metric's mean ± std over seeds
(:func:`stats`). Below the runner (bench/quality.py), the report (bench/quality_report.py), its
plots (bench/quality_plots.py) and the rerun comparison (bench/quality_rerun.py); it imports none
of them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from index.errors import TonearmError

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "bench" / "quality.yaml"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CorpusSpec(_Strict):
    size: Literal["tiny", "small"] = "small"
    seed: int = 0
    dir: Path = Path("data/small")


class MethodSpec(_Strict):
    preset: Path
    label: str
    overrides: list[str] = Field(default_factory=list)
    conditions: list[str] | None = None
    """Conditions this method runs on (default: all)."""
    teachers: Literal["same_seed", "all_seeds"] | None = None
    """Distillation: teachers are the `stage1` runs of the same seed (M = 1) or of every seed (M = 3)."""
    min_languages: int = Field(1, ge=1)
    """Caption languages the method needs (cross-lingual methods: 2); with fewer in the manifest it is not run."""


class ClaimSpec(_Strict):
    paper: str
    claim: str
    better: str
    worse: str
    metric: str
    lower: bool = False
    against_best_seed: bool = False
    """Compare with the best single seed of `worse` (the paper's "best stage-1 model"), not its mean."""


class QualityConfig(_Strict):
    corpus: CorpusSpec = Field(default_factory=CorpusSpec)
    manifest: Path | None = None
    """A ready manifest (Clotho, AudioCaps, ...) instead of the synthetic corpus."""
    conditions: dict[str, float] = Field(default_factory=lambda: {"clean": 0.0, "noisy": 0.2})
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    runs_dir: Path = Path("runs/bench-quality")
    results_dir: Path = Path("docs/results")
    threads_per_job: int = Field(1, ge=1)
    train_overrides: list[str] = Field(default_factory=list)
    methods: dict[str, MethodSpec]
    claims: list[ClaimSpec] = Field(default_factory=list)
    teacher_method: str = "stage1"
    budget_note: str = ""
    """How the budget was chosen (printed under "Budget" in the results)."""
    not_run: dict[str, str] = Field(default_factory=dict)
    """Methods left out for this manifest, with the reason (set by `fit_to_manifest`, not in YAML)."""


def load_quality_config(path: Path) -> QualityConfig:
    """Parse and validate the benchmark config; one-line errors naming the file and key."""
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except OSError as err:
        raise TonearmError(f"{path}: cannot read the benchmark config ({err.strerror})") from None
    try:
        cfg = QualityConfig.model_validate(raw)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise TonearmError(f"{path}: {problems}") from None
    for name, method in cfg.methods.items():
        unknown = set(method.conditions or []) - set(cfg.conditions)
        if unknown:
            raise TonearmError(f"{path}: methods.{name}.conditions: unknown {sorted(unknown)}; known {sorted(cfg.conditions)}")
        if method.teachers and cfg.teacher_method not in cfg.methods:
            raise TonearmError(f"{path}: methods.{name}.teachers needs a method named {cfg.teacher_method!r}")
        if not (ROOT / method.preset).is_file() and not method.preset.is_file():
            raise TonearmError(f"{path}: methods.{name}.preset: {method.preset} not found")
    for i, claim in enumerate(cfg.claims):
        for side in (claim.better, claim.worse):
            if side not in cfg.methods:
                raise TonearmError(f"{path}: claims[{i}]: unknown method {side!r}")
    return cfg


@dataclass
class Job:
    condition: str
    method: str
    seed: int
    out_dir: Path
    overrides: list[str]
    preset: Path
    manifest: Path
    noisy: bool
    depends: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.condition}/{self.method}/seed{self.seed}"

    @property
    def result_path(self) -> Path:
        return self.out_dir / "result.json"

    @property
    def spec_path(self) -> Path:
        return self.out_dir / "job.json"

    def fingerprint(self) -> dict[str, Any]:
        """What decides the job's outcome: preset and overrides, with the runs root and checkout
        abstracted so that a moved runs folder still counts as the same job."""
        runs_root = str(self.out_dir.parents[2])

        def portable(text: str) -> str:
            return text.replace(runs_root, "<runs>").replace(str(ROOT), "<root>")

        return {"preset": portable(str(self.preset)), "overrides": [portable(o) for o in self.overrides]}

    def is_done(self) -> bool:
        """A result exists and was produced by this very job (not by an older budget or preset)."""
        if not self.result_path.is_file():
            return False
        try:
            recorded = json.loads(self.result_path.read_text(encoding="utf-8")).get("job")
        except (OSError, ValueError):
            return False
        return recorded == self.fingerprint()


def stats(results: list[dict[str, Any]], key: str) -> tuple[float, float, int]:
    """(mean, std over seeds (population, 0 for one seed), seeds) of one metric."""
    values = [r["metrics"][key] for r in results if key in r["metrics"] and math.isfinite(r["metrics"][key])]
    if not values:
        return math.nan, math.nan, 0
    return float(np.mean(values)), float(np.std(values)), len(values)
