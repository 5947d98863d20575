"""The item log where disks and crashes damage it (issue 47): lines that are not records are skipped
and reported the same way by every reader, the log's id is created once and survives compaction,
and every directory the log creates is fsynced into its parent."""

from __future__ import annotations

import threading
from pathlib import Path

import index.items.log as item_log
from index.items.log import ID_NAME, LOG_NAME, ItemLog

WAV = b"RIFF" + bytes(40)


def test_corrupt_and_nul_lines_are_skipped_by_every_reader_and_writes_go_on(tmp_path):
    writer = ItemLog(tmp_path)
    writer.put("a", WAV, audio_format="wav", metadata={"n": 1})
    with open(tmp_path / LOG_NAME, "ab") as handle:
        handle.write(b"\x00" * 4096 + b"\n")  # a crash's hole, ending in a newline
        handle.write(b'{"op": "put", "id": "half-written\n')  # cut inside a record
        handle.write(b"[1, 2]\n")  # JSON, not a record
        handle.write(b"\x00\x00" + writer.state.items["a"].to_json().replace('"a"', '"b"', 1).encode()
                     + b"\n")  # NULs before a complete record: the record counts
    writer.put("c", WAV + b"c", audio_format="wav")
    writer.delete("a")

    readers = [ItemLog(tmp_path) for _ in range(2)]
    for reader in readers:
        state = reader.snapshot()
        assert set(state.items) == {"b", "c"} and state.deleted == {"a"}
        assert [c.length for c in reader.corrupt] == [4096, len('{"op": "put", "id": "half-written'), 6]
        assert reader.corrupt[0].reason == "4096 NUL bytes" and "not a record" in reader.corrupt[1].reason
    assert readers[0].version == readers[1].version == writer.version == 4  # the same versions everywhere

    done = writer.compact()
    assert done.compacted
    reader = readers[0]
    assert set(reader.snapshot().items) == {"b", "c"} and reader.corrupt == []  # a compaction drops them


def test_the_log_id_is_made_once_and_kept_by_compaction(tmp_path):
    root = tmp_path / "items"
    ids: list[str] = []
    start = threading.Barrier(4)

    def open_one() -> None:
        start.wait()
        ids.append(ItemLog(root).log_id)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1 and len(ids[0]) == 32  # four replicas creating the log at once agree
    log = ItemLog(root)
    log.put("x", WAV, audio_format="wav")
    log.put("x", WAV + b"2", audio_format="wav")
    assert log.compact().compacted
    assert ItemLog(root).log_id == ids[0] == (root / ID_NAME).read_text().strip()
    assert not [p for p in root.iterdir() if p.name.startswith(".id-")]
    assert ItemLog(tmp_path / "other").log_id != ids[0]


def test_directories_the_log_creates_are_fsynced_into_their_parents(tmp_path, monkeypatch):
    synced: list[Path] = []
    real = item_log._fsync_dir

    def spy(path: Path) -> None:
        synced.append(Path(path))
        real(path)

    monkeypatch.setattr(item_log, "_fsync_dir", spy)
    root = tmp_path / "volume" / "items"
    ItemLog(root)
    # volume/ into tmp_path, items/ into volume/, audio/ + items.jsonl + items.lock + items.id into items/
    assert synced[:3] == [tmp_path, tmp_path / "volume", root]
    assert synced.count(root) >= 4
    synced.clear()
    ItemLog(root)  # nothing created: nothing to fsync
    assert synced == []
