"""bench/multinode_rehearsal.py's accounting of an epoch from the ids each rank recorded (the figures
docs/BENCHMARKS.md reports: duplicates must be 0, coverage over every segment of a resumed epoch)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.multinode_rehearsal import epoch_account, served_ids


def _record(folder: Path, rank: int, *steps: tuple[int, list[str]]) -> None:
    with open(folder / f"served.{rank}.jsonl", "a") as sink:
        for epoch, ids in steps:
            sink.write(json.dumps({"epoch": epoch, "ids": ids}) + "\n")


def test_an_epoch_split_over_two_jobs_is_counted_across_ranks_and_segments(tmp_path: Path) -> None:
    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir()
    after.mkdir()
    _record(before, 0, (0, ["a", "b"]), (1, ["c", "d"]))
    _record(before, 1, (0, ["c", "d"]), (1, ["a", "e"]))
    _record(after, 0, (1, ["b", "f"]))
    _record(after, 1, (1, ["e"]))  # served again after the resume: one duplicate
    first, second = served_ids(before), served_ids(after)
    assert first[0] == {0: ["a", "b"], 1: ["c", "d"]}

    epoch_1 = epoch_account([first[0]], usable={"a", "b", "c", "d", "e", "f", "g", "h"})
    assert (epoch_1["served"], epoch_1["distinct"], epoch_1["duplicates"], epoch_1["coverage"]) == (4, 4, 0, 0.5)

    epoch_2 = epoch_account([first[1], second[1]], usable={"a", "b", "c", "d", "e", "f"})
    assert (epoch_2["served"], epoch_2["distinct"], epoch_2["duplicates"]) == (7, 6, 1)
    assert epoch_2["coverage"] == 1.0 and epoch_2["not_in_corpus"] == []
    assert epoch_account([second[1]], usable={"b"})["not_in_corpus"] == ["e", "f"]
