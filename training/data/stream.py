"""Training from `tonearm data shard` output streamed through fsspec (``data.shards``, SPEC §13).

``data.shards`` names the folder of the shards: a local path, ``s3://bucket/prefix`` (s3fs; the
endpoint and keys come from the usual ``AWS_*`` variables), ``gs://`` (gcsfs) or ``https://``.
``index.json`` and ``records.jsonl`` are read first (counts, languages, captions for the
tokenizer); then each loader worker opens its own shards one after the other and reads them in
order, never the whole corpus (:func:`tar_samples`: one read per member where the file seeks,
webdataset's tar expander where it does not).

Every epoch (seeded by ``(seed, epoch)``):

* the ``train`` shards are shuffled and dealt to the ranks, then to each rank's loader workers,
  balancing clip counts (largest first);
* each worker draws its samples through a shuffle buffer of ``data.shuffle_buffer`` clips and
  decodes the random crop of only the samples it emits (:func:`index.audio.decode_window` on the
  in-memory FLAC/WAV, seeded by ``(seed, epoch, clip row)`` like the file path), then batches them:
  items are the same :class:`TrainItem` the manifest path gives, so every objective's strategy
  (views, KCL's languages, clip indices) is unchanged;
* every rank runs the same number of batches: ``steps_per_epoch`` is the least, over the run's
  epochs and ranks, of the whole batches its workers' shards hold; each worker stops at its
  share. A rank thus drops up to ``workers × (batch_size - 1)`` clips of an epoch (plus the
  imbalance of whole shards between ranks): no clip is seen twice in an epoch.

Resume is exact: batches are delivered round-robin over the workers (DataLoader order), so the
``batch_in_epoch`` batches already trained tell how many batches each worker produced; on
resume each worker replays its stream without decoding audio up to that point (the tar bytes of
those samples are read again, not decoded).

A sample whose audio cannot be decoded is replaced by another clip of the worker's shuffle buffer
(or a recent one) and its error travels in ``TrainItem.skipped`` to :class:`BadSampleBudget`,
exactly as an unreadable file does; a shard that cannot be read or ends early has its error
counted the same way and the worker fills its share from the clips it has.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from index.audio import decode_window
from index.audio_frontend import Padding
from index.errors import AudioDecodeError, DataError
from training.config import ConfigError, TrainConfig, short_clip_padding
from training.data.dataset import MAX_SUBSTITUTES, TrainCollate, TrainItem, _rng_seed
from training.data.manifest import ClipRecord

log = logging.getLogger(__name__)

TRAIN_SPLIT = "train"
RECENT = 32
"""Good samples each worker keeps to replace undecodable ones once its buffer is empty."""


def _join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}"


def read_text(url: str) -> str:
    import fsspec

    with fsspec.open(url, "rt", encoding="utf-8") as handle:
        return str(handle.read())


@dataclass
class ShardCorpus:
    """What ``index.json`` and ``records.jsonl`` say about a shard folder."""

    url: str
    index: dict[str, Any]
    records: dict[str, list[ClipRecord]]
    """Per split, the clips in records.jsonl order (captions filtered to ``data.languages``)."""

    def shards(self, split: str) -> list[tuple[str, int]]:
        """(name, clips) of the split's shards."""
        summary = self.index["splits"].get(split, {"shards": []})
        return [(s["name"], int(s["clips"])) for s in summary["shards"]]


def open_corpus(url: str, *, languages: Sequence[str], drop_other_languages: bool) -> ShardCorpus:
    """Read a shard folder's index and records; captions outside ``languages`` refuse (or drop)."""
    try:
        index = json.loads(read_text(_join(url, "index.json")))
        lines = read_text(_join(url, "records.jsonl")).splitlines()
    except FileNotFoundError as err:
        raise DataError(f"{url}: no index.json / records.jsonl there ({err}); write shards with "
                        "`tonearm data shard MANIFEST --out DIR`") from None
    if not index.get("complete"):
        raise DataError(f"{url}: index.json says the shards are incomplete; rerun `tonearm data shard` to finish")
    records: dict[str, list[ClipRecord]] = {}
    wanted = set(languages)
    for line in lines:
        row = json.loads(line)
        captions = {lang: texts for lang, texts in row["captions"].items() if lang in wanted}
        if len(captions) < len(row["captions"]) and not drop_other_languages:
            other = sorted(set(row["captions"]) - wanted)
            raise DataError(
                f"{url}: clip {row['id']!r} has captions in {other}, not among data.languages; add them "
                "or set data.drop_other_languages=true")
        if captions:
            records.setdefault(row["split"], []).append(ClipRecord(
                id=row["id"], audio=_shard_path(url, row["shard"]), captions=captions, split=row["split"],
                meta={"seconds": row["seconds"], "shard": row["shard"]}))
    return ShardCorpus(url=url, index=index, records=records)


def _tar_members(stream: Any, url: str) -> Iterator[dict[str, Any]]:
    """``{"fname", "data", "__url__"}`` of each regular member of a seekable tar, in order.

    Why not webdataset's ``tar_file_expander``: it opens every stream in tarfile's stream mode
    (``r|*``), which reads a member 10 KiB at a time and joins the pieces, copying a 2.8 MB FLAC
    (a 60-s clip) three times — ~5× the cost of reading it with one ``read`` (profile in
    docs/BENCHMARKS.md, data_path_shards). fsspec's local and object-store files seek, so tarfile's
    random-access mode reads each header and then each member's bytes with one call, in order
    (the object-store file's read-ahead cache keeps it one sequential stream).
    """
    import tarfile

    archive = tarfile.open(fileobj=stream, mode="r:")
    for info in archive:
        if info.isreg():
            handle = archive.extractfile(info)
            assert handle is not None  # a regular member always has a file object
            yield {"fname": info.name, "data": handle.read(), "__url__": url}
        archive.members = []  # type: ignore[attr-defined]  # streamed: keep no list of the shard's members (typeshed omits it)


def tar_samples(stream: Any, url: str) -> Iterator[dict[str, Any]]:
    """The samples (``{"__key__", ext: bytes, …}``) of one shard opened with fsspec: webdataset's
    grouping of members by key over :func:`_tar_members` when the file seeks, webdataset's own
    tar expander (stream mode, e.g. an ``https://`` server without ranges) when it does not."""
    from webdataset.tariterators import group_by_keys, tar_file_expander

    seekable = getattr(stream, "seekable", lambda: False)()
    members = _tar_members(stream, url) if seekable else tar_file_expander([{"url": url, "stream": stream}])
    return group_by_keys(members)


def _shard_path(url: str, shard: str) -> Any:
    from pathlib import PurePosixPath

    return PurePosixPath(_join(url, shard))  # names the clip's shard; never opened as a file


def refuse_unsupported(cfg: TrainConfig) -> None:
    """One line for what needs random access to the training clips' audio.

    Every objective trains from shards: distillation's teachers embed the streamed batch, ASK's
    knowledge bases stream the train shards by clip id (training/data/shard_passes.py)."""
    if cfg.data.val_fraction > 0:
        raise ConfigError("data.val_fraction carves clips out of the training set, which data.shards cannot; "
                          "shard a manifest with its own val split instead")


# --- the epoch plan -------------------------------------------------------------------------


def _deal(shards: Sequence[tuple[str, int]], bins: int) -> list[list[tuple[str, int]]]:
    """Largest first into the emptiest bin (ties: the order given, i.e. the epoch's shuffle)."""
    out: list[list[tuple[str, int]]] = [[] for _ in range(bins)]
    load = [0] * bins
    for shard in sorted(shards, key=lambda s: -s[1]):
        target = min(range(bins), key=lambda b: (load[b], b))
        out[target].append(shard)
        load[target] += shard[1]
    return out


@dataclass
class WorkerShare:
    shards: list[str]
    batches: int


def epoch_plan(
    shards: Sequence[tuple[str, int]], *, epoch: int, seed: int, world: int, workers: int, batch_size: int
) -> list[list[WorkerShare]]:
    """[rank][worker] shards and whole batches of one epoch (before the cut to the common step count)."""
    order = list(shards)
    random.Random(_rng_seed(seed, epoch, 7)).shuffle(order)
    plan = []
    for rank_shards in _deal(order, world):
        plan.append([WorkerShare([name for name, _ in part], sum(c for _, c in part) // batch_size)
                     for part in _deal(rank_shards, workers)])
    return plan


def cut(shares: list[WorkerShare], steps: int) -> list[int]:
    """Batches per worker so that the rank delivers exactly ``steps`` (none above its whole batches)."""
    total = sum(s.batches for s in shares)
    quota = [s.batches * steps // total if total else 0 for s in shares]
    spare = steps - sum(quota)
    for w in sorted(range(len(shares)), key=lambda w: -(shares[w].batches - quota[w])):
        if spare == 0:
            break
        extra = min(spare, shares[w].batches - quota[w])
        quota[w] += extra
        spare -= extra
    return quota


def delivery_order(quota: Sequence[int]) -> list[int]:
    """The worker of each batch, in the order the DataLoader yields them: round-robin from worker 0
    over the workers that still have batches (an exhausted worker's turn is skipped)."""
    left, order = list(quota), []
    while any(left):
        for w in range(len(left)):
            if left[w]:
                left[w] -= 1
                order.append(w)
    return order


def resume_roles(quota: Sequence[int], done: int) -> tuple[list[int], int]:
    """(batches each worker had delivered after ``done`` batches, the worker due next).

    A resumed DataLoader starts its round-robin at worker 0 again; giving physical worker ``p``
    the share of worker ``(p + next) % W`` makes it yield the batches in the uninterrupted order.
    """
    order = delivery_order(quota)
    got = [0] * len(quota)
    for w in order[:done]:
        got[w] += 1
    return got, (order[done] if done < len(order) else 0)


class _NotTrained(Exception):
    """A sample whose clip has no caption in ``data.languages`` (dropped, replaced, not counted as bad)."""


# --- the stream -----------------------------------------------------------------------------


class ShardStream(IterableDataset):
    """This rank's training items of an epoch (module doc); epoch and resume point are shared
    with the (persistent) loader workers through a shared-memory tensor."""

    def __init__(
        self, corpus: ShardCorpus, *, rank: int, world: int, workers: int, batch_size: int, steps: int,
        sample_rate: int, clip_samples: int, seed: int, shuffle_buffer: int, languages: Sequence[str],
        padding: Padding = "pad",
    ) -> None:
        self.url = corpus.url
        self.shards = corpus.shards(TRAIN_SPLIT)
        self.extension = str(corpus.index.get("extension", "flac"))
        self.row_of = {r.id: row for row, r in enumerate(corpus.records.get(TRAIN_SPLIT, []))}
        self.languages = set(languages)
        self.rank, self.world, self.workers = rank, world, max(1, workers)
        self.batch_size, self.steps = batch_size, steps
        self.sample_rate, self.clip_samples, self.padding = sample_rate, clip_samples, padding
        self.seed, self.shuffle_buffer = seed, max(1, shuffle_buffer)
        self.shared = torch.zeros(2, dtype=torch.long).share_memory_()  # epoch, batches to skip

    def set_epoch(self, epoch: int, *, skip: int = 0) -> None:
        self.shared[0], self.shared[1] = epoch, skip

    def share(self, epoch: int, worker: int) -> tuple[list[str], int, int, int]:
        """(shards, batches to deliver, batches already delivered, role) of loader worker ``worker``
        this epoch; the role (the plan's worker whose share it takes) seeds its shuffle buffer."""
        plan = epoch_plan(self.shards, epoch=epoch, seed=self.seed, world=self.world, workers=self.workers,
                          batch_size=self.batch_size)[self.rank]
        quota = cut(plan, self.steps)
        done, due = resume_roles(quota, int(self.shared[1]))
        role = (worker + due) % self.workers
        return plan[role].shards, quota[role], done[role], role

    def _raw(self, names: Sequence[str], errors: list[str]) -> Iterator[dict[str, Any]]:
        """The samples of ``names`` in order, as dicts of bytes; unreadable shards add to ``errors``."""
        import fsspec

        for name in names:
            url = _join(self.url, name)
            try:
                with fsspec.open(url, "rb") as stream:
                    for sample in tar_samples(stream, url):
                        sample["__shard__"] = url
                        yield sample
            except Exception as err:  # noqa: BLE001 - a broken shard is a bad sample, not a crash
                errors.append(f"{url}: shard unreadable or cut short: {type(err).__name__}: {err}")

    def _decode(self, sample: dict[str, Any], epoch: int) -> TrainItem:
        meta = json.loads(sample["json"])
        row = self.row_of.get(meta["id"])
        if row is None:  # no caption in data.languages (drop_other_languages): not a bad sample
            raise _NotTrained(meta["id"])
        audio = sample.get(self.extension)
        if not audio:
            raise AudioDecodeError(f"{sample['__shard__']}: {meta['id']}: no .{self.extension} member")
        rng = np.random.default_rng(_rng_seed(self.seed, epoch, row))
        try:
            wave = decode_window(bytes(audio), sample_rate=self.sample_rate, n=self.clip_samples, mode="random",
                                 rng=rng, padding=self.padding)
        except AudioDecodeError as err:
            reason = str(err).split(": ", 1)[-1]
            raise AudioDecodeError(f"{sample['__shard__']}: {meta['id']}: {reason}") from None
        captions = {lang: texts for lang, texts in meta["captions"].items() if lang in self.languages}
        return TrainItem(wave, captions, row, epoch=epoch)

    def __iter__(self) -> Iterator[TrainItem]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        epoch = int(self.shared[0])
        names, batches, done, role = self.share(epoch, worker)
        want, skip = batches * self.batch_size, done * self.batch_size
        rng = random.Random(_rng_seed(self.seed, epoch, self.rank, role, 3))
        errors: list[str] = []
        raw = self._raw(names, errors)
        buffer: list[dict[str, Any]] = []
        recent: list[dict[str, Any]] = []
        for produced in range(want):
            while len(buffer) < self.shuffle_buffer:
                sample = next(raw, None)
                if sample is None:
                    break
                buffer.append(sample)
            if buffer:
                pick = rng.randrange(len(buffer))
                buffer[pick], buffer[-1] = buffer[-1], buffer[pick]
                sample = buffer.pop()
            elif recent:
                sample = recent[rng.randrange(len(recent))]
            else:
                raise DataError(f"rank {self.rank} worker {worker}: no readable sample in shards {names}; "
                                f"first error: {errors[0] if errors else 'none'}")
            if produced < skip:  # resuming: replayed, not decoded
                recent = (recent + [sample])[-RECENT:]
                continue
            yield self._item(sample, epoch, buffer, recent, rng, errors)

    def _item(self, sample: dict[str, Any], epoch: int, buffer: list[dict[str, Any]],
              recent: list[dict[str, Any]], rng: random.Random, errors: list[str]) -> TrainItem:
        skipped = errors[:]  # shard errors met since the last item travel with this one
        errors.clear()
        candidate = sample
        for _ in range(MAX_SUBSTITUTES + 1):
            try:
                item = self._decode(candidate, epoch)
            except (AudioDecodeError, _NotTrained) as err:
                if isinstance(err, AudioDecodeError):
                    skipped.append(str(err))
                pool = buffer or recent
                if not pool:
                    break
                candidate = pool[rng.randrange(len(pool))]
                continue
            recent.append(candidate)
            del recent[:-RECENT]
            item.skipped = tuple(skipped)
            return item
        raise DataError(f"{MAX_SUBSTITUTES + 1} samples in a row could not be used; first error: "
                        f"{skipped[0] if skipped else 'none (no captions in data.languages)'}")


class StreamBatches:
    """What the loop needs of a training loader: iterable batches, ``set_epoch(epoch, skip=)``, ``len``."""

    def __init__(self, stream: ShardStream, loader: DataLoader) -> None:
        self.stream = stream
        self.loader = loader
        self.skip = 0
        self.epoch = 0

    def set_epoch(self, epoch: int, *, skip: int = 0, samples_in_epoch: int | None = None) -> None:
        # A stream resumes by batches of the same world size and workers only (docs/training.md,
        # "Training on a large corpus"); `samples_in_epoch` (the files path's elastic position)
        # is not used: restore_trainer_state refuses a world-size change for shards.
        self.skip, self.epoch = skip, epoch
        self.stream.set_epoch(epoch, skip=skip)

    def batches_before(self) -> int:
        """Batches of the epoch the current position has passed."""
        return self.skip

    def samples_consumed(self, batch_in_epoch: int) -> int | None:
        """No world-size-independent position for a stream (resume is by batches)."""
        return None

    def __len__(self) -> int:
        return self.stream.steps

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)


def steps_per_epoch(shards: Sequence[tuple[str, int]], *, seed: int, epochs: int, world: int, workers: int,
                    batch_size: int) -> int:
    """The least, over epochs and ranks, of the whole batches a rank's workers hold (module doc)."""
    steps = None
    for epoch in range(max(1, epochs)):
        for rank in epoch_plan(shards, epoch=epoch, seed=seed, world=world, workers=max(1, workers),
                               batch_size=batch_size):
            total = sum(share.batches for share in rank)
            steps = total if steps is None else min(steps, total)
    return steps or 0


def build_stream_loader(
    cfg: TrainConfig, corpus: ShardCorpus, *, rank: int, world: int, options: dict[str, Any], strategy: Any,
    tokenizer: Any, sample_rate: int, clip_samples: int,
) -> StreamBatches:
    """The DataLoader over this rank's shard stream, with ``options`` from :func:`loader_options`."""
    from training.interrupt import ignore_ctrl_c

    shards = corpus.shards(TRAIN_SPLIT)
    workers = int(options.get("num_workers", 0))
    batch = cfg.optim.batch_size
    steps = steps_per_epoch(shards, seed=cfg.seed, epochs=cfg.optim.epochs, world=world, workers=workers,
                            batch_size=batch)
    if steps == 0:
        raise DataError(
            f"{corpus.url}: {len(shards)} train shards of {sum(c for _, c in shards)} clips do not give every "
            f"one of {world} rank(s) × {max(1, workers)} loader worker(s) a whole batch of {batch}; "
            "write smaller shards (tonearm data shard --shard-size) or lower data.num_workers")
    if len(shards) < world * max(1, workers):
        log.warning("%d train shards for %d rank(s) × %d loader workers: some workers stay idle; write smaller "
                    "shards (--shard-size) to use them all", len(shards), world, max(1, workers))
    index_rate = int(corpus.index.get("sample_rate", sample_rate))
    if index_rate != sample_rate:
        log.warning("shards are at %d Hz, the model's front end at %d Hz: every crop is resampled "
                    "(reshard with --sample-rate %d)", index_rate, sample_rate, sample_rate)
    stream = ShardStream(
        corpus, rank=rank, world=world, workers=workers, batch_size=batch, steps=steps,
        sample_rate=sample_rate, clip_samples=clip_samples, seed=cfg.seed,
        shuffle_buffer=cfg.data.shuffle_buffer, languages=cfg.data.languages,
        padding=short_clip_padding(cfg.frontend),
    )
    # A generator of its own: a DataLoader without one draws its workers' base seed from the global
    # torch RNG at every epoch, which would shift dropout after a resume (the draw happened before).
    loader = DataLoader(stream, batch_size=batch, collate_fn=TrainCollate(strategy, tokenizer, seed=cfg.seed),
                        worker_init_fn=ignore_ctrl_c, generator=torch.Generator().manual_seed(cfg.seed), **options)
    return StreamBatches(stream, loader)


# --- records for the loop -------------------------------------------------------------------

_CORPORA: dict[tuple[str, tuple[str, ...], bool], ShardCorpus] = {}


def cached_corpus(cfg: TrainConfig) -> ShardCorpus:
    """:func:`open_corpus` of ``data.shards``, read once per process."""
    assert cfg.data.shards is not None
    key = (cfg.data.shards, tuple(cfg.data.languages), cfg.data.drop_other_languages)
    if key not in _CORPORA:
        _CORPORA[key] = open_corpus(cfg.data.shards, languages=cfg.data.languages,
                                    drop_other_languages=cfg.data.drop_other_languages)
    return _CORPORA[key]


def extract_split(corpus: ShardCorpus, split: str, folder: Path) -> list[ClipRecord]:
    """The clips of a (small) split written out as files, for evaluation's random access."""
    import fsspec

    folder.mkdir(parents=True, exist_ok=True)
    extension = str(corpus.index.get("extension", "flac"))
    by_id = {r.id: r for r in corpus.records.get(split, [])}
    out: list[ClipRecord] = []
    for name, _ in corpus.shards(split):
        url = _join(corpus.url, name)
        with fsspec.open(url, "rb") as stream:
            for sample in tar_samples(stream, url):
                meta = json.loads(sample["json"])
                record = by_id.get(meta["id"])
                if record is None:
                    continue
                path = folder / f"{sample['__key__']}.{extension}"
                if not path.is_file():  # ranks may extract at once: whole files only
                    tmp = path.with_name(f".{path.name}.{os.getpid()}")
                    tmp.write_bytes(sample[extension])
                    os.replace(tmp, path)
                out.append(ClipRecord(id=record.id, audio=path, captions=record.captions, split=split,
                                      meta=record.meta))
    return out


def load_shard_data(cfg: TrainConfig) -> tuple[list[ClipRecord], list[ClipRecord]]:
    """(train records, validation records) of ``data.shards``: the train split's captions (tokenizer,
    counts) and the validation split extracted to ``out_dir/val_clips`` (docs/training.md)."""
    refuse_unsupported(cfg)
    corpus = cached_corpus(cfg)
    train = corpus.records.get(TRAIN_SPLIT, [])
    if len(train) < 2:
        raise DataError(f"{corpus.url}: {len(train)} clip(s) in split 'train'; training needs at least 2")
    if cfg.data.max_clips is not None:
        raise ConfigError("data.max_clips takes the first clips of a manifest; with data.shards write a smaller "
                          "shard set instead")
    split = cfg.eval.split
    folder = cfg.out_dir / "val_clips" / str(corpus.index.get("plan", "shards"))[:16]  # per shard set
    val = extract_split(corpus, split, folder) if corpus.records.get(split) else []
    for name, records in ((TRAIN_SPLIT, train), (split, val)):
        missing = [lang for lang in cfg.data.languages if not any(r.captions.get(lang) for r in records)]
        if records and missing:
            raise DataError(f"{corpus.url}: no {name!r} captions in {missing} although data.languages lists them; "
                            "set data.languages to the shards' languages")
    if not val:
        log.warning("%s has no %r split: no validation; best/ will be the last weights", corpus.url, split)
    log.info("data.shards %s: %d train clips (%.1f h) in %d shards, %d %s clips extracted for validation",
             corpus.url, len(train), corpus.index["splits"][TRAIN_SPLIT].get("hours", 0.0),
             len(corpus.shards(TRAIN_SPLIT)), len(val), split)
    return train, val
