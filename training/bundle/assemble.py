"""The one assembly of a bundle (SPEC §6), trained or pretrained: :func:`assemble_bundle`.

Both exports — :func:`training.bundle.export.export_bundle` (a checkpoint) and
:func:`training.bundle.pretrained.export_pretrained_bundle` (a pretrained model folder) — load their model,
choose the clips (:func:`select_clips`), describe the model (:class:`ModelDescription`) and hand their own
steps (:class:`ExportSteps`: the encoders and their parity checks, how the catalogue is embedded, the
held-out waveforms, the held-out report) to :func:`assemble_bundle`, which runs them in one order inside a
staging folder, writes every other file (the indices and id files, the held-out set, the windows of long
recordings), builds the one :class:`index.bundle.format.BundleManifest` and publishes the bundle. Neither
export builds a manifest or writes a section itself (``tests/training/test_bundle_assembly.py``).

An index-only bundle (`tonearm index`, :mod:`index.catalogue.own_audio`) is not assembled here: it is
torch-free, lives under ``index`` (which never imports ``training``) and copies its source bundle's
manifest, replacing the catalogue's sections.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, TypeVar

import numpy as np

from index.audio.decode import DecodeLimits
from index.bundle import format as fmt
from index.bundle.evalset import MAX_EVAL_CLIPS, EvalSet, write_eval_set
from index.bundle.tokenizer import TextTokenizer
from index.catalogue.checkpoint import CHUNK_FILES, Advance, PassResult, resumable
from index.catalogue.embed_pass import PassOptions
from index.catalogue.half_precision import Precision
from index.catalogue.moment_windows import export_windows
from index.catalogue.ray_embed import RayOptions
from index.engines.faiss_index import parse_factory
from index.runtime.loader import OUTPUTS, TEXT_INPUTS
from training.bundle.parts import (
    CPU,
    OPSET,
    canonical_hash,
    catalogue_records,
    embed_catalogue,
    grammar_records,
    held_out_records,
    make_bundle_id,
    partial_base,
    write_catalogue,
)
from training.bundle.quantize import QuantizeConfig
from training.data.manifest import ClipRecord

E = TypeVar("E")
"""An export's own handle on its staged encoders (sessions, fp32 twins), passed back to its steps."""


@dataclass(frozen=True)
class ModelDescription:
    """What the manifest says about the model whose encoders a bundle holds: where it came from
    (``source``, ``train_config``) and how it reads audio and text. Made by
    :func:`training.bundle.export.trained_model` and :func:`training.bundle.pretrained.pretrained_model`."""

    path: Path
    """The checkpoint directory or the pretrained model folder (``source.checkpoint``, resolved)."""
    name: str
    """The run name (``source.run_name``), the bundle id's prefix and the catalogue checkpoint's name."""
    weights_sha256: str
    config: dict[str, Any]
    """``train_config`` (a pretrained bundle: the folder and the model's own config); its canonical
    hash is ``source.config_hash``."""
    objective: dict[str, Any]
    frontend: dict[str, Any]
    """The feature front-end's settings (a pretrained bundle: its feature extractor's)."""
    embed_dim: int
    languages: list[str]
    sample_rate: int
    clip_seconds: float
    clip_samples: int
    audio_frontend: fmt.AudioFrontendInfo | None
    """How the service prepares uploads (short-clip padding, long clips); None: zero padding."""
    eval_crop: Literal["center", "chunk"]
    """How the held-out clips were prepared (the manifest's ``eval_set.eval_crop``)."""


@dataclass(frozen=True)
class ClipSelection:
    """The clips an export reads: the catalogue to index and the held-out set, from one data manifest."""

    manifest: Path
    all_records: list[ClipRecord]
    catalogue: list[ClipRecord]
    split: str
    """The held-out split (``test``, else ``val``)."""
    held_out: list[ClipRecord]
    refused: list[tuple[str, str]] = field(default_factory=list)
    """(id as shown, reason) of the clips the id grammar left out of ``catalogue`` (:func:`select_clips`)."""

    @property
    def held_out_moments(self) -> list[ClipRecord]:
        """The held-out split's recordings with moments (the windows' held-out report)."""
        return [r for r in self.all_records if r.split == self.split and r.moments]


def select_clips(all_records: Sequence[ClipRecord], *, manifest: Path, splits: Sequence[str] | None,
                 index_factory: str | None, embed_dim: int) -> ClipSelection:
    """The catalogue (every clip, or those of ``splits``) and the held-out set (from every clip); the index
    factory is checked here, before the slow steps. The catalogue's ids follow the id grammar
    (:func:`training.bundle.parts.grammar_records`): stored in NFC; a clip whose id the grammar refuses, or
    that repeats an earlier clip's id once in NFC, is left out and listed in ``skipped_clips``."""
    catalogue, refused = grammar_records(catalogue_records(all_records, splits, manifest))
    if index_factory is not None:
        parse_factory(index_factory, embed_dim)
    split, held_out = held_out_records(all_records)
    return ClipSelection(manifest=manifest, all_records=list(all_records), catalogue=catalogue, split=split,
                         held_out=held_out, refused=refused)


@dataclass(frozen=True)
class StagedEncoders(Generic[E]):
    """Both encoder files and the tokenizer, written into the staging folder, and what their checks found."""

    handle: E
    """The export's own view of them, handed back to its :meth:`ExportSteps.catalogue_pass` and ``evaluate``."""
    audio_inputs: list[str]
    """The staged audio graph's inputs (``waveform``; PE-Audio also ``padding_mask``)."""
    audio_cosine: float
    text_cosine: float
    """Lowest cosine of each staged encoder to the model it came from (``parity_min_cosine``)."""
    tokenizer: TextTokenizer
    quantize: QuantizeConfig


@dataclass(frozen=True)
class CataloguePass:
    """How an export embeds its catalogue: ``clips(task)`` and ``captions(texts, task)``
    (:func:`training.bundle.parts.embed_catalogue`), and the manifest's ``catalogue_pass`` (fp16 copies)."""

    clips: Callable[[Callable[..., Advance]], PassResult]
    captions: Callable[[list[str], Callable[..., Advance]], np.ndarray]
    info: fmt.CataloguePassInfo | None = None


@dataclass(frozen=True, kw_only=True)
class StepOptions:
    """The options both exports' steps take (:class:`training.bundle.export.TrainedSteps`,
    :class:`training.bundle.pretrained.PretrainedSteps` extend it; keyword-only, so each keeps its own model
    fields first): how the encoders are quantized, the ONNX Runtime providers, Ray, the catalogue pass's
    precision, files per checkpointed chunk and the in-process pass's options."""

    quantize: QuantizeConfig
    providers: Sequence[str] = CPU
    ray: RayOptions | None = None
    precision: Precision = "fp32"
    chunk_files: int = CHUNK_FILES
    pass_options: PassOptions | None = None

    @property
    def limits(self) -> DecodeLimits:
        """The decode limits of ``pass_options`` (default: :class:`index.catalogue.embed_pass.PassOptions`'s):
        :attr:`ExportSteps.limits`."""
        return (self.pass_options or PassOptions()).limits


class ExportSteps(Protocol[E]):
    """What differs between a trained and a pretrained export; :func:`assemble_bundle` runs them in this order
    (:class:`training.bundle.export.TrainedSteps`, :class:`training.bundle.pretrained.PretrainedSteps`)."""

    @property
    def limits(self) -> DecodeLimits:
        """What one catalogue file may cost to decode: the clips pass, the parity and held-out clips and the
        windows of long recordings decode under them (:class:`index.audio.decode.DecodeLimits`; a catalogue
        clip past them is skipped with the reason)."""
        ...

    def write_encoders(self, staging: Path, scratch: Path, catalogue: Sequence[ClipRecord]) -> StagedEncoders[E]:
        """Both ONNX encoders and the tokenizer into ``staging`` (an encoder to quantize first in fp32 in
        ``scratch``), checked against the model they came from (parity clips and captions of ``catalogue``)."""
        ...

    def catalogue_pass(self, encoders: E, catalogue: Sequence[ClipRecord], scratch: Path,
                       partial: Path | None) -> CataloguePass:
        """The clips and captions passes (in process, with fp16 copies, or on Ray), checkpointed in
        ``<partial>.partial/`` (None: not checkpointed)."""
        ...

    def held_out(self, records: Sequence[ClipRecord]) -> EvalSet:
        """The held-out clips' waveforms (as the bundle stores them) and caption queries."""
        ...

    def evaluate(self, encoders: E, eval_set: EvalSet,
                 eval_dir: Path) -> tuple[fmt.EvaluationInfo, fmt.QuantizationInfo | None]:
        """The held-out report (``eval_dir``: the set as written); with quantized encoders also the
        measured cost against fp32."""
        ...


def assemble_bundle(steps: ExportSteps[E], model: ModelDescription, clips: ClipSelection, *, out_dir: Path,
                    fingerprint: str, index_factory: str | None, providers: Sequence[str], progress: bool) -> Path:
    """Write the bundle of ``model`` over ``clips`` into ``out_dir`` and return its path: ``steps`` write and check
    the encoders and embed the catalogue; then the indices and id files, the held-out set and its report, the
    windows of long recordings and the manifest, in a staging folder published atomically
    (:func:`index.bundle.format.publish`). ``fingerprint``: the hash of the export's inputs, which names the
    bundle (``<name>-<UTC time>-<8 hex>``) and its resumable catalogue checkpoint
    (:func:`training.bundle.parts.partial_base`, removed once published)."""
    created = datetime.now(UTC).replace(microsecond=0)
    bundle_id = make_bundle_id(model.name, created=created, fingerprint=fingerprint)
    partial = partial_base(out_dir, model.name, fingerprint)
    with resumable(partial), fmt.staged_bundle(out_dir, bundle_id) as staging, tempfile.TemporaryDirectory() as scratch:
        sections = _write_sections(steps, model, clips, staging, Path(scratch), partial=partial,
                                   index_factory=index_factory, providers=providers, progress=progress)
        return fmt.publish(staging, bundle_manifest(model, clips, bundle_id=bundle_id, created=created, **sections))


def _write_sections(steps: ExportSteps[E], model: ModelDescription, clips: ClipSelection, staging: Path,
                    scratch: Path, *, partial: Path | None, index_factory: str | None, providers: Sequence[str],
                    progress: bool) -> dict[str, Any]:
    """Every bundle file except the manifest, in order; the manifest sections they determine."""
    staged = steps.write_encoders(staging, scratch, clips.catalogue)
    passing = steps.catalogue_pass(staged.handle, clips.catalogue, scratch, partial)
    done = embed_catalogue(clips.catalogue, model.languages, source_manifest=clips.manifest, progress=progress,
                           clips=passing.clips, captions=passing.captions, refused=clips.refused)
    indices = write_catalogue(staging, done.audio, done.text, done.records, done.text_items, done.ranges,
                              index_factory=index_factory, source_manifest=clips.manifest)
    eval_set = steps.held_out(clips.held_out)
    write_eval_set(staging / fmt.EVAL_DIR, eval_set)
    evaluation, quantization = steps.evaluate(staged.handle, eval_set, staging / fmt.EVAL_DIR)
    quantize, tokenizer = staged.quantize, staged.tokenizer
    moments = export_windows(  # long recordings' windows, embedded by the clips pass (docs/bundle.md "Moments")
        staging, done.windows, encoder_file=fmt.AUDIO_ENCODER, sample_rate=model.sample_rate,
        clip_samples=model.clip_samples, embed_dim=model.embed_dim, frontend=model.audio_frontend,
        providers=providers, heldout=clips.held_out_moments, languages=model.languages,
        text_files=(fmt.TEXT_ENCODER, fmt.TOKENIZER))
    return {
        "audio_encoder": fmt.EncoderInfo(file=fmt.AUDIO_ENCODER, opset=OPSET, inputs=list(staged.audio_inputs),
                                         outputs=list(OUTPUTS), parity_min_cosine=staged.audio_cosine,
                                         quantization=quantize.label if quantize.applies("audio") else "none"),
        "text_encoder": fmt.EncoderInfo(file=fmt.TEXT_ENCODER, opset=OPSET, inputs=list(TEXT_INPUTS),
                                        outputs=list(OUTPUTS), parity_min_cosine=staged.text_cosine,
                                        quantization=quantize.label if quantize.applies("text") else "none"),
        "tokenizer": fmt.TokenizerInfo(file=fmt.TOKENIZER, max_length=tokenizer.max_length,
                                       vocab_size=tokenizer.vocab_size),
        **indices,
        "eval_set": fmt.EvalSetInfo(split=clips.split, n_clips=len(eval_set.clip_ids),
                                    n_captions=len(eval_set.captions), max_clips=MAX_EVAL_CLIPS,
                                    eval_crop=model.eval_crop),
        "evaluation": evaluation,
        "quantization": quantization,
        "catalogue_pass": passing.info,
        "skipped_clips": done.skipped,
        "moments": moments,
    }


def bundle_manifest(model: ModelDescription, clips: ClipSelection, *, bundle_id: str, created: datetime,
                    **sections: Any) -> fmt.BundleManifest:
    """The manifest of every exported bundle: the model's description and provenance, and the ``sections``
    its files determine (encoders, tokenizer, indices, held-out set and report, quantization, catalogue
    pass, skipped clips, moments); ``files`` is filled in by :func:`index.bundle.format.publish`."""
    return fmt.BundleManifest(
        bundle_id=bundle_id,
        created=created.isoformat().replace("+00:00", "Z"),
        source=fmt.SourceInfo(
            checkpoint=str(model.path.resolve()), run_name=model.name, config_hash=canonical_hash(model.config),
            weights_sha256=model.weights_sha256, data_manifest=str(clips.manifest.resolve()),
        ),
        train_config=model.config,
        objective=model.objective,
        frontend=model.frontend,
        embed_dim=model.embed_dim,
        languages=list(model.languages),
        sample_rate=model.sample_rate,
        clip_seconds=model.clip_seconds,
        clip_samples=model.clip_samples,
        audio_frontend=model.audio_frontend,
        files={},
        **sections,
    )
