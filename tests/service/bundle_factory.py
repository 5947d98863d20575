"""Real bundles for service tests: exported from tiny checkpoints, plus deliberately broken ones."""

from __future__ import annotations

import json
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.conftest import TINY_CONFIG


@dataclass(frozen=True)
class RealBundles:
    root: Path
    """Bundles directory holding ``a``, ``b`` and ``worse``."""
    a: Path
    b: Path
    worse: Path
    corpus: Path
    """Manifest of the tiny corpus the bundles index."""

    def id(self, which: str) -> str:
        return getattr(self, which).name


def train_checkpoint(manifest: Path, out_dir: Path, overrides: list[str]) -> Path:
    from training.config import load_train_config
    from training.loop import train

    cfg = load_train_config(TINY_CONFIG, [f"data.manifest={manifest}", f"out_dir={out_dir}", *overrides])
    return train(cfg) / "best"


def export(checkpoint: Path, manifest: Path, out_dir: Path) -> Path:
    from training.bundle.export import export_bundle

    return export_bundle(checkpoint, manifest=manifest, out_dir=out_dir, progress=False)


def _constant_audio_encoder(path: Path, vector: np.ndarray) -> None:
    """An ONNX audio encoder with the bundle's interface that maps every waveform to ``vector``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    d = vector.shape[0]
    nodes = [
        helper.make_node("ReduceSum", ["waveform", "axis"], ["total"], keepdims=1),
        helper.make_node("Mul", ["total", "zero"], ["zeros"]),
        helper.make_node("Add", ["zeros", "row"], ["embedding"]),
    ]
    graph = helper.make_graph(
        nodes,
        "collapsed_audio",
        [helper.make_tensor_value_info("waveform", TensorProto.FLOAT, ["batch", "samples"])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", d])],
        initializer=[
            numpy_helper.from_array(np.array([1], dtype=np.int64), "axis"),
            numpy_helper.from_array(np.zeros((1, 1), dtype=np.float32), "zero"),
            numpy_helper.from_array(vector.reshape(1, d).astype(np.float32), "row"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def collapsed_copy(src: Path, parent: Path, bundle_id: str) -> Path:
    """A worse bundle: ``src`` with an audio encoder that embeds every clip identically.

    With pessimistic ties every text→audio rank is the worst one, so recall and mAP
    collapse on any held-out set — a regression the gate must refuse.
    """
    from index.bundle import format as fmt

    manifest = fmt.read_manifest(src)
    with fmt.staged_bundle(parent, bundle_id) as staging:
        for rel in manifest.files:
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, staging / rel)
        vector = np.zeros(manifest.embed_dim, dtype=np.float32)
        vector[0] = 1.0
        _constant_audio_encoder(staging / manifest.audio_encoder.file, vector)
        return fmt.publish(staging, manifest.model_copy(update={"bundle_id": bundle_id}))


def copy_bundle(src: Path, parent: Path) -> Path:
    dst = parent / src.name
    shutil.copytree(src, dst)
    for path in dst.rglob("*"):
        path.chmod(path.stat().st_mode | stat.S_IWUSR)
    return dst


def tamper(bundle: Path) -> Path:
    """Change one byte of the caption id file (same size: only the sha256 can tell)."""
    target = bundle / "text_ids.jsonl"
    data = bytearray(target.read_bytes())
    first = json.loads(data.splitlines()[0])
    position = data.index(first["text"][0].encode())
    data[position] = ord("X") if data[position] != ord("X") else ord("Y")
    target.write_bytes(bytes(data))
    return bundle


def build_real_bundles(*, tiny_corpus: Path, tiny_bundle: Path, work: Path) -> RealBundles:
    """Bundle a (the shared tiny bundle), b (retrained with seed 1), worse (collapsed copy of a)."""
    root = work / "bundles"
    root.mkdir()
    a = copy_bundle(tiny_bundle, root)
    b_ckpt = train_checkpoint(tiny_corpus, work / "run-seed1", ["seed=1"])
    b = export(b_ckpt, tiny_corpus, root)
    worse = collapsed_copy(a, root, "worse-" + a.name)
    return RealBundles(root=root, a=a, b=b, worse=worse, corpus=tiny_corpus)


def renamed_copy(src: Path, parent: Path, bundle_id: str) -> Path:
    """``src`` republished under another bundle id: the same encoders, indices and held-out set
    (a candidate exactly as good as ``src``)."""
    from index.bundle import format as fmt

    manifest = fmt.read_manifest(src)
    with fmt.staged_bundle(parent, bundle_id) as staging:
        for rel in manifest.files:
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, staging / rel)
        return fmt.publish(staging, manifest.model_copy(update={"bundle_id": bundle_id}))
