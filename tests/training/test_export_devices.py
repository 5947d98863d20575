"""`tonearm export --devices` and `export --pretrained --devices` (issue 55, part 2): the clips pass split over
two device processes writes the one-device bundle — same ids in the same order, same skipped clips, vectors to
float tolerance. They crashed after the ONNX export and parity check (``a pass over several devices needs the
encoder's EncoderSpec``): neither export handed its encoder to the device processes. The trained catalogue holds
an undecodable clip and a resampling bomb (a WAV declaring 2 Hz, issue 55 part 1): both skipped and listed, the
bomb under the decode limits, in the device processes as in this one.

The "devices" are CPU processes (tests/index/test_catalogue_pass.py: on a GPU node the same code runs the CUDA
provider with a ``device_id`` each). Cost on two loaded cores: trained ~20-40 s (the session's tiny checkpoint,
48 clips, two exports), pretrained ~20-40 s (the small random ClapModel, 6 clips, two exports).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from index.bundle import format as fmt
from index.catalogue.embed_pass import PassOptions
from tests.index.test_decode_limits import write_resampling_bomb
from tests.training.test_export_resume import vectors
from training.bundle import export, pretrained

TWO = PassOptions(decode_workers=2, devices=(0, 1))


def _ids(bundle: Path) -> list[str]:
    return [json.loads(line)["id"] for line in (bundle / fmt.AUDIO_IDS).read_text().splitlines()]


def _assert_same(two: Path, one: Path) -> None:
    assert _ids(two) == _ids(one)
    assert (two / fmt.TEXT_IDS).read_text() == (one / fmt.TEXT_IDS).read_text()
    assert fmt.read_manifest(two).skipped_clips == fmt.read_manifest(one).skipped_clips
    for got, want in zip(vectors(two), vectors(one), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    audio = vectors(one)[0]
    assert not np.allclose(audio[0], audio[1], atol=1e-3)  # distinct clips, distinct vectors: the check can fail


def test_a_trained_export_over_two_devices_equals_the_one_device_export(tiny_checkpoint: Path, tiny_corpus: Path,
                                                                        tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    shutil.copytree(tiny_corpus.parent, corpus)
    manifest = corpus / tiny_corpus.name
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    (corpus / rows[7]["audio"]).write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt garbage")  # skipped, on one device
    write_resampling_bomb(corpus / rows[30]["audio"])  # past the decode limits (issue 55, part 1): on the other
    one = export.export_bundle(tiny_checkpoint, manifest=manifest, out_dir=tmp_path / "one", progress=False)
    two = export.export_bundle(tiny_checkpoint, manifest=manifest, out_dir=tmp_path / "two", progress=False,
                               pass_options=TWO)
    _assert_same(two, one)
    skipped = fmt.read_manifest(two).skipped_clips or []
    assert [s.id for s in skipped] == [rows[7]["id"], rows[30]["id"]]
    assert "sample rate 2 Hz is below the floor of 1000 Hz" in skipped[1].reason


def test_a_pretrained_export_over_two_devices_equals_the_one_device_export(real_manifest: Path,
                                                                           tmp_path: Path) -> None:
    from tests.training.test_pretrained_quantize import write_small_clap

    folder = write_small_clap(tmp_path / "small_clap")
    one = pretrained.export_pretrained_bundle(folder, manifest=real_manifest, out_dir=tmp_path / "one",
                                              progress=False)
    two = pretrained.export_pretrained_bundle(folder, manifest=real_manifest, out_dir=tmp_path / "two",
                                              progress=False, pass_options=TWO)
    _assert_same(two, one)
