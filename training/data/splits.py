"""Which clips of a manifest form each split, including a validation split carved from train.

Datasets such as Clotho's development set ship without a validation split;
``data.val_fraction`` takes a seeded random share of the ``train`` clips as the
validation split (``eval.split``). Training, validation and ``tonearm evaluate``
all select clips here, so a checkpoint is evaluated on exactly the clips its run
held out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from index.errors import DataError
from training.config import DataConfig
from training.data.manifest import ClipRecord

TRAIN_SPLIT = "train"


def carve_validation(
    train: Sequence[ClipRecord], *, fraction: float, seed: int
) -> tuple[list[ClipRecord], list[ClipRecord]]:
    """(remaining train clips, validation clips): `fraction` of `train` chosen by `seed`, order kept."""
    count = max(1, round(len(train) * fraction))
    if len(train) - count < 2:
        raise DataError(
            f"data.val_fraction={fraction} leaves {len(train) - count} of {len(train)} train clips; "
            "training needs at least 2 (lower data.val_fraction)"
        )
    chosen = set(np.random.default_rng(seed).permutation(len(train))[:count].tolist())
    return (
        [r for i, r in enumerate(train) if i not in chosen],
        [r for i, r in enumerate(train) if i in chosen],
    )


def carves(split: str, *, data_cfg: DataConfig, eval_split: str) -> bool:
    """Whether `split` comes from the train clips (``data.val_fraction`` set) rather than the manifest."""
    return data_cfg.val_fraction > 0 and split in (TRAIN_SPLIT, eval_split)


def select_split(
    records: Sequence[ClipRecord], split: str, *, data_cfg: DataConfig, eval_split: str
) -> list[ClipRecord]:
    """The clips of `split`: the manifest's, or with ``data.val_fraction`` train minus / the carved share."""
    if not carves(split, data_cfg=data_cfg, eval_split=eval_split):
        return [r for r in records if r.split == split]
    remaining, carved = carve_validation(
        [r for r in records if r.split == TRAIN_SPLIT],
        fraction=data_cfg.val_fraction,
        seed=data_cfg.val_seed,
    )
    return remaining if split == TRAIN_SPLIT else carved
