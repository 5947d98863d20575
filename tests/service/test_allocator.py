"""glibc malloc arenas of the service process (service/allocator.py, docs/service.md "Memory").

Each case runs in a fresh interpreter (glibc's arena count only grows) that starts eight threads
allocating at once and counts the heaps glibc's own ``malloc_info`` reports. ~1 s in all."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = r"""
import ctypes, re, sys, tempfile, threading
from service.allocator import limit_arenas, trim
print("capped" if limit_arenas(int(sys.argv[1])) else "not-capped")
barrier = threading.Barrier(8)
def work():
    barrier.wait()
    kept = [bytearray(200_000) for _ in range(50)]  # malloc'd (past pymalloc's 512-byte limit)
    barrier.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
trim()
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
with tempfile.NamedTemporaryFile(suffix=".xml") as f:
    stream = libc.fopen(f.name.encode(), b"w")
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    print(len(re.findall(r'<heap nr="\d+"', open(f.name).read())))
"""


def _heaps(cap: int, env_cap: str | None = None) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    env["PYTHONPATH"] = str(ROOT)
    if env_cap is not None:
        env["MALLOC_ARENA_MAX"] = env_cap
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(cap)], capture_output=True, text=True, env=env,
                         timeout=60, check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(sys.platform != "linux", reason="glibc (Linux) only")
def test_the_service_caps_glibc_arenas_and_an_explicit_environment_wins():
    assert Settings().malloc_arenas == 2
    assert _heaps(2) == ("capped", 2)
    status, uncapped = _heaps(0)
    assert status == "not-capped" and uncapped > 2  # glibc's default: a new arena per allocating thread
    assert _heaps(2, env_cap="4") == ("not-capped", 4)  # MALLOC_ARENA_MAX, read by glibc at start, wins


TRIM_PROGRAM = r"""
import sys, time
from service.allocator import PeriodicTrim
def rss_mib():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
blocks = [bytearray(b"\x01") * 100_000 for _ in range(2000)]  # 200 MB in the heap (below the mmap threshold)
keep = bytearray(b"\x01") * 100_000  # a live block above them: free() alone can only trim the heap's top
del blocks
before = rss_mib()
periodic = PeriodicTrim.start(float(sys.argv[1]))
time.sleep(0.6)
print(before, rss_mib(), periodic.trims if periodic else -1)
if periodic: periodic.stop()
"""


def _trimmed(interval_s: float) -> tuple[float, float, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", TRIM_PROGRAM, str(interval_s)], capture_output=True, text=True,
                         env=env, timeout=60, check=True).stdout.split()
    return float(out[0]), float(out[1]), int(out[2])


@pytest.mark.skipif(sys.platform != "linux", reason="glibc (Linux) only")
def test_the_periodic_trim_returns_freed_heap_pages_below_a_live_block():
    assert Settings().malloc_trim_interval_s == 60
    before, after, trims = _trimmed(0.1)
    assert trims >= 1 and before - after > 150, (before, after)  # the 200 MB hole went back to the kernel
    before, after, trims = _trimmed(0)  # off: nothing started, the hole stays resident
    assert trims == -1 and before - after < 50, (before, after)


# ---------------------------------------------------------------- the cyclic GC (service/allocator.py)


def _tracked(obj: object) -> bool:
    """Whether a collection would walk ``obj``: gc.get_objects() lists generations 0–2, not the
    permanent generation that gc.freeze() fills."""
    return any(o is obj for o in gc.get_objects())


def test_a_swap_freezes_the_bundles_objects_out_of_collections_and_pauses_are_measured(fake_bundles):
    from service.app import create_app
    from tests.service.conftest import ADMIN, fake_opener, make_settings, running_client

    gc.unfreeze()
    try:
        app = create_app(make_settings(bundles_dir=fake_bundles, bundle="fake-a", gc_freeze=False), opener=fake_opener)
        with running_client(app):
            rows = app.state.tonearm.registry.active_searcher().bundle.audio_items
            assert gc.get_freeze_count() == 0 and _tracked(rows)
        app = create_app(make_settings(bundles_dir=fake_bundles, bundle="fake-a", gc_freeze=True), opener=fake_opener)
        with running_client(app) as client:
            rows = app.state.tonearm.registry.active_searcher().bundle.audio_items
            assert gc.get_freeze_count() > 0 and not _tracked(rows)  # loaded before the swap: frozen
            answer = client.post("/v1/bundles/activate", headers=ADMIN, json={"bundle_id": "fake-b", "force": True})
            assert answer.status_code == 200, answer.text
            new_rows = app.state.tonearm.registry.active_searcher().bundle.audio_items
            assert new_rows is not rows and not _tracked(new_rows)  # every swap freezes what it brought
            gc.collect()
            metrics = client.get("/metrics").text
        pauses = [line for line in metrics.splitlines() if line.startswith('tonearm_gc_pause_seconds_count{generation="2"}')]
        assert pauses and float(pauses[0].split()[-1]) >= 1, metrics[:2000]
    finally:
        gc.unfreeze()
