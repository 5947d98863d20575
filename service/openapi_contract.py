"""The OpenAPI document states what the *active bundle* accepts: its languages as enums.

Languages are a property of the bundle (a model may serve a subset of the eight, or others),
and the server rejects any other code with ``unknown-language``; a fixed schema would either
admit codes the server refuses or refuse codes a bundle serves. So ``/openapi.json`` is the
static document with the active bundle's languages filled in: the ``lang`` of text queries,
the ``lang`` query parameter of audio search, and the keys of a consistency request's
``captions``. Before a bundle is loaded the document carries no language enum (every
search answers 503 then). After a hot swap the next request of the document shows the new set.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

TEXT_REQUESTS = ("TextSearchRequest", "TextBatchRequest")


def _string_branches(schema: dict[str, Any]) -> list[dict[str, Any]]:
    return [branch for branch in schema.get("anyOf", [schema]) if branch.get("type") == "string"]


def with_languages(doc: dict[str, Any], languages: list[str]) -> dict[str, Any]:
    """A copy of ``doc`` whose language fields enumerate ``languages``."""
    doc = copy.deepcopy(doc)
    schemas = doc.get("components", {}).get("schemas", {})
    for name in TEXT_REQUESTS:
        for branch in _string_branches(schemas.get(name, {}).get("properties", {}).get("lang", {})):
            branch["enum"] = list(languages)
    captions = schemas.get("ConsistencyRequest", {}).get("properties", {}).get("captions")
    if captions is not None:
        captions["propertyNames"] = {"enum": list(languages)}
    for operation in doc.get("paths", {}).get("/v1/search/audio", {}).values():
        for parameter in operation.get("parameters", []):
            if parameter.get("name") != "lang":
                continue
            for branch in parameter["schema"].get("anyOf", [parameter["schema"]]):
                if branch.get("type") == "array":
                    branch["items"]["enum"] = list(languages)
    return doc


def install_language_enums(app: FastAPI, languages: Callable[[], list[str] | None]) -> None:
    """Serve ``app``'s OpenAPI document with the languages ``languages()`` returns (None: as is)."""
    static = app.openapi  # FastAPI's generator; it caches the document itself

    def openapi() -> dict[str, Any]:
        served = languages()
        return with_languages(static(), served) if served else static()

    app.openapi = openapi  # type: ignore[method-assign]
