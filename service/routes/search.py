"""Search routes: text→audio (single and batch) and audio→text (docs/service.md)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import asdict
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Query, Request
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect

from index.audio.formats import MEDIA_TYPES
from index.engines.filters import FilterError, parse_filter
from service.audio_input import DecodedAudio, decode_for_request, limits_of
from service.batching import wait_for_disconnect
from service.deps import BatchersDep, Pool, PoolDep, SearcherDep, SettingsDep
from service.encoder_queues import Batchers
from service.errors import ServiceError
from service.ids import PathId, addressed_id
from service.limits import CAPTIONS_MAX, K_MAX, loads_json
from service.memory_budget import UploadLease, upload_lease
from service.routes import ShallowJsonRoute
from service.schemas import (
    FILTER_PLACEHOLDER,
    AudioHitOut,
    AudioSearchResponse,
    CaptionHitOut,
    MomentHitOut,
    MomentSearchRequest,
    MomentSearchResponse,
    SimilarResponse,
    TextBatchItem,
    TextBatchRequest,
    TextBatchResponse,
    TextSearchRequest,
    TextSearchResponse,
    problem_responses,
)
from service.searcher import AudioHit, AudioQuery, ClipFilter, MomentResult, Searcher, TextLookup
from service.settings import Settings

router = APIRouter(prefix="/v1/search", tags=["search"], route_class=ShallowJsonRoute)

MULTIPART_MAX_FIELDS = 8
"""Form fields (parts without a file name) a multipart upload may carry beside its one file part."""
MULTIPART_OVERHEAD = 64 * 1024
"""Bytes allowed beyond the upload limit for multipart boundaries, headers and small fields."""


def _hits_out(hits: list[AudioHit]) -> list[AudioHitOut]:
    return [AudioHitOut(id=h.id, score=h.score, uri=h.uri, captions=h.captions) for h in hits]


async def _text_hits(
    body: TextSearchRequest | TextBatchRequest,
    queries: list[str],
    searcher: Searcher,
    pool: Pool,
    batchers: Batchers,
    request: Request,
) -> list[list[AudioHit]]:
    """Cache look-up on the event loop when the cache is in-process (no I/O), in the thread pool
    with Redis; misses go to the text encoder's micro-batcher."""
    def look_up() -> TextLookup:
        clip_filter = searcher.clip_filter(body.filter)
        return searcher.lookup_text(queries, lang=body.lang, k=body.k, clip_filter=clip_filter)

    if searcher.cache.backend == "local" and body.filter is None:
        lookup = look_up()
    else:  # Redis I/O, or a filter's mask over every clip
        lookup = await pool.run(look_up)
    if lookup.complete:
        results = [r for r in lookup.results if r is not None]
    else:
        misses = sum(r is None for r in lookup.results)
        results = await batchers.text.submit(
            (searcher, lookup), size=misses, disconnected=lambda: wait_for_disconnect(request.receive)
        )
    return searcher.hits_of(results, min_score=body.min_score, include_captions=body.include_captions,
                            items=lookup.items)


@router.post("/text", responses=problem_responses(400, 415, 422, 503, 504))
async def search_text(
    body: TextSearchRequest, searcher: SearcherDep, pool: PoolDep, batchers: BatchersDep, request: Request
) -> TextSearchResponse:
    """Rank the bundle's clips for one text query in any served language."""
    results = await _text_hits(body, [body.query], searcher, pool, batchers, request)
    return TextSearchResponse(
        bundle_id=searcher.bundle_id, query=body.query, lang=body.lang, hits=_hits_out(results[0])
    )


@router.post("/text:batch", responses=problem_responses(400, 415, 422, 503, 504))
async def search_text_batch(
    body: TextBatchRequest, searcher: SearcherDep, pool: PoolDep, batchers: BatchersDep, request: Request
) -> TextBatchResponse:
    """Several text queries in one call; encoded as one batch (cached queries are skipped)."""
    results = await _text_hits(body, body.queries, searcher, pool, batchers, request)
    items = [TextBatchItem(query=q, hits=_hits_out(h)) for q, h in zip(body.queries, results, strict=True)]
    return TextBatchResponse(bundle_id=searcher.bundle_id, lang=body.lang, results=items)


STREAM_RESERVE_STEP = 1 << 20
"""A body without ``Content-Length`` reserves its bytes in the memory budget this many at a time."""


async def _limited_stream(request: Request, limit: int, lease: UploadLease | None = None) -> AsyncGenerator[bytes, None]:
    """The request body, failing with ``upload-too-large`` as soon as it exceeds ``limit``. With ``lease``,
    its bytes are reserved in the process's memory budget before they are read: all of ``Content-Length``
    at once, or step by step as a body without one streams in (503 ``overloaded`` when there is no room)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ServiceError("upload-too-large", f"Content-Length {declared} exceeds the limit of {limit} bytes")
    reserved = 0
    if lease is not None and declared is not None and declared.isdigit():
        reserved = int(declared)
        await lease.reserve_body(reserved)  # before the first byte is read: a refused body stays unread
    received = 0
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit:
                raise ServiceError("upload-too-large", f"upload exceeds the limit of {limit} bytes")
            if lease is not None and received > reserved:
                step = min(max(received - reserved, STREAM_RESERVE_STEP), limit - reserved)
                await lease.reserve_body(step)
                reserved += step
            yield chunk
    except ClientDisconnect:  # nobody to answer: a 499 in the metrics, not a 500 with a traceback in the log
        raise ServiceError("client-disconnected", f"the client disconnected after {received} bytes of its body") from None


class MemoryMultiPartParser(MultiPartParser):
    """Starlette's parser with file parts kept in memory: Starlette spools parts over 1 MiB to a
    temporary file, and the pod's ``/tmp`` is a 64-MiB memory volume (k8s/base/deployment.yaml) — a
    legal ``items:batch`` of 8 × 9.9 MiB answered 500 ENOSPC. The route reads every part into
    memory anyway, and a tmpfs counts against the pod's memory too: the body's bytes (bounded by
    ``_limited_stream``) are the budget, in the process, with no file (docs/service.md, "Limits")."""

    spool_max_size = 0  # SpooledTemporaryFile(max_size=0) never rolls over to disk


async def read_upload(request: Request, settings: Settings, lease: UploadLease | None = None) -> bytes:
    """Audio bytes from a raw body or from the single file part of a multipart form (with ``lease``: read
    within the process's memory budget, :func:`_limited_stream`)."""
    limit = settings.max_upload_bytes
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        return b"".join([chunk async for chunk in _limited_stream(request, limit, lease)])
    parser = MemoryMultiPartParser(
        request.headers, _limited_stream(request, limit + MULTIPART_OVERHEAD, lease), max_files=1,
        max_fields=MULTIPART_MAX_FIELDS,
    )
    try:
        form = await parser.parse()
    except MultiPartException as err:
        raise ServiceError("bad-upload", f"malformed multipart body: {err}") from None
    files = [value for _, value in form.multi_items() if isinstance(value, UploadFile)]
    if len(files) != 1:
        raise ServiceError("bad-upload", "multipart body must contain exactly one file part (e.g. 'file')")
    try:
        data = await files[0].read()
    finally:
        await form.close()
    if len(data) > limit:
        raise ServiceError("upload-too-large", f"file part exceeds the limit of {limit} bytes")
    return data


async def read_and_decode(
    request: Request, searcher: Searcher, settings: Settings, pool: Pool, lease: UploadLease
) -> DecodedAudio:
    """An audio route's upload, read and decoded within the process's memory budget: the body is held
    until it is decoded, then only the decoded audio (``lease``, until the request ends)."""
    data = await read_upload(request, settings, lease)
    audio = await decode_for_request(data, sample_rate=searcher.bundle.sample_rate, limits=limits_of(settings),
                                     lease=lease, run=pool.run)
    del data  # the only reference: the body's memory goes now, and its bytes back to the budget
    lease.release_body()
    return audio


AUDIO_MEDIA_TYPES = MEDIA_TYPES
"""What an upload must be (index.audio.formats, the list `tonearm index` uses too). The server recognises the container from the content (magic bytes)
and ignores the declared type, so a raw body sent as e.g. application/octet-stream works too;
anything that is not WAV/FLAC/OGG/MP3 audio is a 415 whatever its declared type."""
BINARY = {"type": "string", "format": "binary"}
AUDIO_BODY = {
    "requestBody": {
        "required": True,
        "description": "The audio itself (raw body) or a multipart form with one file part. "
        "The format is recognised from the content: WAV, FLAC, OGG (Vorbis/Opus) or MP3; the "
        "declared type is not used, other content is rejected with 415.",
        "content": {
            **{media_type: {"schema": BINARY} for media_type in AUDIO_MEDIA_TYPES},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {"file": BINARY},
                    "required": ["file"],
                    # a form field is one part holding a string: an array or object here would be
                    # sent as several parts and could exceed MULTIPART_MAX_FIELDS (found by schemathesis)
                    "additionalProperties": {"type": "string"},
                    "maxProperties": 1 + MULTIPART_MAX_FIELDS,
                },
                "encoding": {"file": {"contentType": ", ".join(AUDIO_MEDIA_TYPES)}},
            },
        },
    }
}


FILTER_PARAMETER = {
    "name": "filter",
    "in": "query",
    "required": False,
    "description": "Only clips whose metadata pass this filter: the filter language as JSON "
    "(docs/service.md, Filters), URL-encoded.",
    "content": {"application/json": {"schema": FILTER_PLACEHOLDER}},
}


def filter_param(request: Request, searcher: Searcher) -> ClipFilter | None:
    """The ``filter`` query parameter (JSON) as the clips it passes (None: absent)."""
    raw = request.query_params.get("filter")
    if raw is None:
        return None
    try:
        obj: Any = loads_json(raw)  # refused past JSON_DEPTH_MAX before json.loads recurses
        parse_filter(obj)
    except (ValueError, FilterError) as err:
        raise ServiceError("validation-error", f"query parameter 'filter': {err}") from None
    return searcher.clip_filter(obj)


@router.post(
    "/audio",
    openapi_extra={**AUDIO_BODY, "parameters": [FILTER_PARAMETER]},
    responses=problem_responses(400, 409, 413, 415, 422, 503, 504),
)
async def search_audio(
    request: Request,
    searcher: SearcherDep,
    pool: PoolDep,
    batchers: BatchersDep,
    settings: SettingsDep,
    k: Annotated[int, Query(ge=1, le=K_MAX, description="Caption hits *per language*.")] = 10,
    lang: Annotated[
        list[str] | None,
        Query(
            max_length=CAPTIONS_MAX,
            description="Languages to search (repeat the parameter); default: every served language. "
            "Each gets its own top `k`.",
        ),
    ] = None,
    min_score: Annotated[float | None, Query(ge=-1.0, le=1.0)] = None,
) -> AudioSearchResponse:
    """Rank the bundle's captions for an uploaded clip: the top `k` **per language**.

    Similarity scores are not comparable across languages (a global top k would be taken by
    one language), so each requested language is ranked on its own; `hits` holds up to `k`
    captions per language, grouped by language in the order of `lang`, best first."""
    for code in lang or ():
        searcher.check_language(code)
    clip_filter = await pool.run(filter_param, request, searcher)
    async with upload_lease(settings) as lease:  # the body, then the decoded audio, held until the answer
        audio = await read_and_decode(request, searcher, settings, pool, lease)
        query = AudioQuery(audio.waveform, tuple(lang or ()), k, min_score, clip_filter)
        hits = await batchers.audio.submit((searcher, query), disconnected=lambda: wait_for_disconnect(request.receive))
    return AudioSearchResponse(
        bundle_id=searcher.bundle_id,
        duration_seconds=audio.duration_seconds,
        format=audio.format,
        hits=[CaptionHitOut(**asdict(h)) for h in hits],
    )


K_QUERY = Query(ge=1, le=K_MAX, description="Number of hits.")
MIN_SCORE_QUERY = Query(ge=-1.0, le=1.0, description="Drop hits whose cosine score is below this.")


@router.post(
    "/similar",
    openapi_extra={**AUDIO_BODY, "parameters": [FILTER_PARAMETER]},
    responses=problem_responses(400, 413, 415, 422, 503, 504),
)
async def search_similar_upload(
    request: Request,
    searcher: SearcherDep,
    pool: PoolDep,
    settings: SettingsDep,
    k: Annotated[int, K_QUERY] = 10,
    min_score: Annotated[float | None, MIN_SCORE_QUERY] = None,
) -> SimilarResponse:
    """Sounds like an uploaded one: the catalogue's clips by audio–audio cosine, best first."""
    clip_filter = await pool.run(filter_param, request, searcher)
    async with upload_lease(settings) as lease:  # the body, then the decoded audio, held until the answer
        audio = await read_and_decode(request, searcher, settings, pool, lease)
        hits = await pool.run(
            lambda: searcher.similar_to_audio(audio.waveform, k=k, min_score=min_score, clip_filter=clip_filter)
        )
    return SimilarResponse(bundle_id=searcher.bundle_id, duration_seconds=audio.duration_seconds, hits=_hits_out(hits))


@router.get(
    "/similar/{item_id:path}",
    openapi_extra={"parameters": [FILTER_PARAMETER]},
    responses=problem_responses(404, 422, 503, 504),
)
async def search_similar_item(
    request: Request,
    searcher: SearcherDep,
    pool: PoolDep,
    item_id: PathId,
    k: Annotated[int, K_QUERY] = 10,
    min_score: Annotated[float | None, MIN_SCORE_QUERY] = None,
) -> SimilarResponse:
    """Sounds like a clip of the catalogue (the clip itself excluded), by audio–audio cosine."""
    item_id = await pool.run(addressed_id, item_id, searcher)  # may ask the engine (Milvus): off the event loop

    def run() -> list[AudioHit]:
        clip_filter = filter_param(request, searcher)
        return searcher.similar_to_item(item_id, k=k, min_score=min_score, clip_filter=clip_filter)

    hits = await pool.run(run)
    return SimilarResponse(bundle_id=searcher.bundle_id, id=item_id, hits=_hits_out(hits))


# ---------------------------------------------------------------------- moments (SPEC §19)


def _moments_response(searcher: Searcher, hits: list[MomentResult], **fields: Any) -> MomentSearchResponse:
    window, hop = searcher.moment_resolution()
    return MomentSearchResponse(
        bundle_id=searcher.bundle_id, window_seconds=window, hop_seconds=hop, scorer=searcher.moment_scorer(),
        hits=[MomentHitOut(id=h.id, start=h.start, end=h.end, score=h.score, uri=h.uri) for h in hits], **fields,
    )


@router.post("/moments", responses=problem_responses(400, 409, 415, 422, 503, 504))
async def search_moments(
    body: MomentSearchRequest, searcher: SearcherDep, pool: PoolDep, request: Request
) -> MomentSearchResponse:
    """Where in the catalogue's long recordings a text query happens: ranked `{id, start, end, score}`.

    Each recording longer than the model's window is indexed as windows; the query scores every
    window, adjacent windows near the recording's best are merged into a moment whose boundaries
    are read at 0.65 of its height, and overlapping moments are suppressed (docs/service.md, Moments).
    Windows were embedded when the recordings were written (bundle or added item), never on this request.
    A bundle carrying a trained moment head places and scores the moments with it instead; `scorer`
    says which (`head` or `windows`). Several hits may come from one recording."""

    def run() -> list[MomentResult]:
        searcher.check_language(body.lang)
        text = searcher.normalized(body.query)
        clip_filter = searcher.clip_filter(body.filter)
        embedding = searcher.embed_texts([text])[0]
        return searcher.search_moments(embedding, k=body.k, min_score=body.min_score, clip_filter=clip_filter)

    hits = await pool.run(run)
    return _moments_response(searcher, hits, query=body.query, lang=body.lang)


@router.post(
    "/moments/audio",
    openapi_extra={**AUDIO_BODY, "parameters": [FILTER_PARAMETER]},
    responses=problem_responses(400, 409, 413, 415, 422, 503, 504),
)
async def search_moments_audio(
    request: Request,
    searcher: SearcherDep,
    pool: PoolDep,
    settings: SettingsDep,
    k: Annotated[int, K_QUERY] = 10,
    min_score: Annotated[float | None, MIN_SCORE_QUERY] = None,
) -> MomentSearchResponse:
    """Sounds like this moment: where an uploaded snippet's sound happens in the long recordings."""
    clip_filter = await pool.run(filter_param, request, searcher)
    async with upload_lease(settings) as lease:  # the body, then the decoded audio, held until the answer
        audio = await read_and_decode(request, searcher, settings, pool, lease)

        def run() -> list[MomentResult]:
            embedding = np.asarray(searcher.bundle.encode_audio([audio.waveform]), dtype=np.float32)[0]
            return searcher.search_moments(embedding, k=k, min_score=min_score, clip_filter=clip_filter)

        hits = await pool.run(run)
    return _moments_response(searcher, hits, duration_seconds=audio.duration_seconds)
