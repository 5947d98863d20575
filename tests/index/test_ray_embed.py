"""Ray Data embedding passes (issue 22 item 4): `tonearm index --ray` and `tonearm export --ray`
on a local Ray cluster write the single-process bundle (same ids, vectors to float tolerance,
same index and search results).

"2 workers" here means a pool of two embedding actors — two Ray worker processes, one CPU and
one ONNX session each — on a Ray cluster started with ``ray start --head`` (``ray_address``, shared
with test_ray_milvus.py: tests/index/conftest.py) bound to 127.0.0.1 with 2 CPUs; the tests check
that both actors embedded files. Ray 2.60 keeps a loopback cluster to one node (a second
``ray start --address`` is refused unless the node advertises the machine's routable address, and
then every Ray server listens on all interfaces), so no second node is started: the pool, the
sharding of blocks and the object-store transfer of the encoder are those of a multi-node cluster,
one node wide.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from index.bundle import read_manifest
from index.faiss_index import all_vectors, load_index, parse_factory
from index.own_audio import index_folder
from index.verify import verify_bundle

IN_CI = os.environ.get("CI", "").lower() == "true"
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Ray's switch for a one-machine cluster: node address 127.0.0.1, every server on loopback."""
N_FILES = 24
STALE_TOKEN = "0123456789abcdef0123456789abcdef"  # what `ray.init()` leaves in ~/.ray/auth_token

pytestmark = pytest.mark.slow


def _ray_binary() -> str:
    binary = Path(sys.executable).with_name("ray")
    if not binary.exists():
        if IN_CI:
            pytest.fail("Ray is required in CI (CI=true): pip install 'tonearm[ray]'")
        pytest.skip("Ray is not installed (pip install 'tonearm[ray]')")
    return str(binary)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ray_env(home: Path, **extra: str) -> dict[str, str]:
    """This process's environment for Ray with HOME = ``home`` and none of the caller's Ray state:
    no RAY_ADDRESS, no RAY_AUTH_MODE / RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH (Ray 2.60 reads its
    token from those and from ``$HOME/.ray/auth_token``)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("RAY_AUTH_")}
    return env | LOOPBACK_ENV | {"HOME": str(home)} | extra


def _stale_token_home(parent: Path) -> Path:
    """A HOME as an earlier local ``tonearm index --ray`` (``ray.init()``) leaves it: ``.ray/auth_token``."""
    home = Path(tempfile.mkdtemp(prefix="home", dir=parent))
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(STALE_TOKEN)
    return home


@contextmanager
def _ray_head(env: dict[str, str]) -> Iterator[str]:
    """A 2-CPU Ray head on 127.0.0.1 in its own temp dir, started with ``env``; its process group is killed after."""
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    head = subprocess.Popen(
        [_ray_binary(), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
         "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}",
         f"--ray-client-server-port={_free_port()}"],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _gcs_up(port):
            if head.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray start failed: {head.stderr.read().decode()[-2000:] if head.stderr else ''}")
            time.sleep(0.2)
        yield address
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:  # Ray's own shutdown takes ~10 s; its temp dir goes with it, so a short grace is enough
            head.wait(timeout=2)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=10)
        shutil.rmtree(temp, ignore_errors=True)


def _gcs_up(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def tonearm(*args: str, home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """The CLI in a fresh process (its own Ray driver, on loopback) with HOME = ``home``."""
    return subprocess.run([sys.executable, "-m", "tonearm", *args], env=_ray_env(home, **env),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def sound_folder(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """N_FILES short noise bursts (0.3–3 s, some at another rate, nested) + a corrupt file + a text file."""
    rate = read_manifest(tiny_bundle).sample_rate
    folder = tmp_path_factory.mktemp("ray_sounds")
    rng = np.random.default_rng(1)
    for i in range(N_FILES):
        file_rate = rate if i % 3 else 22050
        n = int(file_rate * (0.3 + 0.12 * i))
        path = folder / f"set{i % 4}" / f"clip{i:02d}.wav"
        path.parent.mkdir(exist_ok=True)
        sf.write(path, (rng.uniform(-0.5, 0.5, n) * np.hanning(n)).astype(np.float32), file_rate)
    (folder / "set1" / "broken.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt garbage")
    (folder / "readme.txt").write_text("not audio\n")
    return folder


def _vectors(bundle: Path, kind: str) -> np.ndarray:
    info = getattr(read_manifest(bundle), f"{kind}_index")
    return all_vectors(load_index(bundle / info.file, spec=parse_factory(info.factory, info.dim), search_params={}))


def _assert_same_index(ray_bundle: Path, local_bundle: Path, kind: str) -> None:
    mine, theirs = getattr(read_manifest(ray_bundle), f"{kind}_index"), getattr(read_manifest(local_bundle), f"{kind}_index")
    assert (mine.factory, mine.ntotal, mine.dim, mine.search_params) == (
        theirs.factory, theirs.ntotal, theirs.dim, theirs.search_params)
    assert (ray_bundle / mine.ids_file).read_text() == (local_bundle / theirs.ids_file).read_text()
    got, expected = _vectors(ray_bundle, kind), _vectors(local_bundle, kind)
    np.testing.assert_allclose(got, expected, atol=2e-5)
    assert not np.allclose(expected[0], expected[1], atol=1e-3), "distinct inputs must give distinct vectors"
    top_got, top_expected = np.argsort(-(got @ got[:8].T), axis=0)[:5], np.argsort(-(expected @ expected[:8].T), axis=0)[:5]
    assert (top_got == top_expected).all()


def test_index_on_ray_writes_the_single_process_bundle(
    ray_address: str, ray_home: Path, sound_folder: Path, tiny_bundle: Path, tmp_path: Path
) -> None:
    local = index_folder(sound_folder, tiny_bundle, tmp_path / "local")
    run = tonearm("-v", "index", str(sound_folder), "--bundle", str(tiny_bundle), "--out", str(tmp_path / "on-ray"),
                  "--ray", ray_address, "--ray-workers", "2", home=ray_home)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"{N_FILES} files indexed, 2 skipped" in run.stdout
    assert "set1/broken.wav" in run.stdout and "readme.txt" in run.stdout
    assert f"Ray pass: {N_FILES + 2} rows on 2 worker processes (pool of 2)" in run.stderr
    verify_bundle(tmp_path / "on-ray")
    assert len(local.clip_ids) == N_FILES
    _assert_same_index(tmp_path / "on-ray", local.path, "audio")


def test_export_on_ray_writes_the_single_process_bundle(
    ray_address: str, ray_home: Path, tiny_bundle: Path, tiny_checkpoint: Path, tiny_corpus: Path, tmp_path: Path
) -> None:
    run = tonearm("-v", "export", str(tiny_checkpoint), "--data", str(tiny_corpus), "--out", str(tmp_path),
                  "--ray", ray_address, home=ray_home)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "on 2 worker processes (pool of 2)" in run.stderr  # one actor per CPU of the cluster by default
    (exported,) = [p for p in tmp_path.iterdir() if (p / "manifest.json").is_file()]
    verify_bundle(exported)
    for kind in ("audio", "text"):
        _assert_same_index(exported, tiny_bundle, kind)
    ours, theirs = read_manifest(exported), read_manifest(tiny_bundle)
    assert ours.text_index and theirs.text_index
    assert ours.text_index.language_ranges == theirs.text_index.language_ranges


def test_pretrained_export_on_ray_writes_the_single_process_bundle(
    ray_address: str, ray_home: Path, tiny_corpus: Path, tmp_path: Path
) -> None:
    """`export --pretrained --ray` (issue 41): a small ClapModel folder bundled in this process and on the
    cluster gives the same ids, vectors (float tolerance) and neighbours, clips and captions."""
    from tests.training.test_pretrained_quantize import write_small_clap
    from training.bundle.pretrained import export_pretrained_bundle

    folder = write_small_clap(tmp_path / "small_clap")
    local = export_pretrained_bundle(folder, manifest=tiny_corpus, out_dir=tmp_path / "local", progress=False)
    run = tonearm("-v", "export", "--pretrained", str(folder), "--data", str(tiny_corpus), "--out", str(tmp_path / "ray"),
                  "--ray", ray_address, "--ray-workers", "2", home=ray_home)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "on 2 worker processes (pool of 2)" in run.stderr
    (exported,) = [p for p in (tmp_path / "ray").iterdir() if (p / "manifest.json").is_file()]
    verify_bundle(exported)
    for kind in ("audio", "text"):
        _assert_same_index(exported, local, kind)


def test_unreachable_cluster_is_a_user_error(ray_home: Path, tiny_bundle: Path, tmp_path: Path) -> None:
    _ray_binary()
    sf.write(tmp_path / "a.wav", np.zeros(1600, np.float32), read_manifest(tiny_bundle).sample_rate)
    run = tonearm("index", str(tmp_path), "--bundle", str(tiny_bundle), "--out", str(tmp_path / "x"),
                  "--ray", f"127.0.0.1:{_free_port()}", home=ray_home)
    assert run.returncode == 2
    assert "cannot reach the Ray cluster" in run.stderr
    run = tonearm("index", str(tmp_path), "--bundle", str(tiny_bundle), "--out", str(tmp_path / "x"),
                  "--ray-workers", "2", home=ray_home)
    assert run.returncode == 2 and "--ray-workers needs --ray" in run.stderr


def test_a_cluster_started_after_a_local_run_takes_its_token(tiny_bundle: Path, tmp_path: Path) -> None:
    """Ray after Ray (issue 41): a local ``--ray`` run left ``~/.ray/auth_token``; a cluster then
    started on the machine (``ray start --head``, RAY_AUTH_MODE unset) turns token authentication
    on with it, and a driver given the cluster's address must send it once refused (Ray itself
    sends a token only to a local cluster it finds). Without a token the refusal is one line saying how to pass
    one, and RAY_AUTH_TOKEN passes it."""
    home = _stale_token_home(tmp_path)
    (tmp_path / "audio").mkdir()
    sf.write(tmp_path / "audio" / "a.wav", np.sin(np.arange(8000, dtype=np.float32) / 7),
             read_manifest(tiny_bundle).sample_rate)
    fast = {"RAY_NUM_REDIS_GET_RETRIES": "2", "RAY_gcs_server_port_wait_time_s": "2"}  # refused in ~2 s, not 20
    with _ray_head(_ray_env(home)) as address:
        run = tonearm("index", str(tmp_path / "audio"), "--bundle", str(tiny_bundle), "--out", str(tmp_path / "x"),
                      "--ray", address, "--ray-workers", "1", home=home, **fast)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "1 files indexed" in run.stdout and "retrying with the Ray token found here" in run.stderr
        elsewhere = Path(tempfile.mkdtemp(prefix="home", dir=tmp_path))  # a machine without the token
        run = tonearm("index", str(tmp_path / "audio"), "--bundle", str(tiny_bundle), "--out", str(tmp_path / "y"),
                      "--ray", address, home=elsewhere, **fast)
        assert run.returncode == 2, run.stderr[-3000:]
        last = run.stderr.strip().splitlines()[-1]
        assert last.startswith("error: cannot reach the Ray cluster") and "RAY_AUTH_TOKEN=" in last, run.stderr
        run = tonearm("index", str(tmp_path / "audio"), "--bundle", str(tiny_bundle), "--out", str(tmp_path / "y"),
                      "--ray", address, "--ray-workers", "1", home=elsewhere, RAY_AUTH_TOKEN=STALE_TOKEN, **fast)
        assert run.returncode == 0, run.stderr[-3000:]


ACTOR_OPTIONS = """
import json, sys
from index.ray_embed import AudioEmbedder, RayOptions, build_dataset, connect, pool_size
from index.errors import TonearmError

address = sys.argv[1]
connect(address)
found = {}
for device in ("cpu", "cuda"):
    options = RayOptions(address=address, workers=2, device=device, cpus_per_worker=None)
    dataset = build_dataset([{"row": 0, "path": "x.wav"}], AudioEmbedder, {"model": b"", "embed_dim": 4},
                            batch_size=16, options=options, workers=2)
    op = dataset._logical_plan.dag
    found[device] = {"remote": op.ray_remote_args, "ctor": sorted(op.fn_constructor_kwargs.items())}
try:
    pool_size(RayOptions(address=address, device="cuda"), {"CPU": 2.0})
    found["no_gpu"] = "accepted"
except TonearmError as err:
    found["no_gpu"] = str(err)
print(json.dumps(found, default=str))
"""


def test_a_ray_actor_asks_for_a_gpu_when_cuda_is_asked(ray_address: str, ray_home: Path) -> None:
    """Issue 49: with ``--device cuda`` each embedding actor reserves a GPU (``num_gpus``) and its decoding
    CPUs (``num_cpus``), and runs the CUDA provider; on the CPU it asks for one CPU and no GPU. Checked on
    the pipeline's actor options (the shared CPU cluster has no GPU to run them); a cluster without a GPU
    is refused in one line before any actor starts."""
    import json

    run = subprocess.run([sys.executable, "-c", ACTOR_OPTIONS, ray_address], env=_ray_env(ray_home),
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["cuda"]["remote"].get("num_gpus") == 1.0 and found["cuda"]["remote"].get("num_cpus") == 4
    assert "num_gpus" not in found["cpu"]["remote"] and found["cpu"]["remote"].get("num_cpus") == 1
    assert ["device", "cuda"] in found["cuda"]["ctor"] and ["threads", 4] in found["cuda"]["ctor"]
    assert "has no GPU" in found["no_gpu"]
