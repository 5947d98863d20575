"""User-facing errors: the CLI prints their message (no traceback) and exits with status 2.

They are defined in the lowest layer that raises them, :mod:`index.errors` (the CLI
package sits above ``index``); this module re-exports them for code written against it.
"""

from __future__ import annotations

from index.errors import (
    AudioDecodeError,
    BundleError,
    BundleNotPublished,
    DataError,
    IndexBackendError,
    IndexTimeout,
    IndexUnavailable,
    TonearmError,
)

__all__ = [
    "AudioDecodeError",
    "BundleError",
    "BundleNotPublished",
    "DataError",
    "IndexBackendError",
    "IndexTimeout",
    "IndexUnavailable",
    "TonearmError",
]
