"""`tonearm data shard` (SPEC §13): webdataset shards keep every clip, caption, language and id,
corrupt files are skipped with their reason, and an interrupted run resumes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from training.data.manifest import read_manifest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus_with_corrupt(tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny corpus plus one train clip whose file is garbage after a FLAC signature."""
    folder = tmp_path_factory.mktemp("corrupt_corpus")
    (folder / "bad.flac").write_bytes(b"fLaC" + bytes(range(256)) * 8)
    lines = []
    for _, record in read_manifest(tiny_corpus, languages=None):
        lines.append({"id": record.id, "audio": str(record.audio), "split": record.split,
                      "captions": record.captions})
    lines.append({"id": "broken.clip", "audio": "bad.flac", "split": "train", "captions": {"eng": ["static"]}})
    manifest = folder / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return manifest


@pytest.fixture(scope="module")
def shards(corpus_with_corrupt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CLI's shards of `corpus_with_corrupt` at 16 kHz, 8 clips a shard, 2 processes."""
    out = tmp_path_factory.mktemp("shards")
    subprocess.run(
        [sys.executable, "-m", "tonearm.cli", "data", "shard", str(corpus_with_corrupt), "--out", str(out),
         "--shard-size", "8", "--workers", "2"],
        check=True, cwd=ROOT, capture_output=True,
    )
    return out


def test_round_trip_keeps_every_caption_language_and_id(corpus_with_corrupt: Path, shards: Path) -> None:
    import webdataset as wds

    expected = {r.id: r for _, r in read_manifest(corpus_with_corrupt, languages=None) if r.id != "broken.clip"}
    seen = {}
    index = json.loads((shards / "index.json").read_text())
    for split, summary in index["splits"].items():
        urls = [str(shards / s["name"]) for s in summary["shards"]]
        for sample in wds.WebDataset(urls, shardshuffle=False):
            meta = json.loads(sample["json"])
            assert meta["split"] == split and meta["id"] not in seen
            wave, rate = sf.read(__import__("io").BytesIO(sample["flac"]), dtype="float32")
            assert rate == 16_000 and wave.ndim == 1 and abs(len(wave) / rate - meta["seconds"]) < 1e-3
            seen[meta["id"]] = meta
    assert set(seen) == set(expected)
    for clip_id, meta in seen.items():
        assert meta["captions"] == expected[clip_id].captions
        assert meta["split"] == expected[clip_id].split
    train = index["splits"]["train"]
    assert train["clips"] == sum(r.split == "train" for r in expected.values())
    assert train["languages"] == sorted({lang for r in expected.values() for lang in r.captions})
    records = [json.loads(line) for line in (shards / "records.jsonl").read_text().splitlines()]
    assert {r["id"] for r in records} == set(expected) and index["complete"] is True


def test_corrupt_file_is_skipped_with_its_reason(shards: Path) -> None:
    index = json.loads((shards / "index.json").read_text())
    assert [s["id"] for s in index["skipped"]] == ["broken.clip"]
    assert "bad.flac" in index["skipped"][0]["reason"]


def test_interrupted_run_resumes_and_keeps_matching_shards(corpus_with_corrupt: Path, shards: Path,
                                                           tmp_path: Path) -> None:
    from training.data.shards import shard_manifest

    out = tmp_path / "copy"
    shutil.copytree(shards, out)
    index = json.loads((out / "index.json").read_text())
    names = [s["name"] for split in index["splits"].values() for s in split["shards"]]
    (out / names[0]).unlink()  # never finished
    (out / names[1]).write_bytes(b"partial")  # cut short: its checksum no longer matches
    kept = {name: (out / name).stat().st_mtime_ns for name in names[2:]}
    again = shard_manifest(corpus_with_corrupt, out, sample_rate=16_000, shard_size=8, workers=1, progress=False)
    assert {name: (out / name).stat().st_mtime_ns for name in names[2:]} == kept  # not rewritten
    assert again["splits"] == index["splits"]  # rewritten byte for byte (same sha256)
    assert again["skipped"] == index["skipped"]
    assert np.isclose(again["hours"], index["hours"])


# --- streaming (data.shards) ------------------------------------------------------------------

BATCH = 4


def clip_rows(items: list) -> list[int]:  # collate of the coverage tests: the clips' rows only
    return [item.index for item in items]


def rows_and_waves(items: list) -> tuple[list[int], np.ndarray]:
    return [i.index for i in items], np.stack([i.waveform for i in items]) if items else np.zeros((0, 16_000))


@pytest.fixture(scope="module")
def clean_shards(tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny corpus (32 train clips) in shards of 8: 4 train shards, 1 per rank × worker of a 2 × 2 run."""
    from training.data.shards import shard_manifest

    out = tmp_path_factory.mktemp("clean_shards")
    shard_manifest(tiny_corpus, out, sample_rate=16_000, shard_size=8, workers=1, progress=False)
    return out


def make_stream(url: str, *, rank: int = 0, world: int = 1, workers: int = 2, languages=("eng", "fra"),
                drop: bool = True, buffer: int = 5):
    from training.data.epoch_plan import Layout
    from training.data.stream import ShardStream, open_corpus

    corpus = open_corpus(url, languages=list(languages), drop_other_languages=drop)
    return ShardStream(corpus, rank=rank, layout=Layout(world, workers, BATCH, buffer), sample_rate=16_000,
                       clip_samples=16_000, seed=0, languages=list(languages)), corpus


def loader_of(stream, collate, workers: int = 2, persistent: bool = False):
    from torch.utils.data import DataLoader

    extra = {"persistent_workers": persistent} if workers else {}
    return DataLoader(stream, batch_size=None, collate_fn=lambda batch: collate(batch[0]) + (batch[1],),
                      num_workers=workers, **extra)


def clip_ids(items: list, corpus) -> list[str]:  # noqa: ANN001
    return [corpus.records["train"][item.index].id for item in items]


def test_streamed_epoch_covers_each_sample_once_over_2_ranks_x_2_workers(clean_shards: Path) -> None:
    per_rank = []
    for rank in (0, 1):
        stream, corpus = make_stream(str(clean_shards), rank=rank, world=2)
        stream.set_epoch(0)
        per_rank.append([rows for rows, _ in loader_of(stream, lambda items: (clip_rows(items),))])
    assert len(per_rank[0]) == len(per_rank[1]) == 4  # same number of batches on every rank
    everything = [row for rank in per_rank for rows in rank for row in rows]
    assert sorted(everything) == list(range(len(corpus.records["train"])))  # each clip once


def test_resume_mid_epoch_continues_where_it_stopped(clean_shards: Path) -> None:
    stream, _ = make_stream(str(clean_shards))
    loader = loader_of(stream, rows_and_waves, persistent=True)
    epochs = []
    for epoch in (0, 1):  # persistent workers see the epoch set after they started
        stream.set_epoch(epoch)
        epochs.append(list(loader))
    assert [b[0] for b in epochs[0]] != [b[0] for b in epochs[1]]
    resumed, _ = make_stream(str(clean_shards))
    resumed.set_epoch(1, skip=3)
    again = list(loader_of(resumed, rows_and_waves))
    assert [b[0] for b in again] == [b[0] for b in epochs[1][3:]]
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(again, epochs[1][3:], strict=True))


def test_corrupt_sample_in_a_shard_leaves_a_hole_and_is_counted(clean_shards: Path, tmp_path: Path) -> None:
    import webdataset as wds

    from index.errors import DataError
    from training.data.loader import BadSampleBudget

    broken = tmp_path / "broken"
    shutil.copytree(clean_shards, broken)
    victim = "train-000001.tar"
    samples = list(wds.WebDataset(str(clean_shards / victim), shardshuffle=False))
    bad_id = json.loads(samples[2]["json"])["id"]
    with wds.TarWriter(str(broken / victim)) as writer:
        for i, sample in enumerate(samples):
            writer.write({"__key__": sample["__key__"], "json": sample["json"],
                          "flac": b"fLaC" + bytes(512) if i == 2 else sample["flac"]})
    stream, corpus = make_stream(str(broken), workers=0)
    stream.set_epoch(0)
    batches = list(loader_of(stream, rows_and_waves, workers=0))
    rows = [row for b in batches for row in b[0]]
    assert len(rows) == len(set(rows)) == 31  # the bad clip's place stays empty: no duplicate
    assert bad_id not in {corpus.records["train"][row].id for row in rows}
    errors = [e for b in batches for e in b[2]]
    assert len(errors) == 1 and bad_id in errors[0] and victim in errors[0]
    budget = BadSampleBudget(max_fraction=0.05, clips=32)
    budget.add(errors)
    assert budget.count == 1
    with pytest.raises(DataError, match="could not be decoded"):
        BadSampleBudget(max_fraction=0.0, clips=32).add(errors)


@pytest.mark.parametrize("member", [0, 1])
def test_a_shard_failing_mid_read_is_named_and_its_remaining_samples_skipped(clean_shards: Path, tmp_path: Path,
                                                                            member: int) -> None:
    """A train shard cut inside its 4th sample (its first or its second member): the 3 samples before
    the cut are served, the 5 from it on never are, and each of those 5 is one named error for the
    bad-sample budget (the reference: the shard's own members, listed by tarfile from the intact file)."""
    import tarfile

    broken = tmp_path / "broken"
    shutil.copytree(clean_shards, broken)
    victim = "train-000001.tar"
    samples: dict[str, list[tarfile.TarInfo]] = {}
    with tarfile.open(clean_shards / victim) as archive:
        for info in archive.getmembers():
            samples.setdefault(info.name.split(".", 1)[0], []).append(info)
        ids = [json.loads(archive.extractfile(next(m for m in members if m.name.endswith(".json"))).read())["id"]
               for members in samples.values()]  # type: ignore[union-attr]
    fourth = list(samples.values())[3][member]
    (broken / victim).write_bytes((clean_shards / victim).read_bytes()[: fourth.offset_data + fourth.size // 2])
    stream, corpus = make_stream(str(broken), workers=0)
    stream.set_epoch(0)
    batches = list(loader_of(stream, rows_and_waves, workers=0))
    errors = [e for b in batches for e in b[2]]
    assert len(errors) == len(ids) - 3 == len(set(errors))
    assert all(victim in e and "the shard failed after 3" in e for e in errors)
    served = {corpus.records["train"][row].id for b in batches for row in b[0]}
    assert set(ids[:3]) <= served and not set(ids[3:]) & served


def test_seekable_tar_reader_gives_webdatasets_samples_and_fails_on_a_cut_shard(clean_shards: Path,
                                                                                  tmp_path: Path) -> None:
    """The random-access tar read (one read per member) yields exactly what webdataset's stream
    expander yields; a non-seekable stream takes webdataset's path; a shard cut mid-member raises."""
    import io

    from webdataset.tariterators import group_by_keys, tar_file_expander

    from training.data.stream import tar_samples

    path = clean_shards / "train-000000.tar"
    data = path.read_bytes()

    def strip(samples):
        return [{k: v for k, v in s.items() if k != "__url__"} for s in samples]

    reference = strip(group_by_keys(tar_file_expander([{"url": "u", "stream": io.BytesIO(data)}])))
    assert len(reference) == 8 and all(s["flac"][:4] == b"fLaC" for s in reference)
    with path.open("rb") as handle:
        assert strip(tar_samples(handle, "u")) == reference

    class Unseekable(io.RawIOBase):
        def __init__(self) -> None:
            self.inner = io.BytesIO(data)

        def readable(self) -> bool:
            return True

        def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
            chunk = self.inner.read(len(buffer))
            buffer[: len(chunk)] = chunk
            return len(chunk)

    assert strip(tar_samples(Unseekable(), "u")) == reference
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[: 1536 + 1000])  # inside the first FLAC (after its pax and ustar headers)
    with cut.open("rb") as handle, pytest.raises(Exception, match="unexpected end of data"):
        list(tar_samples(handle, "u"))


# --- a real S3-compatible server (moto_server on loopback), read through s3fs -------------------


# s3_endpoint: tests/s3_server.py (a session fixture, through tests/training/conftest.py)


def test_training_streams_shards_from_an_s3_bucket(s3_endpoint: str, clean_shards: Path, tmp_path: Path) -> None:
    import boto3

    from training.config import load_train_config
    from training.loop import train

    client = boto3.client("s3")
    client.create_bucket(Bucket="corpus")
    for path in sorted(clean_shards.iterdir()):
        client.upload_file(str(path), "corpus", f"shards/{path.name}")
    url = "s3://corpus/shards"
    stream, corpus = make_stream(url, workers=2)
    stream.set_epoch(0)
    rows = [row for rows, _ in loader_of(stream, lambda items: (clip_rows(items),)) for row in rows]  # forked workers read through s3fs
    assert sorted(rows) == list(range(len(corpus.records["train"])))
    cfg = load_train_config(ROOT / "configs" / "tiny.yaml", [
        "data.manifest=null", f"data.shards={url}", "data.num_workers=2", "optim.epochs=1",
        f"out_dir={tmp_path / 'run'}", "data.languages=[eng,fra]", "data.drop_other_languages=true",
        "eval.select_metric=t2a_R@10_eng"])
    out = train(cfg)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epoch = next(r for r in records if r["kind"] == "epoch")
    assert epoch["step"] == 4 and epoch["bad_samples"] == 0  # 32 clips / batch 8
    assert any(r["kind"] == "eval" for r in records)  # the val split, extracted from its shard
    assert (out / "best").is_dir()


def test_training_from_shards_resumes_exactly(clean_shards: Path, tmp_path: Path) -> None:
    """Interrupted mid-epoch (an odd batch: the workers' round-robin is rotated on resume) with two
    persistent loader workers, then resumed: the weights equal an uninterrupted run's."""
    from safetensors.torch import load_file

    from training.config import load_train_config
    from training.loop import train

    def config(out: Path, *extra: str):  # noqa: ANN202
        return load_train_config(ROOT / "configs" / "tiny.yaml", [
            "data.manifest=null", f"data.shards={clean_shards}", "data.num_workers=2", "optim.batch_size=4",
            "optim.epochs=2", "optim.warmup_steps=1", "data.shuffle_buffer=3", f"out_dir={out}", *extra])

    full = train(config(tmp_path / "full"))
    split = tmp_path / "split"
    train(config(split), interrupt_after_steps=11)  # 8 steps an epoch: epoch 2, batch 3
    train(config(split, "resume=true"))
    expected = load_file(str(full / "last" / "model.safetensors"))
    resumed = load_file(str(split / "last" / "model.safetensors"))
    for name, tensor in expected.items():
        assert (tensor == resumed[name]).all(), name


@pytest.mark.parametrize("override, words", [
    ("data.val_fraction=0.1", "data.val_fraction"),
])
def test_what_needs_random_access_to_training_clips_is_refused_in_one_line(
        clean_shards: Path, tmp_path: Path, override: str, words: str) -> None:
    from training.config import ConfigError, load_train_config
    from training.loop import load_training_data

    cfg = load_train_config(ROOT / "configs" / "tiny.yaml", [
        "data.manifest=null", f"data.shards={clean_shards}", f"out_dir={tmp_path}", override])
    with pytest.raises(ConfigError, match=words) as err:
        load_training_data(cfg)
    assert "\n" not in str(err.value)


def test_a_run_stopped_mid_way_resumes_from_its_progress(corpus_with_corrupt: Path, shards: Path,
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import training.data.shards as writer

    real, calls = writer.write_shard, []

    def stopping(task, **kw):  # noqa: ANN001, ANN202 - Ctrl-C while the third shard is written
        calls.append(task.name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(task, **kw)

    out = tmp_path / "stopped"
    monkeypatch.setattr(writer, "write_shard", stopping)
    with pytest.raises(KeyboardInterrupt):
        writer.shard_manifest(corpus_with_corrupt, out, sample_rate=16_000, shard_size=8, workers=1, progress=False)
    assert json.loads((out / "index.json").read_text())["complete"] is False
    first = {name: (out / name).stat().st_mtime_ns for name in calls[:2]}
    calls.clear()
    monkeypatch.setattr(writer, "write_shard", real)
    again = writer.shard_manifest(corpus_with_corrupt, out, sample_rate=16_000, shard_size=8, workers=1,
                                  progress=False)
    assert {name: (out / name).stat().st_mtime_ns for name in first} == first  # kept, not rewritten
    done = json.loads((shards / "index.json").read_text())
    assert again["splits"] == done["splits"] and again["skipped"] == done["skipped"]
    assert (out / "records.jsonl").read_text() == (shards / "records.jsonl").read_text()
    assert not (out / ".progress").exists()


# --- what `tonearm data shard` refuses (issue 39 item 6) ----------------------------------------

TRUNCATABLE = [("wav", "WAV", "PCM_16", 16_000), ("flac", "FLAC", "PCM_16", 16_000), ("ogg", "OGG", "VORBIS", 16_000),
               ("opus", "OGG", "OPUS", 48_000), ("mp3", "MP3", "MPEG_LAYER_III", 16_000)]


def test_truncated_wav_ogg_mp3_and_flac_are_refused_and_listed(tmp_path: Path) -> None:
    """Each format written whole and cut short by this test (70 % of its bytes; an Ogg file also at
    a page boundary, before its end-of-stream page): the whole files are packed at full length,
    every cut one is skipped with a reason that says it is truncated — none becomes a shorter clip."""
    from training.data.shards import shard_manifest

    rows, cut_ids = [], set()
    for ext, fmt, subtype, rate in TRUNCATABLE:
        wave = (0.3 * np.sin(2 * np.pi * 440 * np.arange(2 * rate) / rate)).astype(np.float32)
        whole = tmp_path / f"whole-{ext}.{'ogg' if ext == 'opus' else ext}"
        sf.write(whole, wave, rate, format=fmt, subtype=subtype)
        data = whole.read_bytes()
        cuts = {f"cut-{ext}": data[: int(len(data) * 0.7)]}
        if fmt == "OGG":
            cuts[f"cut-{ext}-at-page"] = data[: data.rfind(b"OggS")]  # pages whole, the last one missing
        for clip_id, cut_bytes in cuts.items():
            path = tmp_path / f"{clip_id}.{whole.suffix[1:]}"
            path.write_bytes(cut_bytes)
            rows.append({"id": clip_id, "audio": str(path), "split": "train", "captions": {"eng": ["a tone"]}})
            cut_ids.add(clip_id)
        rows.append({"id": f"whole-{ext}", "audio": str(whole), "split": "train", "captions": {"eng": ["a tone"]}})
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    index = shard_manifest(manifest, tmp_path / "shards", sample_rate=16_000, shard_size=4, workers=1,
                           progress=False)
    skipped = {s["id"]: s["reason"] for s in index["skipped"]}
    assert set(skipped) == cut_ids
    for clip_id, reason in skipped.items():
        assert "truncated" in reason or "corrupt" in reason, (clip_id, reason)
    records = [json.loads(line) for line in (tmp_path / "shards" / "records.jsonl").read_text().splitlines()]
    assert {r["id"] for r in records} == {f"whole-{ext}" for ext, *_ in TRUNCATABLE}
    assert all(abs(r["seconds"] - 2.0) < 0.1 for r in records), records  # packed whole


def test_a_rerun_checks_kept_shards_by_size_and_quick_digest_and_rehash_reads_them_whole(
        corpus_with_corrupt: Path, shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    import training.data.shards as writer

    monkeypatch.setattr(writer, "QUICK_BYTES", 4096)  # the tiny shards are smaller than 2 MiB
    out = tmp_path / "quick"
    index = writer.shard_manifest(corpus_with_corrupt, out, sample_rate=16_000, shard_size=8, workers=2,
                                  progress=False)
    entries = [s for split in index["splits"].values() for s in split["shards"]]
    for entry in entries:  # recorded at write time; the reference digest is computed here, independently
        data = (out / entry["name"]).read_bytes()
        assert entry["bytes"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest()
        assert "quick_sha256" in entry
    names = [e["name"] for e in entries]
    cut, flipped = out / names[0], out / names[1]
    cut.write_bytes(cut.read_bytes()[:-700])  # cut short: another size
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, same ends: only a full hash sees it
    flipped.write_bytes(bytes(data))
    full_hashes = []
    real_sha = writer.sha256_of
    monkeypatch.setattr(writer, "sha256_of", lambda path: full_hashes.append(path.name) or real_sha(path))
    times = {name: (out / name).stat().st_mtime_ns for name in names}

    writer.shard_manifest(corpus_with_corrupt, out, sample_rate=16_000, shard_size=8, workers=2, progress=False)
    rewritten = {name for name in names if (out / name).stat().st_mtime_ns != times[name]}
    assert rewritten == {names[0]}  # the cut shard; the flipped byte passes the cheap check
    assert full_hashes == [names[0]]  # no kept shard was read whole: only the one just written was hashed
    assert (out / names[1]).read_bytes() == bytes(data)

    full_hashes.clear()
    times = {name: (out / name).stat().st_mtime_ns for name in names}
    again = writer.shard_manifest(corpus_with_corrupt, out, sample_rate=16_000, shard_size=8, workers=2,
                                  progress=False, rehash=True)
    rewritten = {name for name in names if (out / name).stat().st_mtime_ns != times[name]}
    assert rewritten == {names[1]}  # --rehash finds the flipped byte
    assert sorted(full_hashes) == sorted([*names, names[1]])  # every kept shard hashed whole, then the new one
    assert again["splits"] == index["splits"]  # byte for byte as first written
    cli = json.loads((shards / "index.json").read_text())
    assert [s["sha256"] for s in entries] == [s["sha256"] for split in cli["splits"].values() for s in split["shards"]]
