"""The closed set of domain errors and their RFC 9457 problem+json mapping.

Every error the service returns on purpose is one of :data:`PROBLEMS`: a stable
``type`` URN, an HTTP status and a title. Code raises :class:`ServiceError`
with a problem slug and a detail message; the app turns it into
``application/problem+json`` in one place (:func:`problem_response`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

PROBLEM_MEDIA_TYPE = "application/problem+json"
TYPE_PREFIX = "urn:tonearm:problem:"


@dataclass(frozen=True)
class Problem:
    status: int
    title: str


PROBLEMS: dict[str, Problem] = {
    "validation-error": Problem(422, "Request does not match the schema"),
    "invalid-query": Problem(422, "Query text is empty or too long"),
    "unknown-language": Problem(422, "Language not supported by the active bundle"),
    "unknown-target": Problem(404, "Target clip id not in the active bundle"),
    "invalid-filter": Problem(422, "Filter names a field or a type the catalogue does not have"),
    "upload-too-large": Problem(413, "Upload exceeds the size limit"),
    "bad-upload": Problem(400, "Malformed upload (multipart without one audio file part)"),
    "unsupported-audio": Problem(415, "Upload is not a supported audio format"),
    "audio-decode-failed": Problem(422, "Audio could not be decoded"),
    "audio-limits": Problem(422, "Audio exceeds the duration, sample-rate or channel limits"),
    "unauthorized": Problem(401, "Missing or wrong admin bearer token"),
    "no-caption-index": Problem(409, "The active bundle has no caption index (an index-only bundle from `tonearm index`)"),
    "no-moment-index": Problem(409, "The active bundle indexes no long recording as windows (no moments to search)"),
    "no-heldout-set": Problem(409, "The active bundle has no held-out set (an index-only bundle from `tonearm index`)"),
    "bundle-not-found": Problem(404, "No bundle with this id in the bundles directory"),
    "bundle-invalid": Problem(422, "Bundle failed verification"),
    "quality-gate-rejected": Problem(409, "Candidate bundle regresses past the quality gate"),
    "bundle-not-published": Problem(409, "Bundle vectors are not published to the Milvus backend yet"),
    "no-previous-bundle": Problem(409, "There is no previous bundle to roll back to"),
    "activation-in-progress": Problem(409, "Another activation is running"),
    "not-ready": Problem(503, "No bundle is loaded yet"),
    "items-unavailable": Problem(503, "The item log cannot be used on this replica (see /readyz)"),
    "index-unavailable": Problem(503, "The index backend (Milvus) cannot be reached"),
    "index-timeout": Problem(504, "The index backend (Milvus) did not answer this request within its deadline"),
    "overloaded": Problem(503, "The replica is at capacity (its encoder queue or its upload memory budget is full); "
                          "retry after the Retry-After delay"),
    "client-disconnected": Problem(499, "The client disconnected before its result was ready"),
    "insufficient-storage": Problem(507, "The server has no room left to store the request (a full disk or volume)"),
    "not-found": Problem(404, "Not found"),
    "range-not-satisfiable": Problem(416, "Requested byte range lies outside the file"),
    "method-not-allowed": Problem(405, "Method not allowed"),
    "malformed-body": Problem(400, "Request body cannot be parsed"),
    "unsupported-media-type": Problem(415, "Request body is not sent as application/json"),
    "http-error": Problem(400, "Bad request"),
    "internal-error": Problem(500, "Internal error (a bug; the log has the traceback)"),
}


PYTHON_REPR = re.compile(r"<[^<>]*? (?:object )?at 0x[0-9a-fA-F]+>")
"""A Python object's default repr (``<_io.BytesIO object at 0x…>``): never shown to a client."""


class ServiceError(Exception):
    """A domain error: one of :data:`PROBLEMS`, a human-readable detail, optional extra members."""

    def __init__(self, slug: str, detail: str, **extra: Any) -> None:
        if slug not in PROBLEMS:
            raise KeyError(f"unknown problem slug {slug!r}")
        super().__init__(detail)
        self.slug = slug
        self.detail = detail
        self.extra = extra

    @property
    def status(self) -> int:
        return PROBLEMS[self.slug].status


def problem_body(
    slug: str, detail: str, *, status: int | None = None, instance: str | None = None, **extra: Any
) -> dict[str, Any]:
    """The RFC 9457 JSON object for a problem (extension members merged in).

    ``status`` overrides the table's status only for framework errors passed through
    as ``http-error`` (e.g. a 400 raised by the multipart parser).
    """
    problem = PROBLEMS[slug]
    body: dict[str, Any] = {
        "type": TYPE_PREFIX + slug,
        "title": problem.title,
        "status": status or problem.status,
        "detail": PYTHON_REPR.sub("the input", detail),
    }
    if instance is not None:
        body["instance"] = instance
    body.update(extra)
    return body


def slug_for_status(status: int) -> str:
    """Slug for framework-raised HTTP errors (404 route, 405 method, …)."""
    return {400: "malformed-body", 404: "not-found", 405: "method-not-allowed", 401: "unauthorized", 503: "not-ready"}.get(
        status, "http-error"
    )
