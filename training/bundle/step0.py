"""Step 0 of a fine-tune is the pretrained model — checked at run time (issue 41, SPEC §11).

A run that loads a pretrained folder into a tower (``hf_clap`` / ``hf_ast`` / ``hf_pe_audio`` audio,
``hf_clap`` / ``hf_pe_audio`` / ``hf_auto`` text) starts, before step 1, by embedding a few inputs twice:

* through the **training model** as the data path feeds it: four synthetic clips of 0.05, 0.3, 1
  and 1.4 windows (0.5, 3, 10 and 14 s for a 10-s window; a chirp with noise, white noise, a pulsed
  tone, a high tone over faint noise), each brought to the tower as evaluation does
  (:func:`index.audio.decode.eval_chunks` with the run's ``frontend.short_clip_padding``, its first window;
  :func:`training.evaluate.stack_windows`): padded to the window, the long clip's first window — or,
  for ``hf_pe_audio`` (``reflect``), each clip at its own length (a short clip behind the NaN marker
  the tower reads, the long clip whole: PE-Audio's long-clip rule) — and four captions in four
  languages through the run's tokenizer;
* through the **folder's own transformers model** and its own feature extractor / tokenizer, fed the
  audio the data path gives the tower, unpadded (:attr:`Probe.seen`)
  (``ClapModel.get_audio_features`` on ``ClapFeatureExtractor``'s features of the clip — its
  first window for the long one; ``ASTModel``'s pooled output on ``ASTFeatureExtractor``'s;
  ``PeAudioModel.get_audio_embeds`` on ``PeAudioFeatureExtractor``'s output of each clip, one per
  call — the 14-s clip whole, which the extractor reflect-pads to the hop and neither truncates nor
  windows; ``get_text_features``, ``PeAudioModel.forward``'s ``text_audio_embeds`` or the
  ``AutoModel``'s pooled hidden states on ``AutoTokenizer``'s ids) — code tonearm does not own,
  loaded afresh from the folder (a ``pe_audio_video`` folder: the ``PeAudioModel`` of its audio
  branch, as the tower loads it; its ``PeAudioVideoModel`` needs ``timm``).

What is compared is each tower's output before the run's new projection head. The measure is the
**centred cosine**: both sets L2-normalised, each set's mean removed, cosine per item; the run
stops (:class:`ConfigError`, one line naming the tower, the measure and the threshold) when the
lowest is below :data:`MIN_CENTRED_COS`. Centring is what gives the check power: with random or
weakly trained weights unrelated inputs embed at plain cosines of 0.998–0.9999 to each other, so a
front-end error of plain cosine 0.998 (HTS-AT fed 1,024 padded frames instead of its bicubic
stretch of 1,001) would pass a plain ``cos ≥ 0.999``; its centred cosine is 0.63
(tests/training/test_finetune_step0.py measures every error found before on the full-size models;
tests/training/test_pe_audio_finetune.py the PE-Audio check and its zero-pad negative case).

``model.step0_check: false`` skips it. Cost: one extra forward of four clips and four captions per
tower plus loading the folder's model once more (~10 s for AST-base and ~5 s for CLAP on two CPU
cores; well under a second of GPU). PE-Audio's codec runs over the 27.5 s of probe audio on each
side at a 10-s window: 3–8 s on two CPU cores for the small test config; for the full-size model
~45 s is expected from the ~8 s per 10-s window of the catalogue pass (not measured). It runs in
float32 (TF32 off) on the training device. Towers without a reference here (``hf_auto`` audio, which takes tonearm's own log-mel by design; the
built-in towers) are not checked; :data:`AUDIO_REFERENCES` / :data:`TEXT_REFERENCES` map a tower
kind to its reference, so a new pretrained tower adds one function.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from training.config import ConfigError, TrainConfig, short_clip_padding
from training.models.dual_encoder import PAIRED_KINDS, DualEncoder

log = logging.getLogger(__name__)

MIN_CENTRED_COS = 0.99
"""Lowest centred cosine (per item) between the training tower and the folder's model at step 0.
Measured: 1.0000 for CLAP and AST through the data path; every error found before scores < 0.7."""
PROBE_WINDOWS = (0.05, 0.3, 1.0, 1.4)
"""Probe clip lengths in windows (``data.clip_seconds``): shorter, equal and longer than it."""
CAPTIONS = (
    "a dog barks twice in the distance",
    "un train passe lentement sur un pont métallique",
    "雨がトタン屋根に強く降っている",
    "ein Kind lacht und klatscht in die Hände",
)
"""Probe captions (four languages and scripts)."""


def centred_cosines(got: Tensor, want: Tensor) -> Tensor:
    """Per item: the cosine of ``got[i]`` and ``want[i]`` after L2-normalising every row and removing
    each set's mean row — what differs between the inputs, not what they share."""
    g = nn.functional.normalize(got.detach().double().cpu(), dim=-1)
    w = nn.functional.normalize(want.detach().double().cpu(), dim=-1)
    return nn.functional.cosine_similarity(g - g.mean(0), w - w.mean(0), dim=-1)


def probe_signal(kind: int, t: np.ndarray, seconds: float, rng: np.random.Generator) -> np.ndarray:
    """One of four unrelated float32 signals at times ``t``: a chirp with noise, white noise, a pulsed
    tone, a high tone over faint noise (``kind`` 0–3)."""
    if kind == 0:
        x = 0.3 * np.sin(2 * np.pi * (200 + 2000 * t / seconds) * t) + 0.05 * rng.standard_normal(t.shape)
    elif kind == 1:
        x = 0.2 * rng.standard_normal(t.shape)
    elif kind == 2:
        x = 0.3 * np.sin(2 * np.pi * 440 * t) * (np.sin(2 * np.pi * 3 * t) > 0)
    else:
        x = 0.3 * np.sin(2 * np.pi * 3000 * t) + 0.01 * rng.standard_normal(t.shape)
    return x.astype(np.float32)


def probe_clips(sample_rate: int, window: int) -> list[np.ndarray]:
    """Four different float32 clips of :data:`PROBE_WINDOWS` × `window` samples (seeded)."""
    rng = np.random.default_rng(0)
    clips = []
    for kind, fraction in enumerate(PROBE_WINDOWS):
        t = np.arange(max(1, int(fraction * window))) / sample_rate
        clips.append(probe_signal(kind, t, max(float(t[-1]), 1e-3), rng))
    return clips


@dataclass
class Probe:
    """What both sides of the check embed."""

    clips: list[np.ndarray]
    """Raw clips, as generated."""
    seen: list[np.ndarray]
    """The audio of each clip the data path gives the tower, unpadded — what the folder's extractor is
    given, so the check judges the front end, not the crop length: a clip up to the window whole; a
    longer one its first window (``data.clip_seconds``), or the whole clip where the tower's long-clip
    rule is the model's own forward over it (``hf_pe_audio``, :func:`index.audio.decode.eval_chunks`)."""
    windows: np.ndarray
    """(4, width) float32: the clips as the run's data path brings them to the tower — the first window
    :func:`index.audio.decode.eval_chunks` makes of each with the run's ``frontend.short_clip_padding``, stacked as
    evaluation stacks them (:func:`training.evaluate.stack_windows`: windows of different widths, a
    PE-Audio clip kept whole, are right-padded with the NaN marker)."""
    window: int
    sample_rate: int
    captions: list[str]
    device: torch.device
    labels: list[str] = field(default_factory=list)


@dataclass
class Step0Result:
    """One tower's check."""

    tower: str
    kind: str
    folder: str
    cosines: list[float]
    labels: list[str]

    @property
    def worst(self) -> float:
        return min(self.cosines)


# --- references: the folder's own transformers model, extractor and tokenizer ------------------------


class References:
    """Models loaded from the folders once per check (the CLAP pair shares one ``ClapModel``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.models: dict[tuple[str, str], Any] = {}

    def model(self, class_name: str, folder: str) -> Any:
        import transformers

        key = (class_name, folder)
        if key not in self.models:
            self.models[key] = getattr(transformers, class_name).from_pretrained(folder).eval().float().to(self.device)
        return self.models[key]


def clap_audio_reference(refs: References, cfg: TrainConfig, probe: Probe) -> Tensor:
    """``ClapModel.get_audio_features`` on ``ClapFeatureExtractor``'s features of each clip."""
    from training.models.clap_frontend import clap_extractor

    folder = str(cfg.model.audio.path)
    model = refs.model("ClapModel", folder)
    audio_cfg = model.config.audio_config
    fe = cfg.frontend
    extractor = clap_extractor(
        folder, sample_rate=fe.sample_rate, n_fft=fe.n_fft, hop_length=fe.hop_length, n_mels=fe.n_mels,
        f_min=fe.f_min, f_max=fe.f_max,
        max_frames=int(audio_cfg.spec_size * (audio_cfg.spec_size // audio_cfg.num_mel_bins)),
    )
    feats = extractor(probe.seen, sampling_rate=probe.sample_rate, return_tensors="pt")
    return model.get_audio_features(input_features=feats["input_features"].to(refs.device)).pooler_output


def ast_audio_reference(refs: References, cfg: TrainConfig, probe: Probe) -> Tensor:
    """``ASTModel``'s pooled output on ``ASTFeatureExtractor``'s features of each clip."""
    from training.models.ast_frontend import ast_extractor

    folder = str(cfg.model.audio.path)
    model = refs.model("ASTModel", folder)
    extractor = ast_extractor(folder, sample_rate=cfg.frontend.sample_rate,
                              num_mel_bins=int(model.config.num_mel_bins), max_length=int(model.config.max_length))
    feats = extractor(probe.seen, sampling_rate=probe.sample_rate, return_tensors="pt")["input_values"]
    return model(input_values=feats.to(refs.device)).pooler_output


def _reference_tokens(folder: str, captions: list[str], device: torch.device) -> tuple[Tensor, Tensor]:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    batch = tokenizer(captions, padding=True, truncation=True, return_tensors="pt")
    return batch["input_ids"].to(device), batch["attention_mask"].to(device)


def clap_text_reference(refs: References, cfg: TrainConfig, probe: Probe) -> Tensor:
    """``ClapModel.get_text_features`` on the folder's ``AutoTokenizer`` ids."""
    folder = str(cfg.model.text.path or cfg.model.audio.path)
    ids, mask = _reference_tokens(folder, probe.captions, refs.device)
    return refs.model("ClapModel", folder).get_text_features(input_ids=ids, attention_mask=mask).pooler_output


def auto_text_reference(refs: References, cfg: TrainConfig, probe: Probe) -> Tensor:
    """The folder's ``AutoModel`` on its ``AutoTokenizer`` ids, pooled as ``text.pooling`` says."""
    folder = str(cfg.model.text.path)
    ids, mask = _reference_tokens(folder, probe.captions, refs.device)
    hidden = refs.model("AutoModel", folder)(input_ids=ids, attention_mask=mask).last_hidden_state
    if cfg.model.text.pooling == "cls":
        return hidden[:, 0]
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1)


def _pe_audio_model(refs: References, folder: str) -> Any:
    """The folder's ``PeAudioModel``: ``PeAudioModel.from_pretrained`` for a ``pe_audio`` folder; for a
    ``pe_audio_video`` one (whose ``PeAudioVideoModel`` needs ``timm`` for its video tower) the
    ``PeAudioModel`` of its config's ``audio_config`` holding its ``audio_model.*`` weights."""
    from training.models.pretrained_pe_audio import load_pe_audio_model

    key = ("PeAudioModel", folder)
    if key not in refs.models:
        refs.models[key] = load_pe_audio_model(folder, key="model.audio.path").eval().float().to(refs.device)
    return refs.models[key]


def pe_audio_audio_reference(refs: References, cfg: TrainConfig, probe: Probe) -> Tensor:
    """``PeAudioModel.get_audio_embeds`` on ``PeAudioFeatureExtractor``'s output of each clip as the data
    path gives it (:attr:`Probe.seen`: a short clip at its own length, which the extractor reflect-pads to
    the hop; a long clip whole — the extractor neither truncates nor windows), one clip per call, so its
    ``padding_mask`` is all ones as for the lone clip the tower embeds."""
    from training.models.pretrained_pe_audio import load_pe_audio_extractor

    folder = str(cfg.model.audio.path)
    model = _pe_audio_model(refs, folder)
    extractor = load_pe_audio_extractor(folder, key="model.audio.path")
    out = []
    for clip in probe.seen:
        inputs = extractor(clip, sampling_rate=probe.sample_rate, return_tensors="pt")
        out.append(model.get_audio_embeds(inputs["input_values"].to(refs.device),
                                          padding_mask=inputs["padding_mask"].to(refs.device))[0])
    return torch.stack(out)


def pe_audio_text_reference(refs: References, cfg: TrainConfig, probe: Probe) -> Tensor:
    """``text_audio_embeds`` of ``PeAudioModel.forward`` on the folder's ``AutoTokenizer`` ids (its
    ``get_text_audio_embeds`` does not ask ModernBERT for hidden states in transformers 5.x; the forward
    does; it is given one hop of silence as its audio, which the text embeddings do not depend on)."""
    folder = str(cfg.model.text.path or cfg.model.audio.path)
    model = _pe_audio_model(refs, folder)
    ids, mask = _reference_tokens(folder, probe.captions, refs.device)
    hop = int(np.prod(model.config.audio_config.dac_config.downsampling_ratios))
    silence = torch.zeros(1, 1, hop, device=refs.device)
    return model(input_ids=ids, attention_mask=mask, input_values=silence).text_audio_embeds


Reference = Callable[[References, TrainConfig, Probe], Tensor]
AUDIO_REFERENCES: dict[str, Reference] = {"hf_clap": clap_audio_reference, "hf_ast": ast_audio_reference,
                                          "hf_pe_audio": pe_audio_audio_reference}
"""Audio tower kind → the folder's own model on its own extractor's features."""
TEXT_REFERENCES: dict[str, Reference] = {"hf_clap": clap_text_reference, "hf_auto": auto_text_reference,
                                         "hf_pe_audio": pe_audio_text_reference}
"""Text tower kind → the folder's own model on its own tokenizer's ids."""


# --- the check ------------------------------------------------------------------------------------


def checked_towers(cfg: TrainConfig) -> list[str]:
    """The towers of `cfg` that load a pretrained folder and have a reference here."""
    towers = []
    if cfg.model.audio.kind in AUDIO_REFERENCES and cfg.model.audio.path:
        towers.append("audio")
    text = cfg.model.text
    if text.kind in TEXT_REFERENCES and (text.path or (text.kind in PAIRED_KINDS and cfg.model.audio.path)):
        towers.append("text")
    return towers


def applies(cfg: TrainConfig, *, resuming: bool) -> bool:
    """Whether a run starts from a pretrained folder's weights (not a checkpoint) with the check on."""
    return cfg.model.step0_check and not resuming and cfg.model.init_checkpoint is None and bool(checked_towers(cfg))


@contextmanager
def full_precision(device: torch.device) -> Iterator[None]:
    """float32 matmuls and convolutions (TF32 off) while the check runs; settings restored after."""
    if device.type != "cuda":
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def make_probe(cfg: TrainConfig, device: torch.device) -> Probe:
    from index.audio.decode import eval_chunks
    from training.evaluate import clip_samples, stack_windows

    rate, n = cfg.frontend.sample_rate, clip_samples(cfg.data, cfg.frontend)
    clips = probe_clips(rate, n)
    padding = short_clip_padding(cfg.frontend)
    firsts = [eval_chunks(c, n, padding)[:1] for c in clips]  # type: ignore[arg-type]
    seen = [c[: first.shape[1]] for c, first in zip(clips, firsts, strict=True)]
    labels = [f"clip {i + 1} ({len(c) / rate:.1f} s)" for i, c in enumerate(clips)]
    return Probe(clips=clips, seen=seen, windows=stack_windows(firsts), window=n, sample_rate=rate,
                 captions=list(CAPTIONS), device=device, labels=labels)


@torch.no_grad()
def step0_results(model: DualEncoder, cfg: TrainConfig, tokenizer: Any, device: torch.device) -> list[Step0Result]:
    """The centred cosines of every checked tower (the model's train/eval mode is restored after)."""
    towers = checked_towers(cfg)
    probe = make_probe(cfg, device)
    refs = References(device)
    results = []
    was_training = model.training
    model.eval()
    try:
        with full_precision(device), torch.autocast(device.type, enabled=False):
            if "audio" in towers:
                kind: str = cfg.model.audio.kind
                got = model.audio.tower(torch.from_numpy(probe.windows).to(device))
                want = AUDIO_REFERENCES[kind](refs, cfg, probe)
                results.append(Step0Result("audio", kind, str(cfg.model.audio.path),
                                           centred_cosines(got, want).tolist(), probe.labels))
            if "text" in towers:
                kind = cfg.model.text.kind
                ids, mask = (torch.from_numpy(a).to(device) for a in tokenizer.encode(probe.captions))
                got = model.text.tower(ids, mask)
                want = TEXT_REFERENCES[kind](refs, cfg, probe)
                results.append(Step0Result("text", kind, str(cfg.model.text.path or cfg.model.audio.path),
                                           centred_cosines(got, want).tolist(),
                                           [f"caption {i + 1}" for i in range(len(probe.captions))]))
    finally:
        model.train(was_training)
        del refs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def check_step0(model: DualEncoder, cfg: TrainConfig, tokenizer: Any, device: torch.device) -> list[Step0Result]:
    """Run the step-0 check; raise :class:`ConfigError` (one line) when a tower disagrees with its folder."""
    start = time.perf_counter()
    results = step0_results(model, cfg, tokenizer, device)
    for result in results:
        if result.worst < MIN_CENTRED_COS:
            where = result.labels[result.cosines.index(result.worst)]
            raise ConfigError(
                f"model.step0_check: the {result.tower} tower ({result.kind}, {result.folder}) does not start as "
                f"the folder's own transformers model: centred cosine {result.worst:.3f} < {MIN_CENTRED_COS} on "
                f"{where} (4 probes, L2-normalised, each set's mean removed; training/bundle/step0.py) — a front end, "
                "padding (frontend.short_clip_padding) or tokenizer that is not the model's own; "
                "model.step0_check=false trains anyway"
            )
    log.info(
        "step-0 check (%.1f s): %s", time.perf_counter() - start,
        "; ".join(f"{r.tower} {r.kind} centred cosine ≥ {r.worst:.4f}" for r in results),
    )
    return results


def metrics_record(results: list[Step0Result]) -> dict[str, Any]:
    """The ``step0_check`` record of metrics.jsonl."""
    return {"kind": "step0_check", "step": 0, "threshold": MIN_CENTRED_COS,
            **{f"{r.tower}_centred_cos": round(r.worst, 6) for r in results}}

