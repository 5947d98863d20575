"""Deep verification of a bundle (`tonearm bundle verify`): opens it through the loader.

:func:`index.bundle.format.verify_files` checks files and the schema (the bundle format, lowest
layer); :func:`verify_bundle` adds what needs the encoders and indices loaded (ONNX opsets and
interfaces, dimensions, the tokenizer, index sizes, the held-out set). It sits above
:mod:`index.runtime.loader` (bundle format → backends → loader → verification).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from index.bundle.format import EVAL_DIR, BundleManifest, EvalSetInfo, verify_files
from index.errors import BundleError
from index.runtime.loader import LoadedBundle


def verify_bundle(path: Path | str) -> BundleManifest:
    """Everything `tonearm bundle verify` checks; raises :class:`BundleError` naming the file.

    Checksums and sizes of every file, the manifest schema, ONNX input/output
    names and shapes, embedding dimensions (a probe run of both encoders), the
    tokenizer, index sizes against the id files, and the held-out set's
    consistency with the manifest (each part only when the manifest lists it).
    """
    root = Path(path)
    manifest = verify_files(root)
    _check_onnx_opsets(root, manifest)
    bundle = LoadedBundle.open(root, verify=False)
    try:
        _check_tokenizer(root, manifest, bundle)
        _check_probe(root, manifest, bundle)
        if manifest.eval_set is not None:
            _check_eval_set(root, manifest, manifest.eval_set, bundle)
    finally:
        bundle.close()
    return manifest


def _check_onnx_opsets(root: Path, manifest: BundleManifest) -> None:
    """Opset >= 18 (STFT) when the `onnx` package is installed (it is not needed to serve)."""
    try:
        import onnx
    except ImportError:
        return
    for info in (manifest.audio_encoder, manifest.text_encoder):
        model = onnx.load(str(root / info.file), load_external_data=False)
        opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
        if opset < 18:
            raise BundleError(f"{root / info.file}: ONNX opset {opset} < 18")


def _check_tokenizer(root: Path, manifest: BundleManifest, bundle: Any) -> None:
    tok = bundle.tokenizer
    if (tok.max_length, tok.vocab_size) != (manifest.tokenizer.max_length, manifest.tokenizer.vocab_size):
        raise BundleError(
            f"{root / manifest.tokenizer.file}: max_length/vocab_size {tok.max_length}/{tok.vocab_size} "
            f"!= manifest {manifest.tokenizer.max_length}/{manifest.tokenizer.vocab_size}"
        )


def _check_probe(root: Path, manifest: BundleManifest, bundle: Any) -> None:
    """Both encoders produce finite unit vectors of width ``embed_dim``."""
    probes = {
        manifest.text_encoder.file: bundle.encode_text([f"probe {lang}" for lang in manifest.languages]),
        manifest.audio_encoder.file: bundle.encode_audio(
            [np.zeros(manifest.clip_samples // 2, np.float32), np.full(manifest.clip_samples + 7, 0.1, np.float32)]
        ),
    }
    for name, emb in probes.items():
        if emb.ndim != 2 or emb.shape[1] != manifest.embed_dim or not np.all(np.isfinite(emb)):
            raise BundleError(f"{root / name}: output shape {emb.shape} / non-finite values, expected (n, {manifest.embed_dim})")


def _check_eval_set(root: Path, manifest: BundleManifest, info: EvalSetInfo, bundle: Any) -> None:
    eval_set = bundle.eval_set()
    where = root / EVAL_DIR
    if (len(eval_set.clip_ids), len(eval_set.captions)) != (info.n_clips, info.n_captions):
        raise BundleError(
            f"{where}: {len(eval_set.clip_ids)} clips / {len(eval_set.captions)} captions, "
            f"manifest says {info.n_clips} / {info.n_captions}"
        )
    stray = sorted(set(eval_set.lang.tolist()) - set(manifest.languages))
    if stray:
        raise BundleError(f"{where}: captions in languages {stray} outside the bundle's {manifest.languages}")
