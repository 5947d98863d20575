"""The README's example queries, in all eight languages, find what they ask for in the real demo.

Builds the demo bundle exactly as the first `tonearm serve` does (shared session fixture
``demo_home``), then runs every query of the README table "What the demo knows" through the
same encoder + index search the service uses. A clip counts as relevant when its synthesized
events (the corpus manifest's ``meta.events``) include every sound the row names.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from index.languages import DEFAULT_LANGUAGES
from index.loader import LoadedBundle
from tests.conftest import ROOT
from tonearm.demo import cached_demo_bundle, demo_root

# The first test may wait for the real demo build (tests/conftest.py demo_home: progress, not a clock).
pytestmark = [pytest.mark.slow]
TOP = 3
ROW = re.compile(r"^\| `(?P<lang>[a-z]{3})` \| (?P<query>[^|]+?) \| (?P<sounds>[^|]+?) \|$")
MIN_SCORE = re.compile(r'"min_score": (?P<value>0\.\d+)')


def readme_examples() -> list[tuple[str, str, set[str]]]:
    """(lang, query, sounds) rows of the README's example-query table."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = [ROW.match(line.strip()) for line in text.splitlines()]
    return [(m["lang"], m["query"].strip(), {s.strip() for s in m["sounds"].split(",")}) for m in rows if m]


def test_readme_has_one_example_per_language_at_least():
    examples = readme_examples()
    assert {lang for lang, _, _ in examples} == set(DEFAULT_LANGUAGES)


def demo_clip_events(demo_home: Path) -> dict[str, set[str]]:
    """Clip id → the sounds synthesized into it (the demo corpus manifest's ``meta.events``)."""
    events = {}
    for line in (demo_root(demo_home) / "corpus" / "manifest.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        events[record["id"]] = {e["label"] for e in record["meta"]["events"]}
    return events


@pytest.fixture(scope="module")
def demo(demo_home: Path):
    bundle_dir = cached_demo_bundle(demo_home)
    assert bundle_dir is not None
    return LoadedBundle.open(bundle_dir), demo_clip_events(demo_home)


@pytest.mark.parametrize(("lang", "query", "sounds"), readme_examples())
def test_readme_query_finds_a_clip_with_the_asked_sounds_in_the_top_3(demo, lang, query, sounds):
    bundle, events = demo
    scores, rows = bundle.search_audio(bundle.encode_text([query]), TOP)
    found = [(bundle.audio_items[r]["id"], round(float(s), 3)) for s, r in zip(scores[0], rows[0], strict=True)]
    relevant = [clip for clip, _ in found if sounds <= events[clip]]
    assert relevant, f"{lang} {query!r}: top {TOP} {[(c, s, sorted(events[c])) for c, s in found]}"


def test_readme_min_score_keeps_the_answers_of_its_examples(demo):
    """Each example's best relevant hit scores at least the README's suggested min_score."""
    bundle, events = demo
    suggested = float(MIN_SCORE.search((ROOT / "README.md").read_text(encoding="utf-8"))["value"])
    for lang, query, sounds in readme_examples():
        scores, rows = bundle.search_audio(bundle.encode_text([query]), TOP)
        best = max(float(s) for s, r in zip(scores[0], rows[0], strict=True)
                   if sounds <= events[bundle.audio_items[r]["id"]])
        assert best >= suggested, (lang, query, best)
