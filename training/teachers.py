"""Frozen stage-1 teachers for correspondence distillation (SPEC §4.4).

``build_teachers`` loads every checkpoint of ``objective.distill.teachers`` with
:func:`training.checkpoint.load_checkpoint` (frozen, eval mode, each with its own
tokenizer); ``Teachers.embed(train_batch)`` returns the teacher embeddings the loop puts
into :class:`training.objectives.base.EmbeddingBatch` (``teacher_audio`` (M, B, d),
``teacher_text`` (M, V, B, d)). Teachers of different embedding sizes are zero-padded to
the largest one (dot products, hence similarities, are unchanged).

Caching (``objective.distill.cache``):

* text embeddings are cached per caption string whenever caching is not ``off`` — text
  has no augmentation and teachers run in eval mode, so a caption always embeds the same;
* audio embeddings are cached per training clip, keyed by the clip's **id** (the batch's
  ``clip_index`` is the clip's row of the training records; :func:`build_teachers` maps it to
  the id, so a manifest run and a ``data.shards`` run, whose rows differ, key the same clip
  alike), when ``cache: on``, or with ``cache: auto`` when the training crop covers every
  whole clip: every training clip lasts at most ``data.clip_seconds`` (read from the audio
  file headers, or from records.jsonl's ``seconds`` for a shard corpus, which has no files to
  open), so the random crop never cuts and each clip reaches the teacher as the same waveform
  every epoch. Otherwise (longer clips are randomly cropped) audio is re-embedded every batch.

The teacher pass needs no pass of its own over the corpus: it embeds the training batch the
loader workers deliver (from a manifest's files or streamed from ``data.shards`` alike), each
rank its own rows, so it works from shards with the same strategy as from a manifest.

Caches live in host memory (never on the GPU), each bounded by
``objective.distill.cache_max_mib`` per rank (least recently used entries go first), and
count their hits: :meth:`Teachers.cache_stats` (hit rate, entries, MiB) goes to the epoch
records of ``metrics.jsonl`` and the log. Teachers run under the student's autocast (bf16 on
a GPU), so a teacher pass costs what a student forward does; embeddings are stored as float32.

Under torchrun the audio cache is **sharded**: clip ``c`` is cached only by rank
``crc32(id of c) mod N`` (``c mod N`` when no ids are given). Each step the ranks look the global batch's clips up in their shards (one
all-reduce), encode only the clips no shard holds yet, and send each fresh embedding to
its owner (one all-gather), so every clip is encoded once per run and a rank holds 1/N of
the cache. The text cache (per caption string) stays per rank.
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import soundfile as sf
import torch
import torch.nn.functional as F
from torch import Tensor

from training import distributed
from training.config import ConfigError, DataConfig, FrontendConfig, short_clip_padding
from training.objectives.distill import DistillConfig, parse_distill_config

log = logging.getLogger(__name__)


class _Batch(Protocol):
    """The fields of ``training.data.dataset.TrainBatch`` the teachers read."""

    waveform: Tensor
    clip_index: Tensor
    texts: list[list[str | None]]


class _Record(Protocol):
    audio: Any
    id: str
    meta: dict[str, Any]


class HostCache:
    """An LRU map key → (M, d) float32 CPU tensor, bounded in bytes, counting hits and misses."""

    def __init__(self, max_bytes: float) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._rows: OrderedDict[Hashable, Tensor] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def keys(self) -> list[Hashable]:
        return list(self._rows)

    def lookup(self, key: Hashable) -> Tensor | None:
        """The cached row (counted as a hit, and marked recently used), or None (a miss)."""
        row = self._rows.get(key)
        if row is None:
            self.misses += 1
            return None
        self.hits += 1
        self._rows.move_to_end(key)
        return row

    def put(self, key: Hashable, row: Tensor) -> None:
        row = row.detach().to("cpu", torch.float32).clone()  # not a view of the batch
        old = self._rows.pop(key, None)
        if old is not None:
            self.bytes -= old.numel() * 4
        self._rows[key] = row
        self.bytes += row.numel() * 4
        while self.bytes > self.max_bytes and len(self._rows) > 1:
            _, dropped = self._rows.popitem(last=False)
            self.bytes -= dropped.numel() * 4

    def stats(self) -> dict[str, float]:
        looked = self.hits + self.misses
        return {"hit_rate": self.hits / looked if looked else float("nan"), "entries": float(len(self._rows)),
                "mib": self.bytes / 2**20}


@dataclass
class Teacher:
    """One frozen checkpoint: its DualEncoder and its own tokenizer."""

    name: str
    model: Any
    """A DualEncoder (encode_audio / encode_text); Any because nn.Module attributes type as Tensor | Module."""
    tokenizer: Any
    embed_dim: int


@dataclass
class Teachers:
    """The M frozen teachers and their embedding caches."""

    teachers: list[Teacher]
    device: torch.device
    cache_audio: bool
    cache_text: bool
    cache_max_mib: float = 2048.0
    autocast_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    """The student's autocast (training.runtime.autocast); teachers run under it."""
    clip_ids: Sequence[str] | None = None
    """The training records' ids by row: the audio cache's keys (module doc); rows when None."""
    _audio: HostCache = field(init=False, repr=False)
    _text: HostCache = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._audio = HostCache(self.cache_max_mib * 2**20)
        self._text = HostCache(self.cache_max_mib * 2**20)

    def cache_stats(self) -> dict[str, float]:
        """Hit rate, entries and MiB of each cache this rank holds (for the epoch record)."""
        out: dict[str, float] = {}
        for name, cache, used in (("audio", self._audio, self.cache_audio), ("text", self._text, self.cache_text)):
            if used:
                out.update({f"teacher_{name}_cache_{k}": v for k, v in cache.stats().items()})
        return out

    @property
    def num_teachers(self) -> int:
        return len(self.teachers)

    @property
    def embed_dim(self) -> int:
        return max(t.embed_dim for t in self.teachers)

    def _pad(self, emb: Tensor) -> Tensor:
        return F.pad(emb, (0, self.embed_dim - emb.shape[-1]))

    def _encode_audio(self, waveform: Tensor) -> Tensor:
        """(M, n, d) float32 teacher embeddings of `waveform` (n, T), under the student's autocast."""
        with self.autocast_context():
            return torch.stack([self._pad(t.model.encode_audio(waveform).float()) for t in self.teachers])

    def _encode_texts(self, texts: Sequence[str]) -> Tensor:
        """(M, n, d) teacher embeddings of `texts`, each teacher with its own tokenizer."""
        out = []
        for teacher in self.teachers:
            ids, mask = teacher.tokenizer.encode(list(texts))
            ids_t = torch.as_tensor(np.asarray(ids), dtype=torch.long, device=self.device)
            mask_t = torch.as_tensor(np.asarray(mask), dtype=torch.long, device=self.device)
            with self.autocast_context():
                out.append(self._pad(teacher.model.encode_text(ids_t, mask_t).float()))
        return torch.stack(out)

    def clip_key(self, row: int) -> Hashable:
        """The audio cache's key of the training clip at ``row``: its id (its row without ids)."""
        return self.clip_ids[row] if self.clip_ids is not None else row

    @staticmethod
    def owner(key: Hashable, world: int) -> int:
        """The rank whose audio-cache shard holds ``key`` (a stable hash of an id; ``row mod N``)."""
        if isinstance(key, str):
            return zlib.crc32(key.encode("utf-8")) % world
        return int(key) % world  # type: ignore[call-overload]  # rows are ints

    def audio_cache_rows(self) -> dict[Hashable, Tensor]:
        """This rank's cached teacher audio embeddings, key → (M, d) (for inspection and tests)."""
        return {key: row for key in self._audio.keys() if (row := self._audio._rows.get(key)) is not None}

    def _audio_embeddings(self, waveform: Tensor, clip_index: Tensor) -> Tensor:
        waveform = waveform.to(self.device)
        if not self.cache_audio:
            return self._encode_audio(waveform)
        if distributed.world_size() > 1:
            return self._sharded_audio_embeddings(waveform, clip_index)
        keys = [self.clip_key(int(i)) for i in clip_index.tolist()]
        rows: list[Tensor | None] = [self._audio.lookup(key) for key in keys]
        missing = [row for row, found in enumerate(rows) if found is None]
        out = torch.zeros(self.num_teachers, len(keys), self.embed_dim, device=self.device)
        if missing:
            fresh = self._encode_audio(waveform[missing])
            out[:, missing] = fresh
            for column, row in enumerate(missing):
                self._audio.put(keys[row], fresh[:, column])
        for row, found in enumerate(rows):
            if found is not None:
                out[:, row] = found.to(self.device)
        return out

    def _sharded_audio_embeddings(self, waveform: Tensor, clip_index: Tensor) -> Tensor:
        """(M, B, d) through the cache sharded by ``clip mod N`` (module doc); every rank calls it each step."""
        world, me = distributed.world_size(), distributed.rank()
        rows = int(clip_index.shape[0])
        everyone = [self.clip_key(int(i)) for i in
                    distributed.all_gather_no_grad(clip_index.to(self.device).long()).tolist()]
        found = torch.zeros(len(everyone), self.num_teachers, self.embed_dim, device=self.device)
        hit = torch.zeros(len(everyone), device=self.device)
        for row, key in enumerate(everyone):
            cached = self._audio.lookup(key) if self.owner(key, world) == me else None
            if cached is not None:
                found[row], hit[row] = cached.to(self.device), 1.0
        found, hit = distributed.all_reduce_sum(found), distributed.all_reduce_sum(hit)
        mine = slice(me * rows, (me + 1) * rows)
        local_hit = hit[mine] > 0
        fresh = torch.zeros(rows, self.num_teachers, self.embed_dim, device=self.device)
        missing = (~local_hit).nonzero().squeeze(1)
        if missing.numel():
            fresh[missing] = self._encode_audio(waveform[missing]).transpose(0, 1)
        fresh_everyone = distributed.all_gather_no_grad(fresh)
        computed = distributed.all_gather_no_grad(~local_hit).tolist()
        for row, key in enumerate(everyone):
            if computed[row] and self.owner(key, world) == me:
                self._audio.put(key, fresh_everyone[row])
        return torch.where(local_hit[:, None, None], found[mine], fresh).transpose(0, 1)

    def _text_embeddings(self, texts: list[list[str | None]], batch_size: int) -> Tensor:
        wanted = sorted({t for view in texts for t in view if t is not None})
        table: dict[str, Tensor] = {}
        if self.cache_text:
            for text in wanted:
                cached = self._text.lookup(text)
                if cached is not None:
                    table[text] = cached.to(self.device)
        todo = [t for t in wanted if t not in table]
        if todo:
            fresh = self._encode_texts(todo)
            for i, text in enumerate(todo):
                table[text] = fresh[:, i]
                if self.cache_text:
                    self._text.put(text, fresh[:, i])
        zero = torch.zeros(self.num_teachers, self.embed_dim, device=self.device)
        views = [torch.stack([table[t] if t is not None else zero for t in view], dim=1) for view in texts]
        if not views:
            return torch.zeros(self.num_teachers, 0, batch_size, self.embed_dim, device=self.device)
        return torch.stack(views, dim=1)

    @torch.no_grad()
    def embed(self, batch: _Batch) -> tuple[Tensor, Tensor]:
        """(teacher_audio (M, B, d), teacher_text (M, V, B, d)); missing texts embed as zeros."""
        audio = self._audio_embeddings(batch.waveform, batch.clip_index)
        text = self._text_embeddings(batch.texts, audio.shape[1])
        return audio, text


def crop_covers_clips(records: Sequence[_Record], *, clip_seconds: float) -> bool:
    """True when every clip lasts at most ``clip_seconds`` (so a training crop is the whole clip).

    A clip of a shard corpus (its record names its ``shard``) has no file to open: its duration is
    records.jsonl's ``seconds`` (rounded to 0.1 ms when sharded, i.e. exact to a sample up to 10 kHz),
    read from the column when ``records`` is a shard corpus' (training/data/shard_records.py).
    """
    seconds = getattr(records, "seconds", None)
    if isinstance(seconds, np.ndarray):
        return not len(seconds) or float(seconds.max()) <= clip_seconds
    for record in records:
        meta = getattr(record, "meta", None) or {}
        if "shard" in meta and "seconds" in meta:
            if float(meta["seconds"]) > clip_seconds:
                return False
            continue
        try:
            info = sf.info(str(record.audio))
        except (RuntimeError, OSError) as err:  # unreadable header: decide safely (no cache)
            log.warning("teacher cache: cannot read %s (%s); caching teacher audio off", record.audio, err)
            return False
        if info.frames > clip_seconds * info.samplerate:
            return False
    return True


NAN_TAIL_PADDINGS = ("frames", "reflect")
"""Short-clip paddings whose training batches carry a NaN tail (AST's ``frames``, PE-Audio's ``reflect``:
index/audio/frontend.py), read only by the towers that asked for them."""


def _load_teacher(directory: Any, *, device: torch.device, frontend: FrontendConfig) -> Teacher:
    from training.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(directory, device=str(device))
    teacher_rate = checkpoint.config.frontend.sample_rate
    if teacher_rate != frontend.sample_rate:
        raise ConfigError(
            f"objective.distill.teachers: {directory} was trained at {teacher_rate} Hz, "
            f"the student at {frontend.sample_rate} Hz; teachers must share the student's sample rate"
        )
    student_pad, teacher_pad = short_clip_padding(frontend), short_clip_padding(checkpoint.config.frontend)
    if student_pad in NAN_TAIL_PADDINGS and teacher_pad != student_pad:
        # the student's batches mark a short clip's tail with NaN, which only its own kind of tower reads
        raise ConfigError(
            f"objective.distill.teachers: {directory} pads short clips with {teacher_pad!r}, the student with "
            f"{student_pad!r}, whose batches mark a short clip's tail with NaN for its own tower; the teacher "
            f"would embed NaN: use teachers of the student's audio tower kind"
        )
    model = checkpoint.model.to(device).eval()
    model.requires_grad_(False)
    return Teacher(name=str(directory), model=model, tokenizer=checkpoint.tokenizer, embed_dim=int(model.embed_dim))


def build_teachers(
    distill_cfg: Mapping[str, Any] | DistillConfig,
    *,
    device: torch.device | str,
    train_records: Sequence[_Record],
    tokenizer: Any,
    frontend: FrontendConfig,
    data: DataConfig,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> Teachers:
    """Load the frozen teachers of ``objective.distill`` and decide the caching rule (module doc).

    ``autocast`` is the student's (``lambda: training.runtime.autocast(runtime)``).
    ``tokenizer`` is the student's; it is not used for the teachers (each tokenizes with its
    own, so a teacher with another vocabulary or text tower works).
    """
    del tokenizer  # each teacher tokenizes with its own tokenizer.json
    config = distill_cfg if isinstance(distill_cfg, DistillConfig) else parse_distill_config(distill_cfg)
    device = torch.device(device)
    teachers = [_load_teacher(path, device=device, frontend=frontend) for path in config.teachers]
    if config.cache == "auto":
        cache_audio = crop_covers_clips(train_records, clip_seconds=data.clip_seconds)
    else:
        cache_audio = config.cache == "on"
    log.info(
        "distillation: %d teacher(s), audio embeddings %s, text embeddings %s",
        len(teachers),
        "cached per clip" if cache_audio else "recomputed every batch (random crops)",
        "recomputed" if config.cache == "off" else "cached per caption",
    )
    ids = getattr(train_records, "ids", None)  # data.shards' records: their ids, decoded when asked for
    if ids is None and train_records:
        ids = [str(getattr(r, "id", row)) for row, r in enumerate(train_records)]
    return Teachers(teachers=teachers, device=device, cache_audio=cache_audio, cache_text=config.cache != "off",
                    cache_max_mib=config.cache_max_mib, autocast_context=autocast, clip_ids=ids)
