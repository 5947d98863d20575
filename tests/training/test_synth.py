from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import soundfile as sf

from index.languages import DEFAULT_LANGUAGES
from tonearm.cli import main
from training.data.manifest import load_manifest
from training.data.synth import (
    CLASSES,
    CaptionPlan,
    Event,
    Scene,
    Wording,
    generate_corpus,
    plan_corpus,
    render_caption,
    render_clip,
)


def _digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_gives_byte_identical_corpus_whatever_the_worker_count(tmp_path: Path) -> None:
    assert main(["synth", "--size", "tiny", "--seed", "3", "--out", str(tmp_path / "a")]) == 0
    generate_corpus(size="tiny", seed=3, out_dir=tmp_path / "b", workers=2, progress=False)
    first, second = _digests(tmp_path / "a"), _digests(tmp_path / "b")
    assert len(first) == 48 + 1 and first == second
    other, _ = plan_corpus(size="tiny", seed=4, out_dir=tmp_path / "a")
    assert [r.captions for r in other] != [r.captions for r in load_manifest(tmp_path / "a" / "manifest.jsonl",
                                                                             languages=DEFAULT_LANGUAGES)]


def test_tiny_corpus_structure(tiny_corpus: Path) -> None:
    records = load_manifest(tiny_corpus, languages=DEFAULT_LANGUAGES)
    assert Counter(r.split for r in records) == {"train": 32, "val": 8, "test": 8}
    for record in records:
        assert set(record.captions) == set(DEFAULT_LANGUAGES)
        assert {len(c) for c in record.captions.values()} == {3}
        info = sf.info(record.audio)
        assert (info.samplerate, info.channels, info.subtype) == (16000, 1, "PCM_16")
        assert 2.0 <= info.duration <= 4.0
        assert abs(info.duration - record.meta["duration"]) < 1e-3
        assert 1 <= len(record.meta["events"]) <= 3
        assert {e["label"] for e in record.meta["events"]} <= set(CLASSES)
    first_line = tiny_corpus.read_text(encoding="utf-8").splitlines()[0]
    assert list(json.loads(first_line)) == sorted(json.loads(first_line))


def _scene_key(meta: dict) -> tuple:
    return meta["relation"], tuple((e["label"], tuple(sorted(e["attributes"].items()))) for e in meta["events"])


def test_corpus_is_hard_clips_share_events_and_differ_in_order_or_attributes(tiny_corpus: Path) -> None:
    metas = [r.meta for r in load_manifest(tiny_corpus, languages=DEFAULT_LANGUAGES)]
    same_events = [(a, b) for i, a in enumerate(metas) for b in metas[i + 1:]
                   if Counter(e["label"] for e in a["events"]) == Counter(e["label"] for e in b["events"])
                   and _scene_key(a) != _scene_key(b)]
    assert len(same_events) >= 5
    order_only = [(a, b) for a, b in same_events if a["relation"] == b["relation"]
                  and sorted(_scene_key(a)[1]) == sorted(_scene_key(b)[1])]
    assert order_only, "no pair of clips differing only in the order of their events"
    assert len(CLASSES) >= 12
    assert {m["relation"] for m in metas} >= {"then", "while", "single", "repeat"}


def test_captions_are_translations_rendered_from_one_plan() -> None:
    scene = Scene((Event("dog", (("loudness", "loud"), ("distance", "far"))), Event("bell", (("pitch", "high"),))),
                  "then")
    plan = CaptionPlan((Wording(0, (("loudness", 0), ("distance", 0))), Wording(1, (("pitch", 0),))), 0, None)
    expected = {
        "eng": "A dog barks loudly in the distance, then a church bell chimes at a high pitch.",
        "fra": "Un chien aboie fort au loin, puis une cloche d'église tinte d'un son aigu.",
        "deu": "Ein Hund bellt laut in der Ferne, dann schlägt eine Kirchenglocke mit hohem Ton.",
        "spa": "Un perro ladra fuerte a lo lejos, luego una campana de iglesia repica con un tono agudo.",
        "nld": "Een hond blaft luid in de verte, dan slaat een kerkklok met een hoge toon.",
        "cat": "Un gos borda fort a la llunyania, després una campana d'església repica amb un to agut.",
        "jpn": "遠くで犬が大きく吠えた後、教会の鐘が高い音で響く。",
        "zho": "一只狗在远处大声地叫，然后教堂的钟声用高音回荡。",
    }
    assert {lang: render_caption(lang, scene, plan) for lang in expected} == expected


def test_subordinate_clauses_and_elision() -> None:
    scene = Scene((Event("bird"), Event("rain")), "while", background="noisy")
    plan = CaptionPlan((Wording(0, ()), Wording(1, ())), 0, 0)
    assert render_caption("deu", scene, plan) == "Ein Vogel zwitschert, während es regnet, mit Hintergrundrauschen."
    assert render_caption("fra", scene, plan) == "Un oiseau gazouille pendant qu'il pleut, avec un bruit de fond."
    assert render_caption("jpn", scene, plan) == "雑音の中で、雨が降り注いでいる間に、鳥がさえずる。"
    assert render_caption("nld", scene, plan) == "Een vogel tjilpt, terwijl het regent, met achtergrondruis."


def test_events_follow_the_layout_and_attributes_change_the_signal() -> None:
    def clip(*attributes: tuple[str, str]) -> np.ndarray:
        scene = Scene((Event("alarm", attributes), Event("drum")), "then")
        return render_clip(scene, [[(0.0, 0.9)], [(1.1, 2.0)]], duration=2.0, rng=np.random.default_rng(0))

    base = clip()
    assert base.shape == (32000,) and np.max(np.abs(base)) <= 0.95
    first, second = base[:14000], base[18000:]
    spectrum = np.abs(np.fft.rfft(first))
    assert np.argmax(spectrum) * 16000 / first.size > 2000  # alarm beeps at ~2.6 kHz first
    spectrum = np.abs(np.fft.rfft(second))
    assert np.argmax(spectrum) * 16000 / second.size < 300  # drum hits at ~100 Hz later
    quiet = clip(("loudness", "quiet"))
    assert np.sqrt(np.mean(quiet[:14000] ** 2)) < 0.5 * np.sqrt(np.mean(first**2))


def test_relative_output_dir_gives_loadable_manifest(tmp_path, monkeypatch):
    """`tonearm synth --out corpus` from another directory: audio paths resolve from the manifest."""
    from training.data.manifest import load_manifest
    from training.data.synth import generate_corpus

    monkeypatch.chdir(tmp_path)
    manifest = generate_corpus(size="tiny", seed=3, out_dir=Path("corpus"), progress=False)
    records = load_manifest(tmp_path / manifest, languages=["eng", "fra", "deu", "spa", "nld", "cat", "jpn", "zho"])
    assert records and all(record.audio.is_file() for record in records)
    first_line = (tmp_path / "corpus" / "manifest.jsonl").read_text(encoding="utf-8").splitlines()[0]
    assert '"audio": "audio/' in first_line


def test_lexicon_tables_cover_every_class_and_language() -> None:
    """A language or class missing from one table of synth_lexicon would fail mid-corpus."""
    from training.data.synth_lexicon import BACKGROUND, COUNTS, LEXICON, MODIFIERS, TEMPLATES

    assert set(LEXICON) == set(CLASSES)
    for label, by_language in LEXICON.items():
        assert set(by_language) == set(DEFAULT_LANGUAGES), label
        assert all(by_language.values()), label
    for table in (MODIFIERS, TEMPLATES, COUNTS, BACKGROUND):
        assert set(table) == set(DEFAULT_LANGUAGES)
