"""Validation split across ranks (training/validation.py): the report of 2 gloo processes, each
embedding its share, equals the single-process report (issue 39 item 5)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.ranks import spawn_ranks
from tests.training.test_distributed_runs import free_port


def _eval_set(checkpoint: Path, manifest: Path, crop: str):  # noqa: ANN202
    from training.checkpoint import load_checkpoint
    from training.data.manifest import load_manifest
    from training.evaluate import prepare_eval_set

    loaded = load_checkpoint(checkpoint)
    cfg = loaded.config
    data_cfg = cfg.data.model_copy(update={"eval_crop": crop})
    records = load_manifest(manifest, languages=cfg.data.languages, split="val")
    return loaded, prepare_eval_set(records, data_cfg=data_cfg, frontend_cfg=cfg.frontend)


def _shared_worker(rank: int, world: int, port: int, checkpoint: str, manifest: str, crop: str, out: str) -> None:
    from training import distributed
    from training.validation import evaluate_shared

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    distributed.init_process_group(torch.device("cpu"), timeout_s=60)
    try:
        loaded, eval_set = _eval_set(Path(checkpoint), Path(manifest), crop)
        report = evaluate_shared(loaded.model.eval(), loaded.tokenizer, eval_set, batch_size=3,
                                 device=torch.device("cpu"))
        Path(f"{out}.{rank}").write_text(json.dumps(report))
    finally:
        distributed.destroy_process_group()


@pytest.mark.parametrize("crop", ["chunk", "center"])
def test_validation_split_over_two_ranks_gives_the_single_process_report(
    tiny_checkpoint: Path, tiny_corpus: Path, tmp_path: Path, crop: str
) -> None:
    from training.evaluate import evaluate_prepared

    out = str(tmp_path / "report")
    spawn_ranks(_shared_worker, args=(2, free_port(), str(tiny_checkpoint), str(tiny_corpus), crop, out),
             nprocs=2)
    assert json.loads(Path(f"{out}.1").read_text()) is None  # rank 0 alone holds the report
    shared = json.loads(Path(f"{out}.0").read_text())
    loaded, eval_set = _eval_set(tiny_checkpoint, tiny_corpus, crop)
    alone = evaluate_prepared(loaded.model.eval(), loaded.tokenizer, eval_set, batch_size=32,
                              device=torch.device("cpu"))
    assert shared.keys() == alone.keys() and len(eval_set.records) >= 4
    for key, value in alone.items():
        assert shared[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
