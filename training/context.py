"""The loop's side of :class:`training.objectives.base.TrainingContext`.

Objectives with state across steps (ASK's knowledge bases, drift estimates) ask the
loop for embeddings of the training set or of other manifests with the *current*
encoders. Embedding uses the evaluation crop, no gradients, and the model in eval
mode (restored to train mode afterwards), exactly as validation does.

Under torchrun each rank embeds a contiguous shard of the records and the shards are
gathered in order, so every rank gets the same rows as one process would, for 1/N of
the encoding work.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from index.tokenizer import TextTokenizer
from training import distributed
from training.config import DataConfig, FrontendConfig
from training.data.dataset import eval_captions
from training.data.manifest import ClipRecord
from training.evaluate import embed_chunks, embed_texts, load_clip_chunks


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
    ) -> None:
        self.epoch = 0
        self.step = 0
        self.device = device
        self._model = model
        self._tokenizer = tokenizer
        self._records = list(train_records)
        self._data_cfg = data_cfg
        self._frontend_cfg = frontend_cfg
        self._batch_size = batch_size

    def embed_training_pairs(self) -> tuple[Tensor, Tensor, Tensor]:
        """(audio (N, d), text (N, d), clip_index (N,)): one row per (clip, caption) of the training set."""
        return self._embed_pairs_sharded(self._records)

    def embed_manifest_pairs(self, manifest: Path) -> tuple[Tensor, Tensor]:
        """(audio (N, d), text (N, d)) for every (clip, caption) pair of `manifest` (all splits)."""
        from training.data.manifest import load_manifest

        records = load_manifest(
            Path(manifest),
            languages=self._data_cfg.languages,
            skip_missing_audio=self._data_cfg.skip_missing_audio,
            drop_other_languages=self._data_cfg.drop_other_languages,
        )
        audio, text, _ = self._embed_pairs_sharded(records)
        return audio, text

    def embed_clips(self, clip_index: Tensor) -> Tensor:
        """Audio embeddings (len(clip_index), d) of the given training clips."""
        records = [self._records[int(i)] for i in clip_index.tolist()]
        return self._embed_audio(records)

    def _embed_audio(self, records: Sequence[ClipRecord]) -> Tensor:
        chunks = load_clip_chunks(records, data_cfg=self._data_cfg, frontend_cfg=self._frontend_cfg)
        emb = embed_chunks(self._model, chunks, batch_size=self._batch_size, device=self.device)
        return emb.to(self.device)

    def _embed_pairs_sharded(self, records: Sequence[ClipRecord]) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`_embed_pairs` of all `records`, each rank encoding its shard (module doc)."""
        if distributed.world_size() == 1 or len(records) < distributed.world_size():
            return self._embed_pairs(records)
        shard = distributed.shard_range(len(records))
        audio, text, clip = self._embed_pairs(records[shard.start : shard.stop])
        return (
            distributed.all_gather_rows(audio),
            distributed.all_gather_rows(text),
            distributed.all_gather_rows(clip + shard.start),
        )

    def _embed_pairs(self, records: Sequence[ClipRecord]) -> tuple[Tensor, Tensor, Tensor]:
        captions = eval_captions(records, tuple(self._data_cfg.languages))
        clip = torch.from_numpy(np.asarray(captions.clip, dtype=np.int64))
        audio = self._embed_audio(records)
        text = embed_texts(
            self._model,
            self._tokenizer,
            captions.texts,
            batch_size=self._batch_size,
            device=self.device,
        )
        return audio[clip.to(self.device)], text.to(self.device), clip.to(self.device)
