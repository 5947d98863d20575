"""Validation at an epoch's end, split across ranks (docs/training.md, "Training on a large corpus").

Under torchrun every rank embeds a share of the validation split — its clips balanced by cost
(one window per clip under ``data.eval_crop: center``, ``ceil(duration / clip_seconds)`` under
``chunk``, from the file headers, read once per run: :func:`training.distributed.balanced_assignment`)
and a contiguous share of the caption queries — under the run's autocast (bf16 on a GPU with
``optim.amp``); the embeddings are gathered in split order and rank 0 computes the SPEC §5 report
and logs it. No rank waits on another for the whole pass, as they did when rank 0 validated
alone behind a barrier (a validation split of tens of thousands of long clips then outlasted
``distributed.timeout_s``). On one process it is :func:`training.evaluate.evaluate_prepared`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from training import distributed
from training.evaluate import EvalSet, embed_clips, embed_texts, evaluate_prepared, file_windows

_COSTS: dict[int, list[int]] = {}
"""Windows per clip of an evaluation set (by ``id``), read from the headers once per run."""


def clip_costs(eval_set: EvalSet) -> list[int]:
    """Evaluation windows per clip of `eval_set` (1 each under the center crop)."""
    if eval_set.data_cfg.eval_crop == "center":
        return [1] * len(eval_set.records)
    key = id(eval_set)
    if len(_COSTS.get(key, ())) != len(eval_set.records):
        _COSTS[key] = [file_windows(r.audio, eval_set.data_cfg.clip_seconds) for r in eval_set.records]
    return _COSTS[key]


def evaluate_shared(
    model: Any,
    tokenizer: Any,
    eval_set: EvalSet,
    *,
    batch_size: int,
    device: torch.device,
    num_workers: int = 0,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    progress: bool = False,
) -> dict[str, float] | None:
    """The SPEC §5 report of `eval_set`, each rank embedding its share (module doc); rank 0 gets the
    report, the other ranks None. On one process: :func:`evaluate_prepared` under `autocast`."""
    if not distributed.is_distributed():
        with autocast():
            return evaluate_prepared(model, tokenizer, eval_set, batch_size=batch_size, device=device,
                                     progress=progress, num_workers=num_workers)
    from index.metrics.retrieval import retrieval_report

    records, texts = eval_set.records, eval_set.captions.texts
    costs = clip_costs(eval_set)
    mine = distributed.balanced_assignment(costs, distributed.world_size())[distributed.rank()]
    queries = distributed.shard_range(len(texts))
    with autocast():
        audio = embed_clips(
            model, [records[i] for i in mine], data_cfg=eval_set.data_cfg, frontend_cfg=eval_set.frontend_cfg,
            batch_size=batch_size, device=device, num_workers=num_workers, progress=progress,
            description="validation: clips", windows=None if eval_set.data_cfg.eval_crop == "center"
            else [costs[i] for i in mine],
        )
        text = embed_texts(model, tokenizer, texts[queries.start : queries.stop], batch_size=batch_size,
                           device=device, progress=progress)
    rows = distributed.all_gather_rows(torch.tensor(mine, dtype=torch.long))
    audio = distributed.all_gather_rows(audio)[torch.argsort(rows)]  # back in split order
    text = distributed.all_gather_rows(text)  # contiguous shares: rank order is query order
    if distributed.rank() != 0:
        return None
    captions = eval_set.captions
    report = retrieval_report(
        audio_emb=audio.numpy(), text_emb=text.numpy(), caption_clip=np.asarray(captions.clip),
        caption_lang=np.asarray(captions.lang), caption_group=np.asarray(captions.group),
        languages=list(eval_set.languages),
    )
    return {key: float(value) for key, value in report.items()}
