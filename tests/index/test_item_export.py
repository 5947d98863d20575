"""`tonearm items export` (index/items/export.py): the log's current items as a folder `tonearm index`
folds into a bundle — the same ids, the same metadata, and the vectors the service's overlay gives
the same uploads (the reference: the service's own decoding and the bundle's audio encoder).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from index.bundle.format import read_manifest
from index.catalogue.own_audio import index_folder
from index.items.export import ExportError, export_items
from index.items.log import LOG_NAME, ItemLog
from index.runtime.loader import LoadedBundle
from tests.service.fakes import tone, wav_bytes
from tonearm.cli import main


def _log(root: Path, rate: int) -> tuple[ItemLog, dict[str, tuple[bytes, dict]]]:
    """A log with puts, a replaced item, a deleted item and a takedown; id → (audio, metadata) expected."""
    log = ItemLog(root)
    door, rain, rain2 = (wav_bytes(tone(c, seconds=s, rate=rate), rate=rate) for c, s in
                         ((["dog"], 0.7), (["rain"], 1.0), (["bell", "rain"], 3.0)))
    log.put("foley/door-01", door, audio_format="wav", metadata={"license": "cc0", "tags": ["door", "wood"]})
    log.put("rain", rain, audio_format="wav", metadata={"n": 1}, captions={"eng": ["rain falls"]})
    log.put("gone", door, audio_format="wav")
    log.delete("gone")
    log.put("rain", rain2, audio_format="wav", metadata={"n": 2, "loop": True}, captions={"eng": ["rain", "bells"]})
    log.delete("a-bundle-clip")  # a takedown: stays in the log
    return log, {"foley/door-01": (door, {"license": "cc0", "tags": ["door", "wood"]}),
                 "rain": (rain2, {"n": 2, "loop": True})}


def test_an_export_folds_into_a_bundle_with_the_overlays_vectors(tiny_bundle: Path, tmp_path: Path) -> None:
    from service.audio_input import AudioLimits, decode_upload

    rate = read_manifest(tiny_bundle).sample_rate
    _, expected = _log(tmp_path / "items", rate)
    done = export_items(tmp_path / "items", tmp_path / "export")
    assert (done.items, done.captions_left_out, done.deleted) == (2, 2, 2)
    files = sorted(p.relative_to(done.path).as_posix() for p in done.path.rglob("*") if p.is_file())
    assert files == ["foley/door-01", "metadata.jsonl", "rain"]
    for item_id, (audio, _) in expected.items():
        assert (done.path / item_id).read_bytes() == audio
    rows = [json.loads(line) for line in (done.path / "metadata.jsonl").read_text().splitlines()]
    assert rows == [{"file": item_id, **meta} for item_id, (_, meta) in sorted(expected.items())]

    folded = index_folder(done.path, tiny_bundle, tmp_path / "folded")
    assert folded.clip_ids == sorted(expected) and not folded.skipped
    bundle, source = LoadedBundle.open(folded.path), LoadedBundle.open(tiny_bundle)
    try:
        assert [(c["id"], c.get("metadata")) for c in bundle.audio_items] == [
            (item_id, meta) for item_id, (_, meta) in sorted(expected.items())]
        limits = AudioLimits(max_seconds=60, max_sample_rate=48_000, max_channels=2)
        waves = [decode_upload(expected[i][0], sample_rate=rate, limits=limits).waveform for i in sorted(expected)]
        np.testing.assert_allclose(bundle.audio_embeddings(), source.encode_audio(waves), atol=1e-5)
    finally:
        bundle.close()
        source.close()


def test_ids_that_cannot_be_files_are_refused_before_anything_is_written(tmp_path: Path, capsys) -> None:
    log = ItemLog(tmp_path / "items")
    audio = wav_bytes(tone(["dog"]))
    for item_id, meta in (("ok", {}), ("legacy-up", {}), (".hidden/a", {}), ("a", {}), ("a/b", {}), ("legacy-pad", {}),
                          ("metadata.jsonl", {}), ("legacy-xy", {}), ("has-uri", {"uri": "elsewhere"})):
        log.put(item_id, audio, audio_format="wav", metadata=meta)
    # ids the API refuses since issue 47 (index/ids.py; " pad" since issue 55), in a log written before:
    # export refuses them too
    records = tmp_path / "items" / LOG_NAME
    records.write_text(records.read_text().replace('"legacy-up"', '"../up"').replace('"legacy-xy"', '"x//y"')
                       .replace('"legacy-pad"', '" pad"'))
    with pytest.raises(ExportError) as err:
        export_items(tmp_path / "items", tmp_path / "out")
    message = str(err.value)
    assert message.startswith("7 item(s) cannot be a file of the folder") and "'ok'" not in message
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))

    assert main(["items", "export", "--items-dir", str(tmp_path / "items"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.count("\n") == 1  # one line
    assert main(["items", "export", "--items-dir", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    assert "no item log" in capsys.readouterr().err
    (tmp_path / "taken").mkdir()
    clean = ItemLog(tmp_path / "clean")
    clean.put("fine", audio, audio_format="wav")
    with pytest.raises(ExportError, match="already exists"):
        export_items(tmp_path / "clean", tmp_path / "taken")
    assert main(["items", "export", "--bundles-dir", str(tmp_path), "--out", str(tmp_path / "o2")]) == 2  # no .items
    assert main(["items", "export", "--items-dir", str(tmp_path / "clean"), "--out", str(tmp_path / "o3")]) == 0
    assert (tmp_path / "o3" / "fine").read_bytes() == audio
