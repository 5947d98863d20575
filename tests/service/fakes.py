"""A deterministic keyword bundle whose search results can be worked out by hand.

Text: each concept word (in eng/fra/jpn) adds 1 to its concept's axis, plus a
small constant on a last "bias" axis; L2-normalized. Audio: concept ``c`` is a
sine at ``FREQS[c]``; the audio encoder reads the spectrum magnitude at those
frequencies (+ the same bias). So "a dog" scores ≈1 against the dog clip,
≈0.71 against dog+siren, ≈0 against the others.
"""

from __future__ import annotations

import io
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import soundfile as sf

from index.engines.vector_index import FaissVectorIndex

SAMPLE_RATE = 16_000
CONCEPTS = ("dog", "siren", "bell", "rain")
FREQS = (440.0, 1000.0, 2200.0, 3500.0)
WORDS = {
    "eng": ("dog", "siren", "bell", "rain"),
    "fra": ("chien", "sirène", "cloche", "pluie"),
    "jpn": ("犬", "サイレン", "鐘", "雨"),
}
BIAS = 0.05
# clip id → concepts
CLIPS: dict[str, tuple[str, ...]] = {
    "clip-dog": ("dog",),
    "clip-siren": ("siren",),
    "clip-dog-siren": ("dog", "siren"),
    "clip-bell": ("bell",),
    "clip-rain": ("rain",),
}
CAPTION_TEMPLATES = {"eng": "a {} sound", "fra": "un son de {}", "jpn": "{}の音"}


def _normalize(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def text_vector(text: str) -> np.ndarray:
    v = np.zeros(len(CONCEPTS) + 1, dtype=np.float32)
    for words in WORDS.values():
        for c, word in enumerate(words):
            v[c] += text.count(word)
    v[-1] = BIAS
    return v


def tone(concepts: Sequence[str], seconds: float = 1.0, rate: int = SAMPLE_RATE) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    wave = sum(np.sin(2 * np.pi * FREQS[CONCEPTS.index(c)] * t) for c in concepts)
    return (0.3 * np.asarray(wave, dtype=np.float64)).astype(np.float32)


def audio_vector(wave: np.ndarray, rate: int = SAMPLE_RATE) -> np.ndarray:
    spectrum = np.abs(np.fft.rfft(wave))
    freqs = np.fft.rfftfreq(wave.shape[0], 1 / rate)
    v = np.zeros(len(CONCEPTS) + 1, dtype=np.float32)
    for c, f in enumerate(FREQS):
        band = (freqs > f - 20) & (freqs < f + 20)
        v[c] = spectrum[band].max() if band.any() else 0.0
    peak = v[:-1].max()
    v[:-1] = np.where(v[:-1] > 0.2 * peak, 1.0, 0.0) if peak > 0 else 0.0
    v[-1] = BIAS
    return v


def wav_bytes(wave: np.ndarray, *, rate: int = SAMPLE_RATE, fmt: str = "WAV", channels: int = 1) -> bytes:
    data = np.repeat(wave[:, None], channels, axis=1) if channels > 1 else wave
    buffer = io.BytesIO()
    sf.write(buffer, data, rate, format=fmt)
    return buffer.getvalue()


class EvalSet:
    def __init__(self, waveforms: list[np.ndarray], captions: list[str], clip, lang, group) -> None:
        self.waveforms, self.captions = waveforms, captions
        self.clip, self.lang, self.group = np.asarray(clip), np.asarray(lang), np.asarray(group)


class KeywordBundle:
    """Implements the part of ``index.runtime.loader.LoadedBundle`` the service uses."""

    def __init__(self, path: Path, *, bundle_id: str = "fake-a", languages=("eng", "fra", "jpn"), degrade=False):
        self.path = Path(path)
        self.bundle_id = bundle_id
        self.languages = list(languages)
        self.embed_dim = len(CONCEPTS) + 1
        self.sample_rate = SAMPLE_RATE
        self.clip_samples = SAMPLE_RATE
        self.degrade = degrade  # a "worse" bundle: audio encoder permutes the concept axes
        self.closed = False
        self.audio_items: list[dict[str, Any]] = []
        self.text_items: list[dict[str, Any]] = []
        for row, (clip_id, concepts) in enumerate(CLIPS.items()):
            caps = {
                lang: [CAPTION_TEMPLATES[lang].format(" ".join(WORDS[lang][CONCEPTS.index(c)] for c in concepts))]
                for lang in self.languages
            }
            self.audio_items.append({
                "id": clip_id, "uri": f"file:///audio/{clip_id}.wav", "captions": caps,
                "metadata": {"license": ("cc0", "by")[row % 2], "duration": float(1 + row), "tags": list(concepts)},
            })
            for lang in self.languages:
                self.text_items.append({"clip_id": clip_id, "clip_row": row, "lang": lang, "text": caps[lang][0]})
        self._waves = [tone(c) for c in CLIPS.values()]
        self.audio_index = faiss.IndexFlatIP(self.embed_dim)
        self.audio_index.add(self.encode_audio(self._waves))
        self._text_emb = self.encode_text([t["text"] for t in self.text_items])
        self.warmed = False

    def encode_text(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.embed_dim), dtype=np.float32)
        return _normalize(np.stack([text_vector(t) for t in texts]))

    def encode_audio(self, waveforms: Sequence[np.ndarray]) -> np.ndarray:
        out = _normalize(np.stack([audio_vector(np.asarray(w)) for w in waveforms]))
        if self.degrade:
            out = out[:, [1, 2, 3, 0, 4]]
        return out

    def search_audio(self, queries: np.ndarray, k: int, *, allowed: np.ndarray | None = None, where: Any = None):
        if allowed is not None:  # the real filtered search of index.engines.vector_index over a Flat index
            return FaissVectorIndex(self.audio_index, {}).search(queries, k, allowed=allowed)
        return self.audio_index.search(np.ascontiguousarray(queries, dtype=np.float32), k)

    def audio_embeddings(self) -> np.ndarray:
        return self.audio_index.reconstruct_n(0, self.audio_index.ntotal)

    def search_text(
        self,
        queries: np.ndarray,
        k: int,
        *,
        languages: Collection[str] | None = None,
        allowed_clips: np.ndarray | None = None,
        where: Any = None,
    ):
        scores = queries @ self._text_emb.T
        if languages:
            mask = np.array([t["lang"] in languages for t in self.text_items])
            scores = np.where(mask[None, :], scores, -np.inf)
        if allowed_clips is not None:
            mask = np.asarray(allowed_clips)[[t["clip_row"] for t in self.text_items]]
            scores = np.where(mask[None, :], scores, -np.inf)
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        top = np.take_along_axis(scores, order, axis=1)
        rows = np.where(np.isfinite(top), order, -1)
        out_scores = np.full((queries.shape[0], k), -np.inf, dtype=np.float32)
        out_rows = np.full((queries.shape[0], k), -1, dtype=np.int64)
        out_scores[:, : top.shape[1]] = np.where(np.isfinite(top), top, -np.inf)
        out_rows[:, : rows.shape[1]] = rows
        return out_scores, out_rows

    def eval_set(self) -> EvalSet:
        captions, clip, lang, group = [], [], [], []
        for row, item in enumerate(self.audio_items):
            for code in self.languages:
                captions.append(item["captions"][code][0])
                clip.append(row)
                lang.append(code)
                group.append(row)
        return EvalSet(list(self._waves), captions, clip, lang, group)

    def warmup(self) -> None:
        self.warmed = True

    def close(self) -> None:
        self.closed = True
