"""Training and evaluation views of a manifest (SPEC §2, §4, §5).

Training: :class:`TrainClipDataset` decodes a random crop of a clip (only that window);
:class:`TrainCollate` asks the objective's strategy which caption(s) of each clip
to use (``V`` views per clip), tokenizes them and stacks a :class:`TrainBatch`.
Every random choice is seeded by ``(seed, epoch, clip index)``, so a batch is the
same whatever the number of loader workers. The training loop's batch sampler hands
out ``(epoch, index)`` keys, so the epoch travels with each item and persistent
workers (which never see a later ``set_epoch``) stay correct; plain integer keys use
the epoch given to ``set_epoch`` on both.

A clip whose audio cannot be decoded is replaced by another clip of the set, drawn
from the same seeds, and its error is carried in the item (``skipped``) so the loop
can count and name it against ``data.max_bad_fraction`` (SPEC §13): batch shapes stay
fixed, so every rank still runs the same collectives.

Evaluation: :func:`eval_captions` flattens every caption into a query with its
clip, language and query group (a caption and its translations share a group);
:func:`eval_audio_chunks` gives the windows of one clip under the center-crop or
chunk-and-average policy.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

from index.audio.decode import decode_audio, decode_window, eval_chunks
from index.audio.frontend import Padding
from index.errors import AudioDecodeError, DataError
from training.data.manifest import ClipRecord
from training.objectives.base import Strategy


class Tokenizer(Protocol):
    """What the collate needs from :class:`index.bundle.tokenizer.TextTokenizer`."""

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]: ...


def _rng_seed(*parts: int) -> int:
    """A 64-bit seed derived from integers (stable across processes and Python versions)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1, dtype=np.uint64)[0])


MAX_SUBSTITUTES = 8
"""Replacement clips tried after an undecodable one before the item fails (a corpus where
nine draws in a row fail is not worth training on, and the budget would stop it anyway)."""


@dataclass
class TrainItem:
    """One training clip: a fixed-length waveform, its captions and its index in the training set.

    ``epoch`` is the epoch the item was drawn for (None for a plain integer key); ``skipped``
    the decode errors of clips this item replaced (empty for a readable clip).
    """

    waveform: np.ndarray
    captions: dict[str, list[str]]
    index: int
    epoch: int | None = None
    skipped: tuple[str, ...] = ()


class TrainClipDataset(Dataset):
    """Decoded, resampled, randomly cropped (zero-padded) training clips."""

    def __init__(self, records: Sequence[ClipRecord], *, sample_rate: int, clip_samples: int, seed: int,
                 padding: Padding = "pad") -> None:
        self.records = list(records)
        self.sample_rate = sample_rate
        self.clip_samples = clip_samples
        self.padding = padding  # short clips reach the tower as its own extractor pads them
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, key: int | tuple[int, int]) -> TrainItem:
        epoch, index = key if isinstance(key, tuple) else (None, key)
        seed_epoch = self.epoch if epoch is None else epoch
        skipped: list[str] = []
        candidate = index
        for attempt in range(MAX_SUBSTITUTES + 1):
            record = self.records[candidate]
            rng = np.random.default_rng(_rng_seed(self.seed, seed_epoch, candidate))
            try:
                # Only the crop is decoded and resampled: a 10-min file costs what a 10-s one does (SPEC §13).
                wave = decode_window(
                    record.audio, sample_rate=self.sample_rate, n=self.clip_samples, mode="random", rng=rng,
                    padding=self.padding,
                )
            except AudioDecodeError as err:
                skipped.append(str(err))  # the message starts with the file's name
                pick = np.random.default_rng(_rng_seed(self.seed, seed_epoch, index, 2, attempt))
                candidate = int(pick.integers(len(self.records)))
                continue
            return TrainItem(wave, record.captions, candidate, epoch=epoch, skipped=tuple(skipped))
        raise DataError(
            f"{len(skipped)} clips in a row could not be decoded (clip {index} and {MAX_SUBSTITUTES} "
            f"replacements); first: {skipped[0]}"
        )


@dataclass
class TrainBatch:
    """A collated batch. Shapes: waveform (B, T); input_ids, attention_mask (V, B, L); text_mask (V, B)."""

    waveform: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    text_mask: torch.Tensor
    clip_index: torch.Tensor
    texts: list[list[str | None]]
    skipped: tuple[str, ...] = ()
    """Decode errors of the clips this batch replaced (see :class:`TrainClipDataset`)."""
    extra_draws: int = 0
    """``data.shards``: entries the worker drew beyond the batch's planned size (lost samples replaced
    from its reserve; training/data/stream.py), what a checkpoint records for an exact resume."""

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TrainBatch:
        """The tensors moved to ``device`` (texts and skipped unchanged)."""
        move: dict[str, Any] = {
            name: getattr(self, name).to(device, non_blocking=non_blocking)
            for name in ("waveform", "input_ids", "attention_mask", "text_mask", "clip_index")
        }
        return TrainBatch(texts=self.texts, skipped=self.skipped, extra_draws=self.extra_draws, **move)


class TrainCollate:
    """Pick each clip's text views with the strategy, tokenize, stack (picklable for loader workers).

    Missing views (the strategy returned None, e.g. a clip without that language)
    get ``text_mask`` False, padding ids and an all-zero attention mask.
    """

    def __init__(self, strategy: Strategy, tokenizer: Tokenizer, *, seed: int) -> None:
        self.strategy = strategy
        self.tokenizer = tokenizer
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _views(self, item: TrainItem) -> list[str | None]:
        epoch = self.epoch if item.epoch is None else item.epoch
        rng = random.Random(_rng_seed(self.seed, epoch, item.index, 1))
        views = self.strategy.views(item.captions, rng)
        if len(views) != self.strategy.num_views:
            raise ValueError(f"strategy {self.strategy.name!r} returned {len(views)} views, expected "
                             f"{self.strategy.num_views}")
        return views

    def __call__(self, items: Sequence[TrainItem]) -> TrainBatch:
        per_clip = [self._views(item) for item in items]
        texts = [[views[v] for views in per_clip] for v in range(self.strategy.num_views)]
        present = [(v, b, text) for v, row in enumerate(texts) for b, text in enumerate(row) if text is not None]
        ids, mask = self.tokenizer.encode([text for _, _, text in present] or [""])
        length = ids.shape[1]
        input_ids = np.full((len(texts), len(items), length), getattr(self.tokenizer, "pad_id", 0), dtype=np.int64)
        attention = np.zeros((len(texts), len(items), length), dtype=np.int64)
        text_mask = np.zeros((len(texts), len(items)), dtype=bool)
        for row, (v, b, _) in enumerate(present):
            input_ids[v, b], attention[v, b], text_mask[v, b] = ids[row], mask[row], True
        return TrainBatch(
            waveform=torch.from_numpy(np.stack([item.waveform for item in items])),
            input_ids=torch.from_numpy(input_ids),
            attention_mask=torch.from_numpy(attention),
            text_mask=torch.from_numpy(text_mask),
            clip_index=torch.tensor([item.index for item in items], dtype=torch.long),
            texts=texts,
            skipped=tuple(error for item in items for error in item.skipped),
        )


@dataclass
class EvalCaptions:
    """Every caption of an evaluation set as a query. Arrays are aligned with ``texts`` (Q,)."""

    texts: list[str]
    clip: np.ndarray
    lang: np.ndarray
    group: np.ndarray


def eval_captions(records: Sequence[ClipRecord], languages: Sequence[str]) -> EvalCaptions:
    """Flatten captions clip by clip, position by position, in ``languages`` order.

    ``clip`` is the record's row in ``records``; ``group`` numbers the (clip,
    caption position) pairs, so a caption and its translations share a group.
    Languages not in ``languages`` are ignored.
    """
    texts: list[str] = []
    clip: list[int] = []
    lang: list[str] = []
    group: list[int] = []
    next_group = 0
    for row, record in enumerate(records):
        positions = max((len(record.captions.get(code, [])) for code in languages), default=0)
        for position in range(positions):
            for code in languages:
                captions = record.captions.get(code, [])
                if position < len(captions):
                    texts.append(captions[position])
                    clip.append(row)
                    lang.append(code)
                    group.append(next_group)
            next_group += 1
    return EvalCaptions(
        texts=texts,
        clip=np.asarray(clip, dtype=np.int64),
        lang=np.asarray(lang, dtype=str),
        group=np.asarray(group, dtype=np.int64),
    )


def eval_audio_chunks(
    record: ClipRecord, *, sample_rate: int, clip_samples: int, policy: Literal["center", "chunk"],
    padding: Padding = "pad",
) -> np.ndarray:
    """(C, clip_samples) float32 windows of one clip: one center crop, or every chunk (chunk-and-average);
    a clip shorter than a window is padded with ``padding`` (the bundle's ``audio_frontend`` does the same)."""
    if policy == "center":  # only the middle window is decoded
        return decode_window(record.audio, sample_rate=sample_rate, n=clip_samples, mode="center",
                             padding=padding)[None, :]
    if policy == "chunk":  # every window of the clip: the whole file
        return eval_chunks(decode_audio(record.audio, sample_rate=sample_rate), clip_samples, padding)
    raise ValueError(f"unknown evaluation policy {policy!r}; use center or chunk")
