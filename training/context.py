"""The loop's side of :class:`training.objectives.base.TrainingContext`.

Objectives with state across steps (ASK's knowledge bases, drift estimates) ask the
loop for embeddings of the training set or of other manifests with the *current*
encoders. Embedding uses the evaluation crop, no gradients, and the model in eval
mode (restored to train mode afterwards), exactly as validation does.

Every pass streams (SPEC §13): clips are decoded window by window by loader workers and
embedded as they arrive (:func:`training.evaluate.embed_clips`), keeping only embeddings, so
a pass over 400 k clips needs the memory of its embeddings, not of its audio.

Under torchrun the clips are split across ranks by **cost**, not count
(:func:`training.distributed.balanced_assignment`): a clip costs one window under the center
crop and ``ceil(duration / clip_seconds)`` windows under chunk-and-average (durations read
once from the file headers), so ranks with the long clips do not arrive late at the gather.
Each rank's rows are gathered and put back in record order, so every rank gets the rows one
process would compute.

When the run trains from ``data.shards`` (``corpus`` given) the training pairs come from the
shards themselves (:mod:`training.data.shard_passes`): each rank takes a cost-balanced share of
the train *shards* (windows from records.jsonl's ``seconds``), its loader workers stream them,
and each sample is placed by its clip **id** at its row of the training records (the row the
training stream gives as ``clip_index``). After the gather the result is the manifest path's,
row for row: pairs in record order, ``clip_index`` = the record's row.

The ``*_local`` variants skip the gather: each rank gets only the pairs it embedded (a clip's
pairs all on one rank, ascending by clip), for ASK's partitioned knowledge bases
(:mod:`training.knowledge`).

Passes run under the run's autocast (bf16/fp16 on CUDA with ``optim.amp``, as validation) and
return float32. A clip that cannot be decoded (file or shard) embeds as a zero row; its pairs are
left out of the result and counted in a warning — a zero row in a knowledge base would be a
false neighbour of every query.
"""

from __future__ import annotations

import contextlib
import logging
import math
import resource
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from index.bundle.tokenizer import TextTokenizer
from training import distributed
from training.config import ConfigError, DataConfig, FrontendConfig
from training.data.dataset import eval_captions
from training.data.manifest import ClipRecord
from training.data.shard_passes import embed_shard_clips
from training.data.stream import TRAIN_SPLIT, ShardCorpus
from training.evaluate import StreamStats, embed_clips, embed_texts, file_windows

log = logging.getLogger(__name__)


class LoopContext:
    """Implements ``TrainingContext`` over the run's model, tokenizer and training records.

    ``epoch`` (0-based) and ``step`` (optimizer steps done) are kept current by the loop.
    Returned tensors are on ``device``.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        tokenizer: TextTokenizer,
        train_records: Sequence[ClipRecord],
        data_cfg: DataConfig,
        frontend_cfg: FrontendConfig,
        batch_size: int,
        device: torch.device,
        num_workers: int = 0,
        corpus: ShardCorpus | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.epoch = 0
        self.step = 0
        self.device = device
        self._model = model
        self._tokenizer = tokenizer
        self._records = train_records  # data.shards: compact columns, captions read when a pass needs them
        self._data_cfg = data_cfg
        self._frontend_cfg = frontend_cfg
        self._batch_size = batch_size
        self._num_workers = num_workers
        self._corpus = corpus
        """The shard folder the training records come from (``data.shards``), else None."""
        self._autocast = autocast
        """The run's autocast (``training.runtime.autocast``); every pass runs under it."""
        self._windows: dict[int, list[int]] = {}
        """Per records list (by id()), the evaluation windows of each clip: the cost that balances ranks."""

    def embed_training_pairs(self) -> tuple[Tensor, Tensor, Tensor]:
        """(audio (N, d), text (N, d), clip_index (N,)): one row per (clip, caption) of the training set."""
        if self._corpus is not None:
            return self._embed_shard_pairs("training pairs")
        return self._embed_pairs_balanced(self._records, "training pairs")

    def embed_training_pairs_local(self) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`embed_training_pairs`, this rank's share only (no gather; module doc)."""
        if self._corpus is not None:
            return self._embed_shard_pairs("training pairs", gather=False)
        return self._embed_pairs_balanced(self._records, "training pairs", gather=False)

    def embed_manifest_pairs_local(self, manifest: Path) -> tuple[Tensor, Tensor, Tensor]:
        """(audio, text, record row in `manifest`) of this rank's share of its pairs (no gather)."""
        from training.data.manifest import load_manifest

        records = load_manifest(
            Path(manifest),
            languages=self._data_cfg.languages,
            skip_missing_audio=self._data_cfg.skip_missing_audio,
            drop_other_languages=self._data_cfg.drop_other_languages,
        )
        return self._embed_pairs_balanced(records, Path(manifest).name, gather=False)

    def embed_manifest_pairs(self, manifest: Path) -> tuple[Tensor, Tensor]:
        """(audio (N, d), text (N, d)) for every (clip, caption) pair of `manifest` (all splits)."""
        from training.data.manifest import load_manifest

        records = load_manifest(
            Path(manifest),
            languages=self._data_cfg.languages,
            skip_missing_audio=self._data_cfg.skip_missing_audio,
            drop_other_languages=self._data_cfg.drop_other_languages,
        )
        audio, text, _ = self._embed_pairs_balanced(records, Path(manifest).name)
        return audio, text

    def embed_clips(self, clip_index: Tensor) -> Tensor:
        """Audio embeddings (len(clip_index), d) of the given training clips (this rank's only)."""
        if self._corpus is not None:
            raise ConfigError("embed_clips needs random access to the training clips, which data.shards "
                                      "does not give; use embed_training_pairs")
        records = [self._records[int(i)] for i in clip_index.tolist()]
        return self._embed_audio(records).to(self.device)

    def _embed_audio(self, records: Sequence[ClipRecord], description: str = "embedding clips",
                     stats: StreamStats | None = None, windows: Sequence[int] | None = None) -> Tensor:
        return embed_clips(
            self._model, records, data_cfg=self._data_cfg, frontend_cfg=self._frontend_cfg,
            batch_size=self._batch_size, device=self.device, num_workers=self._num_workers,
            progress=distributed.rank() == 0, description=description, stats=stats, windows=windows,
        )

    def _costs(self, records: Sequence[ClipRecord]) -> list[int]:
        """Evaluation windows per clip: 1 under the center crop, else from the header's duration."""
        if self._data_cfg.eval_crop == "center":
            return [1] * len(records)
        key = id(records)
        if key not in self._windows or len(self._windows[key]) != len(records):
            self._windows[key] = [file_windows(r.audio, self._data_cfg.clip_seconds) for r in records]
        return self._windows[key]

    def _embed_pairs_balanced(
        self, records: Sequence[ClipRecord], what: str, *, gather: bool = True
    ) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`_embed_pairs` of all `records`, each rank encoding a cost-balanced share (module doc);
        ``gather=False``: this rank's share only, clip = the record's row."""
        stats = StreamStats()
        world = distributed.world_size()
        costs = self._costs(records)
        if world == 1 or (gather and len(records) < world):
            result = self._embed_pairs(records, what, stats, costs)
        else:
            mine = distributed.balanced_assignment(costs, world)[distributed.rank()]
            audio, text, clip = self._embed_pairs([records[i] for i in mine], what, stats, [costs[i] for i in mine])
            rows = torch.tensor(mine, dtype=torch.long, device=self.device)[clip]
            if not gather:
                result = audio, text, rows
            else:
                everyone_clip = distributed.all_gather_rows(rows)
                # Rows of every rank, put back in record order (rows of one clip keep caption order).
                order = torch.argsort(everyone_clip, stable=True)
                result = (
                    distributed.all_gather_rows(audio)[order],
                    distributed.all_gather_rows(text)[order],
                    everyone_clip[order],
                )
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        log.info(
            "%s: %d clips (%d windows) embedded on this rank in %.1f s (%.0f s per 10 k clips), "
            "peak RSS %.0f MiB%s",
            what, stats.clips, stats.windows, stats.seconds, stats.per_10k_clips_s(), peak_mib,
            f", {len(stats.failed)} undecodable" if stats.failed else "",
        )
        return result

    def _embed_shard_pairs(self, what: str, *, gather: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`_embed_pairs_balanced` of the training records, streamed from their shards (module doc)."""
        corpus = self._corpus
        assert corpus is not None
        records = corpus.records[TRAIN_SPLIT]
        stats = StreamStats()
        rows_of = records.rows_by_shard()
        names = [name for name, _ in corpus.shards(TRAIN_SPLIT) if name in rows_of]
        clip_seconds = self._data_cfg.clip_seconds
        costs = [
            len(rows_of[name]) if self._data_cfg.eval_crop == "center" else sum(
                max(1, math.ceil(float(seconds) / clip_seconds)) for seconds in records.seconds[rows_of[name]].tolist())
            for name in names
        ]
        world = distributed.world_size()
        shares = distributed.balanced_assignment(costs, world) if world > 1 else [list(range(len(names)))]
        mine = [names[i] for i in shares[distributed.rank()]]
        rows = sorted(row for name in mine for row in rows_of[name].tolist())
        with self._autocast():
            audio = embed_shard_clips(
                self._model, corpus, mine, rows, split=TRAIN_SPLIT, data_cfg=self._data_cfg,
                frontend_cfg=self._frontend_cfg, batch_size=self._batch_size, device=self.device,
                num_workers=self._num_workers, progress=distributed.rank() == 0, description=f"{what}: clips",
                stats=stats,
            )
            captions = eval_captions(records.with_captions(rows), tuple(self._data_cfg.languages))  # this share's
            text = embed_texts(self._model, self._tokenizer, captions.texts, batch_size=self._batch_size,
                               device=self.device)
        local = torch.from_numpy(np.asarray(captions.clip, dtype=np.int64))
        audio, text, local = _without_undecodable(audio, text.float(), local, what, stats)
        clip = torch.tensor(rows, dtype=torch.long)[local].to(self.device)
        audio, text = audio[local].to(self.device), text.to(self.device)
        if world > 1 and gather:
            clip = distributed.all_gather_rows(clip)
            order = torch.argsort(clip, stable=True)  # record order; one clip's captions keep their order
            audio, text, clip = distributed.all_gather_rows(audio)[order], distributed.all_gather_rows(text)[order], clip[order]
        log.info("%s: %d clips (%d windows) from %d shards embedded on this rank in %.1f s, peak RSS %.0f MiB%s",
                 what, stats.clips, stats.windows, len(mine), stats.seconds,
                 resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                 f", {len(stats.failed)} undecodable" if stats.failed else "")
        return audio, text, clip

    def _embed_pairs(
        self, records: Sequence[ClipRecord], what: str, stats: StreamStats, windows: Sequence[int]
    ) -> tuple[Tensor, Tensor, Tensor]:
        captions = eval_captions(records, tuple(self._data_cfg.languages))
        clip = torch.from_numpy(np.asarray(captions.clip, dtype=np.int64))
        with self._autocast():
            audio = self._embed_audio(records, f"{what}: clips", stats, windows)
            text = embed_texts(
                self._model,
                self._tokenizer,
                captions.texts,
                batch_size=self._batch_size,
                device=self.device,
            )
        audio, text, clip = _without_undecodable(audio, text.float(), clip, what, stats)
        return audio[clip].to(self.device), text.to(self.device), clip.to(self.device)


def _without_undecodable(
    audio: Tensor, text: Tensor, clip: Tensor, what: str, stats: StreamStats
) -> tuple[Tensor, Tensor, Tensor]:
    """Leave out the pairs of clips whose audio embedded as zeros (undecodable: every real clip
    embedding is unit-norm); (clips (C, d), pair texts (N, d), pair → clip (N,)) → the kept pairs.
    The clip table is unchanged (``clip`` still indexes it)."""
    decoded = audio.abs().sum(dim=1) > 0
    if bool(decoded.all()):
        return audio, text, clip
    keep = decoded[clip]
    log.warning("%s: %d undecodable clips (%d pairs) left out of the knowledge base (a zero row would be a "
                "false neighbour), e.g. %s", what, int((~decoded).sum()), int((~keep).sum()),
                "; ".join(stats.failed[:3]) or "-")
    return audio, text[keep], clip[keep]
