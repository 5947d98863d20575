"""Ids in request paths: the grammar of :mod:`index.ids` as a 422 problem, and the id a route addresses.

Every route that takes an id takes it as ``{…:path}`` (ids of clips in subfolders hold ``/``) and
passes it through :func:`addressed_id`: an id outside the grammar is a 422 ``validation-error``
(never looked up, so ``x/../val-02401`` can never reach ``val-02401``), and an id that no item
has exactly is looked up as its NFC form (new ids are stored in NFC; docs/service.md, "Ids").
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Path

from index.ids import MAX_ID_CHARS, ItemIdError, check_id, json_pattern, nfc
from service.errors import ServiceError

ID_DESCRIPTION = ("An added item's or a bundle clip's id (docs/service.md, \"Ids\"): `/`-separated segments, none "
                  "empty, `.` or `..` or beginning or ending with whitespace; at most 512 bytes of UTF-8; no control, "
                  "format or separator characters, noncharacters or invisible fillers.")
PathId = Annotated[str, Path(min_length=1, max_length=MAX_ID_CHARS, description=ID_DESCRIPTION,
                             json_schema_extra={"pattern": json_pattern()})]
"""A route's ``{item_id:path}`` parameter (the pattern is published, the grammar enforced by :func:`addressed_id`)."""


def id_schema(description: str) -> dict[str, Any]:
    """The JSON Schema of an id in a request body."""
    return {"type": "string", "minLength": 1, "maxLength": MAX_ID_CHARS, "pattern": json_pattern(),
            "description": description}


def in_catalogue(searcher: Any, item_id: str) -> bool:
    """Whether ``item_id`` is an added item or a visible (not taken down) bundle clip of ``searcher``."""
    return searcher.added_item(item_id) is not None or (item_id in searcher.clip_rows
                                                        and not searcher.clip_hidden(item_id))


def addressed_id(item_id: str, searcher: Any, where: str = "path parameter 'item_id'") -> str:
    """The id a route acts on: ``item_id`` as sent when the catalogue has it, else its NFC form when the
    catalogue has that; ServiceError ``validation-error`` (422) when it breaks the grammar."""
    try:
        check_id(item_id)
    except ItemIdError as err:
        raise ServiceError("validation-error", f"{where}: {err}") from None
    if in_catalogue(searcher, item_id):
        return item_id
    normal = nfc(item_id)
    return normal if normal != item_id and in_catalogue(searcher, normal) else item_id
