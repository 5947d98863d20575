"""`GET /v1/audio/{clip_id}`: the audio of a clip of the active bundle, with HTTP range requests.

The bundle stores each clip's audio URI relative to its data manifest's directory (the
*audio root*; `TONEARM_AUDIO_ROOT` overrides it). Only clips of the bundle are served,
by id — never a path from the request — and the resolved file (symbolic links
followed) must lie inside the audio root, so a URI such as ``../../etc/passwd`` in a
tampered bundle is refused with 404 like a missing file. One byte range per request
(``bytes=a-b``, ``bytes=a-``, ``bytes=-n``, RFC 9110 §14): 206 with ``Content-Range``;
an unsatisfiable range gets 416; anything else the full file (200). Browsers' ``<audio>``
elements seek with exactly these requests.

Items added through ``POST /v1/items`` are served too: their audio as uploaded, from the item
log's content-addressed store (``audio/<sha256>.<format>``, :mod:`index.items.log`), with the
media type of the format the upload was recognised as. The catalogue a search sees decides what
is served: an added item wins over a bundle clip of its id (an upsert replaces the clip), and a
deleted item or a taken-down clip is 404 like an unknown id. Their answers are not cached by
clients (``no-cache``): an id can be replaced or taken down at any time.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from index.items.log import ItemLog
from service.deps import SearcherDep, SettingsDep, StateDep
from service.errors import ServiceError
from service.routes import ShallowJsonRoute
from service.schemas import problem_responses
from service.searcher import Searcher, index_calls
from service.settings import Settings

router = APIRouter(prefix="/v1/audio", tags=["audio"], route_class=ShallowJsonRoute)

CHUNK_BYTES = 64 * 1024
MEDIA_TYPES = {".wav": "audio/wav", ".flac": "audio/flac", ".mp3": "audio/mpeg", ".ogg": "audio/ogg",
               ".opus": "audio/ogg", ".m4a": "audio/mp4"}
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def audio_root(searcher: Searcher, settings: Settings) -> Path | None:
    """The directory clip URIs are relative to: the setting, else the bundle's data manifest's directory."""
    if settings.audio_root is not None:
        return Path(settings.audio_root).resolve()
    source = getattr(getattr(searcher.bundle, "manifest", None), "source", None)
    named_root = getattr(source, "audio_root", None)
    if named_root:  # an index-only bundle (`tonearm index`) names its folder
        return Path(named_root).resolve()
    manifest = getattr(source, "data_manifest", None)
    if not manifest:
        return None
    path = Path(manifest)
    if not path.is_absolute():  # exported with a relative path: relative to the bundle's parent
        path = Path(searcher.bundle.path).parent / path
    return path.resolve().parent


def added_file(searcher: Searcher, item_log: ItemLog | None, clip_id: str) -> Path | None:
    """The stored audio of the added item ``clip_id`` in the searcher's catalogue; None when it is not one."""
    overlay = searcher.items  # one overlay throughout: a write swaps in the next one at any time
    row = overlay.row_of.get(clip_id)
    if row is None:
        return None
    path = item_log.stored_audio(overlay.items[row].audio) if item_log is not None else None
    if path is None or not path.is_file():
        raise ServiceError("not-found", f"the stored audio of item {clip_id!r} is missing from the item log")
    return path


def added_bytes(searcher: Searcher, clip_id: str) -> tuple[bytes, str] | None:
    """The stored audio and format of the added item ``clip_id`` where the items live in the engine
    (Milvus: the audio in its object store); None when it is not one, or items are in the file log."""
    engine = searcher.engine_items
    if engine is None:
        return None
    try:
        with index_calls():
            return engine.audio_of(clip_id)  # type: ignore[attr-defined, no-any-return]
    except FileNotFoundError:
        raise ServiceError("not-found", f"the stored audio of item {clip_id!r} is missing from the audio store") from None


def _ranged(data: bytes, media_type: str, request: Request) -> Response:
    """``data`` whole (200) or the requested byte range (206), never cached by clients."""
    headers = {"Accept-Ranges": "bytes", "Cache-Control": "no-cache"}
    span = parse_range(request.headers.get("range"), len(data))
    if span is None:
        return Response(data, media_type=media_type, headers=headers)
    start, end = span
    headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
    return Response(data[start : end + 1], status_code=206, media_type=media_type, headers=headers)


def clip_file(searcher: Searcher, settings: Settings, clip_id: str) -> Path:
    """The clip's audio file, confined to the audio root; ServiceError ``not-found`` otherwise
    (also for a clip taken down through ``DELETE /v1/items/{id}``)."""
    row = searcher.clip_rows.get(clip_id) if not searcher.clip_hidden(clip_id) else None
    uri = searcher.bundle.audio_items[row].get("uri") if row is not None else None
    if not uri:
        raise ServiceError("not-found", f"clip {clip_id!r} has no audio in bundle {searcher.bundle_id}")
    root = audio_root(searcher, settings)
    if root is None:
        raise ServiceError("not-found", "this bundle does not say where its audio is; set TONEARM_AUDIO_ROOT")
    path = (root / uri).resolve()  # absolute URIs replace the root and are checked like the rest
    if not path.is_relative_to(root) or not path.is_file():
        raise ServiceError("not-found", f"audio of clip {clip_id!r} is not available under the audio root")
    return path


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``(start, end)`` inclusive for one satisfiable range, None for no/ignored header; raises 416."""
    if not header:
        return None
    match = _RANGE.fullmatch(header.strip())
    if match is None:
        return None  # several ranges or another unit: RFC 9110 lets us send the whole file
    first, last = match.groups()
    if not first and not last:
        return None
    if not first:  # suffix: the last n bytes
        length = int(last)
        if length == 0 or size == 0:
            raise ServiceError("range-not-satisfiable", f"range {header!r} of a {size}-byte file", size=size)
        return max(0, size - length), size - 1
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    if start >= size or (last and int(last) < start):
        raise ServiceError("range-not-satisfiable", f"range {header!r} of a {size}-byte file", size=size)
    return start, end


def _read(path: Path, start: int, length: int) -> Iterator[bytes]:
    with path.open("rb") as handle:
        handle.seek(start)
        while length > 0:
            chunk = handle.read(min(CHUNK_BYTES, length))
            if not chunk:
                return
            length -= len(chunk)
            yield chunk


AUDIO_CONTENT: dict[str, dict[str, object]] = {media_type: {} for media_type in (*dict.fromkeys(MEDIA_TYPES.values()), "application/octet-stream")}


@router.get("/{clip_id:path}", response_class=Response, responses={**problem_responses(404, 416, 503),
                                     200: {"content": AUDIO_CONTENT},
                                     206: {"description": "Partial content", "content": AUDIO_CONTENT}})
def clip_audio(clip_id: str, request: Request, searcher: SearcherDep, settings: SettingsDep,
               state: StateDep) -> Response:
    """Stream the audio of a clip or an added item (supports `Range: bytes=…`, as `<audio>` elements send).

    Ids may contain `/` (`tonearm index` names clips by their relative path)."""
    store = state.items
    stored = added_bytes(searcher, clip_id)
    if stored is not None:
        return _ranged(stored[0], MEDIA_TYPES.get(f".{stored[1]}", "application/octet-stream"), request)
    path = added_file(searcher, getattr(store, "log", None), clip_id)
    cache = "no-cache"
    if path is None:
        path = clip_file(searcher, settings, clip_id)
        cache = "no-cache" if store is not None else "public, max-age=3600"
    size = path.stat().st_size
    media_type = MEDIA_TYPES.get(path.suffix.lower(), "application/octet-stream")
    headers = {"Accept-Ranges": "bytes", "Cache-Control": cache}
    span = parse_range(request.headers.get("range"), size)
    if span is None:
        return StreamingResponse(_read(path, 0, size), media_type=media_type,
                                 headers={**headers, "Content-Length": str(size)})
    start, end = span
    headers |= {"Content-Range": f"bytes {start}-{end}/{size}", "Content-Length": str(end - start + 1)}
    return StreamingResponse(_read(path, start, end - start + 1), status_code=206, media_type=media_type,
                             headers=headers)
