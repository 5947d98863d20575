"""Registry: objective config (SPEC §4) → :class:`Objective`.

Adding an objective is one file and one line in one of these dicts. Names are
exact keys; nothing is chosen by substring.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from training.config import ConfigError, ObjectiveConfig
from training.objectives.base import BuildEnv, Objective, PairTerm, Strategy
from training.objectives.cacl import CoAnchor
from training.objectives.infonce import InfoNCE
from training.objectives.iot import IOT
from training.objectives.kcl import OneToK
from training.objectives.moment_span import MomentSpanLoss
from training.objectives.random_language import RandomLanguage
from training.objectives.reweight import SimpleReweight
from training.objectives.siglip import SigLIP
from training.objectives.svr import SupportVectorRegularizer
from training.objectives.triplet import Triplet
from training.objectives.uwd import UWD

BASE_LOSSES: dict[str, type[PairTerm]] = {
    InfoNCE.name: InfoNCE,
    SigLIP.name: SigLIP,
    IOT.name: IOT,
    SimpleReweight.name: SimpleReweight,
    Triplet.name: Triplet,
}
STRATEGIES: dict[str, type[Strategy]] = {
    RandomLanguage.name: RandomLanguage,
    OneToK.name: OneToK,
    CoAnchor.name: CoAnchor,
}
MOMENT_LOSSES: dict[str, type[MomentSpanLoss]] = {
    MomentSpanLoss.name: MomentSpanLoss,
}
"""Objectives of the temporal moment head (`tonearm train-moments`, docs/objectives.md "Moments")."""
REGULARIZERS: dict[str, type[PairTerm]] = {
    SupportVectorRegularizer.name: SupportVectorRegularizer,
    UWD.name: UWD,
}


def _build(table: dict[str, type[Any]], section: str, spec: dict[str, Any], env: BuildEnv) -> Any:
    params = dict(spec)
    name = params.pop("name", None)
    if name not in table:
        known = ", ".join(sorted(table)) or "(none)"
        raise ConfigError(f"objective.{section}: unknown name {name!r}; known: {known}")
    cls = table[name]
    try:
        config = cls.Config.model_validate(params)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {'unknown key' if e['type'] == 'extra_forbidden' else e['msg']}"
            for e in err.errors()
        )
        raise ConfigError(f"objective.{section} ({name}): {problems}") from None
    return cls(config, env)


def build_objective(config: ObjectiveConfig, env: BuildEnv) -> Objective:
    """Build the composed objective; raises :class:`ConfigError` with the offending key."""
    base = _build(BASE_LOSSES, "base", config.base, env)
    strategy = _build(STRATEGIES, "strategy", config.strategy, env)
    regularizers = [
        _build(REGULARIZERS, f"regularizers[{i}]", spec, env) for i, spec in enumerate(config.regularizers)
    ]
    if config.distill is not None:
        # Imported here: distillation pulls in checkpoint loading, which plain runs never need.
        from training.objectives.distill import wrap_with_distillation

        base = wrap_with_distillation(config.distill, base, env)
    if config.knowledge is not None:
        from training.objectives.ask import wrap_with_knowledge

        base = wrap_with_knowledge(config.knowledge, base, env)
    return Objective(base=base, strategy=strategy, regularizers=regularizers)


def build_moment_loss(spec: dict[str, Any]) -> MomentSpanLoss:
    """The moment head's objective from ``{name: ..., **params}``; raises :class:`ConfigError`."""
    params = dict(spec)
    name = params.pop("name", None)
    if name not in MOMENT_LOSSES:
        raise ConfigError(f"moments.objective: unknown name {name!r}; known: {', '.join(sorted(MOMENT_LOSSES))}")
    cls = MOMENT_LOSSES[name]
    try:
        config = cls.Config.model_validate(params)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise ConfigError(f"moments.objective ({name}): {problems}") from None
    return cls(config)
