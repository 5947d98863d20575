"""The demo page at `/` in Debian's headless chromium (Playwright, no browser download).

French query → hits → a clip plays → consistency chart → caption search for an uploaded
clip; keyboard use, labels, a phone-width layout; no console error and no request leaving
the service. Screenshots go to the test's output directory (``TONEARM_SCREENSHOTS`` when set).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from service.app import create_app
from tests.service.conftest import make_settings
from tests.service.test_demo_moments import readme_moment_query

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FRENCH_QUERY = "Un oiseau chante tout près deux fois, avec des pauses."


def _screenshots(tmp_path: Path) -> Path:
    out = Path(os.environ.get("TONEARM_SCREENSHOTS", tmp_path / "screenshots"))
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture
def browser():
    playwright_api = pytest.importorskip("playwright.sync_api") if os.environ.get("CI") != "true" else None
    if playwright_api is None:
        import playwright.sync_api as playwright_api
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is missing: run scripts/ensure-chromium.sh")
        pytest.skip("chromium is not installed (scripts/ensure-chromium.sh)")
    with playwright_api.sync_playwright() as p:
        launched = p.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--autoplay-policy=no-user-gesture-required", "--mute-audio"],
        )
        yield launched
        launched.close()


def _watched_page(browser, server_url: str):
    """A desktop-sized page that records console errors, page errors and requests leaving the service."""
    page = browser.new_page(viewport={"width": 1100, "height": 900})
    problems: list[str] = []
    page.on("console", lambda msg: problems.append(f"console {msg.type}: {msg.text}") if msg.type == "error" else None)
    page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
    page.on("request", lambda req: problems.append(f"request left the service: {req.url}")
            if not req.url.startswith((server_url, "data:", "blob:")) else None)
    return page, problems


def _play_first_hit(page) -> float:
    """Play the first hit's clip, wait until it is really playing (loaded, time moving, no error); its duration."""
    audio = page.locator("#hits li audio").first
    audio.evaluate("a => a.play()")
    page.wait_for_function("""() => { const a = document.querySelector('#hits li audio');
        return a.readyState >= 2 && a.currentTime > 0 && !a.error; }""", timeout=15_000)
    return float(audio.evaluate("a => a.duration"))


def test_demo_page_end_to_end(browser, tiny_bundle: Path, tiny_corpus: Path, uvicorn_runner, tmp_path: Path) -> None:
    shots = _screenshots(tmp_path)
    app = create_app(make_settings(bundle=str(tiny_bundle)))
    with uvicorn_runner(app) as server:
        server.wait_ready()
        page, problems = _watched_page(browser, server.url)

        page.goto(server.url + "/")
        # every form control has a label
        unlabelled = page.evaluate("""() => [...document.querySelectorAll('input, select')]
            .filter(e => !document.querySelector(`label[for="${e.id}"]`)).map(e => e.id || e.name)""")
        assert unlabelled == []
        assert page.locator("#examples button").count() == 2  # the query groups, in the chosen language
        for code in ("jpn", "zho", "cat", "fra"):  # every language has its examples
            page.select_option("#lang", code)
            assert page.locator(f'#examples button[lang="{code}"]').count() == 2

        # keyboard only: Tab to the query box, type French, choose French, Enter
        for _ in range(10):
            if page.evaluate("document.activeElement.id") == "query":
                break
            page.keyboard.press("Tab")
        assert page.evaluate("document.activeElement.id") == "query"
        page.keyboard.type(FRENCH_QUERY)
        page.select_option("#lang", "fra")
        page.focus("#query")
        page.keyboard.press("Enter")
        page.wait_for_selector("#hits li")
        assert page.locator("#hits li").count() == 10
        assert "10 clips" in page.inner_text("#search-status")
        page.screenshot(path=str(shots / "1-search-french.png"), full_page=True)

        assert _play_first_hit(page) > 1.0

        # "more like this" on a hit: ten other clips, by audio–audio similarity
        first = page.inner_text("#hits li .hit-id >> nth=0")
        page.click("#hits li .more-like-this >> nth=0")
        page.wait_for_function(f"document.getElementById('search-status').textContent.includes('like {first}.')")
        assert page.locator("#hits li").count() == 10
        assert first not in [page.inner_text(f"#hits li .hit-id >> nth={i}") for i in range(10)]
        page.click("#query")  # the search below starts from the text results again
        page.keyboard.press("Enter")
        page.wait_for_function("document.getElementById('search-status').textContent.includes('10 clips for')")

        # consistency diagnostic: one bar and one table row per language
        page.click("#consistency-button")
        page.wait_for_selector("#consistency-figure:not([hidden])")
        assert page.locator("#rank-chart rect").count() == 8
        assert page.locator("#rank-table tbody tr").count() == 8
        assert "MRV" in page.inner_text("#rank-caption")
        page.locator("#consistency-figure").scroll_into_view_if_needed()
        page.screenshot(path=str(shots / "2-consistency.png"), full_page=True)

        # caption search for an uploaded clip of the corpus
        with tiny_corpus.open(encoding="utf-8") as handle:
            clip = json.loads(handle.readline())
        page.set_input_files("#audio-file", str(tiny_corpus.parent / clip["audio"]))
        page.click("#upload-button")
        page.wait_for_selector("#captions li")
        assert page.locator("#captions li").count() == 16  # k = 2 per language
        page.screenshot(path=str(shots / "3-upload.png"), full_page=True)

        # phone width: nothing wider than the screen
        page.set_viewport_size({"width": 375, "height": 800})
        wide = page.evaluate("""() => [...document.querySelectorAll('body *')]
            .filter(e => e.getBoundingClientRect().right > 376).map(e => e.tagName + '#' + e.id + '.' + e.className)""")
        assert page.evaluate("document.documentElement.scrollWidth") <= 375, wide
        page.screenshot(path=str(shots / "4-phone.png"), full_page=True)

        assert problems == []


def _readme_moment_query() -> tuple[str, str]:
    """The README's moment query (its language is the page's, French) and the recording it names first."""
    body, recording, _, _ = readme_moment_query()
    assert body["lang"] == "fra"
    return body["query"], recording


@pytest.mark.slow
def test_demo_page_on_the_real_demo_finds_what_the_readme_promises(browser, demo_home: Path, uvicorn_runner,
                                                                   tmp_path: Path) -> None:
    """The page as a newcomer sees it after `make serve`: the README's French query through the
    browser finds a clip with both asked sounds in the top 3; a clip plays; the consistency chart
    ranks the target per language; the screenshots (``demo-*.png``) show the real model."""
    from tests.test_demo_readme_queries import demo_clip_events, readme_examples
    from tonearm.demo import cached_demo_bundle

    bundle = cached_demo_bundle(demo_home)
    assert bundle is not None
    events = demo_clip_events(demo_home)
    query, sounds = next((q, s) for lang, q, s in readme_examples() if lang == "fra")
    shots = _screenshots(tmp_path)
    app = create_app(make_settings(bundle=str(bundle)))
    with uvicorn_runner(app) as server:
        server.wait_ready()
        page, problems = _watched_page(browser, server.url)
        page.goto(server.url + "/")
        page.select_option("#lang", "fra")
        page.fill("#query", query)
        page.press("#query", "Enter")
        page.wait_for_selector("#hits li")
        top = page.locator("#hits li .hit-id").all_inner_texts()[:3]
        assert any(sounds <= events[clip] for clip in top), [(clip, sorted(events[clip])) for clip in top]
        assert _play_first_hit(page) > 1.0

        # "more like this" on a hit: ten other clips, by audio–audio similarity
        first = page.inner_text("#hits li .hit-id >> nth=0")
        page.click("#hits li .more-like-this >> nth=0")
        page.wait_for_function(f"document.getElementById('search-status').textContent.includes('like {first}.')")
        assert page.locator("#hits li").count() == 10
        assert first not in [page.inner_text(f"#hits li .hit-id >> nth={i}") for i in range(10)]
        page.click("#query")  # the search below starts from the text results again
        page.keyboard.press("Enter")
        page.wait_for_function("document.getElementById('search-status').textContent.includes('10 clips for')")
        page.screenshot(path=str(shots / "demo-1-search-french.png"), full_page=False)

        page.click("#consistency-button")
        page.wait_for_selector("#consistency-figure:not([hidden])")
        ranks = [int(r) for r in page.locator("#rank-table tbody td:nth-child(2)").all_inner_texts()]
        assert len(ranks) == 8 and ranks[0] == 1  # English: the default target is the English query's first hit
        # the target box promises no other default than the one used (it once named the search's first hit)
        used = page.inner_text("#consistency-status").split()[1].rstrip(":")
        promised = re.findall(r"(?:train|val|test)-\d+", page.get_attribute("#target", "placeholder") or "")
        assert promised in ([], [used]), (promised, used)
        assert "MRV" in page.inner_text("#rank-caption")
        page.evaluate("document.getElementById('consistency-title').scrollIntoView()")
        page.screenshot(path=str(shots / "demo-2-consistency.png"), full_page=False)

        # the README's moment query: the demo's trained head answers, and the page says so
        moment_query, recording = _readme_moment_query()
        page.fill("#moment-query", moment_query)
        page.click("#moments-button")
        page.wait_for_selector("#moments li .timeline .mark.current")
        assert page.inner_text("#moments li .hit-id >> nth=0").startswith(recording)
        assert "scored by the trained moment head" in page.inner_text("#moments-status")
        assert page.get_attribute("#moments", "data-scorer") == "head"
        page.evaluate("document.getElementById('moments-title').scrollIntoView()")
        page.screenshot(path=str(shots / "demo-4-moments.png"), full_page=False)

        page.set_viewport_size({"width": 375, "height": 800})
        page.evaluate("window.scrollTo(0, 0)")
        assert page.evaluate("document.documentElement.scrollWidth") <= 375
        page.screenshot(path=str(shots / "demo-3-phone.png"), full_page=False)
        assert problems == []
