"""`tonearm index AUDIO_DIR --bundle BUNDLE --out NEW_BUNDLE`: an index-only bundle of your own audio files.

The new bundle reuses the source bundle's ONNX encoders and tokenizer (copied and
re-checksummed) and indexes every file under ``AUDIO_DIR`` (recursively) in one of the
formats the service accepts as uploads (index.audio.formats: WAV, FLAC, OGG, MP3, recognised
by content) whose whole stream decodes; other files are reported once and skipped. It has no captions,
so it has no caption index and no held-out set (docs/bundle.md, "Index-only
bundles"): text→audio search works, audio→text search does not. A clip's uri is its file's POSIX path
relative to ``AUDIO_DIR``, which the manifest records as the audio root, and its id that path in Unicode
NFC, under the id grammar (:func:`index.ids.catalogue_ids`, docs/service.md "Ids"): a file whose path the
grammar refuses, or whose path equals an earlier file's once in NFC, is skipped before the embedding pass
and listed in ``skipped_clips`` with the rule it breaks. Torch-free: needs only the service extra.

Per-file metadata (:mod:`index.items.file_metadata`): ``AUDIO_DIR/metadata.jsonl`` or ``metadata.csv``
(or ``--metadata PATH``) is read and checked before anything is embedded, is not itself indexed,
and each clip's row becomes its ``metadata`` in ``audio_ids.jsonl`` (the filters' fields).

With ``ray`` (`tonearm index --ray [ADDRESS]`) the decoding and embedding run as Ray Data jobs
(:mod:`index.catalogue.ray_embed`), one a chunk, checkpointed and resumed as in this process; the bundle
written is the same.

A file longer than two of the model's windows is also indexed as moment windows (docs/bundle.md, "Moments"),
embedded by the process that decodes and embeds its clip vector — in this process, a device process of
``--devices`` or a Ray actor — from that one decode, and checkpointed with it
(:mod:`index.catalogue.pass_windows`).

With ``milvus`` as well (`tonearm index --ray --milvus-uri URI`) each Ray actor writes its own
vectors into the bundle's Milvus collection, and the moment windows of its long files into the bundle's
windows collections (:mod:`index.catalogue.milvus_pass_windows`), and the driver never holds them: the
collections are then indexed, their recall measured and the bundle registered exactly as `tonearm bundle
publish` does (:mod:`index.engines.milvus_index`, :mod:`index.engines.milvus_windows`), and the bundle
written locally has the ids, encoders and tokenizer but no FAISS file (``manifest.milvus_only``) and no
windows files (its ``moments`` entry counts the windows in Milvus): it is served with
``TONEARM_INDEX_BACKEND=milvus`` only, its moments from Milvus (docs/deploy.md, "Publishing straight to
Milvus"). That pass holds no vectors in the driver and is not checkpointed: rerun it whole.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from index.audio.decode import DecodeLimits, decode_audio
from index.audio.formats import SNIFF_BYTES, SUPPORTED, sniff_format
from index.bundle import format as fmt
from index.catalogue.checkpoint import (
    CHUNK_FILES,
    Chunk,
    EmbedCheckpoint,
    PassRate,
    Windows,
    embed_in_chunks,
    file_items,
    pass_digest,
)
from index.catalogue.embed_pass import (
    DecodeCall,
    EncoderSpec,
    PassClock,
    PassOptions,
    pass_embedder,
    pass_options_from_args,
)
from index.catalogue.half_precision import (
    PROBE_CLIPS,
    Precision,
    check_precision_options,
    probe_waves,
)
from index.catalogue.milvus_pass_windows import (
    MilvusWindowSink,
    begin_windows,
    finish_windows,
    moments_info,
)
from index.catalogue.pass_windows import WindowedDecode, WindowPlan, bundle_windows
from index.catalogue.ray_embed import RayOptions, ray_options_from_args
from index.engines.faiss_ondisk import build_and_save
from index.errors import AudioDecodeError, BundleError, TonearmError
from index.ids import catalogue_ids
from index.items.file_metadata import find_metadata_file, read_file_metadata
from index.moments.windows import write_bundle_windows
from index.runtime.loader import AUDIO_INPUTS, LoadedBundle, device_providers, encode_clips

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IndexedFolder:
    """What `tonearm index` did: the published bundle, the indexed clip ids and the skipped files."""

    path: Path
    clip_ids: list[str]
    skipped: list[tuple[str, str]]
    """(clip id, reason) of every file that could not be decoded or whose path is outside the id grammar
    (then its path as :func:`index.ids.shown_id` shows it), in folder order."""
    published: dict[str, Any] | None = None
    """With ``milvus``: what the Milvus registry recorded (sizes, index type, recall@10; ``windows``: the
    moment windows' entry when a file was long)."""


@dataclass(frozen=True)
class MilvusPublish:
    """`--milvus-uri`: the Ray workers publish the vectors straight to this Milvus."""

    target: Any
    """An :class:`index.engines.milvus_index.MilvusTarget` (a Milvus server: workers in other processes write to it)."""
    index_type: str = "FLAT"


@dataclass(frozen=True)
class FolderClips:
    """The files of a folder a pass embeds, under the id grammar (:func:`folder_clips`)."""

    files: list[Path]
    ids: list[str]
    """Each file's clip id: its path relative to the folder, in NFC."""
    uris: dict[str, str]
    """Clip id → the file's path relative to the folder as the file system spells it (the bundle's ``uri``)."""
    refused: list[tuple[int, str, str]]
    """(position among the folder's files, path as shown, reason) of the files the grammar skips."""
    position: dict[str, int]
    """Clip id → position among the folder's files (the skipped files are listed in folder order)."""

    def in_order(self, skipped: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
        """The pass's ``skipped`` (clip id, reason) and the refused ids together, in folder order."""
        rows = [(self.position[c], c, r) for c, r in skipped] + self.refused
        return [(c, r) for _, c, r in sorted(rows, key=lambda row: row[0])]


def folder_clips(audio_dir: Path, files: Sequence[Path]) -> FolderClips:
    """``files`` (under ``audio_dir``) with their clip ids in NFC; those whose path the grammar refuses or
    that repeat an earlier file's id once in NFC set aside, before anything is embedded (a bundle holds
    only ids every store and route takes: :func:`index.bundle.format.publish` checks them again)."""
    rels = [path.relative_to(audio_dir).as_posix() for path in files]
    kept, skipped = catalogue_ids(rels)
    if skipped:
        log.warning("%d files are skipped for their names, outside the id grammar or NFC duplicates "
                    "(docs/service.md, \"Ids\"; manifest: skipped_clips)", len(skipped))
    return FolderClips(files=[files[i] for i in kept], ids=list(kept.values()),
                       uris={clip_id: rels[i] for i, clip_id in kept.items()},
                       refused=[(i, shown, reason) for i, (shown, reason) in skipped.items()],
                       position={clip_id: i for i, clip_id in kept.items()})


def audio_files(audio_dir: Path, metadata: Path | None = None) -> list[Path]:
    """Every regular file under ``audio_dir`` (recursive, sorted by relative path); hidden ones and
    the per-file metadata table (``metadata``) skipped."""
    skip = metadata.resolve() if metadata is not None else None
    return sorted(
        p for p in audio_dir.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(audio_dir).parts)
        and (skip is None or p.resolve() != skip)
    )


def index_folder(
    audio_dir: Path, source: Path, out: Path, *, progress: bool = False, ray: RayOptions | None = None,
    milvus: MilvusPublish | None = None, providers: Sequence[str] | None = None, chunk_files: int = CHUNK_FILES,
    metadata: Path | None = None, precision: Precision = "fp32", pass_options: PassOptions | None = None,
) -> IndexedFolder:
    """Embed every decodable file under ``audio_dir`` with ``source``'s audio encoder; publish ``out`` atomically.

    In this process the pass is checkpointed every ``chunk_files`` files in ``<out>.partial/`` and
    the same command resumes it after an interruption, reusing every file whose content is unchanged
    (:mod:`index.catalogue.checkpoint`); the files are decoded beside the encoder as ``pass_options`` says
    (:mod:`index.catalogue.embed_pass`; default: in this process).

    ``ray``: embed on a Ray cluster instead of in this process (same vectors to float tolerance).
    ``milvus`` (with ``ray``): the workers write the vectors into Milvus; ``out`` gets no FAISS file.
    ``metadata``: the per-file metadata table (default: :data:`index.items.file_metadata.NAMES` in ``audio_dir``).
    ``precision`` ``fp16``: the pass runs an fp16 copy of the audio encoder, held to the fp32 one on a
    probe set first (:mod:`index.catalogue.half_precision`); the new bundle keeps the fp32 encoder and records the pass."""
    audio_dir, out = Path(audio_dir).resolve(), Path(out)
    if not audio_dir.is_dir():
        raise TonearmError(f"{audio_dir}: audio directory not found")
    if milvus is not None and ray is None:
        raise TonearmError("--milvus-uri needs --ray: without Ray, build the bundle and run `tonearm bundle publish`")
    options = pass_options or PassOptions()
    table = find_metadata_file(audio_dir, Path(metadata) if metadata is not None else None)
    every = audio_files(audio_dir, table)
    metas = read_file_metadata(table, [p.relative_to(audio_dir).as_posix() for p in every]) if table else {}
    folder = folder_clips(audio_dir, every)
    files = folder.files
    if milvus is not None and ray is not None:
        return _index_into_milvus(audio_dir, source, out, folder, len(every), ray, milvus, metas, options)
    if precision != "fp32" and ray is not None:
        check_precision_options(precision, None, ray=True)
    bundle = LoadedBundle.open(source, verify=True, providers=providers)
    catalogue_pass = None
    try:
        manifest = bundle.manifest
        frontend = manifest.audio_frontend.model_dump(mode="json") if manifest.audio_frontend is not None else None
        plan = WindowPlan(bundle.sample_rate, bundle.clip_samples)
        describe = {"encoder": manifest.files[manifest.audio_encoder.file].sha256,
                    "sample_rate": bundle.sample_rate, "clip_samples": bundle.clip_samples, "audio_frontend": frontend,
                    "moments": plan.describe(), **({"precision": precision} if precision != "fp32" else {})}
        # in this process and on Ray alike (the same vectors to float tolerance: either resumes the other's chunks)
        checkpoint = EmbedCheckpoint(out, pass_digest(**describe), describe=describe,
                                     skips_under=options.limits.describe())
        if ray is None:
            with tempfile.TemporaryDirectory() as scratch:
                encode: Callable[[Sequence[np.ndarray]], np.ndarray] = functools.partial(
                    bundle.encode_audio, max_call_samples=options.codec_call_samples)
                encoder_path = source / manifest.audio_encoder.file
                if precision == "fp16":
                    encode, catalogue_pass, encoder_path = _half_encoder(bundle, source, files,
                                                                         Path(scratch), providers, options)
                spec = EncoderSpec(
                    path=str(encoder_path), embed_dim=bundle.embed_dim, clip_samples=bundle.clip_samples,
                    providers=tuple(providers or bundle.onnx_providers), frontend=frontend,
                    call_samples=options.codec_call_samples)
                clip_ids, embeddings, skipped, long = _embed(bundle, folder, progress=progress,
                                                             checkpoint=checkpoint, chunk_files=chunk_files,
                                                             encode=encode, options=options, spec=spec)
        else:
            clip_ids, embeddings, skipped, long = _embed_on_ray(bundle, source, folder, ray, options,
                                                                checkpoint=checkpoint, chunk_files=chunk_files)
        windows = bundle_windows(clip_ids, long)  # keyed by the rows of the audio index written below
    finally:
        bundle.close()
    skipped = folder.in_order(skipped)
    if not clip_ids:
        raise TonearmError(f"{audio_dir}: no decodable audio file among {len(every)} files")
    manifest = bundle.manifest
    with fmt.staged_bundle(out.parent, out.name) as staging:
        built = build_and_save(embeddings, staging / fmt.AUDIO_INDEX)  # lists on disk when large
        audio_index = fmt.IndexInfo(
            file=fmt.AUDIO_INDEX, ids_file=fmt.AUDIO_IDS, factory=built.spec.factory, dim=built.index.d,
            ntotal=built.index.ntotal, search_params=built.search_params, ann_recall_at_10=built.ann_recall_at_10,
        )
        moments = (write_bundle_windows(staging, windows, sample_rate=manifest.sample_rate,
                                        window_samples=manifest.clip_samples) if windows else None)
        path = _write_bundle(staging, source, manifest, audio_dir, out.name, clip_ids, audio_index, metas=metas,
                             uris=folder.uris, catalogue_pass=catalogue_pass, skipped=skipped, moments=moments)
    checkpoint.remove()
    return IndexedFolder(path=path, clip_ids=clip_ids, skipped=skipped)


def _write_bundle(
    staging: Path, source: Path, manifest: fmt.BundleManifest, audio_dir: Path, bundle_id: str,
    clip_ids: list[str], audio_index: fmt.IndexInfo, milvus_only: fmt.MilvusOnlyInfo | None = None,
    *, metas: dict[str, dict[str, Any]] | None = None, uris: dict[str, str] | None = None,
    catalogue_pass: fmt.CataloguePassInfo | None = None, skipped: Sequence[tuple[str, str]] = (),
    moments: fmt.MomentsInfo | None = None,
) -> Path:
    """Encoders, tokenizer, ids (each clip's uri its file's path, ``uris``; with its ``metas`` row as its
    ``metadata``) and manifest of the index-only bundle into ``staging``; publish it."""
    for name in {manifest.audio_encoder.file, manifest.text_encoder.file, manifest.tokenizer.file}:
        shutil.copyfile(source / name, staging / name)
    with (staging / fmt.AUDIO_IDS).open("w", encoding="utf-8") as handle:
        for clip_id in clip_ids:
            handle.write(json.dumps(clip_item(clip_id, metas, (uris or {}).get(clip_id)), ensure_ascii=False) + "\n")
    new = manifest.model_copy(update={
        "bundle_id": bundle_id,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "source": manifest.source.model_copy(update={"data_manifest": str(audio_dir), "audio_root": str(audio_dir)}),
        "audio_index": audio_index,
        "text_index": None,
        "eval_set": None,
        "evaluation": None,
        "milvus_only": milvus_only,
        "catalogue_pass": catalogue_pass,  # this pass's, never the source bundle's
        "skipped_clips": [fmt.SkippedClip(id=rel, reason=reason) for rel, reason in skipped] or None,
        "moments": moments,
    })
    return fmt.publish(staging, fmt.BundleManifest.model_validate(new.model_dump()))


def clip_item(clip_id: str, metas: dict[str, dict[str, Any]] | None, uri: str | None = None) -> dict[str, Any]:
    """A clip's row of ``audio_ids.jsonl``: ``uri`` the file's path relative to the audio root (default: the id,
    that path in NFC), with its ``metas`` row (keyed by that path) as its ``metadata``; what filters and the
    Milvus layout read."""
    uri = uri or clip_id
    row: dict[str, Any] = {"id": clip_id, "uri": uri, "captions": {}}
    if metas and uri in metas:
        row["metadata"] = metas[uri]
    return row


def _half_encoder(
    bundle: LoadedBundle, source: Path, files: list[Path], scratch: Path,
    providers: Sequence[str] | None, options: PassOptions,
) -> tuple[Callable[[Sequence[np.ndarray]], np.ndarray], fmt.CataloguePassInfo, Path]:
    """The fp16 copy of ``bundle``'s audio encoder as an encode function, after the parity gate on the
    first :data:`index.catalogue.half_precision.PROBE_CLIPS` decodable files and four synthetic signals."""
    from index.catalogue.half_precision import catalogue_pass_info, gate, load_half

    manifest = bundle.manifest
    if manifest.audio_encoder.quantization != "none":
        check_precision_options("fp16", None, quantized=["audio"])
    half = load_half(source / manifest.audio_encoder.file, scratch, inputs=AUDIO_INPUTS, embed_dim=bundle.embed_dim,
                     providers=providers or bundle.onnx_providers)
    probe: list[np.ndarray] = []
    for path in files:
        if len(probe) == PROBE_CLIPS:
            break
        try:
            probe.append(decode_file(path, bundle.sample_rate, options.limits))
        except AudioDecodeError:
            continue  # listed by the pass itself
    probe += probe_waves(bundle.sample_rate, bundle.clip_samples)

    def encode(waves: Sequence[np.ndarray]) -> np.ndarray:
        return encode_clips(half, waves, clip_samples=bundle.clip_samples, embed_dim=bundle.embed_dim,
                            frontend=manifest.audio_frontend, max_call_samples=options.codec_call_samples)

    found = gate("audio", bundle.encode_audio, encode, probe)
    device = "cuda" if "CUDAExecutionProvider" in half.session.get_providers() else "cpu"
    return encode, catalogue_pass_info({"audio": found}, device), half.path


def _index_into_milvus(
    audio_dir: Path, source: Path, out: Path, folder: FolderClips, n_files: int, ray: RayOptions,
    milvus: MilvusPublish, metas: dict[str, dict[str, Any]], options: PassOptions,
) -> IndexedFolder:
    """The Ray pass with each actor writing its vectors into Milvus (module docstring).

    The format check runs here first, so a file it refuses takes no collection key; a file that
    passes it but fails to decode on a worker leaves a gap (``manifest.milvus_only.gaps``). Each row's
    metadata is laid out here, before the pass, by the publish's own :func:`catalogue_metas` over the
    clips the bundle holds if every candidate decodes. The actors window the long files into the bundle's
    windows collections, which are finished (:func:`index.catalogue.milvus_pass_windows.finish_windows`) before
    the registry row is written."""
    from index.catalogue.ray_connect import connect
    from index.catalogue.ray_embed import embed_audio_files
    from index.engines import milvus_index

    milvus_index.check_new_bundle(milvus.target, out.name, milvus.index_type)
    candidates: list[Path] = []
    rels: list[str] = []
    skipped: list[tuple[str, str]] = []
    for path, clip_id in zip(folder.files, folder.ids, strict=True):
        try:
            check_format(path)
            candidates.append(path)
            rels.append(clip_id)
        except AudioDecodeError as err:
            skipped.append((clip_id, str(err).removeprefix(f"{path}: ")))
    if not candidates:
        raise TonearmError(f"{audio_dir}: no decodable audio file among {n_files} files")
    manifest = fmt.verify_files(source)
    LoadedBundle.open(source, verify=False).close()  # the encoders load here before any worker starts
    connect(ray.address)  # the cluster is reachable before anything is created in Milvus
    target, index_type, dim = milvus.target, milvus.index_type, manifest.embed_dim
    items = [clip_item(rel, metas, folder.uris[rel]) for rel in rels]
    written_fields, row_metas = milvus_index.catalogue_metas(items)
    sink = milvus_index.begin_audio_publish(target, out.name, dim=dim, index_type=index_type, n=len(candidates))
    plan = WindowPlan(manifest.sample_rate, manifest.clip_samples)
    windows = begin_windows(target, out.name, dim=dim)
    done = embed_audio_files(
        candidates, (source / manifest.audio_encoder.file).read_bytes(), decode=limited(options.limits), embed_dim=dim,
        sample_rate=manifest.sample_rate, clip_samples=manifest.clip_samples, policy="chunk", options=ray, sink=sink,
        metas=row_metas, frontend=manifest.audio_frontend, call_samples=options.codec_call_samples,
        windows=plan, window_sink=MilvusWindowSink.of(windows),
    )
    counts = done.window_counts or [0] * len(candidates)
    if any(counts):
        log.info("index progress: %d moment windows of %d long files written to %s", sum(counts),
                 sum(1 for n in counts if n), windows.collection)
    gaps = [i for i, error in enumerate(done.errors) if error]
    # in file order, as the single-process path lists them
    skipped = folder.in_order(skipped + [(rels[i], done.errors[i].removeprefix(f"{candidates[i]}: ")) for i in gaps])
    clip_ids = [rel for rel, error in zip(rels, done.errors, strict=True) if not error]
    if not clip_ids:
        raise TonearmError(f"{audio_dir}: no decodable audio file among {n_files} files")
    with fmt.staged_bundle(out.parent, out.name) as staging:
        kept = milvus_index.kept_fields(written_fields, [item for item, error in zip(items, done.errors, strict=True)
                                                         if not error])
        entry = finish_windows(windows, counts, [i for i, error in enumerate(done.errors) if not error],
                               progress=log.info)
        info = milvus_index.finish_audio_publish(target, out.name, dim=dim, index_type=index_type,
                                                 n_max=len(candidates), n=len(clip_ids), gaps=gaps, meta_fields=kept,
                                                 extra=entry)
        audio_index = fmt.IndexInfo(
            file="", ids_file=fmt.AUDIO_IDS, factory=f"milvus:{index_type}", dim=dim, ntotal=len(clip_ids),
            ann_recall_at_10=float(info["recall_at_10"]["audio"]),
        )
        only = fmt.MilvusOnlyInfo(uri=target.uri, index_type=index_type, gaps=gaps)
        path = _write_bundle(staging, source, manifest, audio_dir, out.name, clip_ids, audio_index, only, metas=metas,
                             uris=folder.uris, skipped=skipped, moments=moments_info(plan, entry))
    return IndexedFolder(path=path, clip_ids=clip_ids, skipped=skipped, published=info)


def check_format(path: Path) -> None:
    """AudioDecodeError unless the file's first bytes are one of the formats the service takes as uploads."""
    with path.open("rb") as handle:
        head = handle.read(SNIFF_BYTES)
    if sniff_format(head) is None:
        raise AudioDecodeError(f"{path}: not {SUPPORTED} audio (the formats the service takes as uploads)")


def decode_file(path: Path, sample_rate: int, limits: DecodeLimits | None = None) -> np.ndarray:
    """A file's waveform when it is in an accepted format and decodes whole within ``limits`` (default: the
    catalogue pass's, :class:`index.audio.decode.DecodeLimits`); AudioDecodeError otherwise (an
    :class:`index.audio.decode.AudioLimitError` past a limit: the pass skips the file with the reason)."""
    check_format(path)
    return decode_audio(path, sample_rate=sample_rate, complete=True, **(limits or DecodeLimits()).kwargs())


def limited(limits: DecodeLimits) -> Callable[[Path, int], np.ndarray]:
    """:func:`decode_file` under ``limits`` as a ``(path, sample rate)`` decode function (picklable: Ray)."""
    return functools.partial(decode_file, limits=limits)


def _embed(
    bundle: LoadedBundle, folder: FolderClips, *, progress: bool,
    checkpoint: EmbedCheckpoint | None = None, chunk_files: int = CHUNK_FILES,
    encode: Callable[[Sequence[np.ndarray]], np.ndarray] | None = None, options: PassOptions | None = None,
    spec: EncoderSpec | None = None,
) -> tuple[list[str], np.ndarray, list[tuple[str, str]], dict[str, Windows]]:
    """The pass in chunks of ``chunk_files`` files (:func:`index.catalogue.checkpoint.embed_in_chunks`); a file
    whose content a chunk in ``checkpoint`` holds is reused, not embedded; the files decoded beside the
    encoder (:func:`index.catalogue.embed_pass.clip_embedder`), a long one's moment windows embedded from
    the same decode (by clip id). Progress: files done, clips/s of this run, the time left at that rate, the
    decode wait, the encoder's busy fraction and the moment windows embedded (bar and log). ``encode``: the
    waveforms' vectors (default: the bundle's own audio encoder)."""
    encode = encode or bundle.encode_audio
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[speed]}"))
    files, rels = folder.files, folder.ids
    clock = PassClock()
    with Progress(*columns, disable=not progress) as bar:
        task = bar.add_task("embedding audio", total=len(files), speed="")
        rate, logged = PassRate(len(files), clock), 0

        def advance(n: int, /, *, resumed: bool = False) -> None:
            nonlocal logged
            rate.add(n, resumed=resumed)
            bar.update(task, advance=n, speed=rate.describe())
            if rate.done - logged >= 100 or rate.done == len(files):
                log.info("index progress: %d/%d files, %s", rate.done, len(files), rate.describe())
                logged = rate.done

        limits = (options or PassOptions()).limits
        decode = WindowedDecode(DecodeCall(decode_file, args=(bundle.sample_rate, limits), sample_rate=bundle.sample_rate),
                                WindowPlan(bundle.sample_rate, bundle.clip_samples))
        with ExitStack() as stack:
            embed = pass_embedder(rels, files, decode, lambda waves: encode(waves), dim=bundle.embed_dim,
                                  options=options or PassOptions(), clock=clock, spec=spec, stack=stack)
            done = embed_in_chunks(file_items(rels, files), embed, dim=bundle.embed_dim, checkpoint=checkpoint,
                                   chunk_files=chunk_files, advance=advance, what="files")
    return done.clip_ids, done.embeddings, done.skipped, done.windows


def _embed_on_ray(
    bundle: LoadedBundle, source: Path, folder: FolderClips, options: RayOptions,
    pass_options: PassOptions, *, checkpoint: EmbedCheckpoint | None = None, chunk_files: int = CHUNK_FILES,
) -> tuple[list[str], np.ndarray, list[tuple[str, str]], dict[str, Windows]]:
    """The pass as Ray Data jobs, one a chunk of ``chunk_files`` files, checkpointed in ``checkpoint`` as the
    in-process pass is (:func:`index.catalogue.checkpoint.embed_in_chunks`: a rerun reuses every saved vector,
    window and skip whose file's content is unchanged, in this process or on Ray); a file a worker could not
    decode is skipped with the reason; the actors window the long files (by clip id)."""
    from index.catalogue.ray_embed import embed_audio_files

    model = (source / bundle.manifest.audio_encoder.file).read_bytes()
    files, rels = folder.files, folder.ids
    plan = WindowPlan(bundle.sample_rate, bundle.clip_samples)
    clock = PassClock(timed=False)  # the actors decode and encode: this process counts the windows only
    rate = PassRate(len(files), clock)

    def advance(n: int, /, *, resumed: bool = False) -> None:
        rate.add(n, resumed=resumed)
        log.info("index progress: %d/%d files, %s", rate.done, len(files), rate.describe())

    def embed(indices: Sequence[int], step: Callable[[int], None]) -> Chunk:
        chosen = [files[i] for i in indices]
        done = embed_audio_files(chosen, model, decode=limited(pass_options.limits), embed_dim=bundle.embed_dim,
                                 sample_rate=bundle.sample_rate, clip_samples=bundle.clip_samples, policy="chunk",
                                 options=options, frontend=bundle.manifest.audio_frontend,
                                 call_samples=pass_options.codec_call_samples, windows=plan)
        kept = [k for k, error in enumerate(done.errors) if not error]
        long = {rels[indices[k]]: found for k, found in enumerate(done.windows or []) if found is not None}
        clock.count_windows(sum(len(w[0]) for w in long.values()), len(long))
        step(len(indices))
        return Chunk([rels[indices[k]] for k in kept], np.asarray(done.embeddings[kept], np.float32),
                     [(rels[i], error.removeprefix(f"{files[i]}: "))
                      for i, error in zip(indices, done.errors, strict=True) if error], windows=long)

    done = embed_in_chunks(file_items(rels, files), embed, dim=bundle.embed_dim, checkpoint=checkpoint,
                           chunk_files=chunk_files, advance=advance, what="files")
    return done.clip_ids, done.embeddings, done.skipped, done.windows


def cli_index(args: argparse.Namespace) -> int:
    """`tonearm index AUDIO_DIR --bundle BUNDLE --out NEW_BUNDLE`; exit 2 when nothing could be indexed."""
    out = Path(args.out)
    if out.exists():
        raise BundleError(f"{out}: already exists; bundles are never overwritten")
    ray = None
    if args.ray is not None:
        ray = ray_options_from_args(args)
    milvus = None
    if getattr(args, "milvus_uri", None):
        from index.engines.milvus_index import target_from_args

        milvus = MilvusPublish(target_from_args(args.milvus_uri, args.milvus_token_env),
                               index_type=args.milvus_index or "FLAT")
    device, precision = args.device, args.precision
    providers = device_providers(device)
    check_precision_options(precision, device, ray=ray is not None)
    metadata = getattr(args, "metadata", None)
    result = index_folder(Path(args.audio_dir), Path(args.bundle), out, progress=True, ray=ray, milvus=milvus,
                          providers=providers, metadata=Path(metadata) if metadata else None, precision=precision,
                          pass_options=pass_options_from_args(args))
    console = Console()
    for rel, reason in result.skipped:
        console.print(f"[yellow]skipped[/yellow] {escape(rel)}: {escape(reason)}", highlight=False, soft_wrap=True)
    console.print(
        f"[green]OK[/green] {result.path}: {len(result.clip_ids)} files indexed, {len(result.skipped)} skipped "
        "(no captions: text→audio search only)", highlight=False, soft_wrap=True,
    )
    if milvus is not None and result.published is not None:
        console.print(
            f"vectors published to {milvus.target.uri} as {milvus.target.collection(result.path.name, 'audio')} "
            f"({result.published['index_type']}, recall@10 {result.published['recall_at_10']['audio']}); the bundle "
            "holds no FAISS file: serve it with TONEARM_INDEX_BACKEND=milvus", highlight=False, soft_wrap=True,
        )
        found = result.published.get("windows")
        if found:
            console.print(
                f"moment windows published as {milvus.target.collection(result.path.name, 'windows')}: "
                f"{found['n_windows']} windows of {found['n_recordings']} long files ({found['index_type']}, "
                f"recall@10 of the best recordings {found['recall_at_10']})", highlight=False, soft_wrap=True,
            )
    return 0
