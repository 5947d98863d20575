"""`tonearm synth`: the procedural, seeded, 8-language sound-scene corpus (SPEC §2).

A clip is a *scene*: 1–3 synthesized sound events (14 classes with distinct
spectro-temporal signatures), each with optional attributes (loud/quiet,
near/far, high/low pitch, slow/fast repetition), arranged by a temporal relation
(single, repeated N times, A then B, A while B, A then B then C, A then B while
C), over background noise. Captions come from per-language templates with
synonyms; caption ``i`` of every language renders the same *caption plan*
(which attributes are mentioned, which synonym slot, which phrasing), so the
captions at one position are translations (a query group).

Hardness: scenes are generated in *families* — a base scene plus variants that
swap the order, flip one attribute, change the relation or replace one event —
kept in the same split, and captions mention only some attributes, so many
captions partly match other clips and recall does not saturate.

Determinism: every random choice comes from ``numpy`` generators seeded by
``(seed, stream, clip index)``; scenes, layouts and captions are drawn in the
main process, audio in workers from per-clip seeds, so the output is
byte-identical for a seed whatever the worker count. Layout and recipes are
documented in docs/corpus.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import soundfile as sf

from index.languages import DEFAULT_LANGUAGES
from training.data.manifest import ClipRecord, write_manifest
from training.data.noise import NOISY_META_KEY, inject_caption_noise
from training.data.synth_lexicon import (
    ADVERB_JOIN,
    ASIAN,
    BACKGROUND,
    COUNTS,
    LEXICON,
    MODIFIERS,
    TEMPLATES,
)

log = logging.getLogger(__name__)

SR = 16_000
Size = Literal["tiny", "small"]


@dataclass(frozen=True)
class SizeSpec:
    splits: tuple[tuple[str, int], ...]
    captions: int
    min_seconds: float
    max_seconds: float


SIZES: dict[str, SizeSpec] = {
    "tiny": SizeSpec((("train", 32), ("val", 8), ("test", 8)), captions=3, min_seconds=2.0, max_seconds=4.0),
    "small": SizeSpec((("train", 2400), ("val", 300), ("test", 300)), captions=5, min_seconds=3.0, max_seconds=6.0),
}

# =========================================================================== signals


def _time(n: int) -> np.ndarray:
    return np.arange(n) / SR


def _filter(x: np.ndarray, lo: float | None = None, hi: float | None = None, order: int = 2) -> np.ndarray:
    """Zero-phase Butterworth-magnitude band-pass in the frequency domain."""
    spec = np.fft.rfft(x)
    f = np.maximum(np.fft.rfftfreq(x.size, 1 / SR), 1e-3)
    mask = np.ones_like(f)
    if lo:
        mask /= np.sqrt(1 + (lo / f) ** (2 * order))
    if hi:
        mask /= np.sqrt(1 + (f / hi) ** (2 * order))
    return np.fft.irfft(spec * mask, x.size)


def _unit_rms(x: np.ndarray) -> np.ndarray:
    rms = np.sqrt(np.mean(x**2))
    return x / rms if rms > 0 else x


def _smooth_random(rng: np.random.Generator, n: int, rate_hz: float) -> np.ndarray:
    """Piecewise-linear random curve in [0, 1] with about ``rate_hz`` breakpoints a second."""
    k = int(n / SR * rate_hz) + 2
    return np.interp(np.linspace(0, k - 1, n), np.arange(k), rng.uniform(0, 1, k))


def _onsets(rng: np.random.Generator, n: int, ioi: float, jitter: float = 0.12) -> list[int]:
    """Onset samples every ``ioi`` seconds (± jitter) over ``n`` samples; at least one."""
    t = rng.uniform(0.0, 0.06)
    out: list[int] = []
    while t * SR < n - 0.04 * SR or not out:
        out.append(int(t * SR))
        t += ioi * rng.uniform(1 - jitter, 1 + jitter)
    return out


def _place(n: int, onsets: Sequence[int], units: Sequence[np.ndarray]) -> np.ndarray:
    out = np.zeros(n)
    for onset, unit in zip(onsets, units, strict=True):
        end = min(n, onset + unit.size)
        if end > onset:
            out[onset:end] += unit[: end - onset]
    return out


def _harmonics(phase: np.ndarray, f0: np.ndarray, amps: np.ndarray) -> np.ndarray:
    """Sum of ``amps[k-1] * sin(k * phase)``, dropping partials above 7.5 kHz."""
    k = np.arange(1, amps.shape[0] + 1)[:, None]
    audible = (k * f0[None, :]) < 7500
    return (amps[:, None] * audible * np.sin(k * phase[None, :])).sum(axis=0)


def _phase(freq: np.ndarray) -> np.ndarray:
    return 2 * np.pi * np.cumsum(freq) / SR


def _bark(rng: np.random.Generator, pitch: float) -> np.ndarray:
    dur = rng.uniform(0.12, 0.2)
    t = _time(int(dur * SR))
    f0 = 420 * pitch * rng.uniform(0.92, 1.08) * (1 + 0.3 * np.exp(-t / 0.03)) * (1 - 0.15 * t / dur)
    k = np.arange(1, 13)[:, None]
    formant = sum(np.exp(-(((k * f0) - f * np.sqrt(pitch)) / 250) ** 2) for f in (650, 1700, 2900))
    x = (formant * (k * f0 < 7500) * np.sin(k * _phase(f0))).sum(axis=0)
    x += 0.15 * _filter(rng.standard_normal(t.size), 500, 3000)
    return x * (1 - np.exp(-t / 0.008)) * np.exp(-t / (0.45 * dur))


def _dog(rng: np.random.Generator, n: int, pitch: float, rate: float) -> np.ndarray:
    onsets = _onsets(rng, n, 0.55 / rate, jitter=0.25)
    return _place(n, onsets, [_bark(rng, pitch) for _ in onsets])


def _bell(rng: np.random.Generator, n: int, pitch: float, rate: float) -> np.ndarray:
    ratios = np.array([0.5, 1.0, 1.2, 1.5, 2.0, 2.5, 2.67, 3.0])
    amps = np.array([0.5, 1.0, 0.6, 0.4, 0.5, 0.3, 0.2, 0.2])
    t = _time(int(1.6 * SR))
    f = 560 * pitch * rng.uniform(0.95, 1.05)
    decay = np.exp(-t[None, :] / (1.4 / ratios[:, None] ** 0.7))
    freqs = (f * ratios)[:, None]
    strike = (amps[:, None] * (freqs < 7500) * decay * np.sin(2 * np.pi * freqs * t[None, :])).sum(axis=0)
    strike *= 1 - np.exp(-t / 0.002)
    onsets = _onsets(rng, n, 1.0 / rate)
    return _place(n, onsets, [strike * rng.uniform(0.8, 1.0) for _ in onsets])


def _siren(rng: np.random.Generator, n: int, pitch: float, rate: float) -> np.ndarray:
    t = _time(n)
    f = 900 * pitch * (1 + 0.3 * np.sin(2 * np.pi * 0.45 * rate * t + rng.uniform(0, 2 * np.pi)))
    return _harmonics(_phase(f), f, np.array([1.0, 0.5, 0.33, 0.25]))


def _engine(rng: np.random.Generator, n: int, pitch: float, rate: float) -> np.ndarray:
    f0 = 40 * pitch * rng.uniform(0.9, 1.1) * (1 + 0.08 * (_smooth_random(rng, n, 0.7) - 0.5))
    phase = _phase(f0)
    amps = rng.uniform(0.5, 1.0, 24) / np.arange(1, 25) ** 0.8
    hum = _unit_rms(_harmonics(phase, f0, amps)) * (1 + 0.35 * np.sin(0.5 * phase))
    return hum + 0.3 * _unit_rms(_filter(rng.standard_normal(n), None, 250 * pitch))


def _rain(rng: np.random.Generator, n: int, pitch: float, rate: float) -> np.ndarray:
    hiss = _unit_rms(_filter(rng.standard_normal(n), 700 * pitch, 6500 * min(pitch, 1.15)))
    hiss *= 1 + 0.2 * _smooth_random(rng, n, 2.0)
    drops = np.zeros(n)
    positions = rng.integers(0, n, rng.poisson(70 * n / SR))
    np.add.at(drops, positions, rng.uniform(0.2, 1.0, positions.size))
    t = _time(int(0.02 * SR))
    kernel = np.exp(-t / 0.004) * np.sin(2 * np.pi * 3000 * min(pitch, 2.0) * t)
    return hiss + 0.8 * _unit_rms(np.convolve(drops, kernel)[:n])


def _chirp(rng: np.random.Generator, pitch: float, rising: bool) -> np.ndarray:
    t = _time(int(rng.uniform(0.05, 0.12) * SR))
    f_a = min(3200 * pitch * rng.uniform(0.85, 1.15), 6000)
    f_b = f_a * rng.uniform(1.2, 1.5)
    f = np.linspace(f_a, f_b, t.size) if rising else np.linspace(f_b, f_a, t.size)
    f = np.minimum(f * (1 + 0.03 * np.sin(2 * np.pi * 30 * t)), 7400)
    return np.sin(_phase(f)) * np.hanning(t.size)


def _bird(rng: np.random.Generator, n: int, pitch: float, rate: float) -> np.ndarray:
    onsets, units = [], []
    for group in _onsets(rng, n, 0.7 / rate, jitter=0.3):
        rising = bool(rng.random() < 0.5)
        for i in range(int(rng.integers(2, 5))):
            onsets.append(group + int(i * 0.11 / np.sqrt(rate) * SR))
            units.append(_chirp(rng, pitch, rising))
    return _place(n, onsets, units)


def _clapping(rng: np.random.Generator, n: int, pitch: float, rate: float) -> np.ndarray:
    t = _time(int(0.03 * SR))
    out = np.zeros(n)
    for _ in range(3):
        claps = [_filter(rng.standard_normal(t.size), 900 * pitch, 2600 * pitch) * np.exp(-t / 0.007)
                 for _ in range(4)]
        onsets = _onsets(rng, n, 0.38 / rate, jitter=0.08)
        out += _place(n, onsets, [claps[int(rng.integers(4))] for _ in onsets])
    return out


def _water(rng: np.random.Generator, n: int, pitch: float, rate: float) -> np.ndarray:
    out = 0.3 * _unit_rms(_filter(rng.standard_normal(n), None, 1200 * pitch)) * _smooth_random(rng, n, 3.0)
    for start in rng.integers(0, n, rng.poisson(35 * n / SR)):
        tau = rng.uniform(0.01, 0.035)
        t = _time(int(5 * tau * SR))
        f = rng.uniform(500, 1400) * pitch * (1 + 3 * t / t[-1])
        bubble = np.sin(_phase(f)) * np.exp(-t / tau) * (1 - np.exp(-t / 0.002))
        end = min(n, start + t.size)
        out[start:end] += 0.7 * bubble[: end - start]
    return out


def _whistle(rng: np.random.Generator, n: int, pitch: float, rate: float) -> np.ndarray:
    note = int(0.28 / rate * SR)
    count = -(-n // note)
    degrees = rng.choice([0, 2, 4, 7, 9, 12], count)
    f = np.repeat(min(1100 * pitch, 2400) * 2 ** (degrees / 12), note)[:n]
    glide = int(0.015 * SR)
    f = np.convolve(np.pad(f, glide, mode="edge"), np.ones(glide) / glide, mode="same")[glide:-glide]
    t = _time(n)
    f = f * (1 + 0.012 * np.sin(2 * np.pi * 5.5 * t))
    phase = _phase(f)
    gate = ((np.arange(n) % note) < 0.85 * note).astype(float)
    gate = np.convolve(gate, np.ones(80) / 80, mode="same")
    breath = 0.05 * _unit_rms(_filter(rng.standard_normal(n), 800, 4000))
    return (np.sin(phase) + 0.1 * np.sin(2 * phase)) * gate + breath


def _drum(rng: np.random.Generator, n: int, pitch: float, rate: float) -> np.ndarray:
    t = _time(int(0.45 * SR))
    f = 95 * pitch * (1 + 1.2 * np.exp(-t / 0.025))
    body = np.sin(_phase(f)) * np.exp(-t / 0.16)
    click = _filter(rng.standard_normal(t.size), None, 3000) * np.exp(-t / 0.008)
    hit = body + 0.4 * click / np.max(np.abs(click))
    onsets = _onsets(rng, n, 0.5 / rate)
    return _place(n, onsets, [hit * rng.uniform(0.7, 1.0) for _ in onsets])


def _alarm(rng: np.random.Generator, n: int, pitch: float, rate: float) -> np.ndarray:
    t = _time(int(0.08 * SR))
    f = min(2600 * pitch, 3600)
    beep = (np.sin(2 * np.pi * f * t) + (3 * f < 7500) * np.sin(6 * np.pi * f * t) / 3) * np.hanning(t.size) ** 0.2
    onsets = []
    for group in _onsets(rng, n, (4 * 0.15 + 0.35) / rate, jitter=0.02):
        onsets += [group + int(i * 0.15 / rate * SR) for i in range(4)]
    return _place(n, onsets, [beep] * len(onsets))


def _wind(rng: np.random.Generator, n: int, pitch: float, rate: float) -> np.ndarray:
    gust = 0.3 + 0.7 * _smooth_random(rng, n, 0.6) ** 2
    broad = _unit_rms(_filter(rng.standard_normal(n), 60, 500 * pitch))
    howl = _unit_rms(_filter(rng.standard_normal(n), 380 * pitch, 480 * pitch, order=4))
    return gust * (broad + 0.6 * howl)


def _telephone(rng: np.random.Generator, n: int, pitch: float, rate: float) -> np.ndarray:
    period = 1.3 / rate
    t = _time(int(min(0.7, 0.6 * period) * SR))
    trill = np.convolve((np.sin(2 * np.pi * 20 * t) > 0).astype(float), np.ones(40) / 40, mode="same")
    ring = (np.sin(2 * np.pi * 700 * pitch * t) + np.sin(2 * np.pi * 900 * pitch * t)) * trill
    onsets = _onsets(rng, n, period, jitter=0.03)
    return _place(n, onsets, [ring] * len(onsets))


def _knocking(rng: np.random.Generator, n: int, pitch: float, rate: float) -> np.ndarray:
    t = _time(int(0.08 * SR))
    modes = [(180, 1.0, 0.03), (410, 0.6, 0.02), (880, 0.3, 0.012)]
    knock = sum(a * np.exp(-t / tau) * np.sin(2 * np.pi * f * pitch * t) for f, a, tau in modes)
    knock = knock + 0.5 * rng.standard_normal(t.size) * np.exp(-t / 0.002)
    onsets = []
    for group in _onsets(rng, n, 1.1 / rate, jitter=0.15):
        onsets += [group + int(i * 0.17 / np.sqrt(rate) * SR) for i in range(int(rng.integers(2, 4)))]
    return _place(n, onsets, [knock * rng.uniform(0.8, 1.0) for _ in onsets])


Renderer = Callable[[np.random.Generator, int, float, float], np.ndarray]


@dataclass(frozen=True)
class SoundClass:
    render: Renderer
    repeating: bool
    """Repeating classes take the slow/fast ``rate`` attribute (siren: sweep speed)."""


CLASSES: dict[str, SoundClass] = {
    "dog": SoundClass(_dog, True),
    "bell": SoundClass(_bell, True),
    "siren": SoundClass(_siren, True),
    "engine": SoundClass(_engine, False),
    "rain": SoundClass(_rain, False),
    "bird": SoundClass(_bird, True),
    "clapping": SoundClass(_clapping, True),
    "water": SoundClass(_water, False),
    "whistle": SoundClass(_whistle, True),
    "drum": SoundClass(_drum, True),
    "alarm": SoundClass(_alarm, True),
    "wind": SoundClass(_wind, False),
    "telephone": SoundClass(_telephone, True),
    "knocking": SoundClass(_knocking, True),
}

ATTRIBUTES: dict[str, tuple[str, str]] = {
    "loudness": ("loud", "quiet"),
    "distance": ("near", "far"),
    "pitch": ("high", "low"),
    "rate": ("slow", "fast"),
}
PITCH = {"high": 1.5, "low": 0.66}
RATE = {"fast": 1.8, "slow": 0.55}
GAIN_DB = {"loud": 6.0, "quiet": -12.0}
EVENT_LEVEL = 0.08
BACKGROUND_DB = {"clean": -38.0, "noisy": -16.0}

# =========================================================================== scenes


@dataclass(frozen=True)
class Event:
    label: str
    attributes: tuple[tuple[str, str], ...] = ()

    def attribute(self, dim: str) -> str | None:
        return dict(self.attributes).get(dim)


@dataclass(frozen=True)
class Scene:
    """Events in their role order (chronological; for ``while`` the foreground first, the ongoing one last)."""

    events: tuple[Event, ...]
    relation: str
    count: int = 1
    background: str = "clean"


RELATIONS_BY_SIZE = {1: ("single", "repeat"), 2: ("then", "while"), 3: ("sequence", "then_while")}


def _random_attributes(rng: np.random.Generator, label: str) -> tuple[tuple[str, str], ...]:
    dims = [d for d in ATTRIBUTES if d != "rate" or CLASSES[label].repeating]
    return tuple((d, str(rng.choice(ATTRIBUTES[d]))) for d in dims if rng.random() < 0.4)


def _random_scene(rng: np.random.Generator) -> Scene:
    size = int(rng.choice([1, 2, 3], p=[0.25, 0.5, 0.25]))
    labels = rng.choice(list(CLASSES), size, replace=False)
    events = tuple(Event(str(label), _random_attributes(rng, str(label))) for label in labels)
    relation = str(rng.choice(RELATIONS_BY_SIZE[size]))
    count = int(rng.integers(2, 4)) if relation == "repeat" else 1
    return Scene(events, relation, count, "noisy" if rng.random() < 0.3 else "clean")


def _flip_attribute(rng: np.random.Generator, scene: Scene) -> Scene:
    i = int(rng.integers(len(scene.events)))
    event = scene.events[i]
    attrs = dict(event.attributes)
    dims = [d for d in ATTRIBUTES if d != "rate" or CLASSES[event.label].repeating]
    dim = str(rng.choice(dims))
    values = ATTRIBUTES[dim]
    attrs[dim] = values[1] if attrs.get(dim) == values[0] else values[0]
    events = list(scene.events)
    events[i] = Event(event.label, tuple((d, attrs[d]) for d in ATTRIBUTES if d in attrs))
    return replace(scene, events=tuple(events))


def _variant(rng: np.random.Generator, scene: Scene) -> Scene:
    """A near neighbour of ``scene``: swapped roles, one flipped attribute, other relation or event."""
    kind = str(rng.choice(["swap", "flip", "relation", "replace"]))
    if kind == "swap" and len(scene.events) > 1:
        events = list(scene.events)
        events[0], events[1] = events[1], events[0]
        return replace(scene, events=tuple(events))
    if kind == "relation":
        options = [r for r in RELATIONS_BY_SIZE[len(scene.events)] if r != scene.relation]
        relation = options[0]
        return replace(scene, relation=relation, count=int(rng.integers(2, 4)) if relation == "repeat" else 1)
    if kind == "replace":
        i = int(rng.integers(len(scene.events)))
        used = {e.label for e in scene.events}
        label = str(rng.choice([c for c in CLASSES if c not in used]))
        attrs = tuple((d, v) for d, v in scene.events[i].attributes if d != "rate" or CLASSES[label].repeating)
        events = list(scene.events)
        events[i] = Event(label, attrs)
        return replace(scene, events=tuple(events))
    return _flip_attribute(rng, scene)


def _family(rng: np.random.Generator) -> list[Scene]:
    """A base scene and 0–2 distinct variants of it."""
    family = [_random_scene(rng)]
    size = int(rng.choice([1, 2, 3], p=[0.3, 0.4, 0.3]))
    for _ in range(20 * size):
        if len(family) == size:
            break
        candidate = _variant(rng, family[0])
        if candidate not in family:
            family.append(candidate)
    return family


def _layout(rng: np.random.Generator, scene: Scene, duration: float) -> list[list[tuple[float, float]]]:
    """Segments (start, end) in seconds of each event, following the relation."""
    d = duration

    def span(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
        return (round(rng.uniform(*a) * d, 3), round(rng.uniform(*b) * d, 3))

    if scene.relation == "single":
        return [[span((0, 0.15), (0.85, 1.0))]]
    if scene.relation == "repeat":
        slot = 1 / scene.count
        segments = []
        for i in range(scene.count):
            start = (i + rng.uniform(0.05, 0.2)) * slot
            segments.append((round(start * d, 3), round((start + rng.uniform(0.45, 0.6) * slot) * d, 3)))
        return [segments]
    if scene.relation == "then":
        return [[span((0, 0.08), (0.38, 0.46))], [span((0.54, 0.62), (0.92, 1.0))]]
    if scene.relation == "while":
        return [[span((0.2, 0.35), (0.65, 0.8))], [span((0, 0.05), (0.95, 1.0))]]
    if scene.relation == "sequence":
        return [[span((0, 0.05), (0.24, 0.29))], [span((0.36, 0.4), (0.6, 0.64))], [span((0.71, 0.75), (0.95, 1.0))]]
    if scene.relation == "then_while":
        return [[span((0.05, 0.1), (0.4, 0.46))], [span((0.54, 0.6), (0.9, 0.95))], [span((0, 0.03), (0.97, 1.0))]]
    raise ValueError(f"unknown relation {scene.relation!r}")


# =========================================================================== rendering


def _fade(x: np.ndarray) -> np.ndarray:
    m = min(int(0.008 * SR), x.size // 2)
    if m > 0:
        ramp = 0.5 - 0.5 * np.cos(np.linspace(0, np.pi, m))
        x[:m] *= ramp
        x[-m:] *= ramp[::-1]
    return x


def _level(x: np.ndarray) -> np.ndarray:
    """Scale so the 90th percentile of 40 ms frame RMS is 1 (sparse and continuous sounds alike)."""
    frame = int(0.04 * SR)
    usable = x[: x.size - x.size % frame] if x.size >= frame else np.pad(x, (0, frame - x.size))
    rms = np.sqrt(np.mean(usable.reshape(-1, frame) ** 2, axis=1))
    ref = np.percentile(rms, 90)
    return x / ref if ref > 0 else x


def _convolve(x: np.ndarray, ir: np.ndarray) -> np.ndarray:
    size = 1 << int(np.ceil(np.log2(x.size + ir.size - 1)))
    return np.fft.irfft(np.fft.rfft(x, size) * np.fft.rfft(ir, size), size)[: x.size + ir.size - 1]


def _distance(rng: np.random.Generator, x: np.ndarray, distance: str | None) -> np.ndarray:
    """near: dry and +2 dB; default: small room; far: long reverb, low-pass, −5 dB."""
    if distance == "near":
        return x * 1.26
    tail, tau, wet_share = (0.7, 0.18, 0.65) if distance == "far" else (0.25, 0.04, 0.25)
    t = _time(int(tail * SR))
    ir = rng.standard_normal(t.size) * np.exp(-t / tau)
    wet = _convolve(x, ir)
    wet *= np.sqrt(np.mean(x**2)) / max(np.sqrt(np.mean(wet[: x.size] ** 2)), 1e-12)
    y = wet_share * wet
    y[: x.size] += (1 - wet_share) * x
    if distance == "far":
        y = 0.56 * _filter(y, None, 2200)
    return y


def _pink(rng: np.random.Generator, n: int) -> np.ndarray:
    spec = np.fft.rfft(rng.standard_normal(n))
    f = np.maximum(np.fft.rfftfreq(n, 1 / SR), 20.0)
    return _unit_rms(np.fft.irfft(spec / np.sqrt(f), n))


def render_clip(scene: Scene, segments: Sequence[Sequence[tuple[float, float]]], *, duration: float,
                rng: np.random.Generator) -> np.ndarray:
    """The clip's waveform (float64, peak ≤ 0.95) at 16 kHz."""
    n = int(round(duration * SR))
    clip = np.zeros(n)
    for event, spans in zip(scene.events, segments, strict=True):
        pitch = PITCH.get(event.attribute("pitch") or "", 1.0) * rng.uniform(0.95, 1.05)
        rate = RATE.get(event.attribute("rate") or "", 1.0)
        gain = EVENT_LEVEL * 10 ** (GAIN_DB.get(event.attribute("loudness") or "", 0.0) / 20)
        for start, end in spans:
            s, e = int(start * SR), min(n, int(end * SR))
            x = _fade(_level(CLASSES[event.label].render(rng, e - s, pitch, rate)))
            y = _distance(rng, gain * x, event.attribute("distance"))
            stop = min(n, s + y.size)
            clip[s:stop] += y[: stop - s]
    clip += EVENT_LEVEL * 10 ** (BACKGROUND_DB[scene.background] / 20) * _pink(rng, n)
    peak = np.max(np.abs(clip))
    return clip * (0.95 / peak) if peak > 0.95 else clip


# =========================================================================== captions
# The tables (LEXICON, MODIFIERS, TEMPLATES, …) live in training.data.synth_lexicon.



@dataclass(frozen=True)
class Wording:
    """Language-neutral choices for one event in one caption (same for every language)."""

    phrasing: int
    mentions: tuple[tuple[str, int], ...]
    """(attribute dimension, synonym slot) of the attributes this caption mentions."""


@dataclass(frozen=True)
class CaptionPlan:
    events: tuple[Wording, ...]
    template: int
    background: int | None


def _pick(options: Sequence[Any], slot: int) -> Any:
    return options[slot % len(options)]


def _modifiers(lang: str, event: Event, wording: Wording) -> dict[str, str]:
    values = dict(event.attributes)
    return {dim: _pick(MODIFIERS[lang][dim][values[dim]], slot) for dim, slot in wording.mentions}


def _join(*parts: str, sep: str = " ") -> str:
    return sep.join(p for p in parts if p)


def _clause(lang: str, event: Event, wording: Wording) -> dict[str, str]:
    """The event as a clause in every form the language's templates use."""
    phrasing = _pick(LEXICON[event.label][lang], wording.phrasing)
    mods = _modifiers(lang, event, wording)
    pitch, distance = mods.get("pitch", ""), mods.get("distance", "")
    if lang == "jpn":
        subject, *forms = phrasing
        prefix = _join(distance, f"{subject}が", pitch, _join(mods.get("loudness", ""), mods.get("rate", ""), sep="、"), sep="")
        return dict(zip(("", "_past", "_teiru"), (prefix + form for form in forms), strict=True))
    if lang == "zho":
        subject, verb = phrasing
        adverbs = _join(mods.get("loudness", ""), mods.get("rate", ""), sep="、")
        return {"": _join(subject, distance, pitch, adverbs + "地" if adverbs else "", verb, sep="")}
    subject, verb, complement = (*phrasing, "")[:3]
    adverbs = _join(mods.get("loudness", ""), mods.get("rate", ""), sep=ADVERB_JOIN[lang])
    if lang == "eng":
        return {"": _join(subject, verb, complement, adverbs, pitch, distance)}
    if lang in ("deu", "nld"):
        middle = _join(adverbs, pitch, distance, complement)
        return {"": _join(subject, verb, middle), "_inv": _join(verb, subject, middle),
                "_sub": _join(subject, middle, verb)}
    return {"": _join(subject, verb, adverbs, complement, pitch, distance)}


def _finish(lang: str, text: str) -> str:
    if lang in ASIAN:
        return text + "。"
    if lang == "fra":
        text = text.replace("que il", "qu'il").replace("que un", "qu'un").replace("que une", "qu'une")
    return text[0].upper() + text[1:] + "."


def render_caption(lang: str, scene: Scene, plan: CaptionPlan) -> str:
    """One caption of ``scene`` in ``lang`` following the language-neutral ``plan``."""
    slots: dict[str, str] = {"count": COUNTS[lang].get(scene.count, "")}
    for name, event, wording in zip("ABC", scene.events, plan.events, strict=False):
        for form, text in _clause(lang, event, wording).items():
            slots[name + form] = text
    text = _pick(TEMPLATES[lang][scene.relation], plan.template).format(**slots)
    if plan.background is not None:
        extra = _pick(BACKGROUND[lang], plan.background)
        text = extra + text if lang in ASIAN else text + extra
    return _finish(lang, text)


def _random_plan(rng: np.random.Generator, scene: Scene) -> CaptionPlan:
    events = []
    for event in scene.events:
        mentions = tuple((dim, int(rng.integers(6))) for dim, _ in event.attributes if rng.random() < 0.75)
        events.append(Wording(int(rng.integers(6)), mentions))
    background = int(rng.integers(6)) if scene.background == "noisy" and rng.random() < 0.5 else None
    return CaptionPlan(tuple(events), int(rng.integers(6)), background)


def scene_captions(rng: np.random.Generator, scene: Scene, count: int,
                   languages: Sequence[str] = DEFAULT_LANGUAGES) -> dict[str, list[str]]:
    """``count`` captions per language; position i of every language renders the same plan."""
    plans: list[CaptionPlan] = []
    english: set[str] = set()
    for _ in range(50 * count):
        if len(plans) == count:
            break
        plan = _random_plan(rng, scene)
        text = render_caption("eng", scene, plan)
        if text not in english:
            english.add(text)
            plans.append(plan)
    while len(plans) < count:  # a scene with few wordings: repeat, keeping the count fixed
        plans.append(plans[len(plans) % len(english)])
    return {lang: [render_caption(lang, scene, plan) for plan in plans] for lang in languages}


# =========================================================================== corpus


@dataclass(frozen=True)
class ClipJob:
    index: int
    path: Path
    scene: Scene
    segments: tuple[tuple[tuple[float, float], ...], ...]
    duration: float
    seed: int


def _write_clip(job: ClipJob) -> None:
    rng = np.random.default_rng([job.seed, 3, job.index])
    wave = render_clip(job.scene, job.segments, duration=job.duration, rng=rng)
    pcm = np.round(np.clip(wave, -1.0, 1.0) * 32767).astype("<i2")
    job.path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(job.path), pcm, SR, subtype="PCM_16", format="WAV")


def _meta(scene: Scene, segments: Sequence[Sequence[tuple[float, float]]], duration: float, family: int) -> dict[str, Any]:
    events = [{"label": e.label, "attributes": dict(e.attributes), "segments": [list(s) for s in spans]}
              for e, spans in zip(scene.events, segments, strict=True)]
    meta: dict[str, Any] = {"relation": scene.relation, "background": scene.background, "events": events,
                            "duration": duration, "family": family}
    if scene.relation == "repeat":
        meta["count"] = scene.count
    return meta


def plan_corpus(*, size: Size, seed: int, out_dir: Path) -> tuple[list[ClipRecord], list[ClipJob]]:
    """Scenes, captions and layouts of every clip (cheap; the audio is rendered from the jobs)."""
    spec = SIZES[size]
    scene_rng = np.random.default_rng([seed, 1])
    records: list[ClipRecord] = []
    jobs: list[ClipJob] = []
    family_id = 0
    for split, quota in spec.splits:
        scenes: list[tuple[Scene, int]] = []
        while len(scenes) < quota:
            scenes += [(scene, family_id) for scene in _family(scene_rng)]
            family_id += 1
        for scene, family in scenes[:quota]:
            index = len(records)
            rng = np.random.default_rng([seed, 2, index])
            duration = round(float(rng.uniform(spec.min_seconds, spec.max_seconds)), 2)
            segments = _layout(rng, scene, duration)
            clip_id = f"{split}-{index:05d}"
            path = out_dir / "audio" / split / f"{clip_id}.wav"
            captions = scene_captions(rng, scene, spec.captions)
            records.append(ClipRecord(clip_id, path, captions, split, _meta(scene, segments, duration, family)))
            jobs.append(ClipJob(index, path, scene, tuple(tuple(s) for s in segments), duration, seed))
    return records, jobs


def _log_progress(done: int, total: int) -> None:
    """A log record at every tenth of the clips: the terminal bar is not in log files or /readyz."""
    if done == total or done * 10 // total != (done - 1) * 10 // total:
        log.info("synth progress: rendered clips %d/%d", done, total)


def _progress_bar(total: int, enabled: bool) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("synth"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        disable=not enabled, transient=False)
    return progress


def generate_corpus(*, size: Size, seed: int, out_dir: Path, workers: int | None = None,
                    progress: bool = True, noise: float = 0.0) -> Path:
    """Write WAVs (16-bit PCM, 16 kHz) and ``manifest.jsonl`` under ``out_dir``; return the manifest path.

    ``workers=None`` renders in-process for small jobs and with up to two
    processes otherwise; the output is byte-identical either way. The manifest
    is written last (atomically), so its presence means the corpus is complete.
    ``noise`` > 0 replaces that fraction of the training captions with other clips'
    (:mod:`training.data.noise`); the audio is the same as without noise.
    """
    if size not in SIZES:
        raise ValueError(f"unknown corpus size {size!r}; use one of {', '.join(SIZES)}")
    out_dir = Path(out_dir)
    records, jobs = plan_corpus(size=size, seed=seed, out_dir=out_dir)
    noisy = inject_caption_noise(records, noise, seed=seed)
    if workers is None:
        workers = 1 if len(jobs) < 200 else min(2, os.cpu_count() or 1)
    with ExitStack() as stack, _progress_bar(len(jobs), progress) as bar:
        task = bar.add_task("clips", total=len(jobs))
        if workers <= 1:
            rendered: Iterable[None] = map(_write_clip, jobs)
        else:
            pool = stack.enter_context(ProcessPoolExecutor(max_workers=workers))
            rendered = pool.map(_write_clip, jobs, chunksize=16)
        for done, _ in enumerate(rendered, start=1):
            bar.advance(task)
            _log_progress(done, len(jobs))
    manifest = out_dir / "manifest.jsonl"
    write_manifest(records, manifest)
    counts = ", ".join(f"{split} {quota}" for split, quota in SIZES[size].splits)
    log.info("wrote the %s synthetic corpus (seed %d; %s) to %s", size, seed, counts, manifest)
    if noisy:
        log.info("noise %.2f: %d training caption slots replaced (meta.%s)", noise, noisy, NOISY_META_KEY)
    return manifest

