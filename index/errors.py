"""User-facing errors of the torch-free library: the lowest layer, imported by every other one.

The CLI prints their message (no traceback) and exits with status 2; the service maps them to
problems. ``tonearm.errors`` re-exports these names for code written against it. Anything that
is not a :class:`TonearmError` is a bug and keeps its traceback.

Index-backend errors live here too (not in :mod:`index.engines.milvus_index`), so the loader and the
service can tell them apart without importing pymilvus:

* :class:`IndexUnavailable` — the backend cannot be reached (connection refused, UNAVAILABLE,
  its cheap probes past their deadline too): transient, the service answers 503
  ``index-unavailable`` with ``Retry-After``, for every request until it answers again;
* :class:`IndexTimeout` — one call ran past its deadline while the backend still answers (its
  probe did): that call fails alone, the service answers 504 ``index-timeout`` for that request;
* :class:`BundleNotPublished` — the bundle's vectors are not in the backend: the user publishes;
* :class:`IndexInputRefused` — the backend answers but refuses a value of the call (a string longer than
  its VARCHAR field): the caller's input, the service answers 422 ``validation-error``, never a retry.
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


class BundleNotPublished(BundleError):
    """The bundle's vectors are not (completely) in the index backend (Milvus) yet."""


class IndexBackendError(TonearmError):
    """The index backend (Milvus) answered an operation with an error that is not transient."""


class IndexInputRefused(IndexBackendError):
    """The index backend refused a value of the call (an id or string longer than its field, a parameter it
    calls invalid): the input is wrong, not the backend; retrying the same input fails the same way."""


class IndexUnavailable(IndexBackendError):
    """The index backend cannot be reached, or did not answer within its deadline; retry later."""


class IndexTimeout(IndexUnavailable):
    """One call ran past its deadline, but the backend answers others (a cheap probe did): only that
    call fails (a large query, a busy server); the backend is not marked down."""
