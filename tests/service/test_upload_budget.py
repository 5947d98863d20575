"""Request bodies within the process's memory budget (issue 55, part 1).

160 concurrent 10.4-MB uploads to the public ``POST /v1/search/similar`` took a replica from 348 to
2,206 MiB: the decode budget counted decodes, not the bodies read before them. Every audio route now
reads its body under the one budget of ``TONEARM_DECODE_MEMORY_BYTES`` (service/memory_budget.py):

* the budget's rules, by themselves: bodies fill at most three quarters, decodes all of it, waits on
  threads and on the event loop, a cancelled waiter takes nothing;
* every route gives back what its request held, on every path (answers, 4xx, 503s, a client gone in
  the middle of its body, a decode outliving its request);
* a real uvicorn server in a child process under a crowd of legitimate uploads larger than its budget:
  some are refused 503 with ``Retry-After``, all others answered 200, and the server's peak resident set
  (``VmHWM``, reset before the crowd) stays within the budget plus :data:`CROWD_MARGIN_MIB`.

Each test uses a budget capacity no other test uses: there is one budget per capacity and process.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from service.errors import ServiceError
from service.memory_budget import MemoryBudget, UploadLease, process_budget
from tests.service.conftest import ADMIN, fake_opener, make_settings, running_client, wait_until
from tests.service.fakes import tone, wav_bytes
from tests.service.test_routes import assert_problem

MIB = 1 << 20


# ---------------------------------------------------------------- the budget by itself


def test_bodies_fill_three_quarters_and_decodes_the_rest():
    budget = MemoryBudget(100, reserve=25)
    assert budget.body_capacity == 75
    assert budget.take(70, 0.01, body=True) == 70
    with pytest.raises(ServiceError) as err:  # a body: only 5 left of the bodies' 75
        budget.take(10, 0.01, body=True)
    assert err.value.slug == "overloaded" and err.value.extra["retry_after"] == 1
    assert budget.take(25, 0.01) == 25  # a decode: the reserve is its own
    assert budget.take(5, 0.01) == 5
    assert budget.used == 100 and budget.refused == 1
    assert budget.take(0, 0.01, body=True) == 0  # an empty body never waits (it is a 415, not a 503)
    assert budget.charge(1000, body=False) == 25 and budget.charge(1000, body=True) == 75  # larger: runs alone
    budget.give(100)
    assert budget.used == 0 and budget.peak == 100


def test_a_coroutine_waits_for_room_a_thread_gives_back_and_a_cancelled_waiter_takes_nothing():
    budget = MemoryBudget(100, reserve=25)

    async def scenario() -> None:
        budget.take(75, 0.01, body=True)
        threading.Timer(0.1, budget.give, args=(50,)).start()
        began = time.monotonic()
        assert await budget.take_async(40, 5) == 40  # woken by the thread's give, long before 5 s
        assert time.monotonic() - began < 2
        with pytest.raises(ServiceError):
            await budget.take_async(40, 0.05)
        waiter = asyncio.ensure_future(budget.take_async(40, 5))
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert budget.used == 65 and not budget._waiters
        budget.give(65)

    asyncio.run(scenario())
    assert budget.used == 0


def test_a_lease_gives_everything_back_once_and_a_late_decode_too():
    budget = MemoryBudget(100, reserve=25)
    lease = UploadLease(budget, wait_s=0.01)

    async def scenario() -> None:
        async with lease:
            await lease.reserve_body(30)
            lease.keep(budget.take(10, 0.01))  # a decode's output, held until the request ends
            assert budget.used == 40 and lease.held == 40
            lease.release_body()
            assert budget.used == 10

    asyncio.run(scenario())
    assert budget.used == 0 and lease.closed
    lease.keep(budget.take(20, 0.01))  # a decode finishing after its request was cancelled
    lease.close()  # closing twice gives nothing back twice
    assert budget.used == 0


# ---------------------------------------------------------------- routes give back what they held


def _app(fake_bundles: Path, capacity: int, **overrides):
    from service.app import create_app

    settings = make_settings(bundles_dir=fake_bundles, bundle="fake-a", decode_memory_bytes=capacity, **overrides)
    return create_app(settings, opener=fake_opener)


def _wav(seconds: float = 1.0) -> bytes:
    return wav_bytes(tone(["dog"], seconds=seconds))


def test_every_audio_route_gives_its_bytes_back_on_every_answer(fake_bundles):
    capacity = 5 * MIB + 1
    budget = process_budget(capacity)
    audio = _wav()
    calls = [
        (200, "/v1/search/similar", {"content": audio}),
        (200, "/v1/search/similar", {"files": {"file": ("a.wav", audio, "audio/wav")}}),
        (200, "/v1/search/audio", {"content": audio}),
        (None, "/v1/search/moments/audio", {"content": audio}),  # the fake bundle has no moments: any answer
        (201, "/v1/items", {"headers": ADMIN, "data": {"id": "budget-1"}, "files": {"file": ("a.wav", audio)}}),
        (201, "/v1/items:batch", {"headers": ADMIN, "data": {"items": json.dumps([{"id": "b-1"}, {"id": "b-2"}])},
                                  "files": [("file", ("1.wav", audio)), ("file", ("2.wav", audio))]}),
        (415, "/v1/search/similar", {"content": b"not audio at all" * 100}),
        (422, "/v1/search/similar", {"content": audio[:2000]}),  # truncated: the decode fails
        (413, "/v1/search/similar", {"content": b"\0" * (10 * MIB + 1)}),
        (400, "/v1/items", {"headers": ADMIN, "content": audio}),  # not multipart
        (422, "/v1/items:batch", {"headers": ADMIN, "data": {"items": "[]"}, "files": [("file", ("1.wav", audio))]}),
    ]
    with running_client(_app(fake_bundles, capacity)) as client:
        for status, path, kwargs in calls:
            r = client.post(path, **kwargs)
            assert status is None or r.status_code == status, (path, r.status_code, r.text[:300])
            assert budget.used == 0, (path, r.status_code, budget.used)
        assert budget.peak > len(audio)  # the bytes were held while the requests ran


def test_a_body_with_no_room_is_refused_unread_and_a_decode_with_no_room_too(fake_bundles):
    capacity = 5 * MIB + 2
    budget = process_budget(capacity)
    audio = _wav()
    with running_client(_app(fake_bundles, capacity, upload_wait_s=0.1, decode_wait_s=0.1)) as client:
        held = budget.take(budget.body_capacity, 1, body=True)  # other requests' bodies fill their share
        began = time.monotonic()
        for kwargs in ({"content": audio}, {"files": {"file": ("a.wav", audio, "audio/wav")}}):
            r = client.post("/v1/search/similar", **kwargs)
            body = assert_problem(r, 503, "overloaded")
            assert r.headers["retry-after"] == "1" and "memory budget" in body["detail"]
        r = client.post("/v1/items", headers=ADMIN, data={"id": "x"}, files={"file": ("a.wav", audio)})
        assert_problem(r, 503, "overloaded")
        assert time.monotonic() - began < 5  # upload_wait_s each, not the decodes' wait
        assert budget.used == held
        budget.give(held)
        # the body fits, the decode does not: bodies and decodes hold all but a few KiB
        held = budget.take(budget.body_capacity - 2 * len(audio), 1, body=True) + budget.take(budget.reserve, 1)
        r = client.post("/v1/search/similar", content=audio)
        assert_problem(r, 503, "overloaded")
        assert budget.used == held
        budget.give(held)
        assert client.post("/v1/search/similar", content=audio).status_code == 200
        assert budget.used == 0


def _chunks(data: bytes, size: int = 64 * 1024):
    for start in range(0, len(data), size):
        yield data[start:start + size]


def test_a_body_without_content_length_reserves_as_it_streams(fake_bundles):
    capacity = 8 * MIB + 3
    budget = process_budget(capacity)
    big = _wav(seconds=100)  # 3.2 MB: more than the bodies' share left below
    with running_client(_app(fake_bundles, capacity, upload_wait_s=0.1)) as client:
        r = client.post("/v1/search/similar", content=_chunks(_wav()))  # chunked: no Content-Length
        assert r.status_code == 200, r.text
        assert budget.used == 0
        held = budget.take(budget.body_capacity - 2 * MIB, 1, body=True)
        r = client.post("/v1/search/similar", content=_chunks(big))
        assert_problem(r, 503, "overloaded")  # refused part-way, at the step that found no room
        assert budget.used == held
        budget.give(held)
        assert budget.used == 0


def test_a_client_gone_in_the_middle_of_its_body_gives_its_reservation_back(fake_bundles, uvicorn_runner):
    capacity = 9 * MIB + 4
    budget = process_budget(capacity)
    with uvicorn_runner(_app(fake_bundles, capacity)) as server:
        server.wait_ready()
        for content_length in (True, False):
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                framing = b"Content-Length: 4000000\r\n" if content_length else b"Transfer-Encoding: chunked\r\n"
                sock.sendall(b"POST /v1/search/similar HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n")
                part = _wav(seconds=30)[:1_500_000]
                sock.sendall(part if content_length else b"%x\r\n" % len(part) + part + b"\r\n")
                wait_until(lambda: budget.used > 0, timeout=10, what="the body to be reserved")
            wait_until(lambda: budget.used == 0, timeout=10, what="the reservation to be given back")
        r = httpx.post(server.url + "/v1/search/similar", content=_wav(), timeout=30)
        assert r.status_code == 200
        assert budget.used == 0


# ---------------------------------------------------------------- a crowd on a real server

CROWD = 24
"""Concurrent uploads of the crowd: 7.7 MB each, 185 MB together, over a 24-MiB budget."""
CROWD_BUDGET = 24 * MIB
CROWD_WAIT_S = 0.25
"""TONEARM_UPLOAD_WAIT_S of the crowd's server: short, so that a fast machine refuses some of the crowd too."""
CROWD_MARGIN_MIB = 40
"""What the crowd may add to the server's peak beyond its budget: one body's second copy made on the event
loop (``b"".join``: 7.7 MB, one request at a time), the fake encoder's FFTs in the pool's threads, uvicorn's
64-KiB buffer of each waiting connection, the threads' stacks and allocator slack. Without the budget the
crowd's bodies alone would add 185 MB."""

CROWD_SERVER = """
    import sys, pathlib
    from service.app import create_app
    from tests.service.conftest import UvicornServer, fake_opener, make_settings
    bundles = pathlib.Path(sys.argv[1])
    (bundles / "fake-a").mkdir()
    (bundles / "fake-a" / "manifest.json").write_text("{}")
    settings = make_settings(bundles_dir=bundles, bundle="fake-a", search_threads=4, malloc_trim_interval_s=0,
                             decode_memory_bytes=int(sys.argv[2]), upload_wait_s=float(sys.argv[3]))
    with UvicornServer(create_app(settings, opener=fake_opener)) as server:
        server.wait_ready()
        print(server.url, flush=True)
        sys.stdin.read()
"""


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key}")


def crowd_upload(seconds: float = 10.0, rate: int = 48_000, channels: int = 8, seed: int = 0) -> bytes:
    """A legitimate upload: ``seconds`` of ``channels``-channel 16-bit WAV at ``rate`` (10 s × 48 kHz × 8:
    7.7 MB, within every default limit)."""
    rng = np.random.default_rng(seed)
    wave = (0.1 * rng.standard_normal((int(seconds * rate), channels))).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, wave, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def test_a_crowd_over_the_budget_gets_503s_and_the_server_stays_within_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CROWD_SERVER), str(tmp_path), str(CROWD_BUDGET),
                             str(CROWD_WAIT_S)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert url.startswith("http://"), "the server did not start"
        upload = crowd_upload()
        with httpx.Client(base_url=url, timeout=60) as warm:
            assert warm.post("/v1/search/similar", content=upload).status_code == 200
        try:
            Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # the server's peak from now on
            before = _status(proc.pid, "VmRSS")
        except OSError:  # a kernel without it: the peak so far (a weaker check)
            before = _status(proc.pid, "VmHWM")
        answers: list[httpx.Response] = []
        errors: list[BaseException] = []
        barrier = threading.Barrier(CROWD)

        def post() -> None:
            try:
                with httpx.Client(base_url=url, timeout=60) as client:  # a connection each: a real crowd
                    barrier.wait(10)
                    answers.append(client.post("/v1/search/similar", content=upload))
            except BaseException as err:  # noqa: BLE001 — reported below
                errors.append(err)

        threads = [threading.Thread(target=post) for _ in range(CROWD)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors[:3]
        added = _status(proc.pid, "VmHWM") - before
        statuses = sorted(a.status_code for a in answers)
        refused = [a for a in answers if a.status_code == 503]
        print(f"{CROWD} concurrent uploads of {len(upload) / 1e6:.1f} MB over a {CROWD_BUDGET >> 20}-MiB budget: "
              f"{statuses.count(200)} × 200, {len(refused)} × 503; peak +{added / MIB:.0f} MiB")
        assert len(answers) == CROWD and set(statuses) <= {200, 503}, [a.text[:200] for a in answers]
        assert refused and statuses.count(200) >= 2, statuses
        for r in refused:
            assert r.headers["retry-after"] == "1"
            assert r.headers["content-type"].startswith("application/problem+json")
            assert r.json()["type"] == "urn:tonearm:problem:overloaded"
        assert added <= CROWD_BUDGET + (CROWD_MARGIN_MIB << 20), \
            f"the crowd added {added / MIB:.0f} MiB; budget {CROWD_BUDGET >> 20} + margin {CROWD_MARGIN_MIB} MiB"
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(30)
