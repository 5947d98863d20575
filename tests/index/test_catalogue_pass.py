"""The catalogue pass (issue 49, :mod:`index.catalogue.embed_pass`): decode workers beside the encoder, length-
sorted calls under a sample budget, and the catalogue split over several devices, one process each, merged
into the bundle one device writes. The "devices" here are CPU processes (``--devices`` on a GPU node runs the
same code with the CUDA provider and a ``device_id`` each).

Cost: ~6-12 s on two cores (the session's tiny bundle, 14 short files; the split pass starts two spawn
processes with their own decode worker each).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from index.bundle.format import read_manifest
from index.catalogue.embed_pass import (
    DecodeCall,
    Decoder,
    DeviceError,
    DevicePool,
    EncoderSpec,
    PassClock,
    PassOptions,
    length_batches,
    parse_devices,
)
from index.catalogue.own_audio import decode_file, index_folder
from index.engines.faiss_index import all_vectors, load_index, parse_factory
from index.errors import TonearmError


def _vectors(bundle: Path) -> np.ndarray:
    info = read_manifest(bundle).audio_index
    return all_vectors(load_index(bundle / info.file, spec=parse_factory(info.factory, info.dim), search_params={}))


@pytest.fixture(scope="module")
def folder(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    rate = read_manifest(tiny_bundle).sample_rate
    root = tmp_path_factory.mktemp("pass_sounds")
    rng = np.random.default_rng(5)
    for i in range(13):
        n = int(rate * (0.2 + 0.23 * ((i * 7) % 13)))  # mixed lengths, not sorted by name
        sf.write(root / f"c{i:02d}.wav", (rng.uniform(-0.5, 0.5, n) * np.hanning(n)).astype(np.float32), rate)
    (root / "c06b.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt garbage")  # skipped, on the second device
    return root


def test_a_pass_split_over_two_devices_writes_the_one_device_bundle(folder: Path, tiny_bundle: Path,
                                                                   tmp_path: Path) -> None:
    one = index_folder(folder, tiny_bundle, tmp_path / "one", chunk_files=8)
    two = index_folder(folder, tiny_bundle, tmp_path / "two", chunk_files=8,
                       pass_options=PassOptions(decode_workers=2, devices=(0, 1), batch_samples=40_000))
    assert two.clip_ids == one.clip_ids and two.skipped == one.skipped and len(one.clip_ids) == 13
    assert (tmp_path / "two" / "audio_ids.jsonl").read_text() == (tmp_path / "one" / "audio_ids.jsonl").read_text()
    got, want = _vectors(two.path), _vectors(one.path)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert not np.allclose(want[0], want[1], atol=1e-3)  # distinct clips, distinct vectors: the check can fail


def test_decode_workers_give_the_inline_waveforms_in_order(folder: Path, tiny_bundle: Path) -> None:
    rate = read_manifest(tiny_bundle).sample_rate
    paths = sorted(folder.iterdir())
    decode = DecodeCall(decode_file, args=(rate,))
    with Decoder(decode, PassOptions(decode_workers=2, prefetch=3), PassClock()) as pooled:
        got = list(pooled.imap(paths))
    with Decoder(decode, PassOptions(), PassClock()) as inline:
        want = list(inline.imap(paths))
    assert [r for _, r in got] == [r for _, r in want] and sum(1 for w, _ in got if w is None) == 1
    for (a, _), (b, _) in zip(got, want, strict=True):
        assert (a is None and b is None) or np.array_equal(a, b)


def test_length_batches_keep_every_call_within_the_budget() -> None:
    lengths = [5, 100, 7, 50, 6, 300, 49]
    batches = length_batches(lengths, 150)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        longest = max(lengths[i] for i in batch)
        assert len(batch) == 1 or len(batch) * longest <= 150  # padded to the call's longest clip
    assert [lengths[i] for i in batches[0]] == [5, 6, 7]  # similar lengths share a call
    assert [5] in [[lengths[i] for i in b] for b in length_batches([5], 1)]  # one clip over the budget: alone


def test_devices_are_parsed_and_refused_without_cuda() -> None:
    assert parse_devices(None, "cpu") is None
    assert parse_devices("0,2,3", "cuda") == [0, 2, 3]
    for bad, device in (("0,1", "cpu"), ("0,0", "cuda"), ("x", "cuda"), ("-1", "cuda")):
        with pytest.raises(TonearmError):
            parse_devices(bad, device)


@dataclass(frozen=True)
class StartFails(EncoderSpec):
    """Device 1's encoder does not start: it raises as a CUDA provider without its libraries would, or its
    process dies at once (``how="exit"``)."""

    how: str = "raise"

    def load(self, device_id: int | None):  # type: ignore[no-untyped-def]
        if device_id == 1:
            if self.how == "exit":
                os._exit(3)
            raise RuntimeError("CUDA failure 100: no CUDA-capable device is detected\n(a second line)")
        return super().load(device_id)


@pytest.mark.parametrize(("how", "said"), [("raise", "device 1: RuntimeError: CUDA failure 100: no CUDA-capable "
                                                     "device is detected"),
                                           ("exit", "device 1: its process ended while starting")])
def test_a_device_that_cannot_start_is_named_with_its_error(tiny_bundle: Path, how: str, said: str) -> None:
    """Issue 55: not a bare BrokenProcessPool — the pass stops before any chunk, naming the device and its error."""
    manifest = read_manifest(tiny_bundle)
    spec = StartFails(path=str(tiny_bundle / manifest.audio_encoder.file), embed_dim=manifest.embed_dim,
                      clip_samples=manifest.clip_samples, how=how)
    decode = DecodeCall(decode_file, args=(manifest.sample_rate,))
    with pytest.raises(DeviceError) as raised, DevicePool(spec, [0, 1], decode, PassOptions(), PassClock()):
        pass
    message = str(raised.value)
    assert said in message and "1 of 2 device processes" in message and "device 0" not in message
    assert "second line" not in message  # one line


def test_the_codec_call_budget_of_a_pass() -> None:
    """Issue 55: PE-Audio's long clips share calls in a pass given the budget — by default with --device cuda
    (CUDA_CODEC_CALL_SAMPLES), the service's on the CPU; --codec-call-samples sets it."""
    from argparse import Namespace

    from index.catalogue.embed_pass import CUDA_CODEC_CALL_SAMPLES, pass_options_from_args

    def options(**given: object) -> PassOptions:
        return pass_options_from_args(Namespace(decode_workers=0, devices=None, **given))

    assert options(device="cpu").codec_call_samples is None  # index.runtime.loader.CODEC_CALL_SAMPLES
    assert options(device="cuda").codec_call_samples == CUDA_CODEC_CALL_SAMPLES
    assert options(device="cpu", codec_call_samples=2_000_000).codec_call_samples == 2_000_000
    with pytest.raises(ValueError, match="bad pass options"):
        PassOptions(codec_call_samples=0)
