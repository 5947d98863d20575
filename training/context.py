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
"""

from __future__ import annotations

import logging
import math
import resource
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
from training.evaluate import StreamStats, embed_clips, embed_texts

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
        self._num_workers = num_workers
        self._windows: dict[int, list[int]] = {}
        """Per records list (by id()), the evaluation windows of each clip: the cost that balances ranks."""

    def embed_training_pairs(self) -> tuple[Tensor, Tensor, Tensor]:
        """(audio (N, d), text (N, d), clip_index (N,)): one row per (clip, caption) of the training set."""
        return self._embed_pairs_balanced(self._records, "training pairs")

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
            self._windows[key] = [_windows_of(r.audio, self._data_cfg.clip_seconds) for r in records]
        return self._windows[key]

    def _embed_pairs_balanced(
        self, records: Sequence[ClipRecord], what: str
    ) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`_embed_pairs` of all `records`, each rank encoding a cost-balanced share (module doc)."""
        stats = StreamStats()
        world = distributed.world_size()
        costs = self._costs(records)
        if world == 1 or len(records) < world:
            result = self._embed_pairs(records, what, stats, costs)
        else:
            mine = distributed.balanced_assignment(costs, world)[distributed.rank()]
            audio, text, clip = self._embed_pairs([records[i] for i in mine], what, stats, [costs[i] for i in mine])
            mine_t = torch.tensor(mine, dtype=torch.long, device=self.device)
            everyone_clip = distributed.all_gather_rows(mine_t[clip])
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

    def _embed_pairs(
        self, records: Sequence[ClipRecord], what: str, stats: StreamStats, windows: Sequence[int]
    ) -> tuple[Tensor, Tensor, Tensor]:
        captions = eval_captions(records, tuple(self._data_cfg.languages))
        clip = torch.from_numpy(np.asarray(captions.clip, dtype=np.int64))
        audio = self._embed_audio(records, f"{what}: clips", stats, windows)
        text = embed_texts(
            self._model,
            self._tokenizer,
            captions.texts,
            batch_size=self._batch_size,
            device=self.device,
        )
        return audio[clip].to(self.device), text.to(self.device), clip.to(self.device)


def _windows_of(audio: Path, clip_seconds: float) -> int:
    """Chunk-and-average windows of a file (1 when its header cannot be read: it fails later, alone)."""
    import soundfile as sf

    try:
        info = sf.info(str(audio))
    except (RuntimeError, OSError):
        return 1
    return max(1, math.ceil(info.frames / max(1, info.samplerate) / clip_seconds))
