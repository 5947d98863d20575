"""The items' write-ahead record (index.items.log): round trip, crash durability, torn lines, two writers.

Crash and concurrency are real: a child process is killed with SIGKILL right after put() returned,
and two processes append at once; the checks read the files back with a fresh ItemLog.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from index.items.log import LOG_NAME, ItemError, ItemLog

ROOT = Path(__file__).resolve().parents[2]


def test_put_delete_round_trip_and_a_second_reader_agrees(tmp_path):
    log = ItemLog(tmp_path)
    log.put("door-1", b"RIFF-one", audio_format="wav", metadata={"license": "cc0", "duration": 2.5, "tags": ["door"]},
            captions={"eng": ["a door slams"]})
    log.put("rain-1", b"RIFF-two", audio_format="flac")
    log.put("door-1", b"RIFF-three", audio_format="wav", metadata={"license": "by"})  # upsert
    log.delete("rain-1")
    log.delete("bundle-clip-7")  # a takedown of a bundle clip
    assert set(log.state.items) == {"door-1"} and log.state.deleted == {"rain-1", "bundle-clip-7"}
    record = log.state.items["door-1"]
    assert record.metadata == {"license": "by"} and log.audio_path(record).read_bytes() == b"RIFF-three"
    other = ItemLog(tmp_path)  # another replica on the same volume
    other.follow()
    assert other.state == log.state
    log.put("rain-1", b"RIFF-two", audio_format="flac")  # back again
    assert [r.id for r in other.follow()] == ["rain-1"] and "rain-1" not in other.state.deleted


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"item_id": ""}, "item id"),
        ({"item_id": "a\nb"}, "item id"),
        ({"item_id": "a\ud800"}, "item id"),
        ({"metadata": {"x": {"nested": 1}}}, "values are"),
        ({"metadata": {"and": 1}}, "names are"),
        ({"metadata": {"x": [1, 2]}}, "values are"),
        ({"audio_format": "../wav"}, "audio format"),
    ],
)
def test_bad_items_are_refused_and_nothing_is_written(tmp_path, kwargs, message):
    log = ItemLog(tmp_path)
    args = {"item_id": "ok", "audio": b"x", "audio_format": "wav", **kwargs}
    with pytest.raises(ItemError, match=message):
        log.put(args.pop("item_id"), args.pop("audio"), **args)
    assert (tmp_path / LOG_NAME).read_bytes() == b""


CHILD = textwrap.dedent("""
    import sys
    from index.items.log import ItemLog
    log = ItemLog(sys.argv[1])
    log.put("acked", b"audio-bytes", audio_format="wav", metadata={"license": "cc0"})
    print("acknowledged", flush=True)
    sys.stdin.read()  # wait to be killed
""")


def test_an_acknowledged_put_survives_kill_9(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "acknowledged"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    log = ItemLog(tmp_path)
    log.follow()
    assert log.state.items["acked"].metadata == {"license": "cc0"}
    assert log.audio_path(log.state.items["acked"]).read_bytes() == b"audio-bytes"


def test_a_torn_last_line_is_ignored_then_cut_by_the_next_writer(tmp_path):
    log = ItemLog(tmp_path)
    log.put("one", b"a", audio_format="wav")
    with (tmp_path / LOG_NAME).open("ab") as handle:
        handle.write(b'{"op":"put","id":"half')  # a crash in the middle of an append
    reader = ItemLog(tmp_path)
    assert [r.id for r in reader.follow()] == ["one"]
    log.put("two", b"b", audio_format="wav")
    lines = (tmp_path / LOG_NAME).read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["one", "two"]
    assert [r.id for r in reader.follow()] == ["two"]


WRITER = textwrap.dedent("""
    import sys
    from index.items.log import ItemLog
    log = ItemLog(sys.argv[1])
    for i in range(200):
        log.put(f"{sys.argv[2]}-{i}", f"{sys.argv[2]}-{i}".encode(), audio_format="wav", metadata={"i": i})
""")


def test_two_processes_appending_at_once_lose_nothing_and_interleave_no_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), name], env=env) for name in "ab"]
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    log = ItemLog(tmp_path)
    log.follow()
    assert set(log.state.items) == {f"{name}-{i}" for name in "ab" for i in range(200)}
    assert log.state.records == 400


# ---------------------------------------------------------------------- compaction


def test_compaction_keeps_the_state_drops_replaced_records_and_their_audio(tmp_path):
    log = ItemLog(tmp_path)
    log.put("a", b"audio-a1", audio_format="wav", metadata={"v": 1}, captions={"eng": ["first"]})
    log.put("a", b"audio-a2", audio_format="wav", metadata={"v": 2})  # replaces a1
    log.put("b", b"shared", audio_format="wav")
    log.put("c", b"shared", audio_format="wav")  # the same bytes: one file
    log.put("d", b"audio-d", audio_format="flac")
    log.delete("d")
    log.delete("bundle-clip")  # a takedown stays
    log.delete("bundle-clip")
    reader = ItemLog(tmp_path)  # another replica, part-way through the log
    reader.follow()
    log.put("e", b"audio-e", audio_format="wav")
    before_state, before_version = log.snapshot(), log.version
    stored = {p.name for p in (tmp_path / "audio").iterdir()}

    done = log.compact()

    assert done.compacted and done.records_before == 9 and done.records_after == 6
    assert done.audio_removed == 2 and log.version > before_version

    def same(state) -> bool:  # a compacted file counts its own records: the state is what it holds
        return state.items == before_state.items and state.deleted == before_state.deleted

    assert same(log.state) and log.state.records == 6
    live_audio = {r.audio for r in before_state.items.values()}
    assert len(stored - live_audio) == 2  # a's first upload and d's
    assert {p.name for p in (tmp_path / "audio").iterdir()} == live_audio
    for record in log.state.items.values():
        assert log.audio_path(record).exists()
    reader.follow()  # it had the old file open: it sees the new one and replays it
    assert same(reader.state) and reader.version == log.version
    fresh = ItemLog(tmp_path)
    fresh.follow()
    assert same(fresh.state) and fresh.version == log.version
    assert not log.compact().compacted  # nothing left to drop: the file is not rewritten
    assert not list(tmp_path.glob(".compact-*"))


def test_a_writer_that_opened_the_log_before_a_compaction_appends_to_the_new_file(tmp_path):
    early = ItemLog(tmp_path)
    early.put("x", b"one", audio_format="wav")
    other = ItemLog(tmp_path)
    other.put("x", b"two", audio_format="wav")
    other.compact()
    early.put("y", b"three", audio_format="wav")  # early never followed the compaction before this
    fresh = ItemLog(tmp_path)
    fresh.follow()
    assert set(fresh.state.items) == {"x", "y"}
    assert fresh.audio_path(fresh.state.items["x"]).read_bytes() == b"two"
    assert early.state == fresh.state and other.snapshot() == fresh.state


def test_audio_removed_by_a_compaction_is_stored_again_by_a_later_put(tmp_path):
    log = ItemLog(tmp_path)
    log.put("a", b"same-bytes", audio_format="wav")
    log.delete("a")
    assert log.compact().audio_removed == 1
    log.put("b", b"same-bytes", audio_format="wav")
    assert log.audio_path(log.state.items["b"]).read_bytes() == b"same-bytes"


COMPACT_WRITER = textwrap.dedent("""
    import sys
    from index.items.log import ItemLog
    log = ItemLog(sys.argv[1])
    i = 0
    while True:
        # a new id, an upsert of the previous one (sometimes with the audio of a deleted id), a delete
        ops = [("put", f"w-{i}", f"w-{i}".encode())]
        if i % 3 == 1:
            ops.append(("put", f"w-{i - 1}", (f"w-{i - 3}" if i % 2 else f"w-{i - 1}-again").encode()))
        if i % 5 == 4:
            ops.append(("delete", f"w-{i - 2}", b"-"))
        for op, item_id, audio in ops:
            print("doing", op, item_id, audio.decode(), flush=True)
            if op == "put":
                log.put(item_id, audio, audio_format="wav")
            else:
                log.delete(item_id)
            print("acked", op, item_id, audio.decode(), flush=True)
        i += 1
""")

COMPACTOR = textwrap.dedent("""
    import sys
    from index.items.log import ItemLog
    log = ItemLog(sys.argv[1])
    print("started", flush=True)
    while True:
        if log.compact().compacted:
            print("compacted", flush=True)
""")


def _preload(root: Path, n: int) -> None:
    """A log with ``n`` live items and as many replaced records (written as the log writes them)."""
    from index.items.log import ItemRecord

    log = ItemLog(root)
    record = log.put("seed", b"seed-audio", audio_format="wav")
    lines = []
    for i in range(n):
        for version in range(2):
            lines.append(ItemRecord("put", f"old-{i}", record.at, record.audio, {"version": version}).to_json())
    with (root / LOG_NAME).open("a", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")


def _kill_when(compactor: subprocess.Popen, trigger: str, root: Path) -> None:
    """SIGKILL the compactor as it writes its new file (a ``.compact-`` file appears), just after its
    rename (the log is another file: removing audio), or wherever it is (``anywhere``)."""
    import time

    deadline = time.monotonic() + 20
    inode = os.stat(root / LOG_NAME).st_ino
    while trigger != "anywhere" and time.monotonic() < deadline:
        if trigger == "writing" and any(name.startswith(".compact-") for name in os.listdir(root)):
            break
        if trigger == "renamed" and os.stat(root / LOG_NAME).st_ino != inode:
            break
    os.kill(compactor.pid, signal.SIGKILL)


def test_acknowledged_records_survive_kill_9_of_a_compaction_mid_way(tmp_path):
    import random
    import threading
    import time

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    _preload(tmp_path, 4000)  # a compaction rewrites ~1 MB: long enough to be killed inside it
    acked: list[tuple[str, str, str]] = []
    doing: list[tuple[str, str, str]] = []
    rounds = random.Random(7)
    killed_mid_write = 0
    for trigger in ("writing", "renamed", "anywhere"):
        writer = subprocess.Popen([sys.executable, "-c", COMPACT_WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                                  env=env, text=True)
        compactor = subprocess.Popen([sys.executable, "-c", COMPACTOR, str(tmp_path)], stdout=subprocess.PIPE,
                                     env=env, text=True)

        compactions: list[str] = []

        def read(proc=writer):
            assert proc.stdout is not None
            for line in proc.stdout:
                kind, op, item_id, audio = line.split()
                (acked if kind == "acked" else doing).append((op, item_id, audio))

        def drain(proc=compactor, out=compactions):  # a full pipe would stop it outside a compaction
            assert proc.stdout is not None
            out.extend(proc.stdout)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert compactor.stdout is not None and compactor.stdout.readline().strip() == "started"
        drainer = threading.Thread(target=drain, daemon=True)
        drainer.start()
        time.sleep(0.3 + rounds.random() * 0.3)  # the writer is appending, upserting and deleting meanwhile
        _kill_when(compactor, trigger, tmp_path)
        time.sleep(0.2)  # the writer goes on once the kernel has dropped the dead compactor's lock
        os.kill(writer.pid, signal.SIGKILL)
        for proc in (writer, compactor):
            proc.wait(timeout=30)
        reader.join(timeout=30)
        drainer.join(timeout=30)
        assert writer.returncode == compactor.returncode == -signal.SIGKILL and compactions

        log = ItemLog(tmp_path)
        log.follow()
        in_flight = doing[-1][1] if len(doing) > len(acked) else None
        expected: dict[str, str | None] = {}
        for op, item_id, audio in acked:
            expected[item_id] = audio if op == "put" else None
        assert len(acked) > 10
        for item_id, audio in expected.items():
            if item_id == in_flight:
                continue
            if audio is None:
                assert item_id not in log.state.items and item_id in log.state.deleted
            else:
                record = log.state.items[item_id]
                assert log.audio_path(record).read_bytes() == audio.encode(), item_id
        assert all(f"old-{i}" in log.state.items for i in range(0, 4000, 97))
        acked.clear()
        doing.clear()
        killed_mid_write += bool(list(tmp_path.glob(".compact-*")))
    print(f"{killed_mid_write} of 3 compactors were killed before their rename (a temporary file was left)")
    done = ItemLog(tmp_path).compact()  # what a killed compaction left is not in the way
    assert not list(tmp_path.glob(".compact-*")) and done.records_after >= 4000


def test_tonearm_items_compact(tmp_path, capsys):
    from tonearm.cli import main

    log = ItemLog(tmp_path / ".items")
    log.put("a", b"first", audio_format="wav")
    log.put("a", b"second", audio_format="wav")
    assert main(["items", "compact", "--bundles-dir", str(tmp_path)]) == 0
    assert "2 records → 1" in capsys.readouterr().out
    assert len((tmp_path / ".items" / LOG_NAME).read_text().splitlines()) == 2  # the header and a's put
    assert main(["items", "compact", "--items-dir", str(tmp_path / ".items")]) == 0
    assert "nothing to drop" in capsys.readouterr().out
    assert main(["items", "compact", "--items-dir", str(tmp_path / "none")]) == 2
