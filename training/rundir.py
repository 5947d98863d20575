"""A run directory is never replaced silently: resume it, replace it on request, or refuse.

`tonearm train` in an `out_dir` that already holds checkpoints (`last/`, `best/`) needs
`resume=true` (continue exactly) or `--overwrite` (delete them and start afresh);
otherwise it stops with one line quoting both commands, built from the user's own
command line so they can be pasted.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import shutil
from pathlib import Path

from index.errors import TonearmError
from training.config import TrainConfig

log = logging.getLogger(__name__)

CHECKPOINT_DIRS = ("last", "best")
RUN_FLAGS = ("resume=", "overwrite=")
"""Overrides that choose between continuing and replacing a run; the hints add their own."""


class RunExistsError(TonearmError):
    """`out_dir` holds a previous run and neither `resume` nor `overwrite` says what to do with it."""


def train_overrides(args: argparse.Namespace) -> list[str]:
    """The CLI's dotted overrides with the flags that stand for config keys appended."""
    overrides = list(args.overrides or [])
    if getattr(args, "overwrite", False):
        overrides.append("overwrite=true")
    if getattr(args, "drop_other_languages", False):
        overrides.append("data.drop_other_languages=true")
    return overrides


def train_command(args: argparse.Namespace) -> str:
    """The user's `tonearm train` command line without `resume`/`overwrite`, for the hints."""
    processes = getattr(args, "nproc_per_node", None)
    parts = ["tonearm", "train", *(["--nproc-per-node", str(processes)] if processes and processes > 1 else [])]
    parts += [args.config] if args.config else []
    parts += [o for o in train_overrides(args) if not o.startswith(RUN_FLAGS)]
    return shlex.join(parts)


def previous_checkpoints(cfg: TrainConfig) -> list[Path]:
    return [cfg.out_dir / name for name in CHECKPOINT_DIRS if (cfg.out_dir / name).is_dir()]


def refuse_unless_chosen(cfg: TrainConfig, *, command: str) -> None:
    """Raise :class:`RunExistsError` when `out_dir` holds a run that `cfg` neither resumes nor overwrites."""
    out = cfg.out_dir
    if cfg.overwrite or not previous_checkpoints(cfg) or (cfg.resume and (out / "last").is_dir()):
        return
    fresh = f"start afresh, deleting it: {command} --overwrite"
    last_state = out / "last" / "state.json"
    if not last_state.is_file():
        raise RunExistsError(f"{out} already holds a training run's best/; {fresh} (or pick another out_dir)")
    state = json.loads(last_state.read_text(encoding="utf-8"))
    raise RunExistsError(
        f"{out} already holds a training run (last/ at epoch {state.get('epoch')}, step "
        f"{state.get('step')}); resume it: {command} resume=true; or {fresh}"
    )


def delete_previous_run(cfg: TrainConfig) -> None:
    """With `overwrite` (and no run being resumed): delete the previous run's checkpoints."""
    if not cfg.overwrite:
        return
    previous = previous_checkpoints(cfg)
    for directory in previous:
        shutil.rmtree(directory)
    if previous:
        log.warning("overwrite: deleted the previous run's %s", ", ".join(map(str, previous)))
