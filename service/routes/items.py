"""Item routes (admin): add, replace, delete and read the catalogue's items (docs/service.md, Items).

Storage and search of items live in the index layer (:mod:`index.items.log`, :mod:`index.items.overlay`);
:mod:`service.items` embeds them and keeps the loaded bundles in step; this module is HTTP only:
multipart parsing, validation into problem documents, and the order that makes a 201 mean
"durable and searchable": decode (refuse bad audio) → write-ahead record (fsync) → sync the
active bundle's overlay → 201.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace
from tempfile import SpooledTemporaryFile
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Depends, Query, Request
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException

from index.engines.filters import (
    MAX_FIELD_CHARS,
    MAX_STRING_CHARS,
    MAX_VALUES,
    filterable_metadata,
    item_metadata,
)
from index.items.log import (
    MAX_METADATA_FIELDS,
    ItemError,
    ItemRecord,
    check_item_id,
    check_metadata,
    check_text,
)
from service.audio_input import DecodedAudio, decode_for_request, item_limits_of
from service.deps import ItemsWriterDep, PoolDep, RegistryDep, SearcherDep, SettingsDep, StateDep
from service.errors import ServiceError
from service.ids import PathId, addressed_id, id_schema
from service.items import ItemStore
from service.limits import QUERY_MAX_CHARS, loads_json
from service.memory_budget import UploadLease, upload_lease
from service.milvus_items import MilvusCatalogue
from service.routes import ShallowJsonRoute
from service.routes.search import (
    AUDIO_MEDIA_TYPES,
    MULTIPART_OVERHEAD,
    MemoryMultiPartParser,
    _limited_stream,
)
from service.schemas import (
    NOT_BLANK,
    ItemBatchResponse,
    ItemDeleted,
    ItemOut,
    ItemsStatusResponse,
    problem_responses,
)
from service.searcher import Searcher

router = APIRouter(prefix="/v1/items", tags=["items (admin)"], route_class=ShallowJsonRoute)

ITEMS_BATCH_MAX = 32
"""Most items in one ``POST /v1/items:batch``."""
BATCH_BYTES_FACTOR = 8
"""A batch body may hold this many times ``TONEARM_MAX_UPLOAD_BYTES`` (each file within the limit)."""
CAPTIONS_PER_LANGUAGE = 16
FORM_FIELD_BYTES = 512 * 1024

ID_SCHEMA = id_schema("The item's id (unique in the catalogue; re-posting an id replaces the item). Stored in "
                      "Unicode NFC (docs/service.md, \"Ids\"): `/`-separated segments, none empty, `.` or `..`; no "
                      "control or format characters; not only whitespace.")
VALUE_SCHEMA = {"anyOf": [
    {"type": "string", "maxLength": MAX_STRING_CHARS},
    {"type": "number", "minimum": -1e300, "maximum": 1e300},
    {"type": "boolean"},
    {"type": "array", "maxItems": MAX_VALUES, "items": {"type": "string", "maxLength": MAX_STRING_CHARS}},
]}
METADATA_SCHEMA = {
    "type": "object",
    "maxProperties": MAX_METADATA_FIELDS,
    "propertyNames": {"minLength": 1, "maxLength": MAX_FIELD_CHARS, "not": {"enum": ["and", "or", "not"]}},
    "additionalProperties": VALUE_SCHEMA,
    "description": "A flat JSON object: strings, numbers, booleans, lists of strings (what filters compare). "
    "`duration` is set from the audio unless given.",
}
CAPTIONS_SCHEMA = {
    "type": "object",
    "maxProperties": 16,
    "additionalProperties": {
        "type": "array", "maxItems": CAPTIONS_PER_LANGUAGE,
        "items": {"type": "string", "minLength": 1, "maxLength": QUERY_MAX_CHARS, "pattern": NOT_BLANK},
    },
    "description": "Captions by language (served language codes), searchable audio→text.",
}
ITEM_SPEC_SCHEMA = {
    "type": "object",
    "properties": {"id": ID_SCHEMA, "metadata": METADATA_SCHEMA, "captions": CAPTIONS_SCHEMA},
    "required": ["id"],
    "additionalProperties": False,
}
AUDIO_PART = {"contentType": ", ".join(AUDIO_MEDIA_TYPES)}
ITEM_BODY = {
    "requestBody": {
        "required": True,
        "description": "A multipart form: one audio file part (WAV, FLAC, OGG or MP3, recognised from the content), "
        "the item's `id`, its `metadata` (a JSON object) and optionally its `captions` (a JSON object).",
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {"file": {"type": "string", "format": "binary"}, "id": ID_SCHEMA,
                                   "metadata": METADATA_SCHEMA, "captions": CAPTIONS_SCHEMA},
                    "required": ["file", "id"],
                    "additionalProperties": False,
                },
                "encoding": {"file": AUDIO_PART, "metadata": {"contentType": "application/json"},
                             "captions": {"contentType": "application/json"}},
            }
        },
    }
}
BATCH_BODY = {
    "requestBody": {
        "required": True,
        "description": f"A multipart form: 1–{ITEMS_BATCH_MAX} audio `file` parts and one `items` part, a JSON "
        "array describing the files in their order (`id`, `metadata`, `captions`): as many entries as files.",
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "file": {"type": "array", "minItems": 1, "maxItems": ITEMS_BATCH_MAX,
                                 "items": {"type": "string", "format": "binary"}},
                        "items": {"type": "array", "minItems": 1, "maxItems": ITEMS_BATCH_MAX,
                                  "items": ITEM_SPEC_SCHEMA},
                    },
                    "required": ["file", "items"],
                    "additionalProperties": False,
                },
                "encoding": {"file": AUDIO_PART, "items": {"contentType": "application/json"}},
            }
        },
    }
}


@dataclass
class ItemSpec:
    id: str
    metadata: dict[str, Any]
    captions: dict[str, list[str]]


def _invalid(detail: str) -> ServiceError:
    return ServiceError("validation-error", detail)


async def get_store(state: StateDep) -> ItemStore | MilvusCatalogue:
    store = getattr(state, "items", None)
    if store is None:
        if state.items_error is not None:
            raise ServiceError("items-unavailable", state.items_error)
        raise ServiceError("items-unavailable", "items are off on this deployment: TONEARM_ITEMS_ENABLED=false, or "
                           "no directory for the item log (set TONEARM_ITEMS_DIR or TONEARM_BUNDLES_DIR)")
    return store  # type: ignore[no-any-return]


StoreDep = Annotated[ItemStore | MilvusCatalogue, Depends(get_store)]


class _AudioPartsParser(MemoryMultiPartParser):
    """Parts named ``file`` are audio files even without a ``filename`` (clients sending a list of
    binary parts, e.g. for ``items:batch``, often omit it): Starlette would decode them as text.
    In memory, never spooled to ``/tmp`` (:class:`MemoryMultiPartParser`)."""

    def on_headers_finished(self) -> None:
        super().on_headers_finished()
        part = self._current_part
        if part.file is None and part.field_name == "file":
            self._current_fields -= 1
            self._current_files += 1
            if self._current_files > self.max_files:
                raise MultiPartException(f"Too many files. Maximum number of files is {self.max_files}.")
            spool = SpooledTemporaryFile(max_size=self.spool_max_size)
            self._files_to_close_on_error.append(spool)
            part.file = UploadFile(file=spool, size=0, filename="file",  # type: ignore[arg-type]
                                   headers=Headers(raw=part.item_headers))


async def _read_form(request: Request, settings: Any, lease: UploadLease, *,
                     max_files: int) -> tuple[dict[str, list[str]], list[bytes]]:
    """The form's fields and audio files, its body read within the process's memory budget (``lease``)."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise ServiceError("bad-upload", "send a multipart/form-data body: a `file` part, `id` and `metadata` fields")
    # one item: its own byte limit (an hour of compressed audio); a batch: 8 search uploads' worth, each file one
    per_file = settings.item_upload_limit if max_files == 1 else settings.max_upload_bytes
    limit = (per_file if max_files == 1 else settings.max_upload_bytes * BATCH_BYTES_FACTOR) + MULTIPART_OVERHEAD
    stream: AsyncGenerator[bytes, None] = _limited_stream(request, limit, lease)
    parser = _AudioPartsParser(request.headers, stream, max_files=max_files, max_fields=4,
                             max_part_size=FORM_FIELD_BYTES)
    try:
        form = await parser.parse()
    except MultiPartException as err:
        raise ServiceError("bad-upload", f"malformed multipart body: {err}") from None
    fields: dict[str, list[str]] = {}
    files: list[bytes] = []
    try:
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                if name != "file":
                    raise ServiceError("bad-upload", f"unexpected file part {name!r}; audio goes in `file` parts")
                data = await value.read()
                await value.close()  # the spool's copy goes now: one copy of each part is held
                if len(data) > per_file:
                    raise ServiceError("upload-too-large", f"file part exceeds the limit of {per_file} bytes")
                files.append(data)
            else:
                fields.setdefault(name, []).append(value)
    finally:
        await form.close()
    return fields, files


NO_WAVEFORM = np.zeros(0, np.float32)


async def _decode_item(store: ItemStore | MilvusCatalogue, searcher: Searcher, data: bytes, settings: Any,
                       pool: Any, lease: UploadLease) -> DecodedAudio:
    """An item's upload decoded within the memory budget. The file log's store embeds the stored audio
    itself (its sync): only the duration and format are kept. The Milvus store embeds the waveform: it
    stays held by ``lease`` until the request ends."""
    keep = isinstance(store, MilvusCatalogue)  # a long item is never held whole: embedded from its bytes by blocks
    audio = await decode_for_request(data, sample_rate=searcher.bundle.sample_rate, limits=item_limits_of(settings),
                                     lease=lease, run=pool.run, keep=keep)
    return audio if keep else replace(audio, waveform=NO_WAVEFORM)


def _one(fields: dict[str, list[str]], name: str, *, required: bool) -> str | None:
    values = fields.get(name, [])
    if len(values) > 1:
        raise _invalid(f"form field `{name}` is given {len(values)} times")
    if not values and required:
        raise _invalid(f"form field `{name}` is required")
    return values[0] if values else None


def _json(text: str | None, name: str) -> Any:
    if text is None:
        return None
    try:
        return loads_json(text)  # refused past JSON_DEPTH_MAX before json.loads recurses
    except ValueError as err:
        raise _invalid(f"form field `{name}` is not JSON: {err}") from None


def _spec(searcher: Searcher, item_id: Any, metadata: Any, captions: Any, where: str) -> ItemSpec:
    if not isinstance(item_id, str):
        raise _invalid(f"{where}id must be a string")
    try:
        item_id = check_item_id(item_id)  # the id as stored: in NFC
        meta = check_metadata({} if metadata is None else metadata)
    except ItemError as err:
        raise _invalid(f"{where}{err}") from None
    for key, value in meta.items():
        if isinstance(value, int | float) and not isinstance(value, bool) and not _finite(value):
            raise _invalid(f"{where}metadata field {key!r}: numbers must be finite, within ±1e300")
    caps: dict[str, list[str]] = {}
    if captions is not None:
        if not isinstance(captions, dict) or len(captions) > 16:
            raise _invalid(f"{where}captions must be a JSON object of at most 16 languages")
        for lang, texts in captions.items():
            if (not isinstance(texts, list) or len(texts) > CAPTIONS_PER_LANGUAGE
                    or not all(isinstance(t, str) and t.strip() and len(t) <= QUERY_MAX_CHARS for t in texts)):
                raise _invalid(f"{where}captions[{lang!r}] must be a list of up to {CAPTIONS_PER_LANGUAGE} "
                               f"non-blank texts of at most {QUERY_MAX_CHARS} characters")
            searcher.check_language(lang)
            try:
                caps[lang] = [check_text(t, f"{where}captions[{lang!r}]") for t in texts]
            except ItemError as err:
                raise _invalid(str(err)) from None
    return ItemSpec(item_id, meta, caps)


def _finite(value: float) -> bool:
    try:
        return math.isfinite(float(value)) and abs(float(value)) <= 1e300
    except OverflowError:
        return False


def _added_out(record: ItemRecord, bundle_id: str, duration: float | None = None) -> ItemOut:
    return ItemOut(id=record.id, source="added", added_at=record.at, metadata=record.metadata,
                   captions=record.captions or None, bundle_id=bundle_id, duration_seconds=duration)


def _store_items(store: ItemStore | MilvusCatalogue, registry: Any, searcher: Searcher,
                 entries: list[tuple[ItemSpec, bytes, DecodedAudio]]) -> list[ItemRecord]:
    """Write-ahead records first (each fsync'd), then the overlays: searchable when this returns. In
    Milvus: audio, then records, then the serving bundle's rows (:meth:`MilvusCatalogue.add`)."""
    records = []
    if isinstance(store, MilvusCatalogue):
        try:
            return store.add(registry, searcher, [
                (spec.id, data, audio, {"duration": round(audio.duration_seconds, 3), **spec.metadata}, spec.captions)
                for spec, data, audio in entries])
        except ItemError as err:
            raise _invalid(str(err)) from None
    for spec, data, audio in entries:
        meta = dict(spec.metadata)
        meta.setdefault("duration", round(audio.duration_seconds, 3))
        try:
            records.append(store.log.put(spec.id, data, audio_format=audio.format.lower(), metadata=meta,
                                         captions=spec.captions))
        except ItemError as err:
            raise _invalid(str(err)) from None
    _sync_serving(store, registry, searcher)
    return records


def _sync_serving(store: ItemStore, registry: Any, searcher: Searcher) -> None:
    store.sync(searcher)
    with registry.live_lock:  # a swap in progress catches up with this record, or is done: sync its bundle
        active = registry.active_searcher()
    if active is not None and active is not searcher:
        store.sync(active)


@router.post("", status_code=201, openapi_extra=ITEM_BODY,
             responses=problem_responses(400, 401, 409, 413, 415, 422, 503, 507))
async def add_item(
    request: Request, _: ItemsWriterDep, searcher: SearcherDep, pool: PoolDep, settings: SettingsDep,
    store: StoreDep, registry: RegistryDep,
) -> ItemOut:
    """Add one sound (or replace the item of this id): durable and searchable when the 201 comes."""
    async with upload_lease(settings) as lease:  # the body (and the Milvus store's waveform) until the answer
        return await _add_item(request, searcher, pool, settings, store, registry, lease)


async def _add_item(request: Request, searcher: Searcher, pool: Any, settings: Any, store: ItemStore | MilvusCatalogue,
                    registry: Any, lease: UploadLease) -> ItemOut:
    fields, files = await _read_form(request, settings, lease, max_files=1)
    if len(files) != 1:
        raise ServiceError("bad-upload", "the form must contain exactly one `file` part (the audio)")
    unknown = sorted(set(fields) - {"id", "metadata", "captions"})
    if unknown:
        raise _invalid(f"unknown form field(s): {', '.join(unknown)}; use id, metadata, captions")
    spec = _spec(searcher, _one(fields, "id", required=True), _json(_one(fields, "metadata", required=False), "metadata"),
                 _json(_one(fields, "captions", required=False), "captions"), "")
    audio = await _decode_item(store, searcher, files[0], settings, pool, lease)
    records = await pool.run(_store_items, store, registry, searcher, [(spec, files[0], audio)])
    return _added_out(records[0], searcher.bundle_id, audio.duration_seconds)


@router.post(":batch", status_code=201, openapi_extra=BATCH_BODY,
             responses=problem_responses(400, 401, 409, 413, 415, 422, 503, 507))
async def add_items(
    request: Request, _: ItemsWriterDep, searcher: SearcherDep, pool: PoolDep, settings: SettingsDep,
    store: StoreDep, registry: RegistryDep,
) -> ItemBatchResponse:
    """Add or replace several sounds; all are checked (and decoded) before any is recorded."""
    async with upload_lease(settings) as lease:  # the body (and the Milvus store's waveforms) until the answer
        return await _add_items(request, searcher, pool, settings, store, registry, lease)


async def _add_items(request: Request, searcher: Searcher, pool: Any, settings: Any,
                     store: ItemStore | MilvusCatalogue, registry: Any, lease: UploadLease) -> ItemBatchResponse:
    fields, files = await _read_form(request, settings, lease, max_files=ITEMS_BATCH_MAX)
    unknown = sorted(set(fields) - {"items"})
    if unknown:
        raise _invalid(f"unknown form field(s): {', '.join(unknown)}; use `file` parts and one `items` field")
    described = _json(_one(fields, "items", required=True), "items")
    if not isinstance(described, list) or not 1 <= len(described) <= ITEMS_BATCH_MAX:
        raise _invalid(f"`items` must be a JSON array of 1–{ITEMS_BATCH_MAX} objects")
    if len(described) != len(files):
        raise _invalid(f"`items` describes {len(described)} item(s) but the form has {len(files)} `file` part(s)")
    specs = []
    for i, obj in enumerate(described):
        if not isinstance(obj, dict) or set(obj) - {"id", "metadata", "captions"}:
            raise _invalid(f"items[{i}] must be an object with id, metadata, captions")
        specs.append(_spec(searcher, obj.get("id"), obj.get("metadata"), obj.get("captions"), f"items[{i}]: "))
    decoded = [await _decode_item(store, searcher, data, settings, pool, lease) for data in files]
    records = await pool.run(_store_items, store, registry, searcher, list(zip(specs, files, decoded, strict=True)))
    return ItemBatchResponse(bundle_id=searcher.bundle_id,
                             items=[_added_out(r, searcher.bundle_id, a.duration_seconds)
                                    for r, a in zip(records, decoded, strict=True)])


@router.get("", responses=problem_responses(401, 422, 503))
async def list_items(
    status: Annotated[Literal["quarantined"], Query(description="`quarantined`: the added items whose stored "
                                                    "audio cannot be embedded (not searchable), with the reason.")],
    _: ItemsWriterDep, searcher: SearcherDep, pool: PoolDep, store: StoreDep,
) -> ItemsStatusResponse:
    """Items the log holds that no search returns (quarantined), and log lines every reader skipped."""
    if isinstance(store, MilvusCatalogue):
        found = await pool.run(store.quarantined, searcher)
        return ItemsStatusResponse(status=status, bundle_id=searcher.bundle_id, items=found,  # type: ignore[arg-type]
                                   corrupt_lines=[])
    items = await pool.run(store.quarantined, searcher.items)
    return ItemsStatusResponse(status=status, bundle_id=searcher.bundle_id, items=items,  # type: ignore[arg-type]
                               corrupt_lines=store.corrupt_lines())  # type: ignore[arg-type]


def _visible_clip(searcher: Searcher, item_id: str) -> dict[str, Any] | None:
    row = searcher.clip_rows.get(item_id)
    if row is None or searcher.clip_hidden(item_id):
        return None
    return searcher.bundle.audio_items[row]  # type: ignore[no-any-return]


@router.get("/{item_id:path}", responses=problem_responses(401, 404, 422, 503))
async def get_item(item_id: PathId, _: ItemsWriterDep, searcher: SearcherDep, pool: PoolDep) -> ItemOut:
    """An item's metadata, where it comes from, and when it was added."""
    item_id = await pool.run(addressed_id, item_id, searcher)  # may ask the engine (Milvus): off the event loop
    added = await pool.run(searcher.added_item, item_id)
    if added is not None:
        return ItemOut(id=added.id, source="added", added_at=added.added_at, metadata=added.metadata,
                       captions=added.captions or None, bundle_id=searcher.bundle_id)
    clip = await pool.run(_visible_clip, searcher, item_id)
    if clip is None:
        raise ServiceError("not-found", f"no item {item_id!r} in the catalogue of bundle {searcher.bundle_id}")
    meta = {k: v for k, v in filterable_metadata(item_metadata(clip)).items() if k not in ("id", "uri")}
    return ItemOut(id=item_id, source="bundle", metadata=meta, captions=clip.get("captions"),
                   bundle_id=searcher.bundle_id)


@router.delete("/{item_id:path}", responses=problem_responses(401, 404, 422, 503))
async def delete_item(
    item_id: PathId, _: ItemsWriterDep, searcher: SearcherDep, pool: PoolDep, store: StoreDep, registry: RegistryDep,
) -> ItemDeleted:
    """Remove an item from every search (a bundle clip: a takedown, without rebuilding the bundle)."""
    item_id = await pool.run(addressed_id, item_id, searcher)  # may ask the engine (Milvus): off the event loop

    def run() -> tuple[ItemRecord, str]:
        if searcher.added_item(item_id) is not None:
            source = "added"
        elif _visible_clip(searcher, item_id) is not None:
            source = "bundle"
        else:
            raise ServiceError("not-found", f"no item {item_id!r} in the catalogue of bundle {searcher.bundle_id}")
        return _delete(store, registry, searcher, item_id), source

    record, source = await pool.run(run)
    return ItemDeleted(id=item_id, source=source, deleted_at=record.at)  # type: ignore[arg-type]


def _delete(store: ItemStore | MilvusCatalogue, registry: Any, searcher: Searcher, item_id: str) -> ItemRecord:
    """The delete record (fsync'd, or in Milvus), then the serving bundles: hidden when this returns."""
    if isinstance(store, MilvusCatalogue):
        return store.delete(registry, searcher, item_id)
    try:
        record = store.log.delete(item_id)
    except ItemError as err:
        raise _invalid(str(err)) from None
    _sync_serving(store, registry, searcher)
    return record
