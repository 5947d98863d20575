"""What every bundle export shares, trained (:mod:`training.bundle.export`) or pretrained
(:mod:`training.bundle.pretrained`): the bundle's identity, the catalogue and held-out selection, the
progress display, ONNX-vs-torch parity helpers, the catalogue pass, the indices and id files, the
manifest's index and quantization records and the ``--quantize*`` options.

How a bundle is made (SPEC §6): ``training.bundle.export`` turns a *checkpoint* into encoders,
``training.bundle.pretrained`` a *pretrained model folder*; both hand their steps to the one assembly,
:func:`training.bundle.assemble.assemble_bundle`, which runs them with these parts — embed the catalogue
with the ONNX encoders (the clips pass checkpointed in chunks and resumed after an interruption:
:func:`embed_clips`, :func:`embed_catalogue`), build the FAISS indices and id files
(:func:`write_catalogue`), store and evaluate the held-out set — and builds the one manifest;
``training.bundle.cli`` is the one ``tonearm export`` entry point choosing between them. Neither of the
two imports the other.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from index.audio.decode import DecodeLimits
from index.bundle import format as fmt
from index.bundle.evalset import MAX_EVAL_CLIPS
from index.catalogue.checkpoint import (
    CHUNK_FILES,
    CHUNK_TEXTS,
    Advance,
    Chunk,
    EmbedCheckpoint,
    Item,
    PassRate,
    PassResult,
    embed_in_chunks,
    file_items,
    pass_digest,
    text_key,
)
from index.catalogue.embed_pass import EncoderSpec, PassClock, PassOptions, pass_embedder
from index.catalogue.half_precision import (
    PROBE_TEXTS,
    catalogue_pass_info,
    gate,
    half_precision_copy,
)
from index.catalogue.pass_windows import bundle_windows
from index.engines.faiss_index import BuiltIndex
from index.errors import BundleError
from index.ids import catalogue_ids
from index.metrics.report import METRIC_CONVENTION
from index.runtime.loader import OnnxEncoder
from training.bundle.onnx_export import external_data_file
from training.bundle.quantize import QuantizeConfig, check_loss
from training.data.manifest import ClipRecord

log = logging.getLogger("training.bundle.export")
"""The export's logger, whichever pipeline runs (``tonearm/demo_progress.py`` reads its progress lines)."""

OPSET = 18
HELD_OUT_SPLITS = ("test", "val")


def canonical_hash(value: Any) -> str:
    """sha256 of canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()



def make_bundle_id(name: str, *, created: datetime, fingerprint: str) -> str:
    """``<run name>-<UTC timestamp>-<8 hex of the inputs' fingerprint>``."""
    return f"{name}-{created.strftime('%Y%m%dT%H%M%SZ')}-{fingerprint[:8]}"



def held_out_records(records: Sequence[ClipRecord]) -> tuple[str, list[ClipRecord]]:
    """The held-out split (``test``, else ``val``), capped at :data:`MAX_EVAL_CLIPS` clips."""
    for split in HELD_OUT_SPLITS:
        chosen = [r for r in records if r.split == split]
        if chosen:
            return split, chosen[:MAX_EVAL_CLIPS]
    raise BundleError("the data manifest has neither a 'test' nor a 'val' split for the held-out set")



def catalogue_texts(records: Sequence[ClipRecord], languages: Sequence[str]) -> tuple[list[dict[str, Any]], dict[str, tuple[int, int]]]:
    """Caption rows grouped by language (``text_ids.jsonl``) and each language's ``[start, end)``."""
    items: list[dict[str, Any]] = []
    ranges: dict[str, tuple[int, int]] = {}
    for lang in languages:
        start = len(items)
        for row, record in enumerate(records):
            items.extend(
                {"clip_id": record.id, "clip_row": row, "lang": lang, "text": text}
                for text in record.captions.get(lang, [])
            )
        ranges[lang] = (start, len(items))
    return items, ranges



def audio_uri(record: ClipRecord, manifest: Path) -> str:
    """The clip's audio path relative to the data manifest when inside its directory, else as stored."""
    audio = Path(record.audio)
    try:
        return audio.resolve().relative_to(manifest.resolve().parent).as_posix()
    except ValueError:
        return str(audio)



def write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")



@contextmanager
def progress_bar(enabled: bool) -> Iterator[Callable[..., Advance]]:
    """``task(description, total, clock=None)`` → ``advance(n, resumed=False)``; a no-op when disabled. Each
    task shows (bar and log, every 10 %) this run's clips/s and the time left at that rate, and with a
    ``clock`` (:class:`index.catalogue.embed_pass.PassClock`) the decode wait and the encoder's busy fraction
    (:class:`index.catalogue.checkpoint.PassRate`; ``resumed``: items loaded from a checkpoint, not counted)."""
    if not enabled:
        def no_op(_n: int, /, *, resumed: bool = False) -> None:
            return None

        yield lambda _description, _total, clock=None: no_op
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[speed]}"))
    with Progress(*columns, transient=False) as bar:

        def task(description: str, total: int, clock: PassClock | None = None) -> Advance:
            task_id = bar.add_task(description, total=total, speed="")
            rate, next_log = PassRate(total, clock), 0

            def advance(n: int, /, *, resumed: bool = False) -> None:
                # Also to the log (every 10 %), so a log file, not only a terminal, shows the progress.
                nonlocal next_log
                rate.add(n, resumed=resumed)
                bar.update(task_id, advance=n, speed=rate.describe())
                if rate.done >= next_log or rate.done >= total:
                    log.info("export progress: %s %d/%d (%s)", description, rate.done, total, rate.describe())
                    next_log = rate.done + max(1, total // 10)

            return advance

        yield task



def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=-1, keepdims=True), 1e-12)
    return (a * b).sum(axis=-1)



def parity_texts(records: Sequence[ClipRecord], languages: Sequence[str]) -> list[str]:
    """Per language: the shortest and the longest caption, and one far over ``max_length``."""
    texts: list[str] = []
    for lang in languages:
        pool = sorted({t for r in records for t in r.captions.get(lang, [])}, key=lambda t: (len(t), t))
        if pool:
            texts += [pool[0], pool[-1], " ".join([pool[-1]] * 8)]
    return texts



CPU = ("CPUExecutionProvider",)


def load_session(path: Path, inputs: Sequence[str], dim: int, providers: Sequence[str] = CPU) -> OnnxEncoder:
    """An encoder session for the export's checks and catalogue pass (``providers``: ``--device``,
    :func:`index.runtime.loader.device_providers`)."""
    return OnnxEncoder.load(path, inputs=inputs, embed_dim=dim, providers=list(providers), threads=None)



def index_info(built: BuiltIndex, *, file: str, ids_file: str, ranges: dict | None = None) -> fmt.IndexInfo:
    return fmt.IndexInfo(
        file=file, ids_file=ids_file, factory=built.spec.factory, dim=built.index.d, ntotal=built.index.ntotal,
        search_params=built.search_params, ann_recall_at_10=built.ann_recall_at_10, language_ranges=ranges,
    )



def catalogue_records(records: Sequence[ClipRecord], splits: Sequence[str] | None, manifest: Path) -> list[ClipRecord]:
    """The clips to index: every clip, or those of `splits` (each must exist in the manifest)."""
    if not splits:
        return list(records)
    present = sorted({r.split for r in records})
    unknown = [split for split in splits if split not in present]
    if unknown:
        raise BundleError(f"{manifest}: no split {', '.join(map(repr, unknown))} to index "
                          f"(--split; splits present: {', '.join(present)})")
    return [r for r in records if r.split in splits]


def grammar_records(records: Sequence[ClipRecord]) -> tuple[list[ClipRecord], list[tuple[str, str]]]:
    """The catalogue under the id grammar, before anything is embedded (:func:`index.ids.catalogue_ids`,
    docs/service.md "Ids"): each record with its id in NFC, and ``(id as shown, reason)`` of the records
    left out — an id the grammar refuses, or one equal to an earlier record's once in NFC (the first is
    kept) — which the manifest lists in ``skipped_clips`` with the clips that could not be decoded."""
    kept, refused = catalogue_ids([r.id for r in records])
    return ([records[i] if records[i].id == clip_id else replace(records[i], id=clip_id)
             for i, clip_id in kept.items()], list(refused.values()))



def quantize_config(args: argparse.Namespace) -> QuantizeConfig:
    """``--quantize``, ``--quantize-text`` (alias of ``--quantize text``), the precision and the loss policy."""
    return QuantizeConfig.from_choice(
        args.quantize, quantize_text=args.quantize_text, precision=args.quantize_precision,
        max_r10_drop=args.quantize_max_drop, on_loss=args.quantize_on_loss,
    )



def quantization_records(found: Any, quantize: QuantizeConfig) -> tuple[fmt.EvaluationInfo, fmt.QuantizationInfo]:
    """The manifest's evaluation and quantization records of a measured int8 bundle (trained or
    pretrained); stops the export per ``quantize.on_loss`` when the held-out drop is too large."""
    drops = found.drop_points()
    log.info("%s %s: held-out drop vs fp32 (points) %s", quantize.precision, "+".join(quantize.encoders), drops)
    within = check_loss(found, quantize)
    info = fmt.QuantizationInfo(
        precision=quantize.precision, encoders=list(quantize.encoders),
        agreement={name: fmt.QuantizationAgreement(min_cosine=float(c.min()), mean_cosine=float(c.mean()),
                                                   items=len(c)) for name, c in found.cosine.items()},
        recall_drop_points=drops, max_r10_drop=quantize.max_r10_drop, on_loss=quantize.on_loss, within_limit=within,
    )
    evaluation = fmt.EvaluationInfo(report=found.report, convention=METRIC_CONVENTION,
                                    fp32_text_report=found.fp32_report, quantization_delta=found.delta)
    return evaluation, info


# ----------------------------------------------------------------------------- the catalogue pass, checkpointed


def partial_base(out_dir: Path, name: str, fingerprint: str) -> Path:
    """Where an export's checkpointed catalogue pass lives: ``OUT/.<name>-<8 hex>.partial/`` — hidden, named
    by the bundle id without its timestamp, so the same command finds it again (:mod:`index.catalogue.checkpoint`)."""
    return out_dir / f".{name}-{fingerprint[:8]}"


def catalogue_checkpoint(base: Path, encoder: Path, *, providers: Sequence[str], frontend: dict[str, Any],
                         precision: str = "fp32", name: str = "", limits: DecodeLimits | None = None,
                         moments: dict[str, Any] | None = None) -> EmbedCheckpoint:
    """The checkpoint of a catalogue pass (``name`` ``""``: the clips, ``captions``: the captions): its pass
    digest is the encoder's sha256 (and its external data file's, if any), the ONNX Runtime providers, the
    audio preparation (``frontend``) and ``precision`` when not fp32 (`--precision fp16` embeds with fp16
    copies); an item is reused when its content key (:func:`index.catalogue.checkpoint.content_key`) is in a
    chunk saved under the same digest (a pass with another digest starts over and says what changed).
    ``limits``: the decode limits, which decide the skips but no vector (other limits retry the saved skips).
    ``moments``: a clips pass that windows its long recordings, its :meth:`~index.catalogue.pass_windows.WindowPlan.describe`
    (its chunks hold the windows; a pass that did not window is another pass)."""
    checksums = [fmt.sha256_file(p) for p in (encoder, external_data_file(encoder)) if p.is_file()]
    describe = {"encoder": checksums, "providers": list(providers), "frontend": frontend,
                **({"precision": precision} if precision != "fp32" else {}),
                **({"moments": moments} if moments is not None else {})}
    return EmbedCheckpoint(base, pass_digest(**describe), name=name, describe=describe,
                           skips_under=limits.describe() if limits is not None else None)


def embed_clips(records: Sequence[ClipRecord], decode: Callable[[Any], Any], encode: Callable[[list[np.ndarray]], np.ndarray],
                *, dim: int, advance: Advance, checkpoint: EmbedCheckpoint | None, chunk_files: int = CHUNK_FILES,
                options: PassOptions | None = None, clock: PassClock | None = None,
                spec: EncoderSpec | None = None) -> PassResult:
    """The clips pass over ``records`` (:mod:`index.catalogue.embed_pass`): each clip's audio decoded by
    ``decode`` (a picklable :class:`~index.catalogue.embed_pass.DecodeCall` when ``options.decode_workers`` > 0)
    beside the encoder ``encode`` (waves → (n, d)), in chunks checkpointed in ``checkpoint``
    (:func:`index.catalogue.checkpoint.embed_in_chunks`: a clip whose content a saved chunk holds is reused).
    A clip that cannot be decoded is skipped and listed in the result. With ``options.devices`` the clips
    are split over one process per device, each running ``spec`` (:class:`index.catalogue.embed_pass.DevicePool`).
    ``decode`` a :class:`~index.catalogue.pass_windows.WindowedDecode`: the long recordings' moment windows come
    from the same decode, embedded beside their clip vectors (``PassResult.windows``)."""
    ids, paths = [r.id for r in records], [Path(r.audio) for r in records]
    items = file_items(ids, paths)
    with ExitStack() as stack:
        embed = pass_embedder(ids, paths, decode, encode, dim=dim, options=options or PassOptions(),
                              clock=clock or PassClock(), spec=spec, stack=stack)
        return embed_in_chunks(items, embed, dim=dim, checkpoint=checkpoint, chunk_files=chunk_files, advance=advance)


def embed_clips_on_ray(records: Sequence[ClipRecord], run: Callable[[list[Path]], Any], *, dim: int,
                       checkpoint: EmbedCheckpoint | None, chunk_files: int = CHUNK_FILES,
                       advance: Advance | None = None, clock: PassClock | None = None) -> PassResult:
    """The clips pass as Ray jobs (``run(paths)`` → :class:`index.catalogue.ray_embed.RayEmbedded`), one job a chunk,
    checkpointed as the in-process pass is; a clip a worker could not decode is skipped and listed; the long
    recordings' windows the actors embedded (``RayEmbedded.windows``) are checkpointed with the chunk and
    counted on ``clock`` (the progress line's)."""
    ids, paths = [r.id for r in records], [Path(r.audio) for r in records]

    def embed(indices: Sequence[int], step: Callable[[int], None]) -> Chunk:
        done = run([paths[i] for i in indices])
        kept = [k for k, error in enumerate(done.errors) if not error]
        long = {ids[indices[k]]: found for k, found in enumerate(done.windows or []) if found is not None}
        if clock is not None:
            clock.count_windows(sum(len(w[0]) for w in long.values()), len(long))
        step(len(indices))
        return Chunk([ids[indices[k]] for k in kept], np.asarray(done.embeddings[kept], np.float32),
                     [(ids[indices[k]], str(e).removeprefix(f"{paths[indices[k]]}: "))
                      for k, e in enumerate(done.errors) if e], windows=long)

    return embed_in_chunks(file_items(ids, paths), embed, dim=dim, checkpoint=checkpoint, chunk_files=chunk_files,
                           advance=advance or _quiet)


def embed_texts(texts: Sequence[str], encode: Callable[[list[str]], np.ndarray], *, dim: int,
                checkpoint: EmbedCheckpoint | None, advance: Advance | None = None, chunk_texts: int = CHUNK_TEXTS,
                step: int = 256) -> np.ndarray:
    """(N, d) caption embeddings, ``step`` captions a call through ``encode`` (in process, or one Ray job a
    chunk), checkpointed in chunks of ``chunk_texts`` keyed by each caption's text."""
    items = [Item(str(i), text_key(t)) for i, t in enumerate(texts)]

    def embed(indices: Sequence[int], tick: Callable[[int], None]) -> Chunk:
        parts = []
        for s in range(0, len(indices), step):
            part = [texts[i] for i in indices[s : s + step]]
            parts.append(np.asarray(encode(part), np.float32))
            tick(len(part))
        return Chunk([str(i) for i in indices], np.concatenate(parts) if parts else np.zeros((0, dim), np.float32), [])

    return embed_in_chunks(items, embed, dim=dim, checkpoint=checkpoint, chunk_files=chunk_texts,
                           advance=advance or _quiet, what="captions").embeddings


def _quiet(_n: int, /, *, resumed: bool = False) -> None:
    return None


def skipped_info(skipped: Sequence[tuple[str, str]],
                 refused: Sequence[tuple[str, str]] = ()) -> list[fmt.SkippedClip] | None:
    """The manifest's ``skipped_clips`` (None when every clip was embedded): the clips whose ids the grammar
    refused (``refused``, :func:`grammar_records`) and those the pass could not decode; each one logged."""
    for clip_id, reason in [*refused, *skipped]:
        log.warning("skipped catalogue clip %s: %s", clip_id, reason)
    if skipped:
        log.warning("%d catalogue clips could not be decoded and are not indexed (manifest: skipped_clips)",
                    len(skipped))
    if refused:
        log.warning("%d catalogue clips are not indexed for their ids: outside the id grammar, or an earlier "
                    "clip's id once in NFC (docs/service.md, \"Ids\"; manifest: skipped_clips)", len(refused))
    return [fmt.SkippedClip(id=c, reason=r) for c, r in [*refused, *skipped]] or None


def first_decodable(records: Sequence[ClipRecord], decode: Callable[[Any], np.ndarray], n: int = 1) -> list[np.ndarray]:
    """The waveforms of the first ``n`` records that decode (the parity and probe clips: a catalogue's
    undecodable clip is skipped by the pass, not a reason to fail its checks)."""
    from index.errors import AudioDecodeError

    found: list[np.ndarray] = []
    for record in records:
        if len(found) == n:
            break
        try:
            found.append(decode(record.audio))
        except AudioDecodeError:
            continue
    if not found:
        raise BundleError("none of the catalogue's clips could be decoded")
    return found


def pass_checkpoints(partial: Path | None, audio: Path, text: Path, *, providers: Sequence[str],
                     frontend: dict[str, Any], precision: str, limits: DecodeLimits | None = None,
                     moments: dict[str, Any] | None = None) -> tuple[EmbedCheckpoint | None, EmbedCheckpoint | None]:
    """The clips and the captions checkpoints of an export's catalogue pass (None, None: not checkpointed);
    ``moments``: the clips pass windows its long recordings (:func:`catalogue_checkpoint`)."""
    if partial is None:
        return None, None
    return (catalogue_checkpoint(partial, audio, providers=providers, frontend=frontend, precision=precision,
                                 limits=limits, moments=moments),
            catalogue_checkpoint(partial, text, providers=providers, frontend={}, precision=precision,
                                 name="captions"))


@dataclass(frozen=True)
class Catalogue:
    """An embedded catalogue: the clips kept (catalogue order), their vectors, the caption rows of those
    clips with their vectors and language ranges, the skipped clips (the manifest's ``skipped_clips``) and
    the moment windows of the long recordings the clips pass embedded, ``(row of records, spans, vectors)``."""

    records: list[ClipRecord]
    audio: np.ndarray
    text: np.ndarray
    text_items: list[dict[str, Any]]
    ranges: dict[str, tuple[int, int]]
    skipped: list[fmt.SkippedClip] | None
    windows: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)


def embed_catalogue(records: Sequence[ClipRecord], languages: Sequence[str], *, source_manifest: Path, progress: bool,
                    clips: Callable[[Callable[..., Advance]], PassResult],
                    captions: Callable[[list[str], Callable[..., Advance]], np.ndarray],
                    refused: Sequence[tuple[str, str]] = ()) -> Catalogue:
    """The one catalogue pass of every export, trained or pretrained, in process or on Ray: ``clips(task)``
    embeds the clips (``task``: :func:`progress`'s), the clips that could not be decoded are left out (and
    logged), then ``captions(texts, task)`` embeds the captions of the clips kept. ``refused``: the clips the
    id grammar left out before the pass (:func:`grammar_records`), listed first in ``skipped_clips``."""
    with progress_bar(progress) as task:
        done = clips(task)
        skipped = skipped_info(done.skipped, refused)
        kept = kept_records(records, done)
        if not kept:
            raise BundleError(f"{source_manifest}: none of the catalogue's clips could be decoded")
        text_items, ranges = catalogue_texts(kept, languages)
        text_emb = captions([t["text"] for t in text_items], task)
    return Catalogue(kept, done.embeddings, text_emb, text_items, ranges, skipped,
                     bundle_windows([r.id for r in kept], done.windows))


def write_catalogue(staging: Path, audio_emb: np.ndarray, text_emb: np.ndarray, records: Sequence[ClipRecord],
                    text_items: Sequence[dict[str, Any]], ranges: dict[str, tuple[int, int]], *,
                    index_factory: str | None, source_manifest: Path) -> dict[str, fmt.IndexInfo]:
    """The one assembly from a catalogue's embeddings to a bundle's indices and id files, trained or
    pretrained (issue 49): the audio index by the catalogue's size (FAISS lists on disk above the
    threshold, :func:`index.engines.faiss_ondisk.build_and_save`), the caption index grouped by language, both
    id files; the manifest's ``audio_index`` and ``text_index``."""
    from index.engines.faiss_index import build_index, save_index
    from index.engines.faiss_ondisk import build_and_save
    from index.engines.filters import filterable_metadata

    audio_built = build_and_save(audio_emb, staging / fmt.AUDIO_INDEX, index_factory, queries=text_emb)
    text_built = build_index(text_emb, index_factory, queries=audio_emb, language_ranges=ranges)
    save_index(text_built.index, staging / fmt.TEXT_INDEX)
    write_jsonl(staging / fmt.AUDIO_IDS, [
        {"id": r.id, "uri": audio_uri(r, source_manifest), "captions": r.captions, "split": r.split,
         "metadata": filterable_metadata(r.meta)} for r in records
    ])
    write_jsonl(staging / fmt.TEXT_IDS, list(text_items))
    return {"audio_index": index_info(audio_built, file=fmt.AUDIO_INDEX, ids_file=fmt.AUDIO_IDS),
            "text_index": index_info(text_built, file=fmt.TEXT_INDEX, ids_file=fmt.TEXT_IDS, ranges=ranges)}


def kept_records(records: Sequence[ClipRecord], done: PassResult) -> list[ClipRecord]:
    """The records the pass embedded, in catalogue order (the skipped ones left out)."""
    kept = set(done.clip_ids)
    return [r for r in records if r.id in kept]


Encode = Callable[[list[Any]], np.ndarray]


def half_copies(audio: Path, text: Path, scratch: Path) -> tuple[Path, Path]:
    """fp16 copies of both encoder files for the catalogue pass (`--precision fp16`, :mod:`index.catalogue.half_precision`)."""
    return (half_precision_copy(audio, scratch / f"{audio.stem}.fp16.onnx"),
            half_precision_copy(text, scratch / f"{text.stem}.fp16.onnx"))


def probe_texts(records: Sequence[ClipRecord], languages: Sequence[str], catalogue: Sequence[str]) -> list[str]:
    """The caption probe set of an fp16 pass: the parity captions and the first catalogue captions."""
    return parity_texts(records, languages) + list(catalogue[:PROBE_TEXTS])


def half_precision_gate(audio: tuple[Encode, Encode, Sequence[Any]], text: tuple[Encode, Encode, Sequence[Any]],
                        providers: Sequence[str]) -> fmt.CataloguePassInfo:
    """Both encoders' fp16 copies held to fp32 on their probe sets, ``(fp32, fp16, items)`` each
    (:func:`index.catalogue.half_precision.gate`: one line below the gate); the manifest's ``catalogue_pass``."""
    found = {"audio": gate("audio", *audio), "text": gate("text", *text)}
    return catalogue_pass_info(found, "cuda" if "CUDAExecutionProvider" in providers else "cpu")


progress = progress_bar
"""``training.bundle.parts.progress``: the name the exports import."""
