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

from index.engines.filters import filter_json_schema_name as filter_schema_name
from index.engines.filters import filter_json_schemas

TEXT_REQUESTS = ("TextSearchRequest", "TextBatchRequest", "MomentSearchRequest")


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
    for path in ("/v1/items", "/v1/items:batch"):
        for operation in doc.get("paths", {}).get(path, {}).values():
            form = operation.get("requestBody", {}).get("content", {}).get("multipart/form-data", {}).get("schema", {})
            props = form.get("properties", {})
            spec = props.get("items", {}).get("items", {}).get("properties", props)
            if "captions" in spec:
                spec["captions"]["propertyNames"] = {"enum": list(languages)}
    for operation in doc.get("paths", {}).get("/v1/search/audio", {}).values():
        for parameter in operation.get("parameters", []):
            if parameter.get("name") != "lang":
                continue
            for branch in parameter["schema"].get("anyOf", [parameter["schema"]]):
                if branch.get("type") == "array":
                    branch["items"]["enum"] = list(languages)
    return doc


def install_language_enums(
    app: FastAPI,
    languages: Callable[[], list[str] | None],
    filter_fields: Callable[[], dict[str, str] | None] = lambda: None,
) -> None:
    """Serve ``app``'s OpenAPI document with the languages ``languages()`` returns (None: as is) and
    the filter language over the fields ``filter_fields()`` returns (None: any field)."""
    static = app.openapi  # FastAPI's generator; it caches the document itself

    def openapi() -> dict[str, Any]:
        served = languages()
        doc = with_languages(static(), served) if served else static()
        return with_filter_fields(doc, filter_fields())

    app.openapi = openapi  # type: ignore[method-assign]


FILTER_MARK = "x-tonearm-filter"


def _replace_filter_marks(node: Any) -> Any:
    if isinstance(node, dict):
        if node.get(FILTER_MARK):
            return {"$ref": "#/components/schemas/" + filter_schema_name(1)}
        return {key: _replace_filter_marks(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_replace_filter_marks(value) for value in node]
    return node


def with_filter_fields(doc: dict[str, Any], fields: dict[str, str] | None) -> dict[str, Any]:
    """A copy of ``doc`` whose ``filter`` schemas are the filter language over ``fields`` (the active
    catalogue's metadata fields and kinds; None: any field name)."""
    doc = _replace_filter_marks(doc)
    doc.setdefault("components", {}).setdefault("schemas", {}).update(filter_json_schemas(fields))
    return doc
