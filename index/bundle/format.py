"""The bundle format (docs/bundle.md): manifest schema, checksums, atomic publication.

A bundle is a directory that is never modified once published. Its
``manifest.json`` describes everything the service needs and lists the sha256
and size of every other file; the manifest protects itself with a
``manifest_sha256`` computed over its own bytes with that value zeroed, so a
changed byte in *any* file of the bundle is detected and named.

Publication is atomic: files are written into a hidden staging directory beside
the destination, fsynced (files, then the directory), and the directory is
renamed into place. Readers therefore see either no bundle or a complete one.

:func:`verify_files` checks files and the schema; :func:`index.runtime.verify.verify_bundle` adds
the deep checks of `tonearm bundle verify` (ONNX interfaces, dimensions, index sizes, held-out
set) through the loader. This module is the lowest layer above :mod:`index.errors`: it imports
no backend and not the loader (bundle format → backends → loader → verification).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from index.errors import BundleError
from index.ids import check_catalogue_ids

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
AUDIO_ENCODER = "audio_encoder.onnx"
TEXT_ENCODER = "text_encoder.onnx"
TOKENIZER = "tokenizer.json"
AUDIO_INDEX = "audio.faiss"
AUDIO_IDS = "audio_ids.jsonl"
TEXT_INDEX = "text.faiss"
TEXT_IDS = "text_ids.jsonl"
EVAL_DIR = "eval"
MOMENT_HEAD = "moment_head.onnx"
MOMENT_HEAD_INFO = "moment_head.json"

_ZERO_HASH = "0" * 64
OMITTED_WHEN_NONE = ("catalogue_pass", "skipped_clips", "moment_head")
"""Manifest fields added after format version 1 was fixed: written only when set."""
_HASH_KEY = '"manifest_sha256": "'
_CHUNK = 1 << 20
_READ_ONLY = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(_Frozen):
    """Checksum of one bundle file."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)


class SourceInfo(_Frozen):
    """Where the encoders came from."""

    checkpoint: str
    """Checkpoint directory as given to `tonearm export`."""
    run_name: str
    config_hash: str
    """sha256 of the checkpoint's resolved training config (canonical JSON)."""
    weights_sha256: str
    """sha256 of the checkpoint's ``model.safetensors``."""
    data_manifest: str
    """The manifest whose clips were indexed (`tonearm index`: the audio directory)."""
    audio_root: str | None = None
    """Directory clip uris are relative to; None: the data manifest's directory."""


class EncoderInfo(_Frozen):
    """One ONNX encoder file and its interface."""

    file: str
    opset: int
    inputs: list[str]
    outputs: list[str]
    quantization: Literal["none", "dynamic-int8", "fp16"] = "none"
    """How this file's weights are stored; its agreement with fp32 is in ``manifest.quantization``."""
    parity_min_cosine: float
    """Lowest ONNX-vs-PyTorch cosine over the export check's items."""


class TokenizerInfo(_Frozen):
    file: str
    max_length: int = Field(ge=1)
    vocab_size: int = Field(ge=1)


class IndexInfo(_Frozen):
    """One FAISS index: the factory string is its whole configuration."""

    file: str
    ids_file: str
    factory: str
    metric: Literal["inner_product"] = "inner_product"
    dim: int = Field(ge=1)
    ntotal: int = Field(ge=0)
    search_params: dict[str, int] = Field(default_factory=dict)
    """Fixed at load time (``nprobe`` / ``efSearch``), never changed per request."""
    ann_recall_at_10: float = Field(ge=0, le=1)
    """Build-time recall@10 against exact search (tie-tolerant)."""
    language_ranges: dict[str, tuple[int, int]] | None = None
    """Text index only: captions are stored grouped by language, ``[start, end)`` rows."""


class EvalSetInfo(_Frozen):
    """The held-out multilingual evaluation set stored under ``eval/``."""

    split: str
    n_clips: int = Field(ge=0)
    n_captions: int = Field(ge=0)
    max_clips: int
    eval_crop: Literal["center", "chunk"]


class EvaluationInfo(_Frozen):
    """The metrics report (docs/metrics.md) on the held-out set, computed with the bundle's ONNX encoders."""

    encoder: Literal["onnx"] = "onnx"
    report: dict[str, float]
    convention: str
    fp32_text_report: dict[str, float] | None = None
    """With quantized encoders (text and/or audio): the same report with the fp32 encoders."""
    quantization_delta: dict[str, float] | None = None
    """With quantized encoders: quantized minus fp32, for every recall / mAP key (fractions)."""


class QuantizationAgreement(_Frozen):
    """Per-item cosine between a quantized encoder's and the fp32 encoder's embeddings (held-out items)."""

    min_cosine: float
    mean_cosine: float
    items: int = Field(ge=0)


class QuantizationInfo(_Frozen):
    """Quantized encoders and what they cost against fp32 (training.bundle.quantize, docs/bundle.md)."""

    precision: Literal["int8", "fp16"]
    encoders: list[Literal["text", "audio"]]
    agreement: dict[str, QuantizationAgreement]
    """Per quantized encoder (``text``, ``audio``): cosine to fp32 over the held-out captions / clips."""
    recall_drop_points: dict[str, float]
    """fp32 minus quantized held-out R@1 / R@10 (means over languages), in points."""
    max_r10_drop: float
    """The export's limit on the R@10 drop (points)."""
    on_loss: Literal["refuse", "warn"]
    within_limit: bool
    """False only when the export was told to warn instead of refusing."""


class AudioFrontendInfo(_Frozen):
    """How a pretrained model's own feature extractor prepares audio (`tonearm export --pretrained`).

    The loader pads clips shorter than ``clip_samples`` with ``padding``
    (:mod:`index.audio.frontend`) before the audio encoder, whose graph computes the
    extractor's features; clips longer than ``clip_samples`` are chunked and averaged
    (``long_clips``) where the extractor would take a random crop or the whole clip
    (``model_truncation``). ``reflect`` (PE-Audio) pads a short clip by reflection to the next
    multiple of ``pad_multiple`` samples and embeds it at that length, not at ``clip_samples``.
    """

    source: Literal["clap_feature_extractor", "pe_audio_feature_extractor", "ast_feature_extractor"] = (
        "clap_feature_extractor")
    padding: Literal["repeatpad", "repeat", "pad", "reflect", "frames"]
    pad_multiple: int | None = Field(default=None, ge=1)
    """``reflect`` only: short clips are padded to a multiple of this many samples (the hop)."""
    long_clips: Literal["chunk", "whole"] = "chunk"
    """``chunk``: clips longer than ``clip_samples`` are the L2-normalised mean of their windows;
    ``whole`` (PE-Audio bundles, ``reflect`` padding only): one window of the clip's own length, reflect-padded
    to ``pad_multiple`` — the model's own forward (docs/models.md, "PE-Audio: long clips"). Bundles made
    before this field could say ``whole`` read as ``chunk``, which is what they did."""
    model_truncation: str
    """The extractor's own setting for long clips, replaced by ``long_clips`` (deterministic)."""

    @model_validator(mode="after")
    def _multiple_for_reflect(self) -> AudioFrontendInfo:
        if (self.padding == "reflect") != (self.pad_multiple is not None):
            raise ValueError("audio_frontend.pad_multiple is set exactly when padding is 'reflect'")
        if self.long_clips == "whole" and self.padding != "reflect":
            raise ValueError("audio_frontend.long_clips 'whole' needs padding 'reflect' (a model of any input length)")
        return self


class MilvusOnlyInfo(_Frozen):
    """An index-only bundle whose vectors went straight to Milvus (`tonearm index --ray --milvus-uri`).

    The bundle holds no FAISS file (``audio_index.file`` is empty): it is served only with the
    Milvus backend. Its ids, encoders and tokenizer are local as in any bundle."""

    uri: str
    """Where it was published (the service reads the Milvus its own settings name)."""
    index_type: str
    """Milvus index type of the collection (``FLAT``, ``HNSW``, ``IVF_FLAT``, ``AUTOINDEX``)."""
    gaps: list[int] = Field(default_factory=list)
    """Collection keys with no vector: files that passed the format check but did not decode
    (normally none). Bundle row ``r`` is the ``r``-th key not listed here."""


class CataloguePassInfo(_Frozen):
    """A catalogue embedded by half-precision copies of the bundle's encoders (`--precision fp16`,
    :mod:`index.catalogue.half_precision`); the bundle's own encoder files stay fp32 and embed the queries.
    Absent (None): the catalogue was embedded by the encoder files as stored."""

    precision: Literal["fp16"]
    device: Literal["cuda", "cpu"]
    parity_min_centred_cosine: dict[str, float]
    """Per encoder (``audio``, ``text``): lowest centred cosine fp16 vs fp32 over the probe set."""
    probe_items: dict[str, int]
    """Per encoder: items in the probe set."""
    min_centred_cosine: float
    """The gate the pass held each encoder to."""


class SkippedClip(_Frozen):
    """A catalogue clip the pass could not decode: not in the index (issue 49)."""

    id: str
    reason: str


class MomentsInfo(_Frozen):
    """Window embeddings of the recordings longer than one window (SPEC §19, :mod:`index.moments.windows`)."""

    windows_file: str
    """``(W, d)`` float32, L2-normalized window vectors, grouped by recording in time order."""
    spans_file: str
    """``(W, 3)`` float64: the recording's row in ``audio_ids.jsonl``, start and end in seconds."""
    window_seconds: float = Field(gt=0)
    hop_seconds: float = Field(gt=0)
    n_windows: int = Field(ge=0)
    n_recordings: int = Field(ge=0)
    heldout: dict[str, float] | None = None
    """The sliding-window baseline's moment report (docs/metrics.md, "Moments") on the held-out split's
    recordings with moments in the data manifest; None when it has none."""


class MomentHeadInfo(_Frozen):
    """A trained temporal moment head (`tonearm train-moments`, docs/objectives.md "Moments"): the service scores
    moments with it instead of the sliding windows (docs/service.md, "Moments")."""

    file: str = MOMENT_HEAD
    """The head's ONNX graph (:mod:`index.moments.head`)."""
    info_file: str = MOMENT_HEAD_INFO
    """Its JSON description; its ``encoder_sha256`` must equal this section's."""
    encoder_sha256: dict[str, str]
    """sha256 of the audio and text encoder files whose embeddings the head was trained on; checked against
    this bundle's ``files`` at load (:func:`check_moment_head`): a head trained for other encoders is refused."""
    embed_dim: int = Field(ge=1)
    window_seconds: float = Field(gt=0)
    hop_seconds: float = Field(gt=0)
    source_bundle: str
    """The bundle it was trained on and added to (this bundle is that one plus the head)."""
    training: dict[str, Any] = Field(default_factory=dict)
    """How it was trained (data manifest, split, seed, steps, examples)."""
    heldout: dict[str, float] | None = None
    """The head's moment report on the same held-out queries as ``moments.heldout`` (the sliding windows'):
    both scorers side by side; None when the head was trained without a held-out split with moments."""


class BundleManifest(_Frozen):
    """Schema of ``manifest.json`` (docs/bundle.md)."""

    format_version: Literal[1] = 1
    bundle_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    created: str
    """UTC ISO-8601 timestamp."""
    source: SourceInfo
    train_config: dict[str, Any]
    objective: dict[str, Any]
    frontend: dict[str, Any]
    embed_dim: int = Field(ge=1)
    languages: list[str] = Field(min_length=1)
    sample_rate: int = Field(ge=1)
    clip_seconds: float = Field(gt=0)
    clip_samples: int = Field(ge=1)
    audio_encoder: EncoderInfo
    text_encoder: EncoderInfo
    tokenizer: TokenizerInfo
    audio_index: IndexInfo
    text_index: IndexInfo | None = None
    """None in an index-only bundle (`tonearm index`): no captions, so no audio→text search."""
    eval_set: EvalSetInfo | None = None
    """None in an index-only bundle: no held-out set (the quality gate cannot compare it)."""
    evaluation: EvaluationInfo | None = None
    quantization: QuantizationInfo | None = None
    """Quantized encoders and their measured agreement with fp32; None: both encoders fp32."""
    audio_frontend: AudioFrontendInfo | None = None
    """Pretrained bundles only: the model's own short-clip padding; None: zero padding."""
    milvus_only: MilvusOnlyInfo | None = None
    """Set when the vectors live only in Milvus (no FAISS file); None: the bundle's own index."""
    catalogue_pass: CataloguePassInfo | None = None
    """Set when the catalogue was embedded in fp16 (`--precision fp16`); None: by the encoders as stored."""
    skipped_clips: list[SkippedClip] | None = None
    """Catalogue clips that could not be decoded, with the reason (not indexed); None: every clip was."""


    moments: MomentsInfo | None = None
    """Set when the catalogue's long recordings are indexed as windows; None: clips only."""
    moment_head: MomentHeadInfo | None = None
    """Set when the bundle carries a trained moment head (`tonearm train-moments`); None: sliding windows."""
    files: dict[str, FileEntry]
    manifest_sha256: str = _ZERO_HASH
    """sha256 of this file's bytes with this value replaced by 64 zeros."""

    @model_validator(mode="after")
    def _padding_mask_for_whole_clips(self) -> BundleManifest:
        # audio_encoder.inputs [waveform, padding_mask]: the encoder runs clips of different lengths in
        # one call, zero-padded behind the mask (PE-Audio's length buckets, index.runtime.loader.encode_waveforms);
        # only a bundle that embeds clips whole pads them so. [waveform] alone: one length a call.
        if "padding_mask" in self.audio_encoder.inputs and (
                self.audio_frontend is None or self.audio_frontend.long_clips != "whole"):
            raise ValueError("audio_encoder.inputs has padding_mask, which needs audio_frontend.long_clips 'whole'")
        return self


# ----------------------------------------------------------------------------- checksums


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def bundle_files(root: Path) -> list[str]:
    """Every regular file under ``root`` except the manifest, as sorted POSIX relative paths."""
    found = [
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.relative_to(root).as_posix() != MANIFEST_NAME
    ]
    return sorted(found)


def checksum_files(root: Path) -> dict[str, FileEntry]:
    """``{relative path: FileEntry}`` for every file of a (staging) bundle directory."""
    return {
        rel: FileEntry(sha256=sha256_file(root / rel), size=(root / rel).stat().st_size)
        for rel in bundle_files(root)
    }


def check_files(root: Path, files: dict[str, FileEntry]) -> None:
    """Raise :class:`BundleError` naming the first missing, extra, resized or changed file."""
    present = set(bundle_files(root))
    for rel in sorted(set(files) - present):
        raise BundleError(f"{root / rel}: listed in {MANIFEST_NAME} but missing")
    for rel in sorted(present - set(files)):
        raise BundleError(f"{root / rel}: not listed in {MANIFEST_NAME} (bundles are immutable)")
    for rel, entry in files.items():
        path = root / rel
        size = path.stat().st_size
        if size != entry.size:
            raise BundleError(f"{path}: size {size} != {entry.size} recorded in {MANIFEST_NAME}")
        if sha256_file(path) != entry.sha256:
            raise BundleError(f"{path}: sha256 mismatch (file changed or corrupted)")


# ----------------------------------------------------------------------------- manifest io


def _self_hash(raw: bytes, claimed: str) -> str:
    """sha256 of the manifest bytes with the claimed self-hash zeroed."""
    marker = (_HASH_KEY + claimed + '"').encode()
    if raw.count(marker) != 1:
        return ""
    return hashlib.sha256(raw.replace(marker, (_HASH_KEY + _ZERO_HASH + '"').encode())).hexdigest()


def manifest_bytes(manifest: BundleManifest) -> bytes:
    """Serialized manifest with its self-hash filled in."""
    body = manifest.model_copy(update={"manifest_sha256": _ZERO_HASH}).model_dump(mode="json")
    for key in OMITTED_WHEN_NONE:  # a bundle without them is byte-for-byte what readers before them read
        if body.get(key) is None:
            body.pop(key, None)
    raw = (json.dumps(body, indent=2, ensure_ascii=False, sort_keys=False) + "\n").encode()
    digest = hashlib.sha256(raw).hexdigest()
    return raw.replace((_HASH_KEY + _ZERO_HASH + '"').encode(), (_HASH_KEY + digest + '"').encode())


def read_manifest(root: Path) -> BundleManifest:
    """Parse and self-check ``manifest.json`` (schema + self-hash); file checksums are not read."""
    path = root / MANIFEST_NAME
    if not root.is_dir():
        raise BundleError(f"{root}: bundle directory not found")
    if not path.is_file():
        raise BundleError(f"{path}: missing (not a bundle directory?)")
    raw = path.read_bytes()
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BundleError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(body, dict):
        raise BundleError(f"{path}: top level must be an object")
    claimed = str(body.get("manifest_sha256", ""))
    if _self_hash(raw, claimed) != claimed:
        raise BundleError(f"{path}: manifest_sha256 mismatch (file changed or corrupted)")
    try:
        return BundleManifest.model_validate(body)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()[:5])
        raise BundleError(f"{path}: invalid manifest: {problems}") from None


def verify_files(root: Path) -> BundleManifest:
    """Manifest schema and self-hash, then every file's size and sha256."""
    root = Path(root)
    manifest = read_manifest(root)
    check_files(root, manifest.files)
    return manifest


# ----------------------------------------------------------------------------- moment head


def encoder_digests(manifest: BundleManifest) -> dict[str, str]:
    """``{"audio": sha256, "text": sha256}`` of the bundle's encoder files (what a moment head is trained on)."""
    out = {}
    for kind, encoder in (("audio", manifest.audio_encoder), ("text", manifest.text_encoder)):
        entry = manifest.files.get(encoder.file)
        if entry is None:
            raise BundleError(f"bundle {manifest.bundle_id}: {encoder.file} is not listed in {MANIFEST_NAME}")
        out[kind] = entry.sha256
    return out


def check_moment_head(root: Path, manifest: BundleManifest) -> None:
    """Raise :class:`BundleError` unless the bundle's moment head (if any) was trained on its own encoders,
    for its embedding width and its moment windows' window and hop."""
    head = manifest.moment_head
    if head is None:
        return
    where = Path(root) / MANIFEST_NAME
    try:
        described = json.loads((Path(root) / head.info_file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BundleError(f"{Path(root) / head.info_file}: cannot read the moment head's description ({err})") from None
    if described.get("encoder_sha256") != dict(head.encoder_sha256):
        raise BundleError(f"{Path(root) / head.info_file}: encoder_sha256 differs from moment_head.encoder_sha256 "
                          f"in {where}")
    own = encoder_digests(manifest)
    for kind in ("audio", "text"):
        trained = head.encoder_sha256.get(kind)
        if trained != own[kind]:
            raise BundleError(
                f"{where}: the moment head was trained on another {kind} encoder (sha256 {str(trained)[:12]}…, this "
                f"bundle's {own[kind][:12]}…, from {head.source_bundle}): its scores mean nothing here; train one "
                "for this bundle with `tonearm train-moments`")
    if head.embed_dim != manifest.embed_dim:
        raise BundleError(f"{where}: moment head embed_dim {head.embed_dim} != the bundle's {manifest.embed_dim}")
    moments = manifest.moments
    if moments is not None and (abs(moments.window_seconds - head.window_seconds) > 1e-6
                                or abs(moments.hop_seconds - head.hop_seconds) > 1e-6):
        raise BundleError(f"{where}: moment head trained on {head.window_seconds} s windows every {head.hop_seconds} s, "
                          f"the bundle's are {moments.window_seconds} s every {moments.hop_seconds} s")


def _link_or_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)  # bundles are read-only once published: sharing the inode changes neither
    except OSError:
        shutil.copy2(source, target)


def publish_with_moment_head(source: Path, head_dir: Path, parent: Path, bundle_id: str, *,
                             training: dict[str, Any] | None = None, check: bool = True,
                             heldout: dict[str, dict[str, float]] | None = None) -> Path:
    """A new bundle ``parent/bundle_id``: every file of the ``source`` bundle (hard links where the filesystem
    allows, else copies; the source is not touched) plus the moment head of ``head_dir`` (``moment_head.onnx``
    and ``moment_head.json``, whose ``encoder_sha256`` names the encoders it was trained on) and any other file
    under ``head_dir`` (the held-out moment set, ``eval/moment_*``), each replacing the source's file of that
    name. A head of an earlier training is replaced. ``heldout`` (``{"windows": report, "head": report}`` on the
    same queries) becomes ``moments.heldout`` and ``moment_head.heldout``, both scorers side by side. ``check``
    refuses, before publishing, a head trained for other encoders."""
    source = Path(source)
    manifest = verify_files(source)
    head_dir = Path(head_dir)
    try:
        described = json.loads((head_dir / MOMENT_HEAD_INFO).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BundleError(f"{head_dir / MOMENT_HEAD_INFO}: cannot read the moment head ({err})") from None
    try:
        head = MomentHeadInfo(encoder_sha256=described.get("encoder_sha256") or {}, embed_dim=described["embed_dim"],
                              window_seconds=described["window_seconds"], hop_seconds=described["hop_seconds"],
                              source_bundle=manifest.bundle_id, training=training or {},
                              heldout=(heldout or {}).get("head"))
    except (KeyError, ValidationError) as err:
        raise BundleError(f"{head_dir / MOMENT_HEAD_INFO}: not a moment head description ({err})") from None
    body = manifest.model_dump(mode="json")
    body.update(bundle_id=bundle_id, moment_head=head.model_dump(mode="json"), manifest_sha256=_ZERO_HASH,
                created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"))
    if heldout and body.get("moments") is not None:  # the windows' report on the head's held-out queries
        body["moments"]["heldout"] = heldout.get("windows")
    try:
        derived = BundleManifest.model_validate(body)
    except ValidationError as err:
        raise BundleError(f"bundle id {bundle_id!r}: {err.errors()[0]['msg']}") from None
    added = sorted(p.relative_to(head_dir).as_posix() for p in head_dir.rglob("*") if p.is_file())
    if MOMENT_HEAD not in added:
        raise BundleError(f"{head_dir}: no {MOMENT_HEAD} beside {MOMENT_HEAD_INFO}")
    with staged_bundle(parent, bundle_id) as staging:
        for rel in manifest.files:
            if rel not in added:
                _link_or_copy(source / rel, staging / rel)
        for rel in added:
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(head_dir / rel, staging / rel)
        if check:
            check_moment_head(staging, derived.model_copy(update={"files": checksum_files(staging)}))
        return publish(staging, derived)


# ----------------------------------------------------------------------------- atomic publish


def fsync_path(path: Path) -> None:
    """Flush a file's or directory's contents to disk (a rename is durable once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _seal(staging: Path) -> None:
    """fsync every file and directory (deepest first) and make files read-only."""
    for dirpath, _dirnames, filenames in os.walk(staging, topdown=False):
        for name in filenames:
            file_path = Path(dirpath) / name
            fsync_path(file_path)
            if stat.S_IMODE(file_path.stat().st_mode) != _READ_ONLY:  # a hard link of a published file already is
                file_path.chmod(_READ_ONLY)
        fsync_path(Path(dirpath))


@contextmanager
def staged_bundle(parent: Path, bundle_id: str) -> Iterator[Path]:
    """A staging directory in ``parent`` (same filesystem as the destination); removed on error.

    The caller writes every file into it and then calls :func:`publish`.
    """
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    if (parent / bundle_id).exists():
        raise BundleError(f"{parent / bundle_id}: already exists; bundles are never overwritten")
    staging = Path(tempfile.mkdtemp(prefix=f".{bundle_id}.", suffix=".tmp", dir=parent))
    try:
        yield staging
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def publish(staging: Path, manifest: BundleManifest) -> Path:
    """Write the manifest (checksums of the staged files filled in), fsync, rename into place."""
    staging = Path(staging)
    ids_file = staging / manifest.audio_index.ids_file
    if ids_file.is_file():  # every clip id one the API and every store take (Milvus: 512 bytes, NFC)
        with ids_file.open(encoding="utf-8") as lines:
            check_catalogue_ids((json.loads(line)["id"] for line in lines if line.strip()), f"bundle {manifest.bundle_id}")
    manifest = manifest.model_copy(update={"files": checksum_files(staging)})
    (staging / MANIFEST_NAME).write_bytes(manifest_bytes(manifest))
    _seal(staging)
    staging.chmod(0o755)  # mkdtemp makes it 0700; readers (the service) may run as another user
    final = staging.parent / manifest.bundle_id
    if final.exists():
        raise BundleError(f"{final}: already exists; bundles are never overwritten")
    os.rename(staging, final)
    fsync_path(final.parent)
    log.info("published bundle %s", final)
    return final

