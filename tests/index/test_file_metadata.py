"""`tonearm index AUDIO_DIR`'s per-file metadata (index.items.file_metadata): read, checked, carried into
the bundle's clips, and filterable. The expected passing clips are written here by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from index.items.file_metadata import MetadataFileError, find_metadata_file, read_file_metadata

FILES = ["a.wav", "b.wav", "sub/c.wav"]


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_csv_columns_are_typed_and_lists_split(tmp_path):
    table = _write(tmp_path / "metadata.csv",
                   "file,license,duration,loop,tags[],owner\n"
                   "a.wav,cc0,3,true,rain|roof,\n"
                   "./sub/c.wav,by,7.5,false,,\"Smith, J.\"\n"
                   "b.wav,,,,door,\n")
    assert read_file_metadata(table, FILES) == {
        "a.wav": {"license": "cc0", "duration": 3, "loop": True, "tags": ["rain", "roof"]},
        "sub/c.wav": {"license": "by", "duration": 7.5, "loop": False, "owner": "Smith, J."},
        "b.wav": {"tags": ["door"]},
    }


@pytest.mark.parametrize(("text", "message"), [
    ('{"file": "a.wav", "nested": {"x": 1}}\n', "values are strings"),
    ('{"file": "a.wav", "tags": ["ok", 3]}\n', "values are strings"),
    ('{"file": "a.wav", "id": "other"}\n', "catalogue's own fields"),
    ('{"file": "a.wav"}\n{"file": "a.wav"}\n', "named twice"),
    ('{"file": "missing.wav"}\n', "not in the audio folder: 'missing.wav'"),
    ('{"license": "cc0"}\n', "needs a 'file'"),
    ("[1, 2]\n", "JSON object"),
    ('{"file": "a.wav",\n', "not JSON"),
])
def test_bad_jsonl_rows_are_refused_with_their_line(tmp_path, text, message):
    table = _write(tmp_path / "metadata.jsonl", text)
    with pytest.raises(MetadataFileError, match=message) as err:
        read_file_metadata(table, FILES)
    assert str(table) in str(err.value)


def test_the_table_is_found_beside_the_audio_or_named(tmp_path):
    assert find_metadata_file(tmp_path) is None
    _write(tmp_path / "metadata.csv", "file\n")
    assert find_metadata_file(tmp_path) == tmp_path / "metadata.csv"
    _write(tmp_path / "metadata.jsonl", "")
    with pytest.raises(MetadataFileError, match="both"):
        find_metadata_file(tmp_path)
    other = _write(tmp_path / "elsewhere.jsonl", "")
    assert find_metadata_file(tmp_path, other) == other
    with pytest.raises(MetadataFileError, match="no such file"):
        find_metadata_file(tmp_path, tmp_path / "nope.csv")


def test_index_carries_the_metadata_into_the_bundle_and_filters_use_it(tiny_bundle, tmp_path):
    """The table is not indexed as a file, each clip's row is its ``metadata``, and a filter on it
    passes exactly the clips the table says."""
    import soundfile as sf

    from index.bundle.format import read_manifest
    from index.catalogue.own_audio import index_folder
    from index.engines.filters import MetadataTable, parse_filter
    from index.runtime.loader import LoadedBundle

    rate = read_manifest(tiny_bundle).sample_rate
    folder = tmp_path / "sounds"
    (folder / "sub").mkdir(parents=True)
    rng = np.random.default_rng(4)
    for i, name in enumerate(FILES):
        sf.write(folder / name, rng.uniform(-0.5, 0.5, rate // 2 + 500 * i).astype(np.float32), rate)
    rows = [{"file": "a.wav", "license": "cc0", "duration": 2.5, "tags": ["rain"]},
            {"file": "sub/c.wav", "license": "by", "duration": 9}]
    _write(folder / "metadata.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    result = index_folder(folder, tiny_bundle, tmp_path / "own")
    assert result.clip_ids == FILES and result.skipped == []
    bundle = LoadedBundle.open(result.path)
    try:
        assert [item.get("metadata") for item in bundle.audio_items] == [
            {"license": "cc0", "duration": 2.5, "tags": ["rain"]}, None, {"license": "by", "duration": 9}]
        table = MetadataTable.from_items(bundle.audio_items)
        for flt, expected in (({"license": "cc0"}, ["a.wav"]), ({"duration": {"gt": 3}}, ["sub/c.wav"]),
                              ({"not": {"tags": "rain"}}, ["b.wav", "sub/c.wav"])):
            allowed = table.mask(parse_filter(flt))
            assert [FILES[r] for r in np.flatnonzero(allowed)] == expected
            _, found = bundle.search_audio(bundle.encode_text(["noise"]), 3, allowed=allowed)
            assert sorted(FILES[r] for r in found[0] if r >= 0) == expected
    finally:
        bundle.close()
