"""Items across processes: two `tonearm serve` replicas on one bundles volume (real bundles, real
FAISS, real Redis for activations). An item added through one is served by the other; one deleted
through the other is gone from the first; an item acknowledged (201) survives `kill -9` and a
restart; a swap to a bundle of another model re-embeds the added items (their audio→audio
neighbours equal a brute-force numpy ranking of the new model's vectors: the bundle's clips and
the stored audio embedded by the new bundle's own encoder), and a rollback keeps them.

Seconds from a 201 on one replica to the first answer of the other that serves the item are printed.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf

from tests.conftest import ROOT
from tests.service.conftest import free_port, wait_until
from tests.service.fakes import tone, wav_bytes
from tests.service.test_replicas import TOKEN, Replica

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _start(tmp_path: Path, name: str, *, bundles_dir: Path, bundle: str, items_dir: Path, redis_url: str,
           prefix: str) -> Replica:
    port = free_port()
    settings = {
        "TONEARM_ENVIRONMENT": "production", "TONEARM_BUNDLES_DIR": str(bundles_dir), "TONEARM_BUNDLE": bundle,
        "TONEARM_ITEMS_DIR": str(items_dir), "TONEARM_REDIS_URL": redis_url, "TONEARM_KEY_PREFIX": prefix,
        "TONEARM_PUBSUB_CHANNEL": f"{prefix}:activations", "TONEARM_ADMIN_TOKEN": TOKEN,
        "TONEARM_SEARCH_THREADS": "2", "TONEARM_HOME": str(tmp_path / "home"),
    }
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TONEARM_")}, "OMP_NUM_THREADS": "1", **settings}
    log = tmp_path / f"{name}.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "tonearm.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    return Replica(process, f"http://127.0.0.1:{port}", log)


def _post_item(replica: Replica, item_id: str, audio: bytes, metadata: dict) -> dict:
    r = httpx.post(replica.url + "/v1/items", headers=AUTH, timeout=60,
                   data={"id": item_id, "metadata": json.dumps(metadata)}, files={"file": ("a.wav", audio, "audio/wav")})
    assert r.status_code == 201, r.text
    return r.json()


def _similar(replica: Replica, item_id: str, k: int) -> httpx.Response:
    return httpx.get(f"{replica.url}/v1/search/similar/{item_id}", params={"k": k}, timeout=30)


def _seconds_until(predicate, what: str, timeout: float = 30) -> float:
    start = time.monotonic()
    wait_until(predicate, timeout=timeout, interval=0.01, what=what)
    return time.monotonic() - start


def _reference(bundle_dir: Path, audio: dict[str, bytes], item_id: str, k: int) -> list[tuple[float, str]]:
    """Brute force over the new model's vectors: the bundle's clips and the added items' audio."""
    from index.runtime.loader import LoadedBundle

    bundle = LoadedBundle.open(bundle_dir, device="cpu")
    try:
        ids = [str(item["id"]) for item in bundle.audio_items]
        clips = np.asarray(bundle.audio_embeddings(), dtype=np.float32)
        waves = [sf.read(io.BytesIO(data), dtype="float32")[0] for data in audio.values()]
        added = np.asarray(bundle.encode_audio(waves), dtype=np.float32)
    finally:
        bundle.close()
    vectors = np.concatenate([clips, added])
    names = ids + list(audio)
    query = vectors[names.index(item_id)]
    scored = sorted(((float(v @ query), n) for v, n in zip(vectors, names, strict=True) if n != item_id),
                    key=lambda p: -p[0])
    return scored[:k]


def _assert_neighbours(hits: list[dict], expected: list[tuple[float, str]]) -> None:
    np.testing.assert_allclose([h["score"] for h in hits], [s for s, _ in expected], atol=1e-4)
    score_of = {n: s for s, n in expected}
    for hit in hits:
        if hit["id"] in score_of:
            assert abs(hit["score"] - score_of[hit["id"]]) < 1e-4


def test_items_reach_the_other_replica_survive_kill_9_and_are_re_embedded_by_a_swap(
    real_bundles, redis_server, key_prefix, tmp_path
):
    from index.bundle.format import read_manifest

    a, b = real_bundles.id("a"), real_bundles.id("b")
    rate = read_manifest(real_bundles.a).sample_rate
    audio = {
        "it-dog": wav_bytes(tone(["dog"], seconds=1.5, rate=rate), rate=rate),
        "it-siren-bell": wav_bytes(tone(["siren", "bell"], seconds=1.0, rate=rate), rate=rate),
        "it-rain": wav_bytes(tone(["rain", "dog"], seconds=2.0, rate=rate), rate=rate),
        "it-gone": wav_bytes(tone(["bell"], seconds=0.7, rate=rate), rate=rate),
    }
    common = {"bundles_dir": real_bundles.root, "bundle": a, "items_dir": tmp_path / "items",
              "redis_url": redis_server.url, "prefix": key_prefix}
    replicas = [_start(tmp_path, f"r{i}", **common) for i in range(2)]
    try:
        for replica in replicas:
            replica.wait_ready()
        r0, r1 = replicas

        # added through r0 → served by r1 (it follows the shared log)
        _post_item(r0, "it-gone", audio["it-gone"], {"license": "cc0"})
        seen = _seconds_until(lambda: _similar(r1, "it-gone", 3).status_code == 200, "r1 to serve it-gone")
        found = httpx.post(r1.url + "/v1/search/similar", params={"k": 1, "filter": json.dumps({"license": "cc0"})},
                           content=audio["it-gone"], timeout=30).json()["hits"]
        assert [h["id"] for h in found] == ["it-gone"] and found[0]["score"] > 0.999
        # deleted through r1 → gone from r0
        assert httpx.delete(r1.url + "/v1/items/it-gone", headers=AUTH, timeout=30).status_code == 200
        gone = _seconds_until(lambda: _similar(r0, "it-gone", 3).status_code == 404, "r0 to drop it-gone")

        # acknowledged, then kill -9 at once: the restarted replica has it
        _post_item(r0, "it-dog", audio["it-dog"], {"license": "by"})
        r0.process.send_signal(signal.SIGKILL)
        r0.process.wait(timeout=30)
        r0 = replicas[0] = _start(tmp_path, "r0", **common)
        r0.wait_ready()
        assert httpx.get(r0.url + "/v1/items/it-dog", headers=AUTH, timeout=30).json()["source"] == "added"
        top = httpx.post(r0.url + "/v1/search/similar", params={"k": 1}, content=audio["it-dog"], timeout=30).json()
        assert top["hits"][0]["id"] == "it-dog"

        files = [("file", (f"{n}.wav", audio[n], "audio/wav")) for n in ("it-siren-bell", "it-rain")]
        r = httpx.post(r1.url + "/v1/items:batch", headers=AUTH, timeout=60, files=files,
                       data={"items": json.dumps([{"id": "it-siren-bell"}, {"id": "it-rain"}])})
        assert r.status_code == 201, r.text
        wait_until(lambda: _similar(r0, "it-rain", 3).status_code == 200, timeout=30, what="r0 to serve the batch")

        # a swap to b (another model) through r0; r1 follows over Redis; both re-embed the items
        activated = httpx.post(r0.url + "/v1/bundles/activate", headers=AUTH, timeout=120,
                               json={"bundle_id": b, "force": True})
        assert activated.status_code == 200, activated.text
        wait_until(lambda: _similar(r1, "it-dog", 1).json().get("bundle_id") == b, timeout=60, what="r1 on b")
        added = {n: audio[n] for n in ("it-dog", "it-siren-bell", "it-rain")}
        k = 6
        for item in added:
            expected = _reference(real_bundles.b, added, item, k)
            for replica in (r0, r1):
                got = _similar(replica, item, k).json()
                assert got["bundle_id"] == b
                _assert_neighbours(got["hits"], expected)

        # a rollback (through r1) keeps them, embedded by a's encoder again
        assert httpx.post(r1.url + "/v1/bundles/rollback", headers=AUTH, timeout=60).status_code == 200
        wait_until(lambda: _similar(r0, "it-dog", 1).json().get("bundle_id") == a, timeout=60, what="r0 back on a")
        for item in added:
            expected = _reference(real_bundles.a, added, item, k)
            _assert_neighbours(_similar(r0, item, k).json()["hits"], expected)
    finally:
        for replica in replicas:
            replica.stop()
    print(f"\nitem added on r0 served by r1 after {seen * 1000:.0f} ms; deleted on r1, gone from r0 after "
          f"{gone * 1000:.0f} ms; load {os.getloadavg()[0]:.1f}")
    assert seen < 3 and gone < 3  # the target is 1 s (docs/service.md); slack for a loaded CI machine
