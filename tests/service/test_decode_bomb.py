"""Decode bombs: uploads whose decoding would cost far more than their bytes (issue 47, SPEC §17).

The bomb of the issue is a 93-KB FLAC of 60 s of 192-kHz, 8-channel silence. Decoding every
channel to float32 before mixing cost 406 MiB and 3.5 s of CPU; four at once on
``/v1/search/similar`` added 625 MiB to a replica. Memory is measured here as the kernel reports it
(the peak resident set, ``VmHWM``, reset before the decode) of a child process, never estimated by our code:

* the decoder alone (a child process decoding the bomb with no limits) stays within
  :func:`index.audio.decode.decode_estimate` of its output plus slack — one block of every channel;
* a real uvicorn server (a child process) answers the bomb 422 ``audio-limits`` from its header,
  and four concurrent uploads at the samples limit add at most :data:`SERVER_BOUND_MIB` to its peak.
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from index.audio.decode import AudioTooLongError, decode_audio, decode_estimate
from service.settings import Settings
from tests.service.conftest import wait_until
from tests.service.test_routes import assert_problem

DECODER_BOUND_MIB = 24
"""Most the bomb's decoding may add to a process's peak resident set (it was 406 MiB)."""
SERVER_BOUND_MIB = 96
"""Most four concurrent 8-channel uploads at the samples limit may add to a server's peak (they
added 625 MiB before; the server's own allocations for four requests are part of it)."""


def silent_flac(seconds: int, rate: int = 192_000, channels: int = 8) -> bytes:
    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", samplerate=rate, channels=channels, format="FLAC", subtype="PCM_16") as f:
        second = np.zeros((rate, channels), np.int16)
        for _ in range(seconds):
            f.write(second)
    return buf.getvalue()


@pytest.fixture(scope="module")
def bomb(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bomb") / "bomb.flac"
    path.write_bytes(silent_flac(60))
    return path


def _child(code: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env, capture_output=True,
                          text=True, timeout=120, check=True, **kwargs)


DECODE_CHILD = """
    import io, json, sys
    import numpy as np, soundfile as sf
    from index.audio.decode import decode_audio
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    small = io.BytesIO(); sf.write(small, np.zeros((4800, 2), np.float32), 48000, format="FLAC")
    decode_audio(small.getvalue(), sample_rate=16000)  # warm: libraries loaded, soxr initialised
    data = open(sys.argv[1], "rb").read()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the resident set now
        before = status("VmRSS")
    except OSError:  # a kernel without it: the peak so far (a weaker check)
        before = status("VmHWM")
    wave = decode_audio(data, sample_rate=16000)
    print(json.dumps({"before": before, "after": status("VmHWM"), "samples": int(wave.shape[0])}))
"""


def test_decoding_the_bomb_holds_one_block_of_its_channels_not_the_clip(bomb):
    size = len(bomb.read_bytes())
    assert size < 100_000  # the bomb is small on the wire
    out = json.loads(_child(DECODE_CHILD, str(bomb)).stdout)
    assert out["samples"] == 60 * 16000
    added = out["after"] - out["before"]
    estimate = decode_estimate(60 * 192_000, 8, 192_000, 16000)
    # the estimate the budget holds is what decoding costs (plus libsndfile's FLAC decoder)
    assert added <= estimate + (8 << 20), (added, estimate)
    assert added <= DECODER_BOUND_MIB << 20, f"decoding the bomb added {added / 2**20:.0f} MiB"


def test_the_bomb_is_refused_from_its_header_on_every_upload_route(fake_client, bomb):
    data = bomb.read_bytes()
    for path in ("/v1/search/similar", "/v1/search/audio"):
        r = fake_client.post(path, content=data)
        assert_problem(r, 422, "audio-limits")
        assert "samples to decode" in r.json()["detail"]
    # an over-limit memory estimate is refused the same way (a lower TONEARM_MAX_DECODED_BYTES)
    assert Settings().max_decode_samples == 60 * 192_000 * 2


def test_a_header_that_lies_about_its_length_costs_what_the_header_declares():
    """An MP3 without its Xing/Info frame count: libsndfile estimates the length from the first frame's
    bitrate (5.3 s of a 20-s VBR stream here) and decodes no more than it declared, so the limits
    checked from the header bound the decode; the decoder also counts the frames as they come."""
    buf = io.BytesIO()
    sf.write(buf, (0.1 * np.sin(np.arange(8000 * 20) / 5)).astype(np.float32), 8000, format="MP3")
    data = bytearray(buf.getvalue())
    tag = data.find(b"Xing")
    assert tag > 0 and struct.unpack(">I", data[tag + 8:tag + 12])[0] > 0
    data[tag:tag + 4] = b"\0\0\0\0"  # no Xing tag: the header no longer knows the frame count
    declared = sf.info(io.BytesIO(bytes(data))).frames
    assert declared < 8000 * 20
    wave = decode_audio(bytes(data), sample_rate=8000)
    assert wave.shape[0] <= declared
    with pytest.raises(AudioTooLongError):
        decode_audio(bytes(data), sample_rate=8000, max_seconds=declared / 8000 / 2)


SERVER_CHILD = """
    import sys, pathlib
    from service.app import create_app
    from tests.service.conftest import UvicornServer, fake_opener, make_settings
    bundles = pathlib.Path(sys.argv[1])
    for name in ("fake-a",):
        (bundles / name).mkdir()
        (bundles / name / "manifest.json").write_text("{}")
    app = create_app(make_settings(bundles_dir=bundles, bundle="fake-a", search_threads=4), opener=fake_opener)
    with UvicornServer(app) as server:
        server.wait_ready()
        print(server.url, flush=True)
        sys.stdin.read()
"""


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key}")


def test_a_server_under_four_concurrent_bombs_stays_within_its_bound(tmp_path, bomb):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SERVER_CHILD), str(tmp_path)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert url.startswith("http://"), "the server did not start"
        at_limit = silent_flac(15)  # 15 s × 192 kHz × 8 channels: exactly the default samples limit
        small = silent_flac(1, rate=48_000, channels=2)
        with httpx.Client(base_url=url, timeout=60) as client:
            assert client.post("/v1/search/similar", content=small).status_code == 200  # warm
            try:
                Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # the server's peak from now on
                before = _status(proc.pid, "VmRSS")
            except OSError:  # a kernel without it: the peak so far (a weaker check)
                before = _status(proc.pid, "VmHWM")
            answers: list[httpx.Response] = []

            def post(body: bytes) -> None:
                answers.append(client.post("/v1/search/similar", content=body))

            threads = [threading.Thread(target=post, args=(body,)) for body in (at_limit,) * 4 + (bomb.read_bytes(),) * 4]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
            wait_until(lambda: len(answers) == 8, timeout=5, what="answers")
            statuses = sorted(a.status_code for a in answers)
            assert statuses == [200] * 4 + [422] * 4, [a.text[:200] for a in answers]
            added = _status(proc.pid, "VmHWM") - before
            print(f"four 8-channel uploads at the samples limit added {added / 2**20:.0f} MiB to the server's peak")
            assert added <= SERVER_BOUND_MIB << 20, f"four decodes added {added / 2**20:.0f} MiB to the server's peak"
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(30)


def test_concurrent_decodes_share_one_memory_budget():
    """Real threads through the byte semaphore: the bytes held at once never pass the capacity, a
    decode waits for room, and one that finds none within its wait is 503 `overloaded`."""
    import time

    from service.audio_input import DecodeBudget
    from service.errors import ServiceError

    budget = DecodeBudget(100)
    inside, most, lock = [0], [0], threading.Lock()

    def decode(nbytes: int) -> None:
        with budget.hold(nbytes, timeout=10):
            with lock:
                inside[0] += nbytes
                most[0] = max(most[0], inside[0])
            time.sleep(0.05)
            with lock:
                inside[0] -= nbytes

    threads = [threading.Thread(target=decode, args=(40,)) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert most[0] == 80 and budget.peak == 80 and budget.used == 0  # two at a time, never three
    with budget.hold(1000, timeout=1):  # larger than the whole budget: runs alone
        assert budget.used == 100
        with pytest.raises(ServiceError) as err:
            with budget.hold(1, timeout=0.05):
                pass
        assert err.value.slug == "overloaded" and err.value.extra["retry_after"] >= 1


def test_an_upload_that_finds_no_room_in_the_budget_is_a_503(fake_bundles):
    from service.app import create_app
    from service.audio_input import decode_budget
    from tests.service.conftest import fake_opener, make_settings, running_client
    from tests.service.fakes import tone, wav_bytes

    capacity = 3 << 20  # a budget no other test shares (one per capacity and process)
    settings = make_settings(bundles_dir=fake_bundles, bundle="fake-a", decode_memory_bytes=capacity,
                             decode_wait_s=0.1, upload_wait_s=0.1)
    budget = decode_budget(capacity)
    with running_client(create_app(settings, opener=fake_opener)) as client:
        audio = wav_bytes(tone(["dog"]))
        assert client.post("/v1/search/similar", content=audio).status_code == 200
        # the decodes running hold their reserve, other requests' bodies the rest (tests/service/test_upload_budget.py)
        held = budget.take(budget.body_capacity, timeout=1, body=True) + budget.take(budget.reserve, timeout=1)
        r = client.post("/v1/search/similar", content=audio)
        assert_problem(r, 503, "overloaded")
        assert r.headers["retry-after"] == "1"
        budget.give(held)
        assert client.post("/v1/search/similar", content=audio).status_code == 200
        assert budget.used == 0
