"""Embedding passes over the training shards (``data.shards``): ASK's knowledge-base rebuilds.

A pass over a manifest opens each clip's file by position (:class:`training.evaluate.ClipWindows`);
shards give no random access, so here each rank takes a share of the train *shards* (balanced by
evaluation windows, from the ``seconds`` of records.jsonl: :func:`training.distributed.balanced_assignment`),
its loader workers read those shards in order (worker ``w`` of ``W`` reads every ``W``-th one), decode
each sample's evaluation windows (``data.eval_crop``, the same :func:`index.audio.decode.decode_window` /
:func:`index.audio.decode.eval_chunks` as the file path, on the in-memory FLAC/WAV) and hand them back with
the clip's **id**. The id is mapped to the clip's row of the run's training records (records.jsonl
order, the row the training stream gives as ``clip_index``), never to its position in a shard, so the
rows of a pass line up with the batches' clip indices whatever the shard layout.

Only embeddings are kept (the memory of a pass is that of its embeddings, not of its audio). A clip
that cannot be decoded embeds as zeros and is named in a warning, as on the file path; a shard that
cannot be read leaves its clips at zeros and is named too. The knowledge-base pass
(:class:`training.context.LoopContext`) then leaves those zero rows out of the knowledge base.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from index.audio.decode import decode_audio, decode_window, eval_chunks
from index.errors import AudioDecodeError
from training.config import DataConfig, FrontendConfig, short_clip_padding
from training.data.stream import ShardCorpus, _join, tar_samples
from training.evaluate import StreamStats, clip_samples, embed_chunks, progress_bar

log = logging.getLogger(__name__)

Item = tuple[int, np.ndarray, "str | None"]
"""(row of the clip in the run's records, (C, n) evaluation windows, error or None); row −1: a shard error."""


class ShardClipWindows(IterableDataset):
    """The evaluation windows of every clip of ``shards`` whose id is in ``row_of`` (module doc)."""

    def __init__(self, url: str, shards: Sequence[str], row_of: Mapping[str, int], *, extension: str,
                 data_cfg: DataConfig, frontend_cfg: FrontendConfig) -> None:
        self.url, self.shards, self.row_of, self.extension = url, list(shards), dict(row_of), extension
        self.sample_rate = frontend_cfg.sample_rate
        self.clip_samples = clip_samples(data_cfg, frontend_cfg)
        self.policy = data_cfg.eval_crop
        self.padding = short_clip_padding(frontend_cfg)

    def windows(self, audio: bytes) -> np.ndarray:
        """(C, n) windows of one clip under ``data.eval_crop`` (as ``eval_audio_chunks`` on a file)."""
        if self.policy == "center":
            return decode_window(audio, sample_rate=self.sample_rate, n=self.clip_samples, mode="center",
                                 padding=self.padding)[None, :]
        return eval_chunks(decode_audio(audio, sample_rate=self.sample_rate), self.clip_samples, self.padding)

    def __iter__(self) -> Iterator[Item]:
        import fsspec

        info = get_worker_info()
        mine = self.shards[info.id :: info.num_workers] if info is not None else self.shards
        empty = np.zeros((0, self.clip_samples), np.float32)
        for name in mine:
            url = _join(self.url, name)
            try:
                with fsspec.open(url, "rb") as stream:
                    for sample in tar_samples(stream, url):
                        clip_id = json.loads(sample["json"])["id"]
                        row = self.row_of.get(clip_id)
                        if row is None:  # not trained on (no caption in data.languages)
                            continue
                        audio = sample.get(self.extension)
                        try:
                            if not audio:
                                raise AudioDecodeError(f"no .{self.extension} member")
                            yield row, self.windows(bytes(audio)), None
                        except AudioDecodeError as err:
                            yield row, empty, f"{url}: {clip_id}: {str(err).split(': ', 1)[-1]}"
            except Exception as err:  # noqa: BLE001 - a broken shard leaves its clips at zeros, named
                yield -1, empty, f"{url}: shard unreadable or cut short: {type(err).__name__}: {err}"


def _keep_items(items: list[Item]) -> list[Item]:
    return items


def embed_shard_clips(
    model: Any, corpus: ShardCorpus, shards: Sequence[str], rows: Sequence[int], *, split: str,
    data_cfg: DataConfig, frontend_cfg: FrontendConfig, batch_size: int, device: torch.device,
    num_workers: int = 0, progress: bool = False, description: str = "embedding clips",
    stats: StreamStats | None = None,
) -> torch.Tensor:
    """(len(rows), d) float32 CPU embeddings of the clips ``rows`` (rows of ``corpus.records[split]``)
    that ``shards`` hold, streamed through ``num_workers`` loader workers; row i of the result is
    clip ``rows[i]``. Clips of ``rows`` no readable sample gave embed as zeros (named in a warning)."""
    stats = stats if stats is not None else StreamStats()
    started = time.monotonic()
    ids = corpus.records[split].ids
    position = {row: i for i, row in enumerate(rows)}
    dataset = ShardClipWindows(corpus.url, shards, {ids[row]: row for row in rows},
                               extension=str(corpus.index.get("extension", "flac")),
                               data_cfg=data_cfg, frontend_cfg=frontend_cfg)
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=min(num_workers, len(shards)),
                        collate_fn=_keep_items)
    out = torch.zeros(len(rows), int(model.embed_dim))
    seen: set[int] = set()
    decoded = 0
    with progress_bar(len(rows), description, enabled=progress) as bar:
        for items in loader:
            good = [(row, windows) for row, windows, error in items if error is None]
            stats.failed += [error for _, _, error in items if error is not None]
            if good:
                index = torch.tensor([position[row] for row, _ in good])
                out[index] = embed_chunks(model, [w for _, w in good], batch_size=batch_size, device=device)
                stats.windows += sum(len(w) for _, w in good)
                decoded += len(good)
            clips = [row for row, _, _ in items if row >= 0]
            seen.update(clips)
            stats.clips += len(clips)
            bar.update(len(clips))
    stats.seconds += time.monotonic() - started
    if decoded < len(rows):
        log.warning("%s: %d of %d clips could not be decoded and embed as zeros (%d never read; a knowledge-base "
                    "pass leaves them out), e.g. %s",
                    description, len(rows) - decoded, len(rows), len(rows) - len(seen),
                    "; ".join(stats.failed[:3]))
    return out
