"""`tonearm export` and `export --pretrained` resume an interrupted clips pass (issue 41), as `tonearm index`
does (tests/index/test_index_resume.py): the pass checkpoints its vectors in chunks in
``OUT/.<name>-<8 hex>.partial/`` (:mod:`index.catalogue.checkpoint`, :func:`training.bundle.parts.embed_clips`).

For `tonearm export` the interruption is a real one: the export runs in a child process that is
killed with SIGKILL once its second chunk is on disk (the child's only change is that it waits there,
so the kill lands at a known point). The same export run again in this process decodes only the clips
of the chunks not yet written, removes the folder once the bundle is published, and the bundle equals
its uninterrupted twin (a fresh export of the same inputs): same ids and uris row by row, same clip
and caption vectors.

Cost (AMD EPYC, 2 cores; measured with and without other jobs on the cores): the trained test 3–10 s
(the session's tiny checkpoint, 48 clips in chunks of 8; three exports, one of them in the killed
child), the pretrained one 6–20 s (the small random ClapModel of tests/training/test_pretrained_quantize.py,
6 clips in chunks of 2: two exports, interrupted in this process by a KeyboardInterrupt once two chunks
are saved, and an uninterrupted clips pass as the twin), the plan test < 0.1 s.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from index.bundle import format as fmt
from index.catalogue.checkpoint import Chunk, EmbedCheckpoint, content_key
from index.engines.faiss_index import all_vectors, load_index, parse_factory
from index.languages import DEFAULT_LANGUAGES
from training.bundle import export, pretrained
from training.bundle.parts import catalogue_checkpoint
from training.data.manifest import load_manifest

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import sys
from pathlib import Path

from index.catalogue import checkpoint as embed_checkpoint

save = embed_checkpoint.EmbedCheckpoint.save


def save_then_wait(self, number, chunk):
    save(self, number, chunk)
    if number == 1:  # two chunks on disk: tell the parent, which kills this process while it waits here
        print("chunk 1 saved", flush=True)
        sys.stdin.read()


embed_checkpoint.EmbedCheckpoint.save = save_then_wait
kind, source, manifest, out, chunk = sys.argv[1:]
if kind == "trained":
    from training.bundle.export import export_bundle

    export_bundle(source, manifest=manifest, out_dir=out, progress=False, chunk_files=int(chunk))
else:
    from training.bundle.pretrained import export_pretrained_bundle

    export_pretrained_bundle(source, manifest=manifest, out_dir=out, progress=False, chunk_files=int(chunk))
"""


def kill_after_two_chunks(kind: str, source: Path, manifest: Path, out: Path, chunk: int) -> Path:
    """Run the export in a child process, SIGKILL it once two chunks are written; the chunk folder."""
    log = out.parent / f"{out.name}-child.log"
    with log.open("w") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, kind, str(source), str(manifest), str(out), str(chunk)], cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=stderr, text=True,
        )
        try:
            line = child.stdout.readline()  # type: ignore[union-attr]
            child.send_signal(signal.SIGKILL)
        finally:
            child.kill()
            child.communicate()
    assert line == "chunk 1 saved\n", log.read_text()
    assert child.returncode == -signal.SIGKILL
    (partial,) = [p for p in out.iterdir() if p.name.endswith(".partial")]
    assert sorted(p.name for p in partial.glob("chunk-*.npz")) == ["chunk-000000.npz", "chunk-000001.npz"]
    assert not [p for p in out.iterdir() if not p.name.startswith(".")]  # nothing published
    return partial


def counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[str]:
    """Every call of ``module.name`` (the real function) recorded by its first argument."""
    real: Callable[..., Any] = getattr(module, name)
    calls: list[str] = []

    def counted(source: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(str(source))
        return real(source, *args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def vectors(bundle: Path) -> tuple[np.ndarray, np.ndarray]:
    manifest = fmt.read_manifest(bundle)
    found = []
    for info in (manifest.audio_index, manifest.text_index):
        assert info is not None
        spec = parse_factory(info.factory, info.dim)
        found.append(all_vectors(load_index(bundle / info.file, spec=spec, search_params={})))
    return found[0], found[1]


def assert_twins(resumed: Path, twin: Path) -> None:
    for name in (fmt.AUDIO_IDS, fmt.TEXT_IDS):
        assert (resumed / name).read_text() == (twin / name).read_text()
    for got, want in zip(vectors(resumed), vectors(twin), strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_an_interrupted_export_resumes_and_equals_its_uninterrupted_twin(
    tiny_checkpoint: Path, tiny_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunk = 8
    partial = kill_after_two_chunks("trained", tiny_checkpoint, tiny_corpus, tmp_path / "resumed", chunk)
    decoded = counting(monkeypatch, export, "load_eval_waveform")
    twin = export.export_bundle(tiny_checkpoint, manifest=tiny_corpus, out_dir=tmp_path / "twin", progress=False,
                                chunk_files=chunk)
    twin_decodes = len(decoded)
    decoded.clear()
    resumed = export.export_bundle(tiny_checkpoint, manifest=tiny_corpus, out_dir=tmp_path / "resumed",
                                   progress=False, chunk_files=chunk)
    assert len(decoded) == twin_decodes - 2 * chunk  # the two finished chunks were loaded, not embedded
    assert not partial.exists() and not list((tmp_path / "twin").glob("*.partial"))
    assert_twins(resumed, twin)
    assert fmt.read_manifest(twin).audio_index.ntotal == 48  # six chunks, two of them resumed


def test_an_interrupted_pretrained_export_resumes_and_equals_its_uninterrupted_twin(
    real_manifest: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through `export --pretrained`, interrupted in this process (Ctrl-C once two chunks are
    on disk); the twin is an uninterrupted clips pass with the bundle's own encoders (no checkpoint)."""
    from tests.training.test_pretrained_quantize import write_small_clap

    chunk = 2
    folder = write_small_clap(tmp_path / "small_clap")
    save = EmbedCheckpoint.save
    saved: list[int] = []

    def save_then_stop(self: EmbedCheckpoint, number: int, done: Chunk) -> None:
        save(self, number, done)
        saved.append(number)
        if number == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(EmbedCheckpoint, "save", save_then_stop)
    out = tmp_path / "bundles"
    with pytest.raises(KeyboardInterrupt):
        pretrained.export_pretrained_bundle(folder, manifest=real_manifest, out_dir=out, progress=False,
                                            chunk_files=chunk)
    (partial,) = out.glob(".pretrained-small_clap-*.partial")
    assert sorted(p.name for p in partial.glob("chunk-*.npz")) == ["chunk-000000.npz", "chunk-000001.npz"]

    saved.clear()
    monkeypatch.setattr(EmbedCheckpoint, "save", lambda self, number, done: (
        self.folder.name.endswith(".partial") and saved.append(number)) or save(self, number, done))
    resumed = pretrained.export_pretrained_bundle(folder, manifest=real_manifest, out_dir=out, progress=False,
                                                  chunk_files=chunk)
    assert saved == [2]  # chunks 0 and 1 were loaded, only chunk 2 embedded (caption chunks not counted)
    assert not partial.exists()

    model = pretrained.load_pretrained(folder)
    encoders = pretrained.PretrainedEncoders(model, resumed / fmt.AUDIO_ENCODER, resumed / fmt.TEXT_ENCODER)
    records = load_manifest(real_manifest, languages=DEFAULT_LANGUAGES)
    twin = pretrained.embed_catalogue_audio(encoders, records, model.settings.sample_rate, no_progress,
                                            chunk_files=chunk).embeddings
    assert twin.shape == (6, encoders.dim)
    np.testing.assert_allclose(vectors(resumed)[0], twin, atol=1e-6)
    assert [json.loads(line)["id"] for line in (resumed / fmt.AUDIO_IDS).read_text().splitlines()] == [
        r.id for r in records]


def no_progress(_n: int, /, *, resumed: bool = False) -> None:
    return None


def test_a_corrupt_clip_mid_pass_keeps_every_earlier_chunk(
    tiny_checkpoint: Path, tiny_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 49: clip 20 of 48 (chunk 2 of 8-clip chunks) cannot be decoded; the pass is then interrupted
    after chunk 3. Every chunk written stays (none deleted for the bad clip), the rerun embeds only the
    clips of chunks 4 and 5, and the bundle lists the bad clip in ``skipped_clips``, without it in either
    index (its captions left out of the caption index too)."""
    corpus = tmp_path / "corpus"
    shutil.copytree(tiny_corpus.parent, corpus)
    manifest = corpus / tiny_corpus.name
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    bad = rows[20]
    (corpus / bad["audio"]).write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt garbage")
    chunk, save, saved = 8, EmbedCheckpoint.save, []

    def save_then_stop(self: EmbedCheckpoint, number: int, done: Chunk) -> None:
        save(self, number, done)
        saved.append(number)
        if number == 3 and self.folder.name.endswith(".partial"):
            raise KeyboardInterrupt

    monkeypatch.setattr(EmbedCheckpoint, "save", save_then_stop)
    out = tmp_path / "bundles"
    with pytest.raises(KeyboardInterrupt):
        export.export_bundle(tiny_checkpoint, manifest=manifest, out_dir=out, progress=False, chunk_files=chunk)
    (partial,) = out.glob(".*.partial")
    assert sorted(p.name for p in partial.glob("chunk-*.npz")) == [f"chunk-{n:06d}.npz" for n in range(4)]
    with np.load(partial / "chunk-000002.npz") as data:
        assert list(data["skipped_rel"]) == [bad["id"]] and len(data["clip_ids"]) == chunk - 1

    monkeypatch.setattr(EmbedCheckpoint, "save", save)
    decoded = counting(monkeypatch, export, "load_eval_waveform")
    bundle = export.export_bundle(tiny_checkpoint, manifest=manifest, out_dir=out, progress=False, chunk_files=chunk)
    catalogue = [str(corpus / r["audio"]) for r in rows]
    assert [d for d in decoded if d in catalogue[:32]] == []  # chunks 0-3 (the bad clip's too) reused
    assert not partial.exists()
    body = fmt.read_manifest(bundle)
    assert [(s.id, "garbage" in s.reason or "fmt" in s.reason or bool(s.reason)) for s in body.skipped_clips or []] == [
        (bad["id"], True)]
    ids = [json.loads(line)["id"] for line in (bundle / fmt.AUDIO_IDS).read_text().splitlines()]
    assert ids == [r["id"] for r in rows if r["id"] != bad["id"]] and body.audio_index.ntotal == 47
    assert bad["id"] not in {json.loads(line)["clip_id"] for line in (bundle / fmt.TEXT_IDS).read_text().splitlines()}


def test_the_pass_digest_covers_the_encoder_and_the_preparation_and_keys_cover_content(tmp_path: Path) -> None:
    """Chunks are reused only under the same pass digest (another encoder, provider, preparation or precision
    gives another), and per clip by its content key: bytes, not the name or mtime."""
    encoder, audio = tmp_path / "audio_encoder.onnx", tmp_path / "a.wav"
    encoder.write_bytes(b"graph")
    audio.write_bytes(b"RIFF0000")

    def digest(*, providers: tuple[str, ...] = ("CPUExecutionProvider",), frontend: dict[str, Any] | None = None,
               precision: str = "fp32") -> str:
        return catalogue_checkpoint(tmp_path / "out", encoder, providers=providers,
                                    frontend=frontend or {"padding": "pad"}, precision=precision).digest

    first = digest()
    assert digest() == first
    others = [digest(providers=("CUDAExecutionProvider",)), digest(frontend={"padding": "repeat"}),
              digest(precision="fp16")]
    (tmp_path / "audio_encoder.onnx.data").write_bytes(b"weights")  # external data counts
    others.append(digest())
    assert len({first, *others}) == 1 + len(others)

    key = content_key(audio)
    os.utime(audio, ns=(0, 10**18))
    (tmp_path / "b.wav").write_bytes(audio.read_bytes())
    assert content_key(audio) == key == content_key(tmp_path / "b.wav")  # mtime and name: same key
    big = tmp_path / "big.wav"
    body = bytearray(np.random.default_rng(0).bytes(300_000))
    big.write_bytes(bytes(body))
    before = content_key(big)
    body[-1] ^= 1  # the last byte changed
    big.write_bytes(bytes(body))
    assert content_key(big) != before
