"""Language codes (ISO 639-3) shared by training, bundles and the service."""

from __future__ import annotations

DEFAULT_LANGUAGES: tuple[str, ...] = ("eng", "fra", "deu", "spa", "nld", "cat", "jpn", "zho")
"""The papers' multilingual set (ATRI, SupCLAP Table 8)."""

ENGLISH = "eng"


def validate_language_codes(codes: list[str] | tuple[str, ...]) -> None:
    """Reject empty lists, duplicates and codes that are not three lowercase letters."""
    if not codes:
        raise ValueError("at least one language is required")
    for code in codes:
        if len(code) != 3 or not code.isascii() or not code.isalpha() or not code.islower():
            raise ValueError(f"language {code!r} is not an ISO 639-3 code (three lowercase letters)")
    if len(set(codes)) != len(codes):
        raise ValueError(f"duplicate languages in {list(codes)}")
