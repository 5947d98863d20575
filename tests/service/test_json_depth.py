"""JSON nested past ``JSON_DEPTH_MAX`` is refused before ``json.loads`` recurses into it (service/limits.py).

At ~1,000 levels ``json.loads`` reaches Python's recursion limit, and a garbage collection that
starts there ran the GC-pause metric's callback at the limit: a RecursionError in a gc callback
(seen once in the full suite, test_hostile.py's 3,000-level body). The scan's reference is
``json.loads`` itself plus a depth count over the parsed value.
"""

from __future__ import annotations

import json
import random

import pytest

from service.limits import JSON_DEPTH_MAX, json_depth, loads_json

ATOMS = ['"a[b"', '"x\\\\"', '"\\"[{"', '"}]\\\\\\""', "1", "null", "true", '"é{"', '"\\u005b"', '""']


def _random_json(rng: random.Random, depth: int) -> str:
    if depth == 0 or rng.random() < 0.2:
        return rng.choice(ATOMS)
    children = [_random_json(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    if rng.random() < 0.5:
        return "[" + ", ".join(children) + "]"
    return "{" + ", ".join(f'"k{i}[\\"": {c}' for i, c in enumerate(children)) + "}"


def _parsed_depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max((_parsed_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_parsed_depth(v) for v in value.values()), default=0)
    return 0


def test_the_scan_counts_what_json_loads_parses():
    rng = random.Random(0)
    for _ in range(2000):
        text = _random_json(rng, rng.randint(0, 12))
        assert json_depth(text) == _parsed_depth(json.loads(text)), text


def test_at_the_limit_parses_one_past_it_is_refused_before_parsing():
    at_limit = "[" * JSON_DEPTH_MAX + "]" * JSON_DEPTH_MAX
    assert loads_json(at_limit) is not None and loads_json(at_limit.encode()) == json.loads(at_limit)
    for past in ("[" * (JSON_DEPTH_MAX + 1) + "]" * (JSON_DEPTH_MAX + 1), '{"a":' * 100_000, "[" * 10**6):
        with pytest.raises(json.JSONDecodeError, match=f"nested more than {JSON_DEPTH_MAX} levels"):
            loads_json(past)
    assert loads_json('"' + "[" * 5000 + '"') == "[" * 5000  # brackets in a string are text


def test_a_body_one_level_past_the_limit_is_a_422_naming_it(fake_client):
    """The body's own object is one level: a filter of JSON_DEPTH_MAX - 1 levels is parsed (and refused
    by the filter's schema), one more is refused unparsed naming the limit — both 422
    `validation-error`, as a filter nested too deeply always was."""
    for inner in (JSON_DEPTH_MAX - 1, JSON_DEPTH_MAX):
        deep = "[" * inner + "]" * inner
        r = fake_client.post("/v1/search/text", content='{"query": "dog", "filter": ' + deep + "}",
                             headers={"content-type": "application/json"})
        refused_unparsed = inner + 1 > JSON_DEPTH_MAX
        assert (r.status_code, r.json()["type"].rsplit(":", 1)[1]) == (422, "validation-error"), r.text
        assert (f"nested more than {JSON_DEPTH_MAX} levels" in r.text) == refused_unparsed, r.text[:300]


def test_a_gc_pause_near_the_recursion_limit_is_recorded_later_not_raised():
    """A collection a few frames below the recursion limit: the GC-pause callback is entered but the
    histogram's own calls have no room; the callback keeps the pause for the next collection instead
    of raising out of gc (Python 3.11: every call, C ones too, counts against the limit, so at the
    very last frame not even the callback can be entered — the service never gets there since it
    refuses deep JSON before parsing it)."""
    import gc
    import sys

    from service.metrics import GcPauses, ServiceMetrics

    metrics = ServiceMetrics()
    pauses = GcPauses(metrics)

    def recorded() -> float:
        return sum(s.value for m in metrics.registry.collect() for s in m.samples
                   if s.name == "tonearm_gc_pause_seconds_count")

    deepest = [0]

    def probe(level: int) -> None:
        deepest[0] = level
        probe(level + 1)

    with pytest.raises(RecursionError):
        probe(0)

    def dive(level: int, at: int) -> None:
        if level >= at:
            gc.collect(0)
            return
        dive(level + 1, at)

    raised: list[object] = []
    hook, sys.unraisablehook = sys.unraisablehook, raised.append
    pauses.install()
    try:
        unrecorded = 0
        for room in range(2, 9):  # frames left below the limit when gc.collect runs
            dive(0, deepest[0] - room)
            unrecorded = max(unrecorded, len(pauses._unrecorded))
        before = recorded()
        gc.collect(0)
    finally:
        pauses.remove()
        sys.unraisablehook = hook
    assert raised == [], raised
    assert unrecorded >= 1, "the histogram had room at every depth: the test no longer reaches the limit"
    assert recorded() >= before + 2 and not pauses._unrecorded
