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

Reaching a cluster (issues 41, 49; :mod:`index.catalogue.ray_connect`): the shared cluster runs without token
authentication while the CLI's HOME holds a stale ``~/.ray/auth_token``, so every test on it checks an
explicit address with a leftover token; the driver also finds it with no address and with ``auto``
(through its ``RAY_TMPDIR``, so no other cluster on the machine is found). A second cluster started
with token authentication is reached with its token by address and found, and refused in one line
without one or with another's; a local run from an empty HOME leaves that HOME empty.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from index.bundle.format import read_manifest
from index.catalogue.own_audio import index_folder
from index.engines.faiss_index import all_vectors, load_index, parse_factory
from index.runtime.verify import verify_bundle

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


@dataclass(frozen=True)
class RayHead:
    address: str
    """``127.0.0.1:PORT``, the GCS."""
    tmpdir: Path
    """Its RAY_TMPDIR: a driver with this RAY_TMPDIR and no address (or ``auto``) finds the cluster here
    (``ray start`` records it in ``ray/ray_current_cluster`` under it), and none of the machine's others."""

    def finding_it(self) -> dict[str, str]:
        """The environment of a driver that finds this cluster as "the one last started on this machine"."""
        return {"RAY_TMPDIR": str(self.tmpdir)}


@contextmanager
def _ray_head(env: dict[str, str]) -> Iterator[RayHead]:
    """A 2-CPU Ray head on 127.0.0.1 in its own temp dir, started with ``env``; its process group is killed after."""
    port = _free_port()
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    head = subprocess.Popen(
        [_ray_binary(), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
         "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp / 'ray'}",
         f"--ray-client-server-port={_free_port()}"],
        env=env | {"RAY_TMPDIR": str(temp)}, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while not (_gcs_up(port) and (temp / "ray" / "ray_current_cluster").is_file()):  # up and recorded
            if head.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray start failed: {head.stderr.read().decode()[-2000:] if head.stderr else ''}")
            time.sleep(0.2)
        yield RayHead(f"127.0.0.1:{port}", temp)
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


def test_index_on_ray_writes_the_windows_of_long_files(
    ray_address: str, ray_home: Path, tiny_bundle: Path, tmp_path: Path
) -> None:
    """Issue 54, part 5: `tonearm index --ray` windows the long files on the actors, from the decode of their clip
    vector (it wrote no windows before); the bundle's windows are the in-process pass's, counted in the progress."""
    from tests.index.test_pass_windows import bundle_windows_of, write_long_folder

    folder = write_long_folder(tmp_path / "sounds", read_manifest(tiny_bundle).sample_rate)
    local = index_folder(folder, tiny_bundle, tmp_path / "local")
    run = tonearm("-v", "index", str(folder), "--bundle", str(tiny_bundle), "--out", str(tmp_path / "on-ray"),
                  "--ray", ray_address, "--ray-workers", "2", home=ray_home)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "11 moment windows of 2 long files" in run.stderr
    spans, vectors = bundle_windows_of(tmp_path / "on-ray")
    want_spans, want_vectors = bundle_windows_of(local.path)
    assert len(want_spans) == 11
    np.testing.assert_array_equal(spans, want_spans)
    np.testing.assert_allclose(vectors, want_vectors, atol=2e-5)


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


@pytest.fixture(scope="module")
def one_clip(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding one short tone: the cheapest `tonearm index --ray` run (one actor, one file)."""
    folder = tmp_path_factory.mktemp("one_clip")
    sf.write(folder / "a.wav", np.sin(np.arange(8000, dtype=np.float32) / 7), read_manifest(tiny_bundle).sample_rate)
    return folder


def _index_one(one_clip: Path, tiny_bundle: Path, out: Path, ray: list[str], *, home: Path,
               **env: str) -> subprocess.CompletedProcess[str]:
    """`tonearm -v index ONE_CLIP --ray [ADDRESS]` with one actor."""
    return tonearm("-v", "index", str(one_clip), "--bundle", str(tiny_bundle), "--out", str(out), "--ray", *ray,
                   "--ray-workers", "1", home=home, **env)


def _ray_dir(home: Path) -> dict[str, str]:
    """What ``home/.ray`` holds: file name → text."""
    folder = home / ".ray"
    return {p.name: p.read_text() for p in folder.iterdir()} if folder.is_dir() else {}


@pytest.mark.parametrize("found_by", ["no address", "auto"])
def test_a_stale_token_does_not_stop_a_driver_that_finds_an_authless_cluster(
    found_by: str, ray_cluster: RayHead, ray_home: Path, one_clip: Path, tiny_bundle: Path, tmp_path: Path
) -> None:
    """Issue 49: ``~/.ray`` holds a token of an earlier local run and the cluster started on this machine
    runs without token authentication. Ray's own driver, finding that cluster (no address, ``auto``), turns
    token mode on with the stale token; the cluster accepts it but its workers cannot call back into it, and
    every actor was "cancelled before it started running". The driver now asks the cluster and runs in its
    mode. (The explicit address with the same stale token: every test above on ``ray_address``.) The
    token is left as it was; nothing is added to ``~/.ray``."""
    before = _ray_dir(ray_home)
    run = _index_one(one_clip, tiny_bundle, tmp_path / "x", [] if found_by == "no address" else ["auto"],
                     home=ray_home, **ray_cluster.finding_it())
    assert run.returncode == 0, run.stderr[-3000:]
    assert "1 files indexed" in run.stdout
    assert "(the cluster last started on this machine" in run.stderr  # found it, not a new local instance
    assert "runs without token authentication; no token sent" in run.stderr  # Ray alone sent the stale one
    assert _ray_dir(ray_home) == before == {"auth_token": STALE_TOKEN}


def test_an_auth_mode_that_contradicts_the_cluster_is_refused_in_one_line(
    ray_cluster: RayHead, ray_home: Path, one_clip: Path, tiny_bundle: Path, tmp_path: Path
) -> None:
    """RAY_AUTH_MODE set by the user is obeyed, so token mode against a cluster without authentication
    (whose actors would never start) stops before Ray is started, saying what to unset."""
    run = _index_one(one_clip, tiny_bundle, tmp_path / "x", [ray_cluster.address], home=ray_home,
                     RAY_AUTH_MODE="token")
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert "RAY_AUTH_MODE=token" in last and "runs without token authentication" in last, run.stderr


def test_a_local_run_leaves_nothing_behind(one_clip: Path, tiny_bundle: Path, tmp_path: Path) -> None:
    """No address and no cluster: a new local Ray instance. Ray's ``ray.init()`` writes a token to
    ``~/.ray/auth_token`` (which the next ``ray start --head`` on the machine adopts, issue 41); the local
    instance now runs with a token kept in the driver's environment only, so the HOME has no ``.ray`` —
    and no Ray process of the run outlives it. (ONNX Runtime writes its own ``~/.cache/Microsoft``; not Ray's.)"""
    home = tmp_path / "home"
    home.mkdir()
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # nothing recorded: no cluster to find
    try:
        run = _index_one(one_clip, tiny_bundle, tmp_path / "x", [], home=home, RAY_TMPDIR=str(ray_tmp))
        assert run.returncode == 0, run.stderr[-3000:]
        assert "1 files indexed" in run.stdout
        assert not (home / ".ray").exists(), f"the run left {_ray_dir(home)} in ~/.ray"
        assert not _processes_mentioning(str(ray_tmp)), "Ray processes of the local run are still running"
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _processes_mentioning(text: str) -> list[int]:
    """Process ids whose command line holds ``text`` (a Ray temp dir names its session's processes)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def test_a_cluster_with_token_authentication_takes_its_token(
    one_clip: Path, tiny_bundle: Path, tmp_path: Path
) -> None:
    """A cluster started where a token lies (``ray start --head``, RAY_AUTH_MODE unset: as after a local
    run before this fix, issue 41) requires it: a driver with that token reaches it by its address and by
    finding it; a driver without a token, or with another cluster's, is refused in one line naming the
    variables to set (at once: the GCS is asked, ``ray.init`` never retries), and RAY_AUTH_TOKEN passes it."""
    home = _stale_token_home(tmp_path)
    with _ray_head(_ray_env(home)) as head:
        for how, ray in (("address", [head.address]), ("found", [])):
            run = _index_one(one_clip, tiny_bundle, tmp_path / how, ray, home=home, **head.finding_it())
            assert run.returncode == 0, run.stderr[-3000:]
            assert "1 files indexed" in run.stdout
        elsewhere = Path(tempfile.mkdtemp(prefix="home", dir=tmp_path))  # a machine without the token
        for token, says in (({}, "no token was found here"), ({"RAY_AUTH_TOKEN": "f" * 32}, "refused the token")):
            began = time.monotonic()
            run = _index_one(one_clip, tiny_bundle, tmp_path / "y", [head.address], home=elsewhere, **token)
            assert run.returncode == 2, run.stderr[-3000:]
            last = run.stderr.strip().splitlines()[-1]
            assert last.startswith("error: the Ray cluster at") and says in last and "RAY_AUTH_TOKEN=" in last, last
            assert time.monotonic() - began < 30, "refused at once, not after Ray's connect retries"
        run = _index_one(one_clip, tiny_bundle, tmp_path / "z", [head.address], home=elsewhere,
                         RAY_AUTH_TOKEN=STALE_TOKEN)
        assert run.returncode == 0, run.stderr[-3000:]
        assert _ray_dir(elsewhere) == {}


ACTOR_OPTIONS = """
import json, sys
from index.catalogue.ray_connect import connect
from index.catalogue.ray_embed import AudioEmbedder, RayOptions, build_dataset, pool_size
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


RESUMING = """
import logging, sys
from pathlib import Path
from index.catalogue import checkpoint
from index.catalogue.own_audio import index_folder
from index.catalogue.ray_embed import RayOptions

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
folder, bundle, out, address, stop = sys.argv[1:]
if stop == "stop":  # interrupted once the first chunk is saved, as Ctrl-C would
    save = checkpoint.EmbedCheckpoint.save

    def save_then_stop(self, number, chunk):
        save(self, number, chunk)
        raise KeyboardInterrupt

    checkpoint.EmbedCheckpoint.save = save_then_stop
try:
    done = index_folder(Path(folder), Path(bundle), Path(out), ray=RayOptions(address=address, workers=2),
                        chunk_files=14)
except KeyboardInterrupt:
    print("interrupted")
    sys.exit(3)
print(len(done.clip_ids), [rel for rel, _ in done.skipped])
print(dict(done.skipped)["bomb.wav"])
"""


def test_index_on_ray_resumes_from_its_checkpoint(
    ray_address: str, ray_home: Path, sound_folder: Path, tiny_bundle: Path, tmp_path: Path
) -> None:
    """Issue 55: `tonearm index --ray` keeps the content-keyed checkpoint of the other passes, one Ray job a
    chunk. Interrupted after its first chunk of 14 files, the rerun embeds only the other 13 (one more Ray job)
    and writes the single-process bundle; a resampling bomb is skipped under the decode limits on the workers."""
    from tests.index.test_decode_limits import write_resampling_bomb

    folder = tmp_path / "sounds"
    shutil.copytree(sound_folder, folder)
    write_resampling_bomb(folder / "bomb.wav")  # 27 files: 24 sounds, broken.wav, readme.txt, bomb.wav
    local = index_folder(folder, tiny_bundle, tmp_path / "local")
    out = tmp_path / "on-ray"

    def child(stop: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", RESUMING, str(folder), str(tiny_bundle), str(out), ray_address,
                               stop], env=_ray_env(ray_home), capture_output=True, text=True, timeout=300,
                              cwd=Path(__file__).resolve().parents[2])

    first = child("stop")
    assert first.returncode == 3 and "interrupted" in first.stdout, first.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "on-ray.partial").glob("chunk-*.npz")) == ["chunk-000000.npz"]
    second = child("go")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resume: 14 of 27 files reused" in second.stderr, second.stderr[-3000:]
    assert "Ray pass: 13 rows on" in second.stderr and second.stderr.count("Ray pass:") == 1
    count, skipped = second.stdout.splitlines()[0].split(" ", 1)
    assert int(count) == N_FILES and skipped == str([rel for rel, _ in local.skipped]) and len(local.skipped) == 3
    assert "sample rate 2 Hz is below the floor" in second.stdout.splitlines()[1]
    assert not (tmp_path / "on-ray.partial").exists()
    _assert_same_index(out, local.path, "audio")


def test_a_ray_actor_decodes_the_next_group_while_it_encodes_one(tiny_bundle: Path, sound_folder: Path) -> None:
    """Issue 55: an actor decoded its files, then encoded them, one after the other. Its decode thread now
    decodes group g+1 while group g is encoded (no cluster: the actor class called as Ray Data calls it, with
    a decode and an encoder slowed to make the overlap unmistakable); the vectors are the single-process ones."""
    import time as clock

    from index.catalogue.own_audio import decode_file
    from index.catalogue.ray_embed import AUDIO_GROUP_FILES, AudioEmbedder
    from index.runtime.loader import LoadedBundle

    manifest = read_manifest(tiny_bundle)
    paths = sorted(p for p in sound_folder.rglob("clip*.wav"))[: 3 * AUDIO_GROUP_FILES]  # three groups

    def slow_decode(path: Path, rate: int) -> np.ndarray:
        clock.sleep(0.05)
        return decode_file(path, rate)

    class SlowEncoder:
        def __init__(self, encoder: Any) -> None:
            self.encoder = encoder
            self.takes_padding_mask = encoder.takes_padding_mask

        def run(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
            clock.sleep(0.2)
            return self.encoder.run(feeds)  # type: ignore[no-any-return]

    actor = AudioEmbedder((tiny_bundle / manifest.audio_encoder.file).read_bytes(), decode=slow_decode,
                          embed_dim=manifest.embed_dim, sample_rate=manifest.sample_rate,
                          clip_samples=manifest.clip_samples, policy="chunk", threads=1,
                          frontend=manifest.audio_frontend)
    actor.encoder = SlowEncoder(actor.encoder)  # type: ignore[assignment]
    out = actor({"row": np.arange(len(paths)), "path": np.array([str(p) for p in paths], dtype=object)})
    assert list(out["error"]) == [""] * len(paths)
    for group in range(2):
        encoded = [(b, e) for kind, g, b, e in actor.timeline if kind == "encode" and g == group]
        decoded = [(b, e) for kind, g, b, e in actor.timeline if kind == "decode" and g == group + 1]
        assert encoded and len(decoded) == AUDIO_GROUP_FILES
        (began, ended), = encoded[:1]
        assert any(b < ended and e > began for b, e in decoded), (group, actor.timeline)  # beside the encoder
    bundle = LoadedBundle.open(tiny_bundle)
    try:
        want = bundle.encode_audio([decode_file(p, manifest.sample_rate) for p in paths])
    finally:
        bundle.close()
    np.testing.assert_allclose(out["embedding"], want, atol=2e-5)
