"""`tonearm export`: checkpoint → bundle (ONNX encoders + FAISS indices + held-out set + manifest).

Steps (SPEC §6), all inside a staging directory published atomically at the end:

1. export both towers to ONNX (``training.bundle.onnx_export``) and check them against
   PyTorch, cosine >= 0.999 per item: captions of every language (shortest,
   longest, and one truncated at ``max_length``) and audio shorter than, equal
   to and longer than the clip length; the export fails otherwise;
2. optionally quantize the text and/or audio encoder (``--quantize``, dynamic int8;
   :mod:`training.bundle.quantize`), measured against fp32 on the held-out set in step 4 —
   past the configured R@10 loss the export refuses;
3. embed the catalogue — every clip of the data manifest, or of the splits
   asked for (``tonearm export --split test``) — with
   the *ONNX* encoders (what the service will compute), build ``audio.faiss``
   and ``text.faiss`` (captions grouped by language) and measure ANN recall@10
   (``--ray``: both embedding passes run as Ray Data jobs, :mod:`index.catalogue.ray_embed`);
4. store the held-out set (``test`` split, else ``val``; at most
   :data:`index.bundle.evalset.MAX_EVAL_CLIPS` clips) and its SPEC §5 report;
5. write ``manifest.json`` with checksums; fsync; rename into ``out_dir``.

Steps 1–2 and the checkpoint's side of 3–4 (how clips are prepared and embedded, the held-out
waveforms, its report) are :class:`TrainedSteps`; the order, every other file and the manifest are
:func:`training.bundle.assemble.assemble_bundle`, the one assembly `tonearm export --pretrained` shares.

It lives in ``training`` because it needs torch and the checkpoint; what it
writes is read back by the torch-free ``index`` package.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from index.audio.decode import DecodeLimits, decode_audio
from index.bundle import format as fmt
from index.bundle.evalset import (
    EvalSet,
    load_eval_waveform,
    prepare_waveform,
    read_eval_set,
)
from index.bundle.tokenizer import TextTokenizer
from index.catalogue.checkpoint import (
    CHUNK_FILES,
    CHUNK_TEXTS,
    Advance,
    EmbedCheckpoint,
    PassResult,
)
from index.catalogue.embed_pass import DecodeCall, EncoderSpec, PassClock, PassOptions
from index.catalogue.half_precision import (
    PROBE_CLIPS,
    Precision,
    check_precision_options,
    probe_waves,
)
from index.catalogue.pass_windows import WindowedDecode, WindowPlan
from index.catalogue.ray_embed import RayOptions, decode_whole, embed_audio_files, embed_captions
from index.errors import BundleError
from index.metrics.report import METRIC_CONVENTION
from index.runtime.evaluate import evaluate_eval_set
from index.runtime.loader import (
    AUDIO_INPUTS,
    TEXT_INPUTS,
    OnnxEncoder,
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
)
from training.bundle.parts import load_session as _load_session
from training.bundle.quantize import EncoderPair, QuantizeConfig, measure, quantize_model
from training.checkpoint import Checkpoint, load_checkpoint
from training.config import TrainConfig, short_clip_padding
from training.data.dataset import eval_captions
from training.data.manifest import ClipRecord, load_manifest

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- identity


def run_name(checkpoint_dir: Path) -> str:
    """``runs/NAME/best`` → ``NAME``; otherwise the directory name; made id-safe."""
    path = Path(checkpoint_dir).resolve()
    name = path.parent.name if path.name in {"best", "last"} else path.name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-._") or "bundle"


# ----------------------------------------------------------------------------- data


PE_AUDIO_HOP = 1920
"""PE-Audio's codec hop (samples at 48 kHz), for checkpoints whose tower does not say (it always does)."""


def checkpoint_audio_frontend(cfg: TrainConfig, model: Any = None) -> fmt.AudioFrontendInfo | None:
    """The manifest's ``audio_frontend`` of a checkpoint bundle: recorded when short clips are not
    zero-padded (an `hf_clap` tower's own repeat-padding), so the service pads uploads as training did.
    An `hf_pe_audio` tower (``reflect``): short clips at their own length, long clips whole, as its
    evaluation embedded them (``model``: the checkpoint's dual encoder, for the codec's hop)."""
    padding = short_clip_padding(cfg.frontend)
    if padding == "pad":
        return None
    if padding == "reflect":
        hop = int(getattr(getattr(getattr(model, "audio", None), "tower", None), "hop_length", PE_AUDIO_HOP))
        return fmt.AudioFrontendInfo(source="pe_audio_feature_extractor", padding="reflect", pad_multiple=hop,
                                     long_clips="whole", model_truncation="none")
    if padding == "frames":  # an hf_ast tower: the extractor keeps the first max_length frames
        return fmt.AudioFrontendInfo(source="ast_feature_extractor", padding=padding, model_truncation="first_frames")
    return fmt.AudioFrontendInfo(padding=padding, model_truncation="rand_trunc")


def clip_samples_of(cfg: TrainConfig) -> int:
    """Samples per evaluation chunk (as ``training.evaluate.clip_samples``)."""
    return int(round(cfg.data.clip_seconds * cfg.frontend.sample_rate))


# ----------------------------------------------------------------------------- parity


def parity_waveforms(wave: np.ndarray, clip_samples: int) -> list[np.ndarray]:
    """Short (a third), exact-length and long (2.5x) versions of a real clip (tiled when needed)."""
    tiled = np.resize(np.asarray(wave, dtype=np.float32), 3 * clip_samples)
    return [tiled[: clip_samples // 3], tiled[:clip_samples], tiled[: 5 * clip_samples // 2]]


def check_text_parity(model: Any, tokenizer: TextTokenizer, encoder: OnnxEncoder, texts: Sequence[str]) -> float:
    """Minimum per-caption cosine between the PyTorch and ONNX text encoders."""
    ids, mask = tokenizer.encode(list(texts))
    with torch.no_grad():
        expected = model.encode_text(torch.from_numpy(ids), torch.from_numpy(mask)).float().numpy()
    got = encoder.run({"input_ids": ids, "attention_mask": mask})
    return float(cosines(expected, got).min())


def check_audio_parity(model: Any, encoder: OnnxEncoder, waveforms: Sequence[np.ndarray]) -> float:
    """Minimum per-waveform cosine (each length on its own, plus one batch of equal lengths)."""
    worst = 1.0
    batches = [w[None, :] for w in waveforms] + [np.stack([waveforms[1], -waveforms[1], 0.5 * waveforms[1]])]
    for batch in batches:
        with torch.no_grad():
            expected = model.encode_audio(torch.from_numpy(np.ascontiguousarray(batch))).float().numpy()
        worst = min(worst, float(cosines(expected, encoder.run({"waveform": batch})).min()))
    return worst


def _require(value: float, what: str) -> float:
    if not value >= MIN_COSINE:
        raise ExportError(f"{what}: ONNX and PyTorch disagree (min cosine {value:.6f} < {MIN_COSINE})")
    log.info("%s: min cosine ONNX vs PyTorch %.6f", what, value)
    return value


# ----------------------------------------------------------------------------- steps


@dataclass
class _Encoders:
    audio: OnnxEncoder
    text: OnnxEncoder
    audio_cosine: float
    text_cosine: float
    audio_fp32: OnnxEncoder
    text_fp32: OnnxEncoder
    quantize: QuantizeConfig


def export_encoders(
    ckpt: Checkpoint, staging: Path, scratch: Path, *, records: Sequence[ClipRecord], quantize: QuantizeConfig,
    providers: Sequence[str] = CPU, limits: DecodeLimits | None = None,
) -> _Encoders:
    """Write both ONNX encoders (+ tokenizer) into ``staging`` and check them against PyTorch.

    An encoder to quantize is exported in fp32 to ``scratch`` (checked there), and its quantized
    copy goes into ``staging``; its parity cosine is then the quantized one's (not held to 0.999)."""
    cfg, model, dim = ckpt.config, ckpt.model, ckpt.config.model.embed_dim
    model.eval()
    audio_dir = scratch if quantize.applies("audio") else staging
    text_dir = scratch if quantize.applies("text") else staging
    # verify=False: check_audio_parity below runs the file against the model on short, exact and long
    # clips and on a batch of three (the probe of export_audio_encoder would only repeat it)
    audio_fp32_path = export_audio_encoder(model.audio_module(), audio_dir / fmt.AUDIO_ENCODER,
                                           sample_rate=cfg.frontend.sample_rate, opset=OPSET, verify=False)
    text_fp32_path = export_text_encoder(model.text_module(), text_dir / fmt.TEXT_ENCODER,
                                         max_length=ckpt.tokenizer.max_length, opset=OPSET)
    ckpt.tokenizer.save(staging / fmt.TOKENIZER)
    audio_fp32 = _load_session(audio_fp32_path, AUDIO_INPUTS, dim, providers)
    text_fp32 = _load_session(text_fp32_path, TEXT_INPUTS, dim, providers)
    texts = parity_texts(records, cfg.data.languages)
    text_cos = _require(check_text_parity(model, ckpt.tokenizer, text_fp32, texts), "text encoder")
    decode_limits = (limits or DecodeLimits()).kwargs()
    (sample,) = first_decodable(records, lambda path: decode_audio(path, sample_rate=cfg.frontend.sample_rate,
                                                                   **decode_limits))
    waves = parity_waveforms(sample, clip_samples_of(cfg))
    audio_cos = _require(check_audio_parity(model, audio_fp32, waves), "audio encoder")
    audio, text = audio_fp32, text_fp32
    if quantize.applies("audio"):
        audio = _load_session(quantize_model(audio_fp32_path, staging / fmt.AUDIO_ENCODER, precision=quantize.precision),
                              AUDIO_INPUTS, dim, providers)
        audio_cos = check_audio_parity(model, audio, waves)
        log.info("%s audio encoder: min cosine vs PyTorch %.6f", quantize.precision, audio_cos)
    if quantize.applies("text"):
        text = _load_session(quantize_model(text_fp32_path, staging / fmt.TEXT_ENCODER, precision=quantize.precision),
                             TEXT_INPUTS, dim, providers)
        text_cos = check_text_parity(model, ckpt.tokenizer, text, texts)
        log.info("%s text encoder: min cosine vs PyTorch %.6f", quantize.precision, text_cos)
    return _Encoders(audio, text, audio_cos, text_cos, audio_fp32, text_fp32, quantize)


def encode_bundle_audio(encoder: OnnxEncoder, waves: Sequence[np.ndarray], cfg: TrainConfig,
                        frontend: fmt.AudioFrontendInfo | None, call_samples: int | None = None) -> np.ndarray:
    """What the service does to these clips with this bundle: a PE-Audio bundle (``reflect``) through its
    ``audio_frontend`` (:func:`index.runtime.loader.encode_clips`; ``call_samples``: its samples a call), every
    other one zero/tile-padded and chunked."""
    if frontend is not None and frontend.padding == "reflect":
        return encode_clips(encoder, waves, clip_samples=clip_samples_of(cfg), embed_dim=cfg.model.embed_dim,
                            frontend=frontend, max_call_samples=call_samples)
    return encode_waveforms(encoder, waves, clip_samples=clip_samples_of(cfg), embed_dim=cfg.model.embed_dim,
                            padding=short_clip_padding(cfg.frontend))


def embed_catalogue_audio(
    encoder: OnnxEncoder, records: Sequence[ClipRecord], cfg: TrainConfig, advance: Advance,
    model: Any = None, *, checkpoint: EmbedCheckpoint | None = None, chunk_files: int = CHUNK_FILES,
    options: PassOptions | None = None, clock: PassClock | None = None, providers: Sequence[str] = CPU,
) -> PassResult:
    """The catalogue's clip embeddings with the evaluation policy (:func:`training.bundle.parts.embed_clips`:
    decoded beside the encoder, checkpointed in chunks; undecodable clips skipped and listed), and the moment
    windows of the long recordings from the same decode (:func:`windowed_decode`). With ``options.devices``
    each device process loads ``encoder``'s file with ``providers`` (:func:`audio_spec`)."""
    frontend = checkpoint_audio_frontend(cfg, model)
    options = options or PassOptions()
    decode = windowed_decode(cfg, options.limits)
    call = options.codec_call_samples
    return embed_clips(records, decode, lambda waves: encode_bundle_audio(encoder, waves, cfg, frontend, call),
                       dim=cfg.model.embed_dim, advance=advance, checkpoint=checkpoint, chunk_files=chunk_files,
                       options=options, clock=clock, spec=audio_spec(encoder, cfg, model, providers, call))


def window_plan(cfg: TrainConfig) -> WindowPlan:
    """The moment windows of a checkpoint's bundle: its model's window at its rate."""
    return WindowPlan(cfg.frontend.sample_rate, clip_samples_of(cfg))


def windowed_decode(cfg: TrainConfig, limits: DecodeLimits) -> WindowedDecode:
    """The clips pass's decode: a clip under the evaluation policy (:func:`index.bundle.evalset.load_eval_waveform`)
    and a long recording kept whole for its windows — decoded once: with ``center`` a file whose header says it
    is long is decoded whole and cropped in memory (equal to the window decode)."""
    rate, clip_samples, padding = cfg.frontend.sample_rate, clip_samples_of(cfg), short_clip_padding(cfg.frontend)
    clip = DecodeCall(load_eval_waveform, kwargs={"sample_rate": rate, "clip_samples": clip_samples,
                                                  "policy": cfg.data.eval_crop, "padding": padding, **limits.kwargs()},
                      sample_rate=rate)
    if cfg.data.eval_crop != "center":  # the clip is the whole recording
        return WindowedDecode(clip, window_plan(cfg))
    return WindowedDecode(clip, window_plan(cfg), whole=DecodeCall(decode_audio, kwargs={"sample_rate": rate,
                                                                                         **limits.kwargs()}),
                          prepare=functools.partial(prepare_waveform, clip_samples=clip_samples, policy="center",
                                                    padding=padding))


def audio_spec(encoder: OnnxEncoder, cfg: TrainConfig, model: Any, providers: Sequence[str],
               call_samples: int | None = None) -> EncoderSpec:
    """What a device process of ``--devices`` loads to embed as :func:`encode_bundle_audio` does with
    ``encoder``: its file, the providers, and the bundle's preparation (PE-Audio's ``audio_frontend``, else
    the checkpoint's zero/tile padding)."""
    frontend = reflect_frontend(cfg, model)
    return EncoderSpec(path=str(encoder.path), embed_dim=cfg.model.embed_dim, clip_samples=clip_samples_of(cfg),
                       providers=tuple(providers),
                       frontend=frontend.model_dump(mode="json") if frontend is not None else None,
                       padding=short_clip_padding(cfg.frontend), call_samples=call_samples)


def audio_plan(cfg: TrainConfig, model: Any = None) -> dict[str, Any]:
    """What besides the encoder decides a clip's vector here (the catalogue checkpoint's plan)."""
    frontend = checkpoint_audio_frontend(cfg, model)
    return {"sample_rate": cfg.frontend.sample_rate, "clip_samples": clip_samples_of(cfg),
            "eval_crop": cfg.data.eval_crop, "padding": short_clip_padding(cfg.frontend),
            "audio_frontend": frontend.model_dump(mode="json") if frontend is not None else None}


def embed_catalogue_texts(
    encoder: OnnxEncoder, tokenizer: TextTokenizer, texts: Sequence[str], dim: int, advance: Advance,
    checkpoint: EmbedCheckpoint | None = None,
) -> np.ndarray:
    """(N, d) caption embeddings, 256 a call, checkpointed by caption text (:func:`training.bundle.parts.embed_texts`)."""
    return embed_texts(texts, lambda part: encode_texts(encoder, tokenizer, part, embed_dim=dim), dim=dim,
                       checkpoint=checkpoint, advance=advance)


def reflect_frontend(cfg: TrainConfig, model: Any = None) -> fmt.AudioFrontendInfo | None:
    """The bundle's ``audio_frontend`` when the loader must apply it (PE-Audio), else None."""
    frontend = checkpoint_audio_frontend(cfg, model)
    return frontend if frontend is not None and frontend.padding == "reflect" else None


def embed_catalogue_on_ray(
    encoders: _Encoders, records: Sequence[ClipRecord], cfg: TrainConfig, options: RayOptions, model: Any = None,
    *, checkpoint: EmbedCheckpoint | None = None, chunk_files: int = CHUNK_FILES, limits: DecodeLimits | None = None,
    call_samples: int | None = None, advance: Advance | None = None, clock: PassClock | None = None,
) -> PassResult:
    """The catalogue's clip embeddings and the long recordings' moment windows as Ray Data jobs, one a chunk,
    checkpointed as in process (same vectors); each actor decodes under ``limits``."""
    dim, model_bytes = cfg.model.embed_dim, encoders.audio.path.read_bytes()
    decode = functools.partial(decode_whole, limits=limits or DecodeLimits())

    def run(paths: list[Path]) -> Any:
        return embed_audio_files(
            paths, model_bytes, decode=decode, embed_dim=dim, sample_rate=cfg.frontend.sample_rate,
            clip_samples=clip_samples_of(cfg), policy=cfg.data.eval_crop, options=options,
            padding=short_clip_padding(cfg.frontend), frontend=reflect_frontend(cfg, model), call_samples=call_samples,
            windows=window_plan(cfg),
        )

    return embed_clips_on_ray(records, run, dim=dim, checkpoint=checkpoint, chunk_files=chunk_files,
                              advance=advance, clock=clock)


def captions_on_ray(encoder: Path, tokenizer: TextTokenizer, texts: Sequence[str], dim: int, options: RayOptions,
                    checkpoint: EmbedCheckpoint | None) -> np.ndarray:
    """The captions' embeddings as Ray Data jobs, one a chunk, checkpointed by caption text."""
    model_bytes = encoder.read_bytes()
    return embed_texts(texts, lambda part: embed_captions(part, model_bytes, tokenizer, embed_dim=dim,
                                                          options=options).embeddings,
                       dim=dim, checkpoint=checkpoint, step=CHUNK_TEXTS)


def build_held_out(records: Sequence[ClipRecord], cfg: TrainConfig, limits: DecodeLimits | None = None) -> EvalSet:
    """The held-out clips' prepared waveforms and caption queries (query groups as `tonearm evaluate`); a clip
    past the decode ``limits`` stops the export, naming it (the held-out set is every clip of its split)."""
    clip_samples = clip_samples_of(cfg)
    decode_limits = (limits or DecodeLimits()).kwargs()
    captions = eval_captions(records, cfg.data.languages)
    return EvalSet(
        clip_ids=[r.id for r in records],
        waveforms=[
            load_eval_waveform(r.audio, sample_rate=cfg.frontend.sample_rate, clip_samples=clip_samples,
                               policy=cfg.data.eval_crop, padding=short_clip_padding(cfg.frontend), **decode_limits)
            for r in records
        ],
        captions=list(captions.texts),
        clip=np.asarray(captions.clip, dtype=np.int64),
        lang=np.asarray(captions.lang, dtype=str),
        group=np.asarray(captions.group, dtype=np.int64),
    )


def evaluate_staged(
    eval_set: EvalSet, encoders: _Encoders, tokenizer: TextTokenizer, cfg: TrainConfig, model: Any = None,
) -> tuple[fmt.EvaluationInfo, fmt.QuantizationInfo | None]:
    """SPEC §5 report of the held-out set (as stored in the bundle) with the ONNX encoders; with quantized
    encoders also the fp32 report, the per-item agreement and the loss check (:mod:`training.bundle.quantize`)."""
    frontend = checkpoint_audio_frontend(cfg, model)
    dim, languages, quantize = cfg.model.embed_dim, cfg.data.languages, encoders.quantize

    def audio_with(encoder: OnnxEncoder) -> Callable[[Sequence[np.ndarray]], np.ndarray]:
        return lambda waves: encode_bundle_audio(encoder, waves, cfg, frontend)

    def text_with(encoder: OnnxEncoder) -> Callable[[Sequence[str]], np.ndarray]:
        return lambda texts: encode_texts(encoder, tokenizer, texts, embed_dim=dim)

    if not quantize.encoders:
        report = evaluate_eval_set(eval_set, encode_audio=audio_with(encoders.audio),
                                   encode_text=text_with(encoders.text), languages=languages)
        return fmt.EvaluationInfo(report=report, convention=METRIC_CONVENTION), None
    found = measure(
        eval_set, languages,
        audio=EncoderPair(audio_with(encoders.audio), audio_with(encoders.audio_fp32), quantize.applies("audio")),
        text=EncoderPair(text_with(encoders.text), text_with(encoders.text_fp32), quantize.applies("text")),
    )
    return quantization_records(found, quantize)


# ----------------------------------------------------------------------------- orchestration


def _load_inputs(checkpoint_dir: Path, manifest: Path) -> tuple[Checkpoint, list[ClipRecord]]:
    ckpt = load_checkpoint(checkpoint_dir, device="cpu")
    data = ckpt.config.data
    records = load_manifest(manifest, languages=data.languages, skip_missing_audio=data.skip_missing_audio,
                            drop_other_languages=data.drop_other_languages)
    if not records:
        raise BundleError(f"{manifest}: no clips to index")
    return ckpt, records


def trained_model(checkpoint_dir: Path, ckpt: Checkpoint) -> ModelDescription:
    """The manifest's description of a checkpoint: its run, resolved training config and weights, and the
    audio preparation its evaluation used (``audio_frontend``: :func:`checkpoint_audio_frontend`)."""
    cfg = ckpt.config
    config_json = cfg.model_dump(mode="json")
    return ModelDescription(
        path=checkpoint_dir, name=run_name(checkpoint_dir),
        weights_sha256=fmt.sha256_file(checkpoint_dir / "model.safetensors"),
        config=config_json, objective=config_json["objective"], frontend=config_json["frontend"],
        embed_dim=cfg.model.embed_dim, languages=list(cfg.data.languages), sample_rate=cfg.frontend.sample_rate,
        clip_seconds=cfg.data.clip_seconds, clip_samples=clip_samples_of(cfg),
        audio_frontend=checkpoint_audio_frontend(cfg, ckpt.model), eval_crop=cfg.data.eval_crop,
    )


def export_bundle(
    checkpoint_dir: Path | str,
    *,
    manifest: Path | str,
    out_dir: Path | str,
    index_factory: str | None = None,
    quantize_text: bool = False,
    quantize: QuantizeConfig | None = None,
    progress: bool = True,
    splits: Sequence[str] | None = None,
    ray: RayOptions | None = None,
    providers: Sequence[str] = CPU,
    precision: Precision = "fp32",
    chunk_files: int = CHUNK_FILES,
    pass_options: PassOptions | None = None,
) -> Path:
    """Export ``checkpoint_dir`` with the clips of ``manifest`` (only those of ``splits`` when
    given); returns ``out_dir/<bundle_id>``. The held-out set is chosen from every clip.
    ``ray``: the catalogue's embedding pass runs on a Ray cluster (same bundle); ``providers``:
    the ONNX Runtime providers of the checks and the in-process pass (``--device cuda``); ``precision``
    ``fp16``: the in-process pass runs fp16 copies of the encoders (:mod:`index.catalogue.half_precision`).
    The in-process clips pass is checkpointed every ``chunk_files`` clips in
    ``out_dir/.<run name>-<8 hex>.partial/`` (:func:`training.bundle.parts.partial_base`) and the same
    call resumes it after an interruption, reusing every clip whose content is unchanged; the folder is removed
    once the bundle is published. ``pass_options``: decode workers, prefetch and the samples of one encoder
    call (:class:`index.catalogue.embed_pass.PassOptions`; default: decode in this process). A clip that cannot be
    decoded is skipped and listed in the manifest's ``skipped_clips``. The bundle is assembled by
    :func:`training.bundle.assemble.assemble_bundle` with this checkpoint's :class:`TrainedSteps`."""
    checkpoint_dir, manifest, out_dir = Path(checkpoint_dir), Path(manifest), Path(out_dir)
    quantize = quantize or QuantizeConfig.from_choice(None, quantize_text=quantize_text)  # quantize_text: old alias
    check_precision_options(precision, None, ray=ray is not None, quantized=quantize.encoders)
    ckpt, all_records = _load_inputs(checkpoint_dir, manifest)
    clips = select_clips(all_records, manifest=manifest, splits=splits, index_factory=index_factory,
                         embed_dim=ckpt.config.model.embed_dim)
    model = trained_model(checkpoint_dir, ckpt)
    fingerprint = canonical_hash([model.weights_sha256, model.config, str(manifest.resolve()), index_factory,
                                  quantize.model_dump(mode="json") if quantize.encoders else False,
                                  *([sorted(splits)] if splits else []), *(["fp16"] if precision == "fp16" else [])])
    steps = TrainedSteps(ckpt, quantize=quantize, providers=providers, ray=ray, precision=precision, chunk_files=chunk_files,
                         pass_options=pass_options)
    return assemble_bundle(steps, model, clips, out_dir=out_dir, fingerprint=fingerprint,
                           index_factory=index_factory, providers=providers, progress=progress)


@dataclass(frozen=True)
class TrainedSteps(StepOptions):
    """A checkpoint's own steps of the one assembly (:class:`training.bundle.assemble.ExportSteps`): its towers
    to ONNX, checked against PyTorch; the catalogue pass with the evaluation's preparation (in process, fp16
    copies or on Ray); the held-out set prepared as `tonearm evaluate` does, and its report. The options
    (``quantize``, providers, Ray, precision, …, ``limits``) are :class:`training.bundle.assemble.StepOptions`'s."""

    ckpt: Checkpoint

    def write_encoders(self, staging: Path, scratch: Path, catalogue: Sequence[ClipRecord]) -> StagedEncoders[_Encoders]:
        encoders = export_encoders(self.ckpt, staging, scratch, records=catalogue, quantize=self.quantize,
                                   providers=self.providers, limits=self.limits)
        return StagedEncoders(encoders, audio_inputs=encoders.audio.input_names, audio_cosine=encoders.audio_cosine,
                              text_cosine=encoders.text_cosine, tokenizer=self.ckpt.tokenizer, quantize=self.quantize)

    def catalogue_pass(self, encoders: _Encoders, catalogue: Sequence[ClipRecord], scratch: Path,
                       partial: Path | None) -> CataloguePass:
        ckpt, ray, records = self.ckpt, self.ray, catalogue
        cfg, tokenizer, dim = ckpt.config, ckpt.tokenizer, ckpt.config.model.embed_dim
        info = None
        checkpoint, captions = pass_checkpoints(partial, encoders.audio.path, encoders.text.path,
                                                providers=list(CPU) if ray is not None else list(self.providers),
                                                frontend=audio_plan(cfg, ckpt.model), precision=self.precision,
                                                limits=self.limits, moments=window_plan(cfg).describe())
        audio, text = encoders.audio, encoders.text
        if ray is None and self.precision == "fp16":
            all_texts = [t["text"] for t in catalogue_texts(records, cfg.data.languages)[0]]
            audio, text, info = half_encoders(ckpt, encoders, records, all_texts, scratch, self.providers,
                                              self.limits)

        def clips_pass(task: Callable[..., Advance]) -> PassResult:
            if ray is not None:
                counted = PassClock(timed=False)  # the actors decode and encode: the windows are counted here
                return embed_catalogue_on_ray(encoders, records, cfg, ray, ckpt.model, checkpoint=checkpoint,
                                              chunk_files=self.chunk_files, limits=self.limits,
                                              call_samples=(self.pass_options or PassOptions()).codec_call_samples,
                                              advance=task("embedding clips", len(records), counted), clock=counted)
            clock = PassClock()
            return embed_catalogue_audio(audio, records, cfg, task("embedding clips", len(records), clock), ckpt.model,
                                         checkpoint=checkpoint, chunk_files=self.chunk_files,
                                         options=self.pass_options, clock=clock, providers=self.providers)

        def texts_of(texts: list[str], task: Callable[..., Advance]) -> np.ndarray:
            if ray is not None:
                return captions_on_ray(encoders.text.path, tokenizer, texts, dim, ray, captions)
            return embed_catalogue_texts(text, tokenizer, texts, dim, task("embedding captions", len(texts)), captions)

        return CataloguePass(clips_pass, texts_of, info)

    def held_out(self, records: Sequence[ClipRecord]) -> EvalSet:
        return build_held_out(records, self.ckpt.config, self.limits)

    def evaluate(self, encoders: _Encoders, eval_set: EvalSet,
                 eval_dir: Path) -> tuple[fmt.EvaluationInfo, fmt.QuantizationInfo | None]:
        # the set as the bundle stores it (int16 waveforms), as the service's quality gate reads it
        return evaluate_staged(read_eval_set(eval_dir), encoders, self.ckpt.tokenizer, self.ckpt.config,
                               self.ckpt.model)


def half_encoders(
    ckpt: Checkpoint, encoders: _Encoders, records: Sequence[ClipRecord], texts: Sequence[str], scratch: Path,
    providers: Sequence[str], limits: DecodeLimits | None = None,
) -> tuple[OnnxEncoder, OnnxEncoder, fmt.CataloguePassInfo]:
    """fp16 copies of the staged (fp32) encoders for the catalogue pass, after the parity gate on the
    first catalogue clips and four synthetic signals, and on the parity and first catalogue captions."""
    cfg, dim = ckpt.config, ckpt.config.model.embed_dim
    audio_path, text_path = half_copies(encoders.audio.path, encoders.text.path, scratch)
    audio = _load_session(audio_path, AUDIO_INPUTS, dim, providers)
    text = _load_session(text_path, TEXT_INPUTS, dim, providers)
    frontend = checkpoint_audio_frontend(cfg, ckpt.model)
    decode_limits = (limits or DecodeLimits()).kwargs()
    clips = first_decodable(records, lambda path: load_eval_waveform(
        path, sample_rate=cfg.frontend.sample_rate, clip_samples=clip_samples_of(cfg), policy=cfg.data.eval_crop,
        padding=short_clip_padding(cfg.frontend), **decode_limits), PROBE_CLIPS) + probe_waves(cfg.frontend.sample_rate, clip_samples_of(cfg))

    def audio_with(encoder: OnnxEncoder) -> Callable[[list[Any]], np.ndarray]:
        return lambda waves: encode_bundle_audio(encoder, waves, cfg, frontend)

    def text_with(encoder: OnnxEncoder) -> Callable[[list[Any]], np.ndarray]:
        return lambda items: encode_texts(encoder, ckpt.tokenizer, items, embed_dim=dim)

    info = half_precision_gate((audio_with(encoders.audio), audio_with(audio), clips),
                               (text_with(encoders.text), text_with(text),
                                probe_texts(records, cfg.data.languages, texts)), providers)
    return audio, text, info


