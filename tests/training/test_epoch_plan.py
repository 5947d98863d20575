"""An epoch of data.shards is an epoch (training/data/epoch_plan.py, docs/training.md "Training on a
large corpus"): each clip served at most once, ≥ 99 % of the usable clips at any layout, clips
without a caption in the run's languages and undecodable ones counted and named, never replaced;
resume bit-exact on the same layout and without repeats on another one.

References are the shards' own members (read with webdataset) and the sets of ids actually served."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.ranks import spawn_ranks
from tests.training.test_distributed_runs import free_port
from training.data.epoch_plan import (
    Layout,
    coverage,
    draw_order,
    epoch_sequence,
    segment_cut,
    simulate_losses,
    slot_seed,
)

ROOT = Path(__file__).resolve().parents[2]
BATCH = 4


# --- the cut alone, at the scale -----------------------------------------------------


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_uneven_shards_are_covered_once_and_to_99_percent_at_1_2_4_nodes(nodes: int) -> None:
    """400 shards of 700-1000 clips (not a multiple of anything), 8 ranks a node × 11 loader workers,
    batch 256 — the layout that covered 75.8 % at 4 nodes before; every (rank, worker) simulated."""
    counts = [random.Random(shard).randint(700, 1000) for shard in range(400)]
    total = sum(counts)  # the reference: the shards' own member counts
    layout = Layout(world=8 * nodes, workers=11, batch_size=256)
    cut = segment_cut(total, layout)
    served: list[np.ndarray] = []
    for rank, chunks in enumerate(cut.ranks):
        assert sum(len(c.sizes) for c in chunks) == cut.steps  # every rank the same number of batches
        rows = 0
        for worker, chunk in enumerate(chunks):
            order = draw_order(chunk.stop - chunk.start, buffer=1000, first=256,
                               seed=slot_seed(0, 0, 0, rank, worker))
            assert sorted(order) == list(range(chunk.stop - chunk.start))
            served.append(chunk.start + np.asarray(order, dtype=np.int64))
            rows += sum(chunk.sizes)
        assert rows == cut.per_rank
    positions = np.concatenate(served)
    assert len(np.unique(positions)) == len(positions)  # no position twice
    assert positions.min() >= 0 and positions.max() < total
    assert len(positions) / total >= 0.99
    assert coverage(total, total, layout).served == len(positions)


def test_odd_layouts_keep_ranks_in_lockstep_and_batch_sizes_equal_across_ranks() -> None:
    for n, world, workers, batch in [(97, 3, 5, 7), (31, 2, 0, 4), (10, 4, 3, 3), (1000, 7, 2, 64), (9, 4, 1, 2)]:
        cut = segment_cut(n, Layout(world, workers, batch))
        per_step = []
        for chunks in cut.ranks:
            sizes = [0] * cut.steps
            for worker, chunk in enumerate(chunks):  # DataLoader round-robin: batch t from worker t % W
                for i, size in enumerate(chunk.sizes):
                    sizes[worker + i * max(1, workers)] = size
            per_step.append(sizes)
            assert all(size >= 2 for size in sizes)
        assert all(sizes == per_step[0] for sizes in per_step)
        assert n - cut.per_rank * world <= 2 * world - 1


def test_a_worker_holds_at_most_its_buffer_and_serves_before_it_is_full() -> None:
    """What a worker holds while emitting draw d: the chunk entries read up to the furthest one drawn
    so far, less those emitted. It never exceeds the buffer, and the first batch comes early."""
    for length, buffer, batch in [(1000, 100, 32), (50, 1000, 8), (300, 7, 16)]:
        order = draw_order(length, buffer=buffer, first=batch, seed=1)
        furthest = -1
        for d, j in enumerate(order):
            furthest = max(furthest, j)
            assert furthest + 1 - d <= max(buffer, 1)
        # The first batch is served after reading < 3 batches' worth, whatever the buffer's size.
        assert max(order[:batch]) < (batch - 1) + min(buffer, 2 * batch - 1) <= 3 * batch
        assert sorted(order) == list(range(length))


def test_shuffle_buffer_auto_is_sized_from_memory() -> None:
    from training.data.loader import MAX_SHUFFLE_ENTRIES, node_memory, shuffle_entries

    crop = 10 * 48_000 * 4  # a 10-s float32 crop at 48 kHz: 1.92 MB
    assert shuffle_entries(300, None, entry_bytes=crop, workers=4) == (300, 300 * crop)  # explicit wins
    assert shuffle_entries("auto", 500 * 10**6, entry_bytes=crop, workers=4) == (260, 260 * crop)
    assert shuffle_entries("auto", 10**12, entry_bytes=crop, workers=4)[0] == MAX_SHUFFLE_ENTRIES
    entries, size = shuffle_entries("auto", None, entry_bytes=crop, workers=23, ranks_on_node=8)
    assert size * 23 * 8 <= 0.2 * node_memory() or entries == 16


# --- real shards: a language subset and a corrupt sample ----------------------------------------


@pytest.fixture(scope="module")
def subset_shards(tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The tiny corpus with no English caption on every third train clip, in uneven shards of 5
    (7 train shards, the last of 2), and the audio of one sample garbled after sharding."""
    import webdataset as wds

    from training.data.manifest import read_manifest
    from training.data.shards import shard_manifest

    folder = tmp_path_factory.mktemp("subset")
    lines, train = [], 0
    for _, record in read_manifest(tiny_corpus, languages=None):
        captions = dict(record.captions)
        if record.split == "train":
            if train % 3 == 0:
                captions.pop("eng", None)
            train += 1
        lines.append({"id": record.id, "audio": str(record.audio), "split": record.split, "captions": captions})
    manifest = folder / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    out = folder / "shards"
    shard_manifest(manifest, out, sample_rate=16_000, shard_size=5, workers=1, progress=False)
    victim = out / "train-000002.tar"
    samples = list(wds.WebDataset(str(victim), shardshuffle=False))
    bad = next(s for s in samples if "eng" in json.loads(s["json"])["captions"])
    with wds.TarWriter(str(victim)) as writer:
        for sample in samples:
            writer.write({"__key__": sample["__key__"], "json": sample["json"],
                          "flac": b"fLaC" + bytes(512) if sample is bad else sample["flac"]})
    return out, json.loads(bad["json"])["id"]


def shard_members(folder: Path) -> dict[str, dict]:
    """The reference: every train sample's json as the shards themselves hold it."""
    import webdataset as wds

    index = json.loads((folder / "index.json").read_text())
    urls = [str(folder / s["name"]) for s in index["splits"]["train"]["shards"]]
    return {json.loads(s["json"])["id"]: json.loads(s["json"]) for s in wds.WebDataset(urls, shardshuffle=False)}


class Got(tuple):  # type: ignore[type-arg]
    """(ids, waves, errors) of a batch, with the stream's reserve draws as an attribute."""

    extra_draws = 0


def make_batches(url: str, *, rank: int, world: int, workers: int, persistent: bool = False):  # noqa: ANN201
    from torch.utils.data import DataLoader

    from training.data.stream import ShardStream, StreamBatches, open_corpus

    corpus = open_corpus(url, languages=["eng"], drop_other_languages=True)
    stream = ShardStream(corpus, rank=rank, layout=Layout(world, workers, BATCH, 3), sample_rate=16_000,
                         clip_samples=8_000, seed=0, languages=["eng"])

    def collate(batch):  # noqa: ANN001, ANN202 - (ids, waves, errors) of the stream's (items, errors, extra draws)
        items, errors, extra = batch
        waves = np.stack([i.waveform for i in items]) if items else np.zeros((0, 8_000), np.float32)
        got = Got(([corpus.records["train"][i.index].id for i in items], waves, errors))
        got.extra_draws = extra  # what StreamBatches records for the checkpoint's plan
        return got

    extra = {"persistent_workers": persistent} if workers else {}
    loader = DataLoader(stream, batch_size=None, collate_fn=collate, num_workers=workers, **extra)
    return StreamBatches(stream, loader), corpus


def test_a_language_subset_with_a_corrupt_sample_serves_each_clip_once_and_names_the_rest(
        subset_shards: tuple[Path, str]) -> None:
    folder, bad_id = subset_shards
    members = shard_members(folder)
    english = {clip for clip, meta in members.items() if "eng" in meta["captions"]}
    served, errors, steps = [], [], []
    for rank in (0, 1):  # 2 ranks × 2 loader workers, each rank as its own process would run it
        batches, corpus = make_batches(str(folder), rank=rank, world=2, workers=2)
        assert sorted(corpus.unusable["train"]) == sorted(set(members) - english)  # counted and named
        batches.set_epoch(0)
        got = list(batches)
        steps.append(len(got))
        served += [clip for ids, _, _ in got for clip in ids]
        errors += [e for _, _, errs in got for e in errs]
    assert steps[0] == steps[1] == len(batches)
    assert len(served) == len(set(served))  # no clip twice: the bad one's place stays empty
    assert set(served) <= english - {bad_id}
    assert len(served) >= len(english) - 1 - (2 * 2 - 1)  # all but the bad one and the cut's tail
    assert len(errors) == 1 and bad_id in errors[0] and "train-000002.tar" in errors[0]


def test_resume_after_a_bad_sample_gives_the_same_batches_bit_for_bit(subset_shards: tuple[Path, str]) -> None:
    folder, bad_id = subset_shards
    batches, _ = make_batches(str(folder), rank=0, world=1, workers=2, persistent=True)
    epochs = []
    for epoch in (0, 1):
        batches.set_epoch(epoch)
        epochs.append(list(batches))
    hole = next(t for t, (ids, _, errs) in enumerate(epochs[1]) if errs)
    # The bad sample's batch is filled from the worker's next draw (here without a reserve: its last batch is short).
    assert bad_id in epochs[1][hole][2][0] and len(epochs[1][hole][0]) == BATCH
    for skip in (hole, hole + 1):  # resumed on the bad sample's batch, and right after it
        plan = batches.plan_state(1, skip)
        again, _ = make_batches(str(folder), rank=0, world=1, workers=2)
        again.restore(plan, epoch=1, batch_in_epoch=skip, saved_world=1)
        again.set_epoch(1, skip=skip)
        resumed = list(again)
        assert len(resumed) == len(epochs[1]) - skip
        for (ids, waves, errs), (ids0, waves0, errs0) in zip(resumed, epochs[1][skip:], strict=True):
            assert ids == ids0 and errs == errs0
            assert np.array_equal(waves, waves0)


def plain_train_records(folder: Path, languages: list[str], split: str = "train") -> tuple[list[dict], list[str]]:
    """The reference: records.jsonl parsed with json alone — the split's lines with a caption in
    ``languages`` (captions cut to those), in file order (a row is a position here), and the ids of
    the split's other lines."""
    rows, unusable = [], []
    for line in (folder / "records.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        captions = {lang: texts for lang, texts in record["captions"].items() if lang in languages}
        if record["split"] == split:
            (rows if captions else unusable).append({**record, "captions": captions} if captions else record["id"])
    return rows, unusable


def test_the_stream_serves_each_row_the_id_and_captions_records_jsonl_gives_it(
        subset_shards: tuple[Path, str]) -> None:
    """A rank holds no captions (training/data/shard_records.py): each item a 2-rank × 2-worker epoch
    serves (uneven shards of 5, English only, every third train clip without an English caption)
    carries, at its row, the captions a plain json parse of records.jsonl gives that row, and the
    rank's record of the row has that line's id, seconds, shard and ordinal."""
    from torch.utils.data import DataLoader

    from training.data.stream import ShardStream, open_corpus

    folder, bad_id = subset_shards
    reference, unusable = plain_train_records(folder, ["eng"])
    served: list[int] = []
    for rank in (0, 1):
        corpus = open_corpus(str(folder), languages=["eng"], drop_other_languages=True)
        records = corpus.records["train"]
        assert len(records) == len(reference) and corpus.unusable["train"] == unusable
        stream = ShardStream(corpus, rank=rank, layout=Layout(2, 2, BATCH, 3), sample_rate=16_000,
                             clip_samples=8_000, seed=0, languages=["eng"])
        stream.set_epoch(0)
        loader = DataLoader(stream, batch_size=None, num_workers=2,
                            collate_fn=lambda batch: [(item.index, item.captions) for item in batch[0]])
        for batch in loader:
            for row, captions in batch:
                line = reference[row]
                assert captions == line["captions"]
                clip = records[row]
                assert (clip.id, clip.meta["seconds"], clip.meta["shard"]) == (line["id"], line["seconds"], line["shard"])
                served.append(row)
    assert len(served) == len(set(served)) >= len(reference) - 1 - 3  # all but the bad clip and the cut's tail
    import webdataset as wds

    ordinal = {}  # the reference: each clip's position among its shard's own members
    for shard in {line["shard"] for line in reference}:
        for place, sample in enumerate(wds.WebDataset(str(folder / shard), shardshuffle=False)):
            ordinal[json.loads(sample["json"])["id"]] = place
    assert [records[row].meta["ordinal"] for row in range(len(reference))] == [
        ordinal[line["id"]] for line in reference]


def test_captions_read_again_match_records_jsonl_in_any_order_and_language_subset(
        subset_shards: tuple[Path, str]) -> None:
    """What the knowledge-base pass (a rank's share of rows, any order), the validation split and the
    tokenizer (every caption, clip by clip, in data.languages order) read again from records.jsonl by
    byte range equals a plain json parse of it, for a language subset over uneven shards."""
    from training.data.shard_records import caption_texts
    from training.data.stream import open_corpus

    folder, _ = subset_shards
    languages = ["fra", "eng"]
    reference, _ = plain_train_records(folder, languages)
    corpus = open_corpus(str(folder), languages=languages, drop_other_languages=True)
    records = corpus.records["train"]
    rows = list(range(len(reference)))
    random.Random(0).shuffle(rows)
    share = rows[: len(rows) // 2]
    got = records.with_captions(share)
    assert [(r.id, r.captions) for r in got] == [(reference[row]["id"], reference[row]["captions"]) for row in share]
    assert list(caption_texts(records, languages)) == [
        text for line in reference for lang in languages for text in line["captions"].get(lang, [])]
    assert records.pairs == sum(len(texts) for line in reference for texts in line["captions"].values())
    val, _ = plain_train_records(folder, languages, split="val")
    held = corpus.records["val"]
    assert len(val) > 0 and [(r.id, r.captions, r.split) for r in held.with_captions(range(len(held)))] == [
        (line["id"], line["captions"], "val") for line in val]


def test_a_shard_cut_short_loses_its_remaining_samples_without_substitutes(subset_shards: tuple[Path, str],
                                                                         tmp_path: Path) -> None:
    import webdataset as wds

    folder, bad_id = subset_shards
    cut = tmp_path / "cut"
    shutil.copytree(folder, cut)
    victim = cut / "train-000004.tar"
    members = [json.loads(s["json"])["id"] for s in wds.WebDataset(str(victim), shardshuffle=False)]
    data = victim.read_bytes()
    victim.write_bytes(data[:3000])  # cut inside its first sample: none of its samples arrives
    english = {clip for clip, meta in shard_members(folder).items() if "eng" in meta["captions"]}
    batches, _ = make_batches(str(cut), rank=0, world=1, workers=0)
    batches.set_epoch(0)
    got = list(batches)
    served = [clip for ids, _, _ in got for clip in ids]
    errors = [e for _, _, errs in got for e in errs]
    assert len(served) == len(set(served)) and set(served) <= english - {bad_id}
    lost = (english - {bad_id}) - set(served)
    assert english & set(members) and english & set(members) <= lost  # the cut shard's clips are missing, none repeated instead
    assert len(lost - set(members)) <= 1  # besides them only the cut's tail (21 usable, batches of 4: 20)
    assert any("train-000004.tar" in e and "skipped" in e for e in errors), errors


@pytest.mark.parametrize(("before", "after"), [((2, 2), (1, 1)), ((1, 2), (2, 1)), ((2, 1), (4, 0))])
def test_a_resume_on_another_layout_serves_the_epochs_remaining_clips_once(
        subset_shards: tuple[Path, str], before: tuple[int, int], after: tuple[int, int]) -> None:
    folder, bad_id = subset_shards
    english = {clip for clip, meta in shard_members(folder).items() if "eng" in meta["captions"]}
    world, workers = before
    served, plan = [], None
    extras = []  # every rank's draws beyond its batches' sizes (gather_extra in a real run)
    for rank in range(world):  # each rank runs 2 batches of epoch 1, then the job stops
        batches, _ = make_batches(str(folder), rank=rank, world=world, workers=workers)
        batches.set_epoch(1)
        for ids, _, _ in list(batches)[:2]:
            served += ids
        extras.append(batches.extra_before(2))
    batches.all_extra = extras  # rank 0's checkpoint records every rank's
    plan = batches.plan_state(1, 2)
    world2, workers2 = after
    rest, lengths = [], set()
    for rank in range(world2):
        batches, _ = make_batches(str(folder), rank=rank, world=world2, workers=workers2)
        said = batches.restore(plan, epoch=1, batch_in_epoch=2, saved_world=world)
        assert "not yet served" in said
        batches.set_epoch(1, skip=2)
        got = list(batches)
        lengths.add(len(got))
        rest += [clip for ids, _, _ in got for clip in ids]
        assert batches.batches_before() + len(got) == len(batches)  # the loop's count of the epoch
    assert len(lengths) == 1  # ranks in lockstep
    assert not set(served) & set(rest) and len(rest) == len(set(rest))
    assert set(served) | set(rest) <= english - {bad_id}
    # Nothing is lost but the bad clip and the tails of the two cuts.
    assert len(served) + len(rest) >= len(english) - 1 - (2 * world - 1) - (2 * world2 - 1)


# --- the loop: 2 gloo processes from shards, resumed on 1 -----------------------------------------


def _shard_worker(rank: int, world: int, shards: str, out: str, stop: int | None, port: int) -> None:
    from training.config import load_train_config
    from training.loop import train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    train(load_train_config(ROOT / "configs" / "tiny.yaml", shard_run(shards, out, "seed=1")),
          interrupt_after_steps=stop)


def shard_run(shards: str, out: str, *extra: str) -> list[str]:
    return ["data.manifest=null", f"data.shards={shards}", "data.num_workers=1", "optim.batch_size=3",
            "optim.epochs=2", "optim.warmup_steps=1", "data.shuffle_buffer=3", "data.languages=[eng]",
            "data.drop_other_languages=true", "eval.select_metric=t2a_R@10_eng", "threads=1",
            "distributed.timeout_s=60", "data.max_bad_fraction=0.2", f"out_dir={out}", *extra]


def test_two_gloo_processes_from_shards_resume_on_one(subset_shards: tuple[Path, str], tmp_path: Path) -> None:
    """21 usable English clips (1 of them corrupt) on 2 ranks of batch 3: 9 a rank (9 % 3 = 0), 3 steps an
    epoch, the ranks agreeing on each step's batch; stopped after 4 (epoch 2, batch 1), resumed on one process: epoch 2 serves the 21 − 6
    clips it had left, 5 steps of 3."""
    from training.config import load_train_config
    from training.loop import train

    folder, bad_id = subset_shards
    out = tmp_path / "run"
    spawn_ranks(_shard_worker, args=(2, str(folder), str(out), 4, free_port()), nprocs=2)
    state = json.loads((out / "last" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["data_plan"]["segments"] == [
        {"world": 2, "workers": 1, "batch_size": 3, "shuffle_buffer": 3, "batches": 1, "reserve": 0.004,
         "reserve_shared": True, "extra_draws": [[1], [0]]}]  # rank 0's first batch drew one more in place of the corrupt clip
    # The bad-sample budget is checkpointed: rank 0's corrupt clip of epoch 1, per rank.
    assert [len(errors) for errors in state["bad_samples"]["per_rank"]] == [1, 0]
    train(load_train_config(ROOT / "configs" / "tiny.yaml", shard_run(str(folder), str(out), "seed=1", "resume=true")))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    plans = [r for r in records if r["kind"] == "data_plan"]
    assert [p["world_size"] for p in plans] == [2, 1] and plans[0]["clips_per_epoch"] == 18
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [e["step"] for e in epochs] == [3, 4 + 5]
    # With seed 1 the corrupt clip falls to rank 0 in epoch 1 (its shard's first English sample: the
    # interleaved sequence starts with every shard's first samples). Without a reserve (too few clips
    # for data.bad_sample_reserve) rank 0 fills that batch from its next draw, so its last batch is one
    # short and rank 1 holds back one clip of the last step: 8 + 8 served, 1 held back (job totals, the worst
    # rank beside them; bad_samples are the distinct bad clips of all ranks).
    assert (epochs[0]["clips_served"], epochs[0]["clips_held_back"], epochs[0]["bad_samples"]) == (16, 1, 1)
    assert (epochs[0]["clips_served_worst_rank"], epochs[0]["clips_held_back_worst_rank"]) == (8, 1)
    assert epochs[0]["bad_samples_worst_rank"] == 1
    # Resumed on one process, the budget still holds the corrupt clip met before the stop (2 -> 1).
    assert epochs[1]["bad_samples"] == 1 and epochs[1]["clips_served"] in (14, 15)


def test_training_from_shards_with_a_bad_sample_resumes_bit_exactly(subset_shards: tuple[Path, str],
                                                                    tmp_path: Path) -> None:
    """Two persistent loader workers, batch 3, 7 steps an epoch; stopped at step 9 and at step 12
    (either side of where the corrupt clip's hole may fall), resumed: the weights equal the
    uninterrupted run's bit for bit."""
    from safetensors.torch import load_file

    from training.config import load_train_config
    from training.loop import train

    folder, _ = subset_shards

    def config(out: Path, *extra: str):  # noqa: ANN202
        return load_train_config(ROOT / "configs" / "tiny.yaml",
                                 shard_run(str(folder), str(out), "data.num_workers=2", *extra))

    full = train(config(tmp_path / "full"))
    expected = load_file(str(full / "last" / "model.safetensors"))
    records = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["bad_samples"] for r in records if r["kind"] == "epoch") >= 1  # the hole was met
    for stop in (9, 12):
        split = tmp_path / f"split{stop}"
        train(config(split), interrupt_after_steps=stop)
        train(config(split, "resume=true"))
        resumed = load_file(str(split / "last" / "model.safetensors"))
        for name, tensor in expected.items():
            assert (tensor == resumed[name]).all(), (stop, name)


# --- `tonearm train CONFIG --plan` ------------------------------------------------------------------


def test_the_plan_dry_run_matches_what_the_stream_serves_and_refuses_what_does_not_fit(
        subset_shards: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from index.errors import DataError
    from training.config import load_train_config
    from training.data.cluster_plan import Cluster, plan_for
    from training.data.loader import loader_options
    from training.data.stream import build_stream_loader, cached_corpus
    from training.launch import cli_plan

    folder, _ = subset_shards
    cfg = load_train_config(ROOT / "configs" / "tiny.yaml", shard_run(str(folder), str(tmp_path), "data.num_workers=auto",
                                                                       "data.shuffle_buffer=auto"))
    plan = plan_for(cfg, Cluster(nodes=1, gpus_per_node=2, cores_per_node=6, memory_per_node=2**34,
                                 shm_per_node=2**33))
    assert plan.fits and plan.layout.world == 2 and plan.layout.workers == 2  # 6 cores / 2 ranks - 1
    served, steps, holes = [], set(), 0
    for rank in range(2):  # the stream the run would build on each rank of that cluster
        options = loader_options(plan.layout.workers, prefetch_factor=2, persistent=False, cuda=False)
        strategy = SimpleNamespace(num_views=1, views=lambda captions, rng: [next(iter(captions.values()))[0]],
                                   name="first")
        batches = build_stream_loader(cfg, cached_corpus(cfg), rank=rank, world=2, options=options, strategy=strategy,
                                      tokenizer=SimpleNamespace(encode=lambda texts: (np.zeros((len(texts), 3), int),
                                                                                      np.ones((len(texts), 3), int))),
                                      sample_rate=16_000, clip_samples=8_000)
        assert batches.stream.layout.workers == plan.layout.workers
        batches.set_epoch(0)
        got = list(batches)
        steps.add(len(got))
        served += [int(i) for batch in got for i in batch.clip_index]
        holes += sum(len(batch.skipped) for batch in got)
    assert steps == {plan.steps}
    assert len(set(served)) == len(served)
    assert len(served) + holes == round(plan.coverage * 21) == 18  # 21 usable; 9 a rank (9 % 3 = 0)
    args = argparse.Namespace(nodes=1, gpus_per_node=2, cores_per_node=6, memory_per_node="64Mi", shm_per_node="1Mi")
    with pytest.raises(DataError, match="does not fit"):
        cli_plan(args, cfg)
    assert "DOES NOT FIT" in capsys.readouterr().out


# --- `--plan`: the model, its optimizer and ASK's knowledge bases against GPU and host memory ------------


def _plan_config(folder: Path, tmp_path: Path, *extra: str):  # noqa: ANN202
    from training.config import load_train_config

    return load_train_config(ROOT / "configs" / "tiny.yaml", shard_run(str(folder), str(tmp_path), *extra))


def _cluster(ranks: int = 2, *, memory: int = 2**34, shm: int = 2**33, gpu: int = 80 * 2**30):  # noqa: ANN202
    from training.data.cluster_plan import Cluster

    return Cluster(nodes=1, gpus_per_node=ranks, cores_per_node=2 * ranks, memory_per_node=memory,
                   shm_per_node=shm, gpu_memory=gpu)


def test_the_plan_counts_the_model_gradients_and_adamw_state_of_the_run(subset_shards: tuple[Path, str],
                                                                         tmp_path: Path) -> None:
    """References: the model built normally (on CPU, weights and all) and a real AdamW step of it —
    the parameters that got a gradient and the optimizer's own state tensors, with the audio tower
    frozen (frozen parameters get neither gradient nor moments)."""
    import torch

    from training.data.cluster_plan import plan_for
    from training.finetune import apply_freezing
    from training.loop import build_optimizer
    from training.models.dual_encoder import build_dual_encoder

    folder, _ = subset_shards
    cfg = _plan_config(folder, tmp_path, "optim.audio.freeze=true")
    torch.manual_seed(0)
    model = build_dual_encoder(cfg.model, cfg.frontend, vocab_size=cfg.model.text.vocab_size)
    apply_freezing(model, cfg, epoch=0)
    optimizer = build_optimizer(model, model, cfg)
    audio, text = model(0.1 * torch.randn(2, 16_000), torch.randint(1, 50, (2, 6)), torch.ones(2, 6, dtype=torch.long))
    (audio.sum() + text.sum()).backward()
    optimizer.step()
    total = sum(p.numel() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    moments = sum(t.numel() * t.element_size() for state in optimizer.state.values() for key, t in state.items()
                  if key != "step")
    assert 0 < grads < 4 * total  # the frozen tower really has none

    one = plan_for(cfg, _cluster(1))
    assert (one.parameters, one.trainable) == (total, grads // 4)
    assert one.gpu_bytes == 4 * total + grads + moments  # no knowledge bases, no teachers, no DDP at world size 1
    two = plan_for(cfg, _cluster(2))
    assert two.gpu_bytes == one.gpu_bytes + grads  # DDP's gradient buckets: one more copy of the gradients
    unfrozen = plan_for(_plan_config(folder, tmp_path), _cluster(1))
    assert unfrozen.trainable == unfrozen.parameters == total


def test_the_plan_counts_asks_knowledge_bases_as_the_real_ones_hold_them(subset_shards: tuple[Path, str],
                                                                          tmp_path: Path) -> None:
    """Reference: the fine and coarse KBs built by training.knowledge from random embeddings of the
    run's shape — one pair per English caption of the usable train clips, counted in the manifest
    the shards were written from — and the bytes of their tensors."""
    import torch
    import torch.nn.functional as F

    from training.data.cluster_plan import plan_for
    from training.knowledge import build_coarse_kb, build_fine_kb

    folder, _ = subset_shards
    rows = [json.loads(line) for line in (folder.parent / "manifest.jsonl").read_text().splitlines()]
    captions = [len(r["captions"]["eng"]) for r in rows if r["split"] == "train" and "eng" in r["captions"]]
    knowledge = "objective.knowledge={sources: [train], n_clusters: 4, partition: none}"
    cfg = _plan_config(folder, tmp_path, knowledge)
    without = plan_for(_plan_config(folder, tmp_path), _cluster(2))
    plan = plan_for(cfg, _cluster(2))
    d = cfg.model.embed_dim
    clip = torch.repeat_interleave(torch.arange(len(captions)), torch.tensor(captions))
    audio = F.normalize(torch.randn(len(captions), d), dim=-1)[clip]
    text = F.normalize(torch.randn(len(clip), d), dim=-1)
    fine, coarse = build_fine_kb(audio, text, clip), build_coarse_kb(audio, text, n_clusters=4)
    # Each tensor once. On CUDA a side's keys are the very tensor the other side has as partners;
    # on this CPU FAISS holds the keys (a copy of equal values), so equal float tables count once.
    held: list[torch.Tensor] = []
    for side in (fine.audio, fine.text, coarse.audio, coarse.text):
        for tensor in (side.keys, side.partner_table, side.partner_row, side.clip):
            if not any(tensor.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() or (
                    tensor.is_floating_point() and t.shape == tensor.shape and torch.equal(t, tensor)) for t in held):
                held.append(tensor)
    assert plan.kb_gpu_bytes == sum(t.numel() * t.element_size() for t in held)
    rebuild = len(clip) * (16 * d + 32) + len(captions) * (8 * d + 16)  # u, v, [u; v], ids; the clips' rows
    assert plan.kb_rebuild_bytes == rebuild
    assert plan.gpu_bytes == without.gpu_bytes + rebuild
    split = plan_for(_plan_config(folder, tmp_path, knowledge.replace("none", "auto")), _cluster(2))
    assert split.kb_gpu_bytes < plan.kb_gpu_bytes  # half the fine rows, the same coarse prototypes


def test_the_plan_says_which_memory_does_not_fit_and_what_to_change(subset_shards: tuple[Path, str], tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from index.errors import DataError
    from training.data.cluster_plan import plan_for
    from training.launch import cli_plan

    folder, _ = subset_shards
    cfg = _plan_config(folder, tmp_path, "objective.knowledge={sources: [train], n_clusters: 4, partition: none}")
    fits = plan_for(cfg, _cluster(2))
    assert fits.fits and fits.advice == ()
    model = fits.gpu_bytes - fits.kb_rebuild_bytes

    def refused(**sizes: str) -> str:
        args = argparse.Namespace(nodes=1, gpus_per_node=2, cores_per_node=4, **{
            "memory_per_node": "16Gi", "shm_per_node": "8Gi", "gpu_memory": "80Gi", **sizes})
        with pytest.raises(DataError, match="does not fit") as err:
            cli_plan(args, cfg)
        out = capsys.readouterr().out
        return "\n".join([line for line in out.splitlines() if "DOES NOT FIT" in line] + [str(err.value)])

    # the model alone is over the GPU: it says to freeze a tower
    said = refused(gpu_memory=str(int(0.9 * model)))
    assert said.startswith("GPU memory per rank") and "optim.audio.freeze" in said and "host" not in said
    # the model fits, its knowledge bases at their rebuild do not: it names the knowledge bases
    said = refused(gpu_memory=str(int((model + fits.kb_rebuild_bytes // 2) / 0.9)))
    assert said.startswith("GPU memory per rank") and "objective.knowledge.partition" in said
    # host memory: a node of less than the shuffle buffers, records and rebuild copies counted
    said = refused(memory_per_node=str(int(fits.node_host_bytes / 0.8 * 0.9)))
    assert said.count("DOES NOT FIT") == 2 and "host memory per node" in said and "data.shuffle_buffer" in said
    assert "GPU" not in said and "/dev/shm:" not in said
    args = argparse.Namespace(nodes=1, gpus_per_node=2, cores_per_node=4, memory_per_node="16Gi",
                              shm_per_node="8Gi", gpu_memory="80Gi")
    assert cli_plan(args, cfg) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" not in out and "ASK KBs between rebuilds" in out and "AdamW moments" in out


# --- one rank's bad sample costs that rank alone (issue 48) ---------------------------------------


def _clips_batch(got):  # noqa: ANN001, ANN202 - a TrainBatch of the clips (no text: lockstep reads none)
    import torch

    from training.data.dataset import TrainBatch

    items, errors, extra = got
    rows = len(items)
    return TrainBatch(waveform=torch.as_tensor(np.stack([i.waveform for i in items])) if items
                      else torch.zeros(0, 4_000), input_ids=torch.zeros(1, rows, 1, dtype=torch.long),
                      attention_mask=torch.zeros(1, rows, 1, dtype=torch.long),
                      text_mask=torch.zeros(1, rows, dtype=torch.bool),
                      clip_index=torch.tensor([i.index for i in items], dtype=torch.long), texts=[[]],
                      skipped=tuple(errors), extra_draws=extra)


def _lockstep_worker(rank: int, world: int, port: int, folder: str, workers: int, batch: int, reserve: float,
                     out: str) -> None:
    """This rank's real stream and the loop's lockstep over gloo for 3 epochs; writes what it saw."""
    import torch

    from training import distributed
    from training.data.stream import ShardStream, StreamBatches, open_corpus

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    distributed.init_process_group(torch.device("cpu"), timeout_s=60)
    corpus = open_corpus(folder, languages=["eng"], drop_other_languages=True)
    stream = ShardStream(corpus, rank=rank, layout=Layout(world, workers, batch, 3, reserve), sample_rate=16_000,
                         clip_samples=4_000, seed=0, languages=["eng"])

    from torch.utils.data import DataLoader

    context = {"multiprocessing_context": "fork"} if workers else {}  # not a forkserver of the rank's own
    batches = StreamBatches(stream, DataLoader(stream, batch_size=None, collate_fn=_clips_batch, num_workers=workers,
                                               **context))
    seen = []
    for epoch in range(3):
        batches.set_epoch(epoch)
        rows, served, errors = [], [], []
        for got in batches:
            rows.append(int(got.waveform.shape[0]))
            errors += list(got.skipped)
            kept = batches.lockstep(got)
            served += [corpus.records["train"].ids[int(i)] for i in (kept.clip_index if kept is not None else [])]
        seen.append({"rows": rows, "served": served, "errors": errors, "held_back": batches.held_back,
                     "steps": len(batches)})
    distributed.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))


@pytest.mark.parametrize(("world", "workers", "batch"), [(2, 2, 3), (4, 0, 2)])
def test_one_ranks_bad_sample_leaves_the_other_ranks_batches_full(
        subset_shards: tuple[Path, str], tmp_path: Path, world: int, workers: int, batch: int) -> None:
    """Uneven shards of 5, a language subset (every third clip without English), one garbled sample; real
    gloo ranks running the loop's lockstep: with a reserve the rank that meets the bad sample fills its
    batch from its own share — every rank's every batch is full, nothing is held back, no clip twice."""
    folder, bad_id = subset_shards
    english = {clip for clip, meta in shard_members(folder).items() if "eng" in meta["captions"]}
    spawn_ranks(_lockstep_worker, args=(world, free_port(), str(folder), workers, batch, 0.25, str(tmp_path)),
                nprocs=world)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    met = 0
    for epoch in range(3):
        views = [rank[epoch] for rank in ranks]
        served = [clip for view in views for clip in view["served"]]
        assert len(served) == len(set(served)), epoch  # 0 duplicates across the ranks
        assert set(served) <= english - {bad_id}
        assert all(view["held_back"] == [] for view in views), epoch  # no rank held back for another's loss
        full = [view["rows"] for view in views]
        assert all(rows == full[0] for rows in full), epoch  # every rank's batches as full as the plan's
        met += sum(bad_id in error for view in views for error in view["errors"])
    assert met >= 1  # the garbled sample was drawn (and replaced) in some epoch
    cut = segment_cut(len(english), Layout(world, workers, batch, 3, 0.25))
    assert all(sum(view["rows"]) == cut.in_batches for rank in ranks for view in rank)


def test_a_resume_does_not_report_again_the_samples_lost_before_it(subset_shards: tuple[Path, str],
                                                                   tmp_path: Path) -> None:
    """A shard cut short loses its samples; each is reported in the batch that draws it (and replaced
    there), so a resume after some of them reports only the later ones — never one of a batch already run."""
    folder, _ = subset_shards
    cut = tmp_path / "cut"
    shutil.copytree(folder, cut)
    victim = cut / "train-000004.tar"
    victim.write_bytes(victim.read_bytes()[:3000])
    batches, _ = make_batches(str(cut), rank=0, world=1, workers=0)
    batches.set_epoch(0)
    full = list(batches)
    lost = [t for t, (_, _, errs) in enumerate(full) if any("skipped, not read" in e for e in errs)]
    errors = [e for _, _, errs in full for e in errs]
    assert lost and len(errors) == len(set(errors))  # each loss reported once
    for skip in (lost[0] + 1, lost[-1]):
        again, _ = make_batches(str(cut), rank=0, world=1, workers=0)
        again.restore(batches.plan_state(0, skip), epoch=0, batch_in_epoch=skip, saved_world=1)
        again.set_epoch(0, skip=skip)
        resumed = list(again)
        # the same clips named (the message's "after N of this worker's M samples" counts what the
        # resumed worker still wanted of the shard, fewer than before)
        assert [[e.split(": skipped")[0] for e in errs] for _, _, errs in resumed] == \
            [[e.split(": skipped")[0] for e in errs] for _, _, errs in full[skip:]]
        assert [ids for ids, _, _ in resumed] == [ids for ids, _, _ in full[skip:]]


def concentrated(victim: int, clips: int, shards: int = 400, per_shard: int = 1000, seed: int = 0) -> set[int]:
    """Positions of epoch 0's sequence of ``clips`` samples of shard ``victim`` (of ``shards`` shards of
    ``per_shard``): one shard's damage, which the interleave keeps within one group of 8 shards."""
    order, _ = epoch_sequence([np.arange(per_shard)] * shards, seed=0, epoch=0)
    mine = np.flatnonzero(order == victim)
    return {int(p) for p in mine[np.random.default_rng(seed).permutation(len(mine))[:clips]]}


@pytest.mark.parametrize(("world", "workers"), [(4, 8), (32, 11)])
def test_a_tenth_of_a_percent_bad_samples_hold_back_at_most_a_tenth_of_a_percent(world: int, workers: int) -> None:
    """The issue's scale: 400 k usable clips, batch 64, at 4 ranks × 8 workers and at 4 nodes × 8 GPUs ×
    11 workers (96 cores a node), with 0.1 % bad samples spread at random and with 5 % of one shard bad.
    The reserve is the rank's, shared by its workers: the ranks hold back ≤ 0.1 % of the clips (0 here)
    and serve ≥ 99 %, none twice. Split per worker, as it was, the same reserve held back 591 and 1,023
    clips at 32 ranks (the review measured 421 and 992 with other draws)."""
    usable = 400_000
    spread = set(random.Random(5).sample(range(usable), usable // 1000))
    layout = Layout(world, workers, 64, 1000, 0.004)
    for bad in (spread, concentrated(123, 50), concentrated(7, 50)):
        outcome = simulate_losses(usable, layout, bad)
        assert len(outcome.served) == len(set(outcome.served)) and not set(outcome.served) & bad
        assert outcome.held_back <= usable // 1000, outcome.held_back
        assert outcome.held_back == 0
        assert len(outcome.served) / usable >= 0.99
    if world == 32:  # the reserve split per worker: each worker's losses against its slice of it
        split = simulate_losses(usable, Layout(world, workers, 64, 1000, 0.004, shared=False), spread)
        assert split.held_back > usable // 4000
        shared = simulate_losses(usable, Layout(world, workers, 64, 1000, 0.002), spread)
        assert shared.held_back == 0  # 0.002 shared is enough for spread damage; one shard's takes 0.004
        assert simulate_losses(usable, Layout(world, workers, 64, 1000, 0.002), concentrated(123, 50)).held_back > 0
    no_reserve = simulate_losses(usable, Layout(world, workers, 64, 1000, 0.0), spread)
    assert no_reserve.held_back > 0  # without it a worker's last batch comes short and the other ranks hold back


# --- the reserve shared by a rank's workers (issue 55, part 4 c) -------------------------------------


def test_a_ranks_losses_in_one_workers_chunk_are_paid_from_the_ranks_shared_reserve(tmp_path: Path) -> None:
    """60 clips in shards of 10, 2 ranks × 2 loader workers, batch 4, reserve 0.25 (7 a rank): 5 samples
    of rank 0's worker 0's chunk garbled — more than a per-worker slice of the reserve (4) holds, fewer
    than the rank's. The real streams (loader worker processes, the main process's top-up) serve exactly
    what ``simulate_losses`` computes, every batch full, nothing held back, no clip twice; the reserve
    split per worker, as it was, would have held clips back."""
    import soundfile as sf
    import webdataset as wds
    from torch.utils.data import DataLoader

    from training.data.shards import shard_manifest
    from training.data.stream import ShardStream, StreamBatches, open_corpus

    rng = np.random.default_rng(0)
    (tmp_path / "audio").mkdir()
    lines = []
    for i in range(60):
        sf_path = tmp_path / "audio" / f"c{i}.wav"
        sf.write(sf_path, (rng.standard_normal(4_000) * 0.1).astype(np.float32), 16_000, subtype="PCM_16")
        lines.append(json.dumps({"id": f"c{i:02d}", "audio": str(sf_path), "split": "train",
                                 "captions": {"eng": [f"noise {i}"]}}))
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    folder = tmp_path / "shards"
    shard_manifest(tmp_path / "m.jsonl", folder, sample_rate=16_000, codec="pcm16", shard_size=10, workers=1,
                   progress=False)
    layout = Layout(2, 2, 4, 3, 0.25)
    corpus = open_corpus(str(folder), languages=["eng"], drop_other_languages=False)
    probe = ShardStream(corpus, rank=0, layout=layout, sample_rate=16_000, clip_samples=4_000, seed=0,
                        languages=["eng"])
    cut = segment_cut(probe.plan.usable_clips, layout)
    assert (cut.per_rank, cut.reserve, cut.steps) == (30, 7, 6)
    shards, ordinals = epoch_sequence(probe.plan.usable, seed=0, epoch=0, mix=probe.plan.mix)

    def clip_id(position: int) -> str:
        shard, ordinal = int(shards[position]), int(ordinals[position])
        row = int(probe.plan.rows[shard][list(probe.plan.usable[shard]).index(ordinal)])
        return probe.plan.ids[row]

    chunk = cut.ranks[0][0]
    bad_positions = set(range(chunk.start, chunk.stop)[1:10:2])  # 5 of its 12
    bad_ids = {clip_id(p) for p in bad_positions}
    for tar in sorted(folder.glob("train-*.tar")):
        samples = list(wds.WebDataset(str(tar), shardshuffle=False))
        with wds.TarWriter(str(tar)) as writer:
            for sample in samples:
                garbled = json.loads(sample["json"])["id"] in bad_ids
                writer.write({"__key__": sample["__key__"], "json": sample["json"],
                              "wav": b"RIFF" + bytes(64) if garbled else sample["wav"]})

    def rank_batches(rank: int) -> tuple[StreamBatches, list[str]]:
        corpus = open_corpus(str(folder), languages=["eng"], drop_other_languages=False)
        stream = ShardStream(corpus, rank=rank, layout=layout, sample_rate=16_000, clip_samples=4_000, seed=0,
                             languages=["eng"])
        loader = DataLoader(stream, batch_size=None, collate_fn=_clips_batch, num_workers=2,
                            multiprocessing_context="fork")
        return StreamBatches(stream, loader), list(corpus.records["train"].ids)

    ranks, runs = [], []
    for rank in (0, 1):
        batches, ids = rank_batches(rank)
        batches.set_epoch(0)
        got = list(batches)
        runs.append((batches, got))
        ranks.append(([[ids[int(i)] for i in b.clip_index] for b in got], [e for b in got for e in b.skipped],
                      batches.reserve_drawn))
    assert [len(rows) for rows in ranks[0][0]] == [len(rows) for rows in ranks[1][0]] == [4, 4, 4, 4, 4, 3]
    assert sorted(e.split(": ")[1] for e in ranks[0][1]) == sorted(bad_ids) and ranks[1][1] == []
    expected = simulate_losses(60, layout, bad_positions)
    assert expected.held_back == 0 and expected.reserve_drawn == ranks[0][2] == 5 and ranks[1][2] == 0
    served = [clip for rows in ranks[0][0] + ranks[1][0] for clip in rows]
    assert sorted(served) == sorted(clip_id(p) for p in expected.served) and len(served) == len(set(served))
    assert simulate_losses(60, Layout(2, 2, 4, 3, 0.25, shared=False), bad_positions).held_back > 0
    # A resume on the same layout takes the reserve up where the checkpoint's plan says (bit-identical batches).
    batches, got = runs[0]
    for skip in (4, 5):  # rank 0's batch 4 is topped up from the reserve; batch 5 comes after it
        again, _ = rank_batches(0)
        again.restore(batches.plan_state(0, skip), epoch=0, batch_in_epoch=skip, saved_world=2)
        again.set_epoch(0, skip=skip)
        resumed = list(again)
        assert [b.clip_index.tolist() for b in resumed] == [b.clip_index.tolist() for b in got[skip:]]
        assert all(np.array_equal(a.waveform, b.waveform) for a, b in zip(resumed, got[skip:], strict=True))
    assert batches.plan_state(0, 5)["segments"][0]["reserve_used"] == [5]
