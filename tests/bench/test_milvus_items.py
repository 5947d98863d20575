"""bench/milvus_items.py at toy sizes: both designs measured on the same items (Milvus on milvus-lite,
the overlay through the real item log and a replay in a fresh process), exact where they should be."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.milvus_items import SELECTIVITY, main
from tests.milvus_server import require_milvus

pytestmark = pytest.mark.timeout(300)


def test_both_designs_run_on_the_same_items_and_the_exact_ones_find_the_exact_top_10(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_milvus()
    results = tmp_path / "results.json"
    code = main(["--overlay-sizes", "150,400", "--milvus-sizes", "400", "--milvus-uri", str(tmp_path / "lite.db"),
                 "--index", "FLAT", "--dim", "16", "--batch", "150", "--queries", "12", "--min-queries", "12",
                 "--request-puts", "2", "--results", str(results), "--work-dir", str(tmp_path), "--no-write"])
    assert code == 0
    section = capsys.readouterr().out
    runs = json.loads(results.read_text())
    assert set(runs) == {"overlay:150", "overlay:400", "milvus:400"}
    for run in runs.values():
        assert set(run["cells"]) == set(SELECTIVITY)
        for cell in run["cells"].values():
            assert cell["recall"] == 1.0 and cell["queries"] == 12  # exact scan, FLAT: the exact top-10
        assert run["ingest_per_s"] > 0
    # the same items: the same number pass each filter in both designs
    assert {k: c["passing"] for k, c in runs["overlay:400"]["cells"].items()} == \
           {k: c["passing"] for k, c in runs["milvus:400"]["cells"].items()}
    startup = runs["overlay:400"]["startup"]
    assert startup["rss_mib"] > startup["rss_base_mib"] and startup["overlay_s"] > 0
    assert runs["milvus:400"]["request_puts"]["puts"] == 2
    assert "| overlay (exact) | 400 |" in section and "| Milvus FLAT | 400 |" in section
    assert "Where each design stops" in section and "GiB per million" in section
