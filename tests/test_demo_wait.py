"""Waiting for the demo build on progress (tonearm/demo_wait.py), with a real builder subprocess.

The test holds the demo build lock of a fresh home, as a concurrent `make serve` or test
session building the demo would: the builder subprocess (``python -m tonearm.demo``) waits
on it. A build log that keeps growing keeps the waiter waiting past the stall limit; a log
that stops growing fails it (and stops the builder); when the lock holder finishes, the
builder reuses its bundle instead of building a second one.
"""

from __future__ import annotations

import fcntl
import threading
import time
from pathlib import Path

import pytest

from tonearm import demo
from tonearm.demo_wait import wait_for_demo_bundle
from tonearm.errors import TonearmError

STALL = 4.0


def _hold_lock(home: Path):
    root = demo.demo_root(home)
    root.mkdir(parents=True)
    handle = open(root / ".lock", "w")  # released by the test
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


def test_a_build_that_stops_progressing_fails_and_the_builder_is_stopped(tmp_path):
    handle = _hold_lock(tmp_path)
    try:
        started = time.monotonic()
        with pytest.raises(TonearmError, match=f"no progress for {STALL:.0f} s"):
            wait_for_demo_bundle(tmp_path, stall_seconds=STALL)
        assert time.monotonic() - started < STALL + 40
    finally:
        handle.close()
    assert demo.cached_demo_bundle(tmp_path) is None


def test_a_progressing_build_is_waited_for_past_the_stall_limit_and_reused(tmp_path):
    """Another process 'builds' for 3 × the stall limit, logging every second; then publishes."""
    handle = _hold_lock(tmp_path)
    root = demo.demo_root(tmp_path)
    bundle = root / "bundles" / "demo-by-the-other-process"

    def other_builder() -> None:
        try:
            with open(root / demo.BUILD_LOG, "a", encoding="utf-8") as log:
                for epoch in range(int(3 * STALL)):
                    log.write(f"INFO training.loop: epoch {epoch}: loss 1.0\n")
                    log.flush()
                    time.sleep(1.0)
            bundle.mkdir(parents=True)
            (bundle / "manifest.json").write_text("{}")
            (root / f"bundle-{demo.config_fingerprint()}.path").write_text(str(bundle))
        finally:
            handle.close()

    thread = threading.Thread(target=other_builder)
    thread.start()
    try:
        assert wait_for_demo_bundle(tmp_path, stall_seconds=STALL) == bundle
    finally:
        thread.join(60)
    assert not (root / "corpus").exists()  # the waiting builder built nothing itself


def test_the_cache_key_follows_the_config_and_the_build_code_and_the_corpus_only_the_synthesizer(
    tmp_path, monkeypatch
):
    for rel in ("configs/demo.yaml", "configs/default.yaml", "training/loop.py", "training/data/synth.py",
                "index/languages.py", "index/bundle/format.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n")
    monkeypatch.setattr(demo, "ROOT", tmp_path)
    monkeypatch.setattr(demo, "DEMO_CONFIG", tmp_path / "configs" / "demo.yaml")
    recipe, corpus = demo.config_fingerprint(), demo.corpus_fingerprint("small")
    keys = []
    for rel in ("configs/demo.yaml", "training/loop.py", "index/bundle/format.py", "training/data/synth.py"):
        (tmp_path / rel).write_text((tmp_path / rel).read_text() + "# changed\n")
        keys.append((demo.config_fingerprint(), demo.corpus_fingerprint("small")))
    assert len({recipe, *(k[0] for k in keys)}) == 5  # every change → a new build
    assert [k[1] == corpus for k in keys] == [True, True, True, False]  # only the synthesizer → a new corpus
    assert demo.corpus_fingerprint("tiny") != demo.corpus_fingerprint("small")
