"""The bucket read once (issue 48): `tonearm data shard` records each sample's byte range, the stream
range-reads only its share's samples from a real S3-compatible server (moto_server) — bytes fetched
counted by a TCP proxy in front of it — and a read that fails is retried from the failing sample's
offset (a wrapped s3fs filesystem that fails on cue), only what stays unreadable counted; a reply
that is not the range asked for is retried, never parsed, and the retries are ours alone (a stub S3
server that ignores Range or answers 503 forever, issue 55 part 4)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import soundfile as sf

from tests.s3_server import CountingProxy, FolderS3

CLIPS, SECONDS, RATE, SHARD = 240, 2.0, 16_000, 20


@pytest.fixture(scope="module")
def wav_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """240 two-second noise clips (64 KB of PCM-16 each, every one captioned) in 12 shards of 20."""
    from training.data.shards import shard_manifest

    folder = tmp_path_factory.mktemp("wav_corpus")
    rng = np.random.default_rng(0)
    lines = []
    for i in range(CLIPS):
        sf.write(folder / f"c{i}.wav", rng.uniform(-0.5, 0.5, int(SECONDS * RATE)).astype(np.float32), RATE,
                 subtype="PCM_16")
        lines.append(json.dumps({"id": f"clip.{i}", "audio": f"c{i}.wav", "split": "train",
                                 "captions": {"eng": [f"noise {i}"]}}))
    (folder / "m.jsonl").write_text("\n".join(lines) + "\n")
    out = folder / "shards"
    shard_manifest(folder / "m.jsonl", out, sample_rate=RATE, codec="pcm16", shard_size=SHARD, workers=1,
                   progress=False)
    return out


def test_each_samples_recorded_range_holds_exactly_its_members(wav_shards: Path) -> None:
    """The reference: webdataset's own reader of the whole shard, and of the recorded byte range alone."""
    import io

    import webdataset as wds
    from webdataset.tariterators import group_by_keys, tar_file_expander

    records = [json.loads(line) for line in (wav_shards / "records.jsonl").read_text().splitlines()]
    assert len(records) == CLIPS
    by_shard: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_shard.setdefault(record["shard"], []).append(record)
    for name, mine in by_shard.items():
        data = (wav_shards / name).read_bytes()
        whole = list(wds.WebDataset(str(wav_shards / name), shardshuffle=False))
        assert [json.loads(s["json"])["id"] for s in whole] == [r["id"] for r in mine]
        ends = [r["offset"] + r["size"] for r in mine]
        assert [r["offset"] for r in mine[1:]] == ends[:-1]  # samples tile the shard
        for record, sample in zip(mine, whole, strict=True):
            piece = data[record["offset"]:record["offset"] + record["size"]]
            alone = list(group_by_keys(tar_file_expander([{"url": name, "stream": io.BytesIO(piece)}])))
            assert len(alone) == 1 and alone[0]["wav"] == sample["wav"] and alone[0]["json"] == sample["json"]
            for ext, (start, size) in record["members"].items():
                assert data[start:start + size] == sample[ext]


def share_entries(stream: Any, epoch: int = 0) -> Iterator[tuple[Any, list[str]]]:
    """Every loader worker's entries of ``stream``'s rank for a fresh epoch, read by the stream's own
    reader, worker after worker (what the workers of a DataLoader do, one process)."""
    stream.set_epoch(epoch)
    left, cut = stream.cut(epoch)
    for chunk in cut.ranks[stream.rank]:
        errors: list[str] = []
        keep = set(range(chunk.stop - chunk.start))
        for _, entry in stream._entries(epoch, left[chunk.start:chunk.stop], keep, errors):
            yield entry, errors


def sample_bytes(shards: Path) -> list[int]:
    """Bytes of each clip's sample (its tar members, headers and padding), by row (records.jsonl order)."""
    return [json.loads(line)["size"] for line in (shards / "records.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def bucket(s3_endpoint: str, wav_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[CountingProxy, str, str]]:
    """The shards in a bucket twice: as written, and with records.jsonl without offsets (an older
    shard set); s3fs talks to the server through a :class:`CountingProxy`."""
    import os

    import boto3
    import s3fs

    client = boto3.client("s3")
    client.create_bucket(Bucket="reads")
    old = tmp_path_factory.mktemp("old") / "records.jsonl"
    old.write_text("".join(json.dumps({k: v for k, v in json.loads(line).items() if k not in ("offset", "size",
                                       "members")}) + "\n" for line in (wav_shards / "records.jsonl").read_text()
                           .splitlines()))
    for path in sorted(wav_shards.iterdir()):
        client.upload_file(str(path), "reads", f"new/{path.name}")
        client.upload_file(str(old if path.name == "records.jsonl" else path), "reads", f"old/{path.name}")
    proxy = CountingProxy(s3_endpoint)
    os.environ["AWS_ENDPOINT_URL"] = proxy.url
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield proxy, "s3://reads/new", "s3://reads/old"
    finally:
        os.environ["AWS_ENDPOINT_URL"] = s3_endpoint
        s3fs.S3FileSystem.clear_instance_cache()
        proxy.close()


def make_stream(url: str, *, rank: int, world: int, workers: int, batch: int, policy: Any = None) -> Any:
    from training.data.epoch_plan import Layout
    from training.data.stream import ShardStream, open_corpus

    corpus = open_corpus(url, languages=["eng"], drop_other_languages=False)
    return ShardStream(corpus, rank=rank, layout=Layout(world, workers, batch, 16), sample_rate=RATE,
                       clip_samples=RATE, seed=0, languages=["eng"], read_policy=policy)


def epoch_ratio(proxy: CountingProxy, url: str, sizes: list[int], *, world: int, workers: int,
                batch: int) -> tuple[float, int]:
    """(bytes fetched from the server / bytes of the samples served, samples served) of one epoch of
    every rank and worker of the layout."""
    streams = [make_stream(url, rank=r, world=world, workers=workers, batch=batch) for r in range(world)]
    proxy.reset()  # index.json and records.jsonl are read: from here on only shards
    served, fetched_items = 0, []
    for stream in streams:
        entries = [entry for entry, _ in share_entries(stream)]
        assert all(not isinstance(e, str) for e in entries), [e for e in entries if isinstance(e, str)][:3]
        served += sum(sizes[e.index] for e in entries)
        fetched_items += [e.index for e in entries]
    assert len(fetched_items) == len(set(fetched_items))
    return proxy.down / served, len(fetched_items)


@pytest.mark.parametrize(("world", "workers", "batch"), [(1, 0, 8), (4, 8, 3)])
def test_an_epoch_fetches_at_most_105_percent_of_the_samples_it_serves(
        bucket: tuple[CountingProxy, str, str], wav_shards: Path, world: int, workers: int, batch: int) -> None:
    proxy, new, old = bucket
    sizes = sample_bytes(wav_shards)
    ratio, served = epoch_ratio(proxy, new, sizes, world=world, workers=workers, batch=batch)
    assert served >= CLIPS - 2 * world and ratio <= 1.05, (ratio, served)
    if world > 1:  # what it was: every worker's reads run ahead into samples other workers serve
        before, _ = epoch_ratio(proxy, old, sizes, world=world, workers=workers, batch=batch)
        assert before > 1.5, before


class Flaky:
    """Failures injected into s3fs' ranged reads (:class:`FlakyS3`): ``failures[(shard, start)]``
    requests of that shard starting at byte ``start`` fail before reaching the server; every
    request is recorded."""

    failures: ClassVar[dict[tuple[str, int], int]] = {}
    requests: ClassVar[list[tuple[str, int, int]]] = []


def flaky_filesystem() -> type:
    import s3fs

    class FlakyS3(s3fs.S3FileSystem):
        protocol = ("flaky",)

        async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
            if method == "get_object" and "Range" in kwargs:  # the stream's range reads (stream.fetch_range)
                first, last = (int(n) for n in kwargs["Range"].removeprefix("bytes=").split("-"))
                Flaky.requests.append((f"{kwargs['Bucket']}/{kwargs['Key']}", first, last + 1))
                key = (kwargs["Key"].rsplit("/", 1)[-1], first)
                if Flaky.failures.get(key, 0) > 0:
                    Flaky.failures[key] -= 1
                    raise OSError(f"connection reset by peer (injected at byte {first})")
            return await super()._call_s3(method, *args, **kwargs)

    return FlakyS3


@pytest.fixture
def flaky(bucket: tuple[CountingProxy, str, str]) -> Iterator[str]:
    import fsspec

    fsspec.register_implementation("flaky", flaky_filesystem(), clobber=True)
    Flaky.failures.clear()
    Flaky.requests.clear()
    yield "flaky://reads/new"
    Flaky.failures.clear()


def shard_spans(stream: Any, shard: int) -> list[tuple[int, int, int]]:
    plan = stream.plan
    return [(int(o), int(plan.offsets[shard][i]), int(plan.sizes[shard][i]))
            for i, o in enumerate(plan.usable[shard].tolist())]


def test_a_read_failing_mid_shard_is_retried_from_the_failing_samples_offset_and_loses_nothing(
        flaky: str, caplog: pytest.LogCaptureFixture) -> None:
    from training.data.stream import ReadPolicy

    stream = make_stream(flaky, rank=0, world=1, workers=0, batch=8)
    spans = shard_spans(stream, 0)
    stream.read_policy = ReadPolicy(retries=3, backoff=0.0, block=3 * spans[0][2])  # 3 samples a request
    fail_at = spans[6][1]  # the third request of shard 0: samples 6-8, mid-shard
    Flaky.failures[("train-000000.tar", fail_at)] = 2
    with caplog.at_level(logging.WARNING, logger="training.data.stream"):
        entries = [entry for entry, _ in share_entries(stream)]
    assert all(not isinstance(e, str) for e in entries)
    assert sorted(e.index for e in entries) == list(range(CLIPS))  # nothing lost, nothing twice
    shard0 = [(start, end) for path, start, end in Flaky.requests if path.endswith("train-000000.tar")]
    assert shard0.count((fail_at, spans[8][1] + spans[8][2])) == 3  # failed twice, then read from that offset
    assert min(start for start, _ in shard0) == spans[0][1] and all(start >= spans[0][1] for start, _ in shard0)
    assert sum(1 for r in caplog.records if "retry" in r.getMessage()) == 2


def test_a_sample_still_unreadable_after_the_retries_is_the_only_one_counted(flaky: str) -> None:
    from training.data.stream import ReadPolicy

    stream = make_stream(flaky, rank=0, world=1, workers=0, batch=8)
    spans = shard_spans(stream, 3)
    stream.read_policy = ReadPolicy(retries=2, backoff=0.0, block=3 * spans[0][2])
    Flaky.failures[("train-000003.tar", spans[9][1])] = 10**6  # every request starting at sample 9 fails
    got = list(share_entries(stream))
    errors = [e for entry, _ in got if isinstance(entry, str) for e in [entry]]
    served = [entry.index for entry, _ in got if not isinstance(entry, str)]
    bad_row = int(stream.plan.rows[3][9])
    assert len(errors) == 1 and stream.plan.ids[bad_row] in errors[0] and "after 2 retries" in errors[0]
    # its request of 3 samples: 3 attempts; then one request per sample, no more retries
    shard3 = [start for path, start, _ in Flaky.requests if path.endswith("train-000003.tar")]
    assert shard3.count(spans[9][1]) == 3 + 1
    assert sorted(served) == sorted(set(range(CLIPS)) - {bad_row})  # its request's other samples were read


def test_an_older_shard_set_reopens_a_shard_at_the_failing_samples_header_and_loses_nothing(
        wav_shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No byte offsets in records.jsonl: the shard is read as a file; a read failing inside sample 6
    (a local filesystem wrapped to fail once there) reopens the shard at sample 6's first header."""
    import shutil

    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    from training.data.stream import ReadPolicy

    old = tmp_path / "old"
    shutil.copytree(wav_shards, old)
    lines = (wav_shards / "records.jsonl").read_text().splitlines()
    (old / "records.jsonl").write_text("".join(json.dumps({k: v for k, v in json.loads(line).items() if k not in (
        "offset", "size", "members")}) + "\n" for line in lines))
    sixth = json.loads(lines[6])  # shard 0's sample 6 (records.jsonl keeps the shard order)
    assert sixth["shard"] == "train-000000.tar"
    fail_at = sixth["members"]["wav"][0] + 100
    events: list[tuple[str, int]] = []

    class Failing:
        def __init__(self, inner: Any, path: str) -> None:
            self.inner, self.path = inner, path

        def read(self, n: int = -1) -> bytes:
            start = self.inner.tell()
            end = start + (n if n >= 0 else 1 << 40)
            if self.path.endswith("train-000000.tar") and start <= fail_at < end and not any(
                    e[0] == "fail" for e in events):
                events.append(("fail", start))
                raise OSError("connection reset by peer (injected)")
            return self.inner.read(n)

        def seek(self, offset: int, whence: int = 0) -> int:
            if whence == 0 and self.path.endswith("train-000000.tar"):
                events.append(("seek", offset))
            return self.inner.seek(offset, whence)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def __enter__(self) -> Failing:
            return self

        def __exit__(self, *exc: object) -> None:
            self.inner.close()

    class FlakyLocal(LocalFileSystem):
        protocol = ("flakyfile",)

        @classmethod
        def _strip_protocol(cls, path: Any) -> Any:
            return super()._strip_protocol(str(path).removeprefix("flakyfile://"))

        def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
            return Failing(super()._open(path, mode, **kwargs), path)

    fsspec.register_implementation("flakyfile", FlakyLocal, clobber=True)
    stream = make_stream(f"flakyfile://{old}", rank=0, world=1, workers=0, batch=8,
                         policy=ReadPolicy(retries=3, backoff=0.0))
    assert stream.plan.mix == 1 and not stream.plan.ranged(0)  # an older set: files, no interleave
    with caplog.at_level(logging.WARNING, logger="training.data.stream"):
        entries = [entry for entry, _ in share_entries(stream)]
    assert all(not isinstance(e, str) for e in entries)
    assert sorted(e.index for e in entries) == list(range(CLIPS))
    failed = events.index(next(e for e in events if e[0] == "fail"))
    assert events[failed + 1] == ("seek", sixth["offset"])  # reopened at sample 6's first header
    assert any("retry 1 of 3" in r.getMessage() for r in caplog.records)


# --- replies checked, one retry layer (issue 55, part 4) --------------------------------------------


@pytest.fixture
def stub_bucket(wav_shards: Path) -> Iterator[FolderS3]:
    """The shards served by :class:`FolderS3` (a minimal S3 server whose answers a test can bend)."""
    with FolderS3(wav_shards) as server:
        yield server


def test_a_range_reply_holding_the_whole_object_is_retried_never_parsed_and_no_sample_is_lost(
        stub_bucket: FolderS3) -> None:
    """The review's reproduction: a server that answers a Range request with a 200 and the whole shard
    (every other request here) made samples of equal size parse as the shard's first clips (counted as
    bad: 4 of 8 lost). Every reply is now checked by its length before a byte of it is parsed."""
    from training.data.stream import ReadPolicy

    answered: list[int] = []

    def every_other(method: str, key: str, rng: str | None) -> str | None:
        if method == "GET" and rng and key.endswith(".tar"):
            answered.append(1)
            return "ignore-range" if len(answered) % 2 == 1 else None
        return None

    stub_bucket.answer = every_other
    stream = make_stream("s3://any", rank=0, world=1, workers=0, batch=8,
                         policy=ReadPolicy(retries=2, backoff=0.0, block=4 * sample_bytes_of(stub_bucket)))
    assert len(set(sample_bytes(stub_bucket.folder))) == 1  # every sample the same size: only ids tell them apart
    entries = [entry for entry, _ in share_entries(stream)]
    assert [e for e in entries if isinstance(e, str)] == []
    assert sorted(e.index for e in entries) == list(range(CLIPS))  # nothing lost, nothing twice
    assert len(answered) >= 2 * (CLIPS // 4)  # a wrong reply to every request once, then the right one


def sample_bytes_of(server: FolderS3) -> int:
    return sample_bytes(server.folder)[0]


def test_a_server_that_always_ignores_range_is_a_clear_error_per_sample_never_another_clip(
        stub_bucket: FolderS3) -> None:
    from training.data.stream import ReadPolicy

    stub_bucket.answer = lambda method, key, rng: "ignore-range" if rng and key.endswith("train-000002.tar") else None
    stream = make_stream("s3://any", rank=0, world=1, workers=0, batch=8, policy=ReadPolicy(retries=1, backoff=0.0))
    entries = [entry for entry, _ in share_entries(stream)]
    errors = [e for e in entries if isinstance(e, str)]
    shard2 = {stream.plan.ids[int(r)] for r in stream.plan.rows[2]}
    assert len(errors) == SHARD and {e.split(": ")[1] for e in errors} == shard2
    assert all("ignores Range" in e for e in errors), errors[0]
    assert not any("where records.jsonl has" in e for e in errors)  # never parsed as another clip
    assert len([e for e in entries if not isinstance(e, str)]) == CLIPS - SHARD


def test_a_content_range_naming_other_bytes_is_a_wrong_reply() -> None:
    from training.data.stream import WrongReply, _Permanent, checked_reply

    assert checked_reply(b"x" * 10, "bytes 100-109/500", 100, 110) == b"x" * 10
    assert checked_reply(b"x" * 10, None, 100, 110) == b"x" * 10
    with pytest.raises(WrongReply, match="reply holds 'bytes 0-9/500'"):
        checked_reply(b"x" * 10, "bytes 0-9/500", 100, 110)  # the right length, the wrong bytes
    with pytest.raises(WrongReply, match="holds 500 bytes"):
        checked_reply(b"x" * 500, None, 100, 110)  # a 200 with the whole object
    with pytest.raises(_Permanent, match="cut short"):
        checked_reply(b"x" * 5, "bytes 100-104/105", 100, 110)  # the object ends before the sample


@pytest.mark.parametrize("samples", [1, 3])
def test_a_persistent_503_gives_up_after_the_documented_retries_alone(stub_bucket: FolderS3, samples: int) -> None:
    """One retry layer: s3fs' and botocore's own retries are off for shard reads, so a sample the server
    answers 503 (SlowDown) to forever is given up after ReadPolicy's 4 retries — 5 requests and 7.5 s of
    waits (the documented total) — where the three layers nested took 125 requests and ~210 s. A merged
    request of several samples then asks for each once more, without further waits."""
    import time

    from training.data.stream import ReadPolicy, read_sample_ranges

    stub_bucket.answer = lambda method, key, rng: 503 if key.endswith(".tar") else None
    records = [json.loads(line) for line in (stub_bucket.folder / "records.jsonl").read_text().splitlines()]
    spans = [(i, r["offset"], r["size"]) for i, r in enumerate(records[:samples])]
    waits: list[float] = []
    began = time.monotonic()
    got = list(read_sample_ranges(f"s3://any/{records[0]['shard']}", spans, ReadPolicy(), sleep=waits.append))
    took = time.monotonic() - began
    assert [ordinal for ordinal, _ in got] == list(range(samples))
    assert all(isinstance(error, str) and "after 4 retries" in error and "reduce your request rate" in error
               for _, error in got)
    requests = [r for r in stub_bucket.requests if r[1].endswith(".tar")]
    assert len(requests) == 5 + (samples if samples > 1 else 0)
    assert waits == [0.5, 1.0, 2.0, 4.0]  # 7.5 s in all, ours
    assert took < 5.0, took  # no library backoff beside ours (s3fs' alone waits ≥ 1.9 s per 5 attempts)
