"""Request limits that are part of the API contract (published in the OpenAPI schema).

Deployment-dependent limits (upload size, audio duration, sample rate, channels)
are settings instead (:mod:`service.settings`).
"""

from __future__ import annotations

import json
import re
from typing import Any

QUERY_MAX_CHARS = 512
"""Longest query after whitespace normalization."""
K_MAX = 100
"""Largest number of hits per query."""
BATCH_MAX = 64
"""Most queries in one ``/v1/search/text:batch`` call."""
CAPTIONS_MAX = 16
"""Most languages in one consistency diagnosis."""
JSON_DEPTH_MAX = 64
"""Deepest nesting of arrays and objects in any JSON the API reads (bodies, the ``filter`` query
parameter, form fields): far above what it takes (a filter nests 8 levels, ``index.engines.filters.MAX_DEPTH``)
and far below ``json.loads``'s recursion, which reaches Python's recursion limit at ~1,000 levels —
there, whatever else runs in the thread at that moment (a garbage collection's callback: the GC pause
metric) fails with ``RecursionError`` too. Deeper JSON is refused before it is parsed."""

_JSON_SPECIALS = re.compile(r'[\[\]{}"\\]')


def json_depth(text: str, *, stop_above: int = JSON_DEPTH_MAX) -> int:
    """Deepest nesting of ``[``/``{`` in ``text`` outside strings (escapes honoured), counting stops at
    ``stop_above + 1``: a linear scan over the brackets, quotes and backslashes only, no recursion.
    Malformed JSON gets a number too (``json.loads`` then says what is wrong)."""
    depth = deepest = 0
    in_string = False
    escaped = -1  # position of the character a backslash escapes
    for found in _JSON_SPECIALS.finditer(text):
        char, at = found.group(), found.start()
        if in_string:
            if at == escaped:
                continue
            if char == "\\":
                escaped = at + 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > stop_above:
                    break
        elif char in "]}":
            depth -= 1
    return deepest


def loads_json(text: str | bytes) -> Any:
    """``json.loads`` of JSON nested at most :data:`JSON_DEPTH_MAX` levels; deeper: a
    ``json.JSONDecodeError`` (a ``ValueError``) before parsing, as for any other JSON the API refuses."""
    if isinstance(text, bytes | bytearray):
        text = text.decode("utf-8")
    if json_depth(text) > JSON_DEPTH_MAX:
        raise json.JSONDecodeError(f"nested more than {JSON_DEPTH_MAX} levels deep", text, 0)
    return json.loads(text)
