"""Request limits that are part of the API contract (published in the OpenAPI schema).

Deployment-dependent limits (upload size, audio duration, sample rate, channels)
are settings instead (:mod:`service.settings`).
"""

from __future__ import annotations

QUERY_MAX_CHARS = 512
"""Longest query after whitespace normalization."""
K_MAX = 100
"""Largest number of hits per query."""
BATCH_MAX = 64
"""Most queries in one ``/v1/search/text:batch`` call."""
CAPTIONS_MAX = 16
"""Most languages in one consistency diagnosis."""
