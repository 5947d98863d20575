"""The items' write-ahead record (index.item_log): round trip, crash durability, torn lines, two writers.

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

from index.item_log import LOG_NAME, ItemError, ItemLog

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
    from index.item_log import ItemLog
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
    from index.item_log import ItemLog
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
