"""`tonearm export --pretrained MODEL_DIR`: a published model folder → bundle, no training (SPEC §11).

Families (:mod:`training.bundle.pretrained_family`, read from ``config.json``): Hugging Face
``ClapModel`` (:mod:`training.models.pretrained_clap`) and Meta PE-Audio ``PeAudioModel``
(:mod:`training.models.pretrained_pe_audio`).

Steps (the bundle is the one `tonearm export` writes from a checkpoint, SPEC §6):

1. load and check the folder;
2. export the two encoders to ONNX — the audio graph takes a waveform at the
   extractor's rate and computes the extractor's features inside (CLAP: its log-mel;
   PE-Audio: none, the codec encoder reads the waveform) — and check them against the
   **model's own** audio embedding (on its feature extractor's output) and text embedding
   (on its own tokenizer's ids): cosine ≥ 0.999 per item, through the same padding and
   chunking the service applies; the export fails otherwise;
3. embed the data manifest's clips and captions with the ONNX encoders, build the
   FAISS indices, store the held-out set and its report;
4. write the manifest: ``frontend`` = the extractor's settings, ``audio_frontend`` =
   the padding the service applies to uploads (resampled to ``sample_rate`` first).

Step 2 and the folder's side of 3 (how clips are prepared and embedded, the held-out waveforms, the
report) are :class:`PretrainedSteps`, the manifest's model description :func:`pretrained_model`; the
order, every other file and the manifest are :func:`training.bundle.assemble.assemble_bundle`, the one
assembly a checkpoint's `tonearm export` shares.
"""

from __future__ import annotations

import argparse
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from index.audio.decode import DecodeLimits, decode_audio, eval_chunks
from index.audio.frontend import keeps_short_clips, pad_short_clip
from index.bundle import format as fmt
from index.bundle.evalset import EvalSet
from index.catalogue.checkpoint import (
    CHUNK_FILES,
    CHUNK_TEXTS,
    Advance,
    EmbedCheckpoint,
    PassResult,
)
from index.catalogue.embed_pass import (
    DecodeCall,
    EncoderSpec,
    PassClock,
    PassOptions,
    pass_options_from_args,
)
from index.catalogue.half_precision import (
    PROBE_CLIPS,
    Precision,
    centred_cosines,
    check_precision_options,
    probe_waves,
)
from index.catalogue.pass_windows import WindowedDecode, WindowPlan
from index.catalogue.ray_embed import (
    RayOptions,
    decode_whole,
    embed_audio_files,
    embed_captions,
    ray_options_from_args,
)
from index.errors import BundleError
from index.languages import DEFAULT_LANGUAGES
from index.metrics.report import METRIC_CONVENTION
from index.runtime.evaluate import evaluate_eval_set
from index.runtime.loader import (
    AUDIO_INPUTS,
    TEXT_INPUTS,
    device_providers,
    encode_clips,
    encode_texts,
    encode_waveforms,
)
from training.bundle.assemble import (
    CataloguePass,
    ModelDescription,
    StagedEncoders,
    StepOptions,
    assemble_bundle,
    select_clips,
)
from training.bundle.onnx_export import (
    MIN_COSINE,
    ExportError,
    export_audio_encoder,
    export_text_encoder,
)
from training.bundle.parts import (
    CPU,
    OPSET,
    canonical_hash,
    catalogue_texts,
    cosines,
    embed_clips,
    embed_clips_on_ray,
    embed_texts,
    first_decodable,
    half_copies,
    half_precision_gate,
    parity_texts,
    pass_checkpoints,
    probe_texts,
    quantization_records,
    quantize_config,
)
from training.bundle.parts import load_session as _load_session
from training.bundle.pretrained_family import detect_family
from training.bundle.quantize import EncoderPair, QuantizeConfig, measure, quantize_model
from training.data.dataset import eval_captions
from training.data.manifest import ClipRecord, load_manifest
from training.models.pretrained_clap import (
    PretrainedClap,
    load_pretrained_clap,
    reference_audio_features,
    reference_text_features,
)
from training.models.pretrained_pe_audio import PretrainedPeAudio, load_pretrained_pe_audio

log = logging.getLogger(__name__)

Pretrained = PretrainedClap | PretrainedPeAudio


def embed_dim(model: Pretrained) -> int:
    if isinstance(model, PretrainedPeAudio):
        return model.embed_dim
    return int(model.model.config.projection_dim)


def pad_multiple(model: Pretrained) -> int | None:
    return model.settings.pad_multiple if isinstance(model, PretrainedPeAudio) else None


def load_pretrained(folder: Path) -> Pretrained:
    """The folder's model, by the family its ``config.json`` names (one-line refusal otherwise)."""
    family = detect_family(folder)
    if family in ("pe_audio", "pe_audio_video"):
        return load_pretrained_pe_audio(folder)
    return load_pretrained_clap(folder)


def frontend_info(model: Pretrained) -> fmt.AudioFrontendInfo:
    """The manifest's ``audio_frontend``: the padding the service applies to uploads."""
    s = model.settings
    if isinstance(model, PretrainedPeAudio):
        return fmt.AudioFrontendInfo(source="pe_audio_feature_extractor", padding="reflect",
                                     pad_multiple=model.settings.pad_multiple, long_clips=model.settings.long_clips,
                                     model_truncation=s.truncation)
    return fmt.AudioFrontendInfo(padding=s.padding, model_truncation=s.truncation)  # type: ignore[arg-type]


class PretrainedEncoders:
    """The staged ONNX encoders with the bundle's audio preparation (padding, then chunking) —
    the steps of :meth:`index.runtime.loader.LoadedBundle.encode_audio`, on the staged files."""

    def __init__(self, clap: Pretrained, audio: Path, text: Path, providers: Sequence[str] = CPU) -> None:
        dim = embed_dim(clap)
        self.clap, self.dim, self.providers = clap, dim, tuple(providers)
        self.audio = _load_session(audio, AUDIO_INPUTS, dim, providers)
        self.text = _load_session(text, TEXT_INPUTS, dim, providers)

    def prepare(self, wave: np.ndarray) -> np.ndarray:
        s = self.clap.settings
        return pad_short_clip(wave, s.clip_samples, s.padding, pad_multiple(self.clap))  # type: ignore[arg-type]

    def encode_audio(self, waves: Sequence[np.ndarray], *, max_call_samples: int | None = None) -> np.ndarray:
        """``max_call_samples``: PE-Audio's samples a call (default the service's; a catalogue pass's
        ``--codec-call-samples``)."""
        if isinstance(self.clap, PretrainedPeAudio):  # exactly the service's path (long clips whole)
            return encode_clips(self.audio, waves, clip_samples=self.clap.settings.clip_samples, embed_dim=self.dim,
                                frontend=frontend_info(self.clap), max_call_samples=max_call_samples)
        prepared = [self.prepare(w) for w in waves]
        return encode_waveforms(self.audio, prepared, clip_samples=self.clap.settings.clip_samples,
                                embed_dim=self.dim, keep_short=keeps_short_clips(self.clap.settings.padding))

    def encode_text(self, texts: Sequence[str]) -> np.ndarray:
        return encode_texts(self.text, self.clap.tokenizer, texts, embed_dim=self.dim)

    def spec(self, call_samples: int | None = None) -> EncoderSpec:
        """What a device process of ``--devices`` loads to embed as :meth:`encode_audio` does: the audio file,
        the providers and the manifest's ``audio_frontend`` (:func:`index.runtime.loader.encode_clips` pads a
        CLAP clip as :meth:`prepare` does, and runs PE-Audio's whole clips in length buckets, ``call_samples``
        a call)."""
        return EncoderSpec(path=str(self.audio.path), embed_dim=self.dim, clip_samples=self.clap.settings.clip_samples,
                           providers=self.providers, frontend=frontend_info(self.clap).model_dump(mode="json"),
                           call_samples=call_samples)


def reference_window(model: Pretrained, window: np.ndarray) -> torch.Tensor:
    """The model's own audio embedding of one window, through its own feature extractor."""
    if isinstance(model, PretrainedPeAudio):
        return model.reference_audio(window)
    return reference_audio_features(model, window)


def reference_texts(model: Pretrained, texts: list[str]) -> torch.Tensor:
    """The model's own text embeddings, with its own tokenizer."""
    if isinstance(model, PretrainedPeAudio):
        return model.reference_text(texts)
    return reference_text_features(model, texts)


def reference_clip_features(clap: Pretrained, wave: np.ndarray) -> np.ndarray:
    """What the model's own pipeline gives a clip under the bundle's policy: its embedding of
    the clip (≤ ``max_length_s``) or the normalised mean over its chunk windows (longer)."""
    n = clap.settings.clip_samples
    whole = isinstance(clap, PretrainedPeAudio) and clap.settings.long_clips == "whole"
    windows = [wave] if wave.shape[0] <= n or whole else list(eval_chunks(wave, n))
    mean = torch.nn.functional.normalize(torch.stack([reference_window(clap, w) for w in windows]), dim=-1).mean(0)
    return torch.nn.functional.normalize(mean, dim=-1).numpy()


def parity_clips(wave: np.ndarray, n: int, *, reflect: bool = False) -> list[np.ndarray]:
    """A short clip (a third), one of exactly ``max_length_s`` and a long one (2.5x), from a real clip.

    ``reflect`` (PE-Audio, ~1 s of CPU per second of audio in each of torch and ONNX): a short clip of
    a twentieth of the window plus 7 samples (not a hop multiple, so the reflection runs), one of
    exactly the window and one of 10.5 s + 7 samples (embedded whole, ``long_clips = "whole"``) — 21 s of
    audio, not 43 s. Chunk-and-average of longer clips (CLAP) is the loader's mean over such windows, the
    same code for every family (``index.runtime.loader.encode_waveforms``).

    Two more short clips of unrelated synthetic signals (white noise, a pulsed tone;
    :func:`index.catalogue.half_precision.probe_waves`) give the centred cosine of :func:`check_parity` its power:
    a short-clip padding error moves the short clips away from the others."""
    tiled = np.resize(np.asarray(wave, dtype=np.float32), 3 * n)
    short = n // 20 + 7 if reflect else n // 3
    probes = probe_waves(48_000, short)[1:3]
    if reflect:
        return [tiled[:short], tiled[:n], tiled[: n + n // 20 + 7], *probes]
    return [tiled[:short], tiled[:n], tiled[: 5 * n // 2], *probes]


Expected = tuple[np.ndarray, np.ndarray]
"""The model's own (audio, text) embeddings of the parity clips and captions."""


def references(model: Pretrained, waves: Sequence[np.ndarray], texts: Sequence[str]) -> Expected:
    """The model's own embeddings of ``waves`` (under the bundle's window policy) and ``texts``: computed
    once per export, shared by the fp32 check and the quantized encoders' recorded parity."""
    return (np.stack([reference_clip_features(model, w) for w in waves]),
            reference_texts(model, list(texts)).numpy())


def parity(encoders: PretrainedEncoders, waves: Sequence[np.ndarray], texts: Sequence[str], expected: Expected,
           modalities: Sequence[str] = ("audio", "text")) -> dict[str, float]:
    """Minimum per-item cosine of ``encoders`` to the model's own embeddings, per modality (no check)."""
    found = {}
    if "audio" in modalities:
        found["audio"] = float(cosines(encoders.encode_audio(waves), expected[0]).min())
    if "text" in modalities:
        found["text"] = float(cosines(encoders.encode_text(texts), expected[1]).min())
    return found


def check_parity(encoders: PretrainedEncoders, waves: Sequence[np.ndarray], texts: Sequence[str],
                 expected: Expected) -> tuple[float, float]:
    """Minimum per-item cosine of the bundle's encoders to the model's own audio / text embeddings;
    :class:`ExportError` below :data:`MIN_COSINE`, or when the lowest **centred** cosine (each set's mean
    row removed, :func:`index.catalogue.half_precision.centred_cosines`; :mod:`training.bundle.step0`) is below
    :data:`MIN_CENTRED_COSINE`: with random or weakly trained weights unrelated inputs embed at plain
    cosines near 1, so zero padding of short clips passes a plain 0.999 (0.99946) but not the centred check."""
    found = parity(encoders, waves, texts, expected)
    centred = {"audio": float(centred_cosines(encoders.encode_audio(waves), expected[0]).min()),
               "text": float(centred_cosines(encoders.encode_text(texts), expected[1]).min())}
    for name, value in found.items():
        what = f"{name} encoder vs the model's own {name} embedding"
        if not value >= MIN_COSINE:
            raise ExportError(f"{what}: min cosine {value:.6f} < {MIN_COSINE}")
        if not centred[name] >= MIN_CENTRED_COSINE:
            raise ExportError(f"{what}: min centred cosine {centred[name]:.6f} < {MIN_CENTRED_COSINE} "
                              f"(plain cosine {value:.6f})")
        log.info("%s: min cosine %.6f, centred %.6f", what, value, centred[name])
    return found["audio"], found["text"]


MIN_CENTRED_COSINE = 0.99
"""Lowest centred cosine of the bundle's encoders to the model's own (as :data:`training.bundle.step0.MIN_CENTRED_COS`)."""


def export_pretrained_encoders(clap: Pretrained, staging: Path, scratch: Path | None = None, *,
                               quantize: QuantizeConfig | None = None, providers: Sequence[str] = CPU,
                               ) -> tuple[PretrainedEncoders, PretrainedEncoders]:
    """Write both ONNX encoders and the tokenizer into ``staging``; returns (served, fp32) encoders.

    An encoder to quantize (``quantize``) is exported in fp32 to ``scratch`` and its quantized copy
    (:func:`training.bundle.quantize.quantize_model`) goes into ``staging``; without quantization both are the same."""
    s, quantize = clap.settings, quantize or QuantizeConfig()
    if quantize.encoders and scratch is None:
        raise ValueError("quantized export needs a scratch folder for the fp32 encoders")
    audio_fp32 = (scratch if quantize.applies("audio") else staging) / fmt.AUDIO_ENCODER  # type: ignore[operator]
    text_fp32 = (scratch if quantize.applies("text") else staging) / fmt.TEXT_ENCODER  # type: ignore[operator]
    # PE-Audio: the graph takes a padding_mask, so the loader runs mixed lengths in length buckets
    export_audio_encoder(clap.audio, audio_fp32, sample_rate=s.sample_rate, opset=OPSET, mask_multiple=pad_multiple(clap))
    export_text_encoder(clap.text, text_fp32, max_length=clap.tokenizer.max_length, opset=OPSET)
    clap.tokenizer.save(staging / fmt.TOKENIZER)
    for path, modality in ((audio_fp32, "audio"), (text_fp32, "text")):
        if quantize.applies(modality):  # type: ignore[arg-type]
            quantize_model(path, staging / path.name, precision=quantize.precision)
    fp32 = PretrainedEncoders(clap, audio_fp32, text_fp32, providers)
    if not quantize.encoders:
        return fp32, fp32
    return PretrainedEncoders(clap, staging / fmt.AUDIO_ENCODER, staging / fmt.TEXT_ENCODER, providers), fp32


def embed_catalogue_audio(encoders: PretrainedEncoders, records: Sequence[ClipRecord], rate: int, advance: Advance, *,
                          checkpoint: EmbedCheckpoint | None = None, chunk_files: int = CHUNK_FILES,
                          options: PassOptions | None = None, clock: PassClock | None = None) -> PassResult:
    """The catalogue's clip embeddings (:func:`training.bundle.parts.embed_clips`: decoded beside the
    encoder, checkpointed in chunks; undecodable clips skipped and listed) and the long recordings' moment
    windows from the same decode; with ``options.devices`` each device process loads the encoder's file as
    :meth:`PretrainedEncoders.spec` says."""
    options = options or PassOptions()
    decode = WindowedDecode(DecodeCall(decode_audio, kwargs={"sample_rate": rate, **options.limits.kwargs()},
                                       sample_rate=rate), window_plan(encoders.clap))
    encode = functools.partial(encoders.encode_audio, max_call_samples=options.codec_call_samples)
    return embed_clips(records, decode, encode, dim=encoders.dim, advance=advance, checkpoint=checkpoint, chunk_files=chunk_files,
                       options=options, clock=clock, spec=encoders.spec(options.codec_call_samples))


def window_plan(model: Pretrained) -> WindowPlan:
    """The moment windows of a pretrained model's bundle: its window at its rate."""
    return WindowPlan(model.settings.sample_rate, model.settings.clip_samples)


def audio_plan(model: Pretrained) -> dict[str, Any]:
    """What besides the encoder decides a clip's vector here (the catalogue checkpoint's plan)."""
    s = model.settings
    return {"sample_rate": s.sample_rate, "clip_samples": s.clip_samples, "padding": s.padding,
            "audio_frontend": frontend_info(model).model_dump(mode="json")}


def _embed_on_ray(clap: Pretrained, encoders: PretrainedEncoders, records: Sequence[ClipRecord], options: RayOptions,
                  checkpoint: EmbedCheckpoint | None, chunk_files: int, limits: DecodeLimits,
                  call_samples: int | None = None, advance: Advance | None = None,
                  clock: PassClock | None = None) -> PassResult:
    """The catalogue's clip embeddings on a Ray cluster, one job a chunk: each actor runs the served encoder
    file and prepares a clip as :meth:`PretrainedEncoders.encode_audio` does (the manifest's ``audio_frontend``:
    padding, then the chunk mean), so the vectors are the in-process pass's; it windows the long recordings."""
    s, model_bytes = clap.settings, encoders.audio.path.read_bytes()

    def run(paths: list[Path]) -> Any:
        return embed_audio_files(paths, model_bytes, decode=functools.partial(decode_whole, limits=limits),
                                 embed_dim=encoders.dim,
                                 sample_rate=s.sample_rate, clip_samples=s.clip_samples, policy="chunk",
                                 options=options, frontend=frontend_info(clap), call_samples=call_samples,
                                 windows=window_plan(clap))

    return embed_clips_on_ray(records, run, dim=encoders.dim, checkpoint=checkpoint, chunk_files=chunk_files,
                              advance=advance, clock=clock)


def _held_out(records: Sequence[ClipRecord], languages: Sequence[str], rate: int, limits: DecodeLimits) -> EvalSet:
    captions = eval_captions(records, languages)
    return EvalSet(
        clip_ids=[r.id for r in records],
        waveforms=[decode_audio(r.audio, sample_rate=rate, **limits.kwargs()) for r in records],
        captions=list(captions.texts),
        clip=np.asarray(captions.clip, dtype=np.int64),
        lang=np.asarray(captions.lang, dtype=str),
        group=np.asarray(captions.group, dtype=np.int64),
    )


def _load_records(manifest: Path, languages: Sequence[str] | None) -> tuple[list[ClipRecord], list[str]]:
    chosen = list(languages or DEFAULT_LANGUAGES)
    records = load_manifest(manifest, languages=chosen, drop_other_languages=bool(languages))
    if not records:
        raise BundleError(f"{manifest}: no clips to index")
    present = [lang for lang in chosen if any(r.captions.get(lang) for r in records)]
    if not present:
        raise BundleError(f"{manifest}: no captions in {', '.join(chosen)}")
    return records, present


def pretrained_model(model_dir: Path, clap: Pretrained, languages: Sequence[str]) -> ModelDescription:
    """The manifest's description of a pretrained model folder: the folder and its model's own config, the
    weights file's sha256, the feature extractor's settings (``frontend``) and the padding the service applies
    to uploads (``audio_frontend``, :func:`frontend_info`); held-out clips are chunked (``eval_crop``)."""
    weights = next(p for p in (model_dir / "model.safetensors", model_dir / "pytorch_model.bin",
                               model_dir / "model.safetensors.index.json") if p.is_file())
    s = clap.settings
    return ModelDescription(
        path=model_dir, name="pretrained-" + model_dir.resolve().name, weights_sha256=fmt.sha256_file(weights),
        config={"pretrained": str(model_dir.resolve()), "model": clap.model.config.to_dict()},
        objective={"name": "none", "pretrained": "pe-audio" if isinstance(clap, PretrainedPeAudio) else "laion-clap"},
        frontend=s.extractor, embed_dim=embed_dim(clap), languages=list(languages), sample_rate=s.sample_rate,
        clip_seconds=s.max_length_s, clip_samples=s.clip_samples, audio_frontend=frontend_info(clap),
        eval_crop="chunk",
    )


def export_pretrained_bundle(
    model_dir: Path | str,
    *,
    manifest: Path | str,
    out_dir: Path | str,
    languages: Sequence[str] | None = None,
    index_factory: str | None = None,
    splits: Sequence[str] | None = None,
    progress: bool = True,
    quantize: QuantizeConfig | None = None,
    providers: Sequence[str] = CPU,
    ray: RayOptions | None = None,
    precision: Precision = "fp32",
    chunk_files: int = CHUNK_FILES,
    pass_options: PassOptions | None = None,
) -> Path:
    """Bundle of the model folder ``model_dir`` (CLAP or PE-Audio) over the clips of ``manifest``; returns its path.
    ``providers``: ONNX Runtime providers of the checks and the catalogue pass (``--device cuda``); ``ray``: the
    catalogue pass (clips and captions) runs as two Ray Data jobs instead (same bundle, vectors to float tolerance);
    ``precision`` ``fp16``: the in-process pass runs fp16 copies of the encoders (:mod:`index.catalogue.half_precision`).
    The in-process clips pass is checkpointed every ``chunk_files`` clips in ``out_dir/.<name>-<8 hex>.partial/``
    (:func:`training.bundle.parts.partial_base`) and the same call resumes it after an interruption; the folder
    is removed once the bundle is published. The bundle is assembled by
    :func:`training.bundle.assemble.assemble_bundle` with this folder's :class:`PretrainedSteps`."""
    model_dir, manifest, out_dir = Path(model_dir), Path(manifest), Path(out_dir)
    check_precision_options(precision, None, ray=ray is not None, quantized=(quantize or QuantizeConfig()).encoders)
    clap = load_pretrained(model_dir)  # refuses families other than SUPPORTED in one line
    all_records, langs = _load_records(manifest, languages)
    clips = select_clips(all_records, manifest=manifest, splits=splits, index_factory=index_factory,
                         embed_dim=embed_dim(clap))
    model = pretrained_model(model_dir, clap, langs)
    quantize = quantize or QuantizeConfig()
    fingerprint = canonical_hash([model.weights_sha256, clap.settings.extractor, str(manifest.resolve()), index_factory,
                                  langs, *([sorted(splits)] if splits else []),
                                  *([quantize.model_dump(mode="json")] if quantize.encoders else []),
                                  *(["fp16"] if precision == "fp16" else [])])
    steps = PretrainedSteps(clap, langs, quantize=quantize, providers=providers, ray=ray, precision=precision,
                            chunk_files=chunk_files, pass_options=pass_options)
    return assemble_bundle(steps, model, clips, out_dir=out_dir, fingerprint=fingerprint,
                           index_factory=index_factory, providers=providers, progress=progress)


Staged = tuple[PretrainedEncoders, PretrainedEncoders]
"""A pretrained export's staged encoders: (served, fp32) — the same pair without quantization."""


@dataclass(frozen=True)
class PretrainedSteps(StepOptions):
    """A pretrained folder's own steps of the one assembly (:class:`training.bundle.assemble.ExportSteps`).

    The fp32 encoders are held to :data:`MIN_COSINE` (and the centred :data:`MIN_CENTRED_COSINE`) against the
    model's own embeddings; a quantized encoder's recorded parity is its own cosine to the model (not held to
    it) and its cost is measured on the held-out set against fp32. The options (``quantize``, providers, Ray,
    precision, …, ``limits``) are :class:`training.bundle.assemble.StepOptions`'s."""

    clap: Pretrained
    languages: list[str]

    def write_encoders(self, staging: Path, scratch: Path, catalogue: Sequence[ClipRecord]) -> StagedEncoders[Staged]:
        clap, quantize, rate = self.clap, self.quantize, self.clap.settings.sample_rate
        encoders, fp32 = export_pretrained_encoders(clap, staging, scratch, quantize=quantize, providers=self.providers)
        limits = self.limits.kwargs()
        (sample,) = first_decodable(catalogue, lambda path: decode_audio(path, sample_rate=rate, **limits))
        clips = parity_clips(sample, clap.settings.clip_samples, reflect=keeps_short_clips(clap.settings.padding))
        texts = parity_texts(catalogue, self.languages)
        expected = references(clap, clips, texts)
        audio_cos, text_cos = check_parity(fp32, clips, texts, expected)
        if quantize.encoders:
            found = parity(encoders, clips, texts, expected, modalities=quantize.encoders)
            audio_cos, text_cos = found.get("audio", audio_cos), found.get("text", text_cos)
            log.info("%s encoders vs the model: audio %.6f, text %.6f", quantize.label, audio_cos, text_cos)
        return StagedEncoders((encoders, fp32), audio_inputs=encoders.audio.input_names, audio_cosine=audio_cos,
                              text_cosine=text_cos, tokenizer=clap.tokenizer, quantize=quantize)

    def catalogue_pass(self, encoders: Staged, catalogue: Sequence[ClipRecord], scratch: Path,
                       partial: Path | None) -> CataloguePass:
        clap, ray, records, languages = self.clap, self.ray, catalogue, self.languages
        served, rate, info = encoders[0], clap.settings.sample_rate, None
        checkpoint, captions = pass_checkpoints(partial, served.audio.path, served.text.path,
                                                providers=list(CPU) if ray is not None else list(self.providers),
                                                frontend=audio_plan(clap), precision=self.precision,
                                                limits=self.limits, moments=window_plan(clap).describe())
        passing = served
        if ray is None and self.precision == "fp16":
            all_texts = [t["text"] for t in catalogue_texts(records, languages)[0]]
            passing, info = _half_encoders(clap, served, records, languages, all_texts, scratch, self.providers,
                                           self.limits)

        def clips_pass(task: Callable[..., Advance]) -> PassResult:
            if ray is not None:
                counted = PassClock(timed=False)  # the actors decode and encode: the windows are counted here
                return _embed_on_ray(clap, served, records, ray, checkpoint, self.chunk_files, self.limits,
                                     (self.pass_options or PassOptions()).codec_call_samples,
                                     task("embedding clips", len(records), counted), counted)
            clock = PassClock()
            return embed_catalogue_audio(passing, records, rate, task("embedding clips", len(records), clock),
                                         checkpoint=checkpoint, chunk_files=self.chunk_files,
                                         options=self.pass_options, clock=clock)

        def texts_of(texts: list[str], task: Callable[..., Advance]) -> np.ndarray:
            if ray is not None:
                model_bytes = served.text.path.read_bytes()
                return embed_texts(texts, lambda part: embed_captions(part, model_bytes, clap.tokenizer,
                                                                      embed_dim=served.dim, options=ray).embeddings,
                                   dim=served.dim, checkpoint=captions, step=CHUNK_TEXTS)
            return embed_texts(texts, passing.encode_text, dim=served.dim, checkpoint=captions,
                               advance=task("embedding captions", len(texts)))

        return CataloguePass(clips_pass, texts_of, info)

    def held_out(self, records: Sequence[ClipRecord]) -> EvalSet:
        return _held_out(records, self.languages, self.clap.settings.sample_rate, self.limits)

    def evaluate(self, encoders: Staged, eval_set: EvalSet,
                 eval_dir: Path) -> tuple[fmt.EvaluationInfo, fmt.QuantizationInfo | None]:
        # the set as decoded (float), before the bundle's int16 copy — as pretrained exports always measured it
        return _evaluate(eval_set, self.languages, encoders[0], encoders[1], self.quantize)


def _half_encoders(
    clap: Pretrained, encoders: PretrainedEncoders, records: Sequence[ClipRecord], languages: Sequence[str],
    texts: Sequence[str], scratch: Path, providers: Sequence[str], limits: DecodeLimits,
) -> tuple[PretrainedEncoders, fmt.CataloguePassInfo]:
    """fp16 copies of the staged (fp32) encoders for the catalogue pass, after the parity gate on the first
    catalogue clips and four synthetic signals, and on the parity and first catalogue captions."""
    s = clap.settings
    audio, text = half_copies(encoders.audio.path, encoders.text.path, scratch)
    half = PretrainedEncoders(clap, audio, text, providers)
    clips = first_decodable(records, lambda path: decode_audio(path, sample_rate=s.sample_rate, **limits.kwargs()),
                            PROBE_CLIPS)
    clips += probe_waves(s.sample_rate, s.clip_samples)
    info = half_precision_gate((encoders.encode_audio, half.encode_audio, clips),
                               (encoders.encode_text, half.encode_text, probe_texts(records, languages, texts)),
                               providers)
    return half, info


def _evaluate(eval_set: EvalSet, languages: Sequence[str], encoders: PretrainedEncoders, fp32: PretrainedEncoders,
              quantize: QuantizeConfig) -> tuple[fmt.EvaluationInfo, fmt.QuantizationInfo | None]:
    """The held-out report; with quantized encoders also the fp32 report, the agreement and the
    loss check — the same measurement trained bundles get (:func:`training.bundle.export.evaluate_staged`)."""
    if not quantize.encoders:
        report = evaluate_eval_set(eval_set, encode_audio=encoders.encode_audio, encode_text=encoders.encode_text,
                                   languages=languages)
        return fmt.EvaluationInfo(report=report, convention=METRIC_CONVENTION), None
    found = measure(
        eval_set, languages,
        audio=EncoderPair(encoders.encode_audio, fp32.encode_audio, quantize.applies("audio")),
        text=EncoderPair(encoders.encode_text, fp32.encode_text, quantize.applies("text")),
    )
    return quantization_records(found, quantize)


def cli_export_pretrained(args: argparse.Namespace) -> int:
    """`tonearm export --pretrained MODEL_DIR --data MANIFEST --out BUNDLES_DIR [--languages L ...]`."""
    from rich.console import Console

    from index.metrics.report import format_report_rich

    ray = None
    if getattr(args, "ray", None) is not None:
        ray = ray_options_from_args(args)
    providers = device_providers(getattr(args, "device", "cpu"))
    path = export_pretrained_bundle(
        args.pretrained, manifest=args.data, out_dir=args.out, languages=getattr(args, "languages", None),
        index_factory=args.index, splits=args.split, progress=True, quantize=quantize_config(args),
        providers=providers, ray=ray, precision=getattr(args, "precision", "fp32"),
        pass_options=pass_options_from_args(args),
    )
    manifest = fmt.read_manifest(path)
    console = Console()
    if manifest.evaluation is not None:
        console.print(format_report_rich(manifest.evaluation.report, manifest.languages))
    console.print(f"bundle written: {path}")
    return 0
