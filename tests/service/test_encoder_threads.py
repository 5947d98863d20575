"""The rule that sizes ONNX Runtime threads and concurrent encoder calls (docs/service.md, "Threads")."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from service.bundles import (
    LARGE_ENCODER_BYTES,
    GatedBundle,
    default_opener,
    encoder_bytes,
    encoder_calls_for,
    encoder_slots,
    onnx_threads_for,
)
from service.settings import Settings

BIG, SMALL = LARGE_ENCODER_BYTES, LARGE_ENCODER_BYTES - 1


@pytest.mark.parametrize(
    ("setting", "largest", "cores", "threads"),
    [
        (0, BIG, 2, 2),  # auto, CLAP-size: one call spans the cores
        (0, BIG, 8, 8),
        (0, SMALL, 2, 1),  # auto, demo-size: parallelism from the batch workers
        (0, BIG, 1, 1),
        (1, BIG, 2, 1),  # an explicit value always wins
        (3, SMALL, 2, 3),
    ],
)
def test_onnx_threads_rule(setting, largest, cores, threads):
    assert onnx_threads_for(Settings(onnx_threads=setting), largest, cores) == threads


@pytest.mark.parametrize(
    ("onnx_threads", "setting", "threads", "cores", "calls"),
    [
        (0, 0, 2, 2, 1),  # auto threads: calls × threads ≤ cores
        (0, 0, 2, 8, 4),
        (0, 0, 4, 2, 1),  # never below one call
        (0, 0, 1, 2, None),  # 1-thread calls: no limit (the workers bound them)
        (2, 0, 2, 2, None),  # explicit threads keep their old meaning: no limit unless asked
        (2, 1, 2, 2, 1),  # explicit calls
        (0, 3, 2, 2, 3),
        (1, 2, 1, 2, 2),
    ],
)
def test_encoder_calls_rule(onnx_threads, setting, threads, cores, calls):
    assert encoder_calls_for(Settings(onnx_threads=onnx_threads, encoder_calls=setting), threads, cores) == calls


def test_defaults_keep_one_thread_per_call():
    settings = Settings()
    assert settings.onnx_threads == 1 and encoder_calls_for(settings, onnx_threads_for(settings, BIG, 2), 2) is None


def test_encoder_bytes_counts_external_data_and_takes_the_larger_tower(tmp_path: Path):
    (tmp_path / "text_encoder.onnx").write_bytes(b"x" * 10)
    (tmp_path / "text_encoder.onnx.data").write_bytes(b"x" * 100)
    (tmp_path / "audio_encoder.onnx").write_bytes(b"x" * 50)
    assert encoder_bytes(tmp_path) == 110


class _CountingBundle:
    """Records how many encoder calls overlap."""

    bundle_id = "fake"

    def __init__(self) -> None:
        self.running = 0
        self.most = 0
        self.lock = threading.Lock()

    def _call(self, n: int) -> np.ndarray:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(0.02)  # long enough for the other threads to try to enter
        with self.lock:
            self.running -= 1
        return np.zeros((n, 4), np.float32)

    def encode_text(self, texts):
        return self._call(len(texts))

    def encode_audio(self, waveforms):
        return self._call(len(waveforms))


@pytest.mark.parametrize("slots", [1, 2])
def test_gated_bundle_bounds_calls_across_text_and_audio(slots):
    inner = _CountingBundle()
    gated = GatedBundle(inner, threading.BoundedSemaphore(slots))
    calls = [lambda: gated.encode_text(["a"]), lambda: gated.encode_audio([np.zeros(4)])] * 4
    threads = [threading.Thread(target=call) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert inner.most == slots
    assert gated.bundle_id == "fake"  # everything else passes through
    assert gated.encode_text(["a", "b"]).shape == (2, 4)


def test_encoder_slots_are_shared_per_count():
    assert encoder_slots(1) is encoder_slots(1)
    assert encoder_slots(1) is not encoder_slots(2)


def test_auto_on_a_small_bundle_is_one_thread_ungated(tiny_bundle, monkeypatch):
    monkeypatch.setenv("TONEARM_ONNX_THREADS", "0")
    assert encoder_bytes(tiny_bundle) < LARGE_ENCODER_BYTES
    opened = default_opener(Settings())(tiny_bundle)
    try:
        assert not isinstance(opened, GatedBundle)
        assert opened._text_encoder.session.get_session_options().intra_op_num_threads == 1  # type: ignore[attr-defined]
    finally:
        opened.close()


def test_explicit_threads_and_calls_gate_the_calls(tiny_bundle, monkeypatch):
    monkeypatch.setenv("TONEARM_ONNX_THREADS", "2")
    monkeypatch.setenv("TONEARM_ENCODER_CALLS", "1")
    opened = default_opener(Settings())(tiny_bundle)
    try:
        assert isinstance(opened, GatedBundle)
        assert opened._slots is encoder_slots(1)
        assert opened._text_encoder.session.get_session_options().intra_op_num_threads == 2
        assert opened.encode_text(["a dog"]).shape[0] == 1
    finally:
        opened.close()
