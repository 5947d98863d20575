"""User-facing errors: the CLI prints their message (no traceback) and exits with status 2.

Every package raises a subclass for a problem the user can fix (bad input, bad
config, missing file); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class TonearmError(Exception):
    """A problem the user can fix; the message says what and where."""


class DataError(TonearmError):
    """A manifest, caption file or dataset layout that cannot be used."""


class AudioDecodeError(DataError):
    """An audio file or upload that cannot be decoded (unreadable, empty, not audio)."""


class BundleError(TonearmError):
    """A bundle that is missing, incomplete, tampered with or inconsistent."""
