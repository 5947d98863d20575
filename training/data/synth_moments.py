"""`tonearm synth --moments`: long recordings with exact, captioned moments (SPEC §19).

This module sits on top of :mod:`training.data.synth` (the clip corpus, which never imports it) and
holds the handler of ``tonearm synth`` (:func:`cli_synth`), which writes either corpus.

The Clotho-Moment recipe (Munakata et al. 2024, "Language-based Audio Moment
Retrieval": Clotho clips overlaid on long Walking Tour backgrounds, the clip's
captions describing the moment) on tonearm's own sounds: a background *bed*
(pink noise whose level drifts slowly, 20 s – 10 min) with *moments* laid on
it — each moment a one- or two-event scene of the 14 synthetic classes
(:mod:`training.data.synth`: single, repeated, A then B, A while B), with one
caption per language (position ``i`` of every language is moment ``i``'s
caption, so the translations form a query group as everywhere in tonearm).
Moments usually sit apart; some overlap an earlier one (``OVERLAP_PROBABILITY``). One recording in four
(``LONG_EVENT_SHARE``, spread evenly over the indices: 3, 7, 11, …) also holds a **long** moment: one scene
stretched over 40–85 % of the recording (``LONG_EVENT_FRACTION``: a rain, a dog barking on and off), beside
the short ones — so a head trained on the corpus sees events that cover most of a recording. The other
recordings are planned exactly as without it (``long_share=0`` writes the corpus of before, byte for byte).

Boundaries are the samples' own: each moment is rendered alone, its 10-ms
frame RMS is compared with the bed's RMS, and ``start``/``end`` are the first
and last frame where the moment is ``EDGE_OVER_BED`` times louder than the bed;
outside them the moment's signal is gated to silence (5-ms ramps inside), so a
reverberant tail or a quiet first bark never leaves energy outside its span.
The test reads the rendered WAV's energy, not this bookkeeping
(tests/training/test_synth_moments.py).

Manifest: the moments schema of docs/corpus.md ("Moments: long recordings"): one
line per recording, ``moments`` = ``[{"start", "end", "captions": {lang: [one caption]}}]``
in seconds, the clip's own ``captions`` = the moments' captions (position i = moment i);
``meta.duration`` the recording's length, ``meta.moment_events`` what each moment holds
(labels, relation; ``"long": true`` on a long moment), ``meta.bed_db`` the bed level. Determinism as in :mod:`training.data.synth`: plans from
``(seed, 5, i)``, audio from ``(seed, 6, i)``; byte-identical for a seed.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

from index.languages import DEFAULT_LANGUAGES
from training.data.manifest import ClipRecord, MomentRecord, write_manifest
from training.data.synth import (
    CLASSES,
    EVENT_LEVEL,
    GAIN_DB,
    PITCH,
    RATE,
    RELATIONS_BY_SIZE,
    SR,
    Event,
    Scene,
    _distance,
    _fade,
    _layout,
    _level,
    _log_progress,
    _pink,
    _progress_bar,
    _random_attributes,
    _smooth_random,
    generate_corpus,
    scene_captions,
)

log = logging.getLogger(__name__)

FRAME = int(0.01 * SR)
"""Frame of the boundary envelope (10 ms)."""
EDGE_OVER_BED = 4.0
"""A moment starts (ends) at its first (last) frame whose RMS is this many times the bed's RMS."""
RAMP = int(0.005 * SR)
OVERLAP_PROBABILITY = 0.2
MOMENT_SECONDS = (3.0, 10.0)
SECONDS_PER_MOMENT = (15.0, 25.0)
"""A recording of D seconds holds about D / U(15, 25) moments (at least one)."""
BED_DB = (-40.0, -34.0)
"""The bed's RMS relative to an event's nominal level (EVENT_LEVEL)."""
MIN_GAP = 1.0
LONG_EVENT_SHARE = 0.25
"""Default share of the recordings that hold a long moment (``generate_moment_corpus(long_share=...)``)."""
LONG_EVENT_FRACTION = (0.40, 0.85)
"""A long moment covers this fraction of its recording (nominal; its written span is its audio's own)."""


@dataclass(frozen=True)
class MomentSizeSpec:
    splits: tuple[tuple[str, int], ...]
    min_seconds: float
    max_seconds: float


MOMENT_SIZES: dict[str, MomentSizeSpec] = {
    # tests: a few short beds
    "tiny": MomentSizeSpec((("train", 6), ("val", 2), ("test", 4)), 20.0, 30.0),
    # the head's training set and the benchmark's held-out set (bench/moments_head.py)
    "small": MomentSizeSpec((("train", 160), ("val", 16), ("test", 48)), 60.0, 120.0),
}


@dataclass(frozen=True)
class PlannedMoment:
    scene: Scene
    start: float
    """Nominal start (s); the written boundaries are the rendered signal's own."""
    length: float
    long: bool = False
    """The recording's long moment (LONG_EVENT_FRACTION of it)."""


@dataclass(frozen=True)
class RecordingJob:
    index: int
    path: Path
    duration: float
    bed_db: float
    moments: tuple[PlannedMoment, ...]
    seed: int


def _moment_scene(rng: np.random.Generator, used: set[str]) -> Scene:
    """A one- or two-event scene, preferring classes not yet used in the recording."""
    size = int(rng.choice([1, 2], p=[0.6, 0.4]))
    free = [c for c in CLASSES if c not in used]
    pool = free if len(free) >= size else list(CLASSES)
    labels = rng.choice(pool, size, replace=False)
    events = tuple(Event(str(label), _random_attributes(rng, str(label))) for label in labels)
    relation = str(rng.choice(RELATIONS_BY_SIZE[size]))
    count = int(rng.integers(2, 4)) if relation == "repeat" else 1
    return Scene(events, relation, count, "clean")


def plan_recording(rng: np.random.Generator, duration: float) -> list[PlannedMoment]:
    """Moments apart (gaps ≥ MIN_GAP) in time order, plus some overlapping an earlier one."""
    count = max(1, int(round(duration / rng.uniform(*SECONDS_PER_MOMENT))))
    lengths = list(rng.uniform(*MOMENT_SECONDS, count))
    while len(lengths) > 1 and sum(lengths) + MIN_GAP * (len(lengths) + 1) > duration:
        lengths.pop()
    lengths = [min(x, duration - 2 * MIN_GAP) for x in lengths]
    free = duration - sum(lengths) - MIN_GAP * (len(lengths) + 1)
    gaps = MIN_GAP + free * rng.dirichlet(np.ones(len(lengths) + 1))
    used: set[str] = set()
    out: list[PlannedMoment] = []
    t = float(gaps[0])
    for i, length in enumerate(lengths):
        scene = _moment_scene(rng, used)
        used.update(e.label for e in scene.events)
        out.append(PlannedMoment(scene, round(t, 3), round(float(length), 3)))
        t += float(length + gaps[i + 1])
    for base in list(out):
        if rng.random() < OVERLAP_PROBABILITY:
            start = base.start + rng.uniform(0.3, 0.7) * base.length
            length = min(rng.uniform(MOMENT_SECONDS[0], 8.0), duration - 0.5 - start)
            if length >= MOMENT_SECONDS[0]:
                scene = _moment_scene(rng, used)
                used.update(e.label for e in scene.events)
                out.append(PlannedMoment(scene, round(float(start), 3), round(float(length), 3)))
    return sorted(out, key=lambda m: m.start)


def has_long_moment(index: int, share: float) -> bool:
    """Whether recording ``index`` holds a long moment: the indices where ``floor((i + 1) · share)`` steps up,
    so any run of recordings holds its share of them (0.25: 3, 7, 11, …)."""
    return int((index + 1) * share) > int(index * share)


def plan_long_recording(rng: np.random.Generator, duration: float) -> list[PlannedMoment]:
    """One moment over LONG_EVENT_FRACTION of the recording, with :func:`plan_recording`'s short moments in the
    time left (before it, after it, or both; none when that is too short for one), ≥ MIN_GAP apart from it."""
    length = float(rng.uniform(*LONG_EVENT_FRACTION)) * duration
    rest = duration - length - 2 * MIN_GAP
    short = plan_recording(rng, rest) if rest >= MOMENT_SECONDS[0] + 2 * MIN_GAP else []
    # the long moment goes in at a free point of the short moments' plan: the start or the end of it, or
    # between two moments (never inside one); everything after that point moves past it
    free = [0.0, rest] + [m.start + m.length for m in short]
    free = sorted({round(t, 3) for t in free
                   if not any(o.start < t < o.start + o.length for o in short) and t <= rest})
    at = float(free[int(rng.integers(len(free)))])
    used = {e.label for m in short for e in m.scene.events}
    scene = _moment_scene(rng, used)
    shift = length + 2 * MIN_GAP
    moved = [m if m.start < at else PlannedMoment(m.scene, round(m.start + shift, 3), m.length) for m in short]
    long = PlannedMoment(scene, round(at + MIN_GAP, 3), round(length, 3), long=True)
    return sorted([*moved, long], key=lambda m: m.start)


def render_moment(scene: Scene, length: float, rng: np.random.Generator) -> np.ndarray:
    """The scene alone over ``length`` seconds: events rendered as in a corpus clip, each
    event's reverberation cut at its segment's end (the clip keeps its tails; a moment must not)."""
    n = int(round(length * SR))
    out = np.zeros(n)
    segments = _layout(rng, scene, length)
    for event, spans in zip(scene.events, segments, strict=True):
        pitch = PITCH.get(event.attribute("pitch") or "", 1.0) * rng.uniform(0.95, 1.05)
        rate = RATE.get(event.attribute("rate") or "", 1.0)
        gain = EVENT_LEVEL * 10 ** (GAIN_DB.get(event.attribute("loudness") or "", 0.0) / 20)
        for start, end in spans:
            s, e = int(start * SR), min(n, int(end * SR))
            if e - s < 2 * FRAME:
                continue
            x = _fade(_level(CLASSES[event.label].render(rng, e - s, pitch, rate)))
            y = _fade(_distance(rng, gain * x, event.attribute("distance"))[: e - s])
            out[s:e] += y
    return out


def own_boundaries(signal: np.ndarray, bed_rms: float) -> tuple[int, int] | None:
    """(first, last + 1) sample of the frames where ``signal`` is EDGE_OVER_BED × the bed's RMS."""
    frames = signal.size // FRAME
    if frames == 0:
        return None
    rms = np.sqrt(np.mean(signal[: frames * FRAME].reshape(frames, FRAME) ** 2, axis=1))
    loud = np.flatnonzero(rms >= EDGE_OVER_BED * bed_rms)
    if loud.size == 0:
        return None
    return int(loud[0]) * FRAME, int(loud[-1] + 1) * FRAME


def _gate(signal: np.ndarray, first: int, stop: int) -> np.ndarray:
    """Silence outside [first, stop), with RAMP-long raised-cosine ramps just inside."""
    out = np.zeros_like(signal)
    out[first:stop] = signal[first:stop]
    r = min(RAMP, (stop - first) // 2)
    if r > 0:
        ramp = 0.5 - 0.5 * np.cos(np.linspace(0, np.pi, r))
        out[first : first + r] *= ramp
        out[stop - r : stop] *= ramp[::-1]
    return out


def render_recording(job: RecordingJob) -> tuple[np.ndarray, list[tuple[float, float] | None]]:
    """(waveform with peak ≤ 0.95, each moment's own (start, end) in seconds or None if inaudible)."""
    rng = np.random.default_rng([job.seed, 6, job.index])
    n = int(round(job.duration * SR))
    bed_rms = EVENT_LEVEL * 10 ** (job.bed_db / 20)
    drift = 1.0 + 0.3 * (_smooth_random(rng, n, 0.05) - 0.5)
    wave = bed_rms * _pink(rng, n) * drift / np.sqrt(np.mean(drift**2))
    spans: list[tuple[float, float] | None] = []
    for moment in job.moments:
        signal = render_moment(moment.scene, moment.length, rng)
        # the bed may drift up to ×1.15 around its mean: measure the edges against the loudest bed
        found = own_boundaries(signal, 1.15 * bed_rms)
        if found is None:
            spans.append(None)
            continue
        first, stop = found
        signal = _gate(signal, first, stop)
        offset = int(round(moment.start * SR))
        end = min(n, offset + signal.size)
        wave[offset:end] += signal[: end - offset]
        spans.append((round((offset + first) / SR, 3), round(min(offset + stop, n) / SR, 3)))
    peak = float(np.max(np.abs(wave)))
    return (wave * (0.95 / peak) if peak > 0.95 else wave), spans


def _write(job: RecordingJob) -> list[tuple[float, float] | None]:
    wave, spans = render_recording(job)
    pcm = np.round(np.clip(wave, -1.0, 1.0) * 32767).astype("<i2")
    job.path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(job.path), pcm, SR, subtype="PCM_16", format="WAV")
    return spans


def plan_moment_corpus(*, size: str, seed: int, out_dir: Path, seconds: tuple[float, float] | None = None,
                       long_share: float = LONG_EVENT_SHARE) -> list[tuple[RecordingJob, dict[str, list[str]], str]]:
    """Every recording's job, captions (position i = moment i of the job) and split."""
    spec = MOMENT_SIZES[size]
    lo, hi = seconds or (spec.min_seconds, spec.max_seconds)
    planned = []
    index = 0
    for split, quota in spec.splits:
        for _ in range(quota):
            rng = np.random.default_rng([seed, 5, index])
            duration = round(float(rng.uniform(lo, hi)), 2)
            long = has_long_moment(index, long_share)
            moments = plan_long_recording(rng, duration) if long else plan_recording(rng, duration)
            captions: dict[str, list[str]] = {lang: [] for lang in DEFAULT_LANGUAGES}
            for moment in moments:
                for lang, texts in scene_captions(rng, moment.scene, 1).items():
                    captions[lang].append(texts[0])
            path = out_dir / "audio" / split / f"{split}-{index:05d}.wav"
            job = RecordingJob(index, path, duration, round(float(rng.uniform(*BED_DB)), 2), tuple(moments), seed)
            planned.append((job, captions, split))
            index += 1
    return planned


def moment_meta(job: RecordingJob, spans: Sequence[tuple[float, float] | None]) -> dict[str, Any]:
    """``meta`` of a recording: its length, bed level and what each (audible) moment holds."""
    events = [{"labels": [e.label for e in m.scene.events], "relation": m.scene.relation,
               **({"long": True} if m.long else {})}
              for m, span in zip(job.moments, spans, strict=True) if span is not None]
    return {"duration": job.duration, "bed_db": job.bed_db, "moment_events": events, "kind": "moments"}


def generate_moment_corpus(*, size: str, seed: int, out_dir: Path, workers: int | None = None,
                           progress: bool = True, seconds: tuple[float, float] | None = None,
                           long_share: float = LONG_EVENT_SHARE) -> Path:
    """Write the recordings (16-bit PCM, 16 kHz WAV) and ``manifest.jsonl``; return the manifest path.

    ``seconds`` = (min, max) bed length overrides the size's (1–10 min: ``(60, 600)``); ``long_share`` is the
    share of recordings with a long moment (:func:`has_long_moment`; 0: none, the corpus of before).
    """
    if size not in MOMENT_SIZES:
        raise ValueError(f"unknown moment corpus size {size!r}; use one of {', '.join(MOMENT_SIZES)}")
    if seconds is not None and not (10.0 <= seconds[0] <= seconds[1] <= 3600.0):
        raise ValueError(f"bed seconds {seconds}: need 10 <= min <= max <= 3600")
    if not 0.0 <= long_share <= 1.0:
        raise ValueError(f"long_share {long_share}: need 0 <= share <= 1")
    out_dir = Path(out_dir)
    planned = plan_moment_corpus(size=size, seed=seed, out_dir=out_dir, seconds=seconds, long_share=long_share)
    jobs = [job for job, _, _ in planned]
    if workers is None:
        workers = 1 if len(jobs) < 32 else min(2, os.cpu_count() or 1)
    with ExitStack() as stack, _progress_bar(len(jobs), progress) as bar:
        task = bar.add_task("recordings", total=len(jobs))
        if workers <= 1:
            rendered: Iterable[list[tuple[float, float] | None]] = map(_write, jobs)
        else:
            pool = stack.enter_context(ProcessPoolExecutor(max_workers=workers))
            rendered = pool.map(_write, jobs, chunksize=4)
        all_spans = []
        for done, spans in enumerate(rendered, start=1):
            all_spans.append(spans)
            bar.advance(task)
            _log_progress(done, len(jobs))
    records = []
    for (job, captions, split), spans in zip(planned, all_spans, strict=True):
        keep = [i for i, span in enumerate(spans) if span is not None]
        if not keep:
            log.warning("%s: no audible moment; left out of the manifest", job.path)
            continue
        moments = [MomentRecord(span[0], span[1], {lang: [texts[i]] for lang, texts in captions.items()})
                   for i, span in enumerate(spans) if span is not None]
        kept = {lang: [texts[i] for i in keep] for lang, texts in captions.items()}
        records.append(ClipRecord(job.path.stem, job.path, kept, split, moment_meta(job, spans), moments))
    manifest = out_dir / "manifest.jsonl"
    write_manifest(records, manifest)
    hours = sum(job.duration for job in jobs) / 3600
    log.info("wrote the %s moment corpus (seed %d; %d recordings, %.2f h, %d moments) to %s", size, seed,
             len(records), hours, sum(len(r.moments) for r in records), manifest)
    return manifest


def cli_synth(args: argparse.Namespace) -> int:
    """``tonearm synth --size tiny|small --seed N --out DIR [--noise P] [--moments [--bed-seconds MIN MAX]]``."""
    if getattr(args, "moments", False):
        if args.noise:
            raise SystemExit("tonearm synth: --noise applies to the clip corpus, not to --moments")
        seconds = tuple(args.bed_seconds) if args.bed_seconds else None
        generate_moment_corpus(size=args.size, seed=args.seed, out_dir=Path(args.out), seconds=seconds)  # type: ignore[arg-type]
        return 0
    if getattr(args, "bed_seconds", None):
        raise SystemExit("tonearm synth: --bed-seconds needs --moments")
    generate_corpus(size=args.size, seed=args.seed, out_dir=Path(args.out), noise=args.noise)
    return 0
