"""Request and response bodies of the /v1 API (docs/service.md); limits and examples live here."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StringConstraints,
    WithJsonSchema,
)

from index.engines.filters import FilterError, parse_filter
from service.limits import BATCH_MAX, CAPTIONS_MAX, K_MAX, QUERY_MAX_CHARS

LANG_FIELD = Field(
    None,
    min_length=1,
    max_length=16,
    description="ISO 639-3 code of the query language (e.g. `fra`); must be one the bundle serves.",
    examples=["fra"],
)
K_FIELD = Field(10, description=f"Number of hits, 1–{K_MAX}.", examples=[10])
MIN_SCORE_FIELD = Field(None, description="Drop hits whose cosine score is below this.", examples=[0.2])


NOT_BLANK = r"[^\t\n\v\f\r\u001c-\u001f \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff]"
"""Pattern of query texts: at least one character that is not whitespace (blank queries are rejected).
The class spells out the union of JavaScript's whitespace (``\\s`` in the OpenAPI document's regex
dialect) and Python's (``str.split``, which the service's normalisation uses): with ``\\S`` a query
of one U+0085 or U+001C was valid by the schema and then refused as blank by the service."""
QueryText = Annotated[str, StringConstraints(min_length=1, max_length=QUERY_MAX_CHARS, pattern=NOT_BLANK)]


def _json_number(value: Any) -> Any:
    """Numbers must be JSON numbers, as the schema says: no `"5"` strings, no booleans (`55.0` is an integer)."""
    if isinstance(value, str | bool):
        raise ValueError("must be a JSON number")
    return value


HitCount = Annotated[int, Field(ge=1, le=K_MAX), BeforeValidator(_json_number)]
Score = Annotated[float, Field(ge=-1.0, le=1.0), BeforeValidator(_json_number)]


def _filter_form(value: Any) -> Any:
    """A filter's form and limits (index.engines.filters.parse_filter); fields are checked against the catalogue
    when the search runs (``invalid-filter``)."""
    try:
        parse_filter(value)
    except FilterError as err:
        raise ValueError(str(err)) from None
    return value


FILTER_PLACEHOLDER = {"type": "object", "x-tonearm-filter": True}
"""Where the filter language's schema goes: service.openapi_contract replaces it by a reference to
the components ``Filter`` (and its nested levels), stated for the active bundle's metadata fields."""
ClipFilterField = Annotated[
    dict[str, Any] | None, BeforeValidator(_filter_form), WithJsonSchema(FILTER_PLACEHOLDER)
]
FILTER_FIELD = Field(
    None,
    description="Only clips whose metadata pass this filter (docs/service.md, Filters).",
    examples=[{"license": "cc0", "duration": {"lte": 5}}],
)


class _Request(BaseModel):
    # booleans are StrictBool (JSON `0` or `"true"` is not a boolean), numbers `HitCount`/`Score`
    model_config = ConfigDict(extra="forbid")


class TextSearchRequest(_Request):
    """One text query → ranked audio clips."""

    query: str = Field(
        min_length=1,
        max_length=QUERY_MAX_CHARS,
        pattern=NOT_BLANK,
        description=f"Free text in any served language, 1–{QUERY_MAX_CHARS} characters after trimming.",
        examples=["un chien aboie puis une sirène passe"],
    )
    lang: str | None = LANG_FIELD
    k: HitCount = K_FIELD
    min_score: Score | None = MIN_SCORE_FIELD
    include_captions: StrictBool = Field(False, description="Attach each clip's captions to its hit.")
    filter: ClipFilterField = FILTER_FIELD


class TextBatchRequest(_Request):
    """Several text queries in one call (same `lang`, `k`, `min_score` for all)."""

    queries: list[QueryText] = Field(
        min_length=1,
        max_length=BATCH_MAX,
        description=f"1–{BATCH_MAX} queries, each 1–{QUERY_MAX_CHARS} characters.",
        examples=[["a dog barks", "犬が吠えてからサイレンが鳴る"]],
    )
    lang: str | None = LANG_FIELD
    k: HitCount = K_FIELD
    min_score: Score | None = MIN_SCORE_FIELD
    include_captions: StrictBool = False
    filter: ClipFilterField = FILTER_FIELD


class AudioHitOut(BaseModel):
    id: str = Field(description="Clip id from the indexed manifest.", examples=["synth-000123"])
    score: float = Field(description="Cosine similarity of query and clip.", examples=[0.61])
    uri: str | None = Field(None, description="Clip location recorded at export, when known.")
    captions: dict[str, list[str]] | None = Field(None, description="Captions per language (on request).")


class TextSearchResponse(BaseModel):
    bundle_id: str = Field(description="Bundle that answered.", examples=["demo-small-0"])
    query: str
    lang: str | None = None
    hits: list[AudioHitOut]


class TextBatchItem(BaseModel):
    query: str
    hits: list[AudioHitOut]


class TextBatchResponse(BaseModel):
    bundle_id: str
    lang: str | None = None
    results: list[TextBatchItem]


class SimilarResponse(BaseModel):
    bundle_id: str
    id: str | None = Field(None, description="The catalogue clip the hits are like (GET); absent for an upload.")
    duration_seconds: float | None = Field(None, description="Decoded duration of the upload (POST).")
    hits: list[AudioHitOut] = Field(description="Clips by audio–audio cosine, best first; the clip itself excluded.")


class MomentSearchRequest(_Request):
    """One text query → ranked moments inside the catalogue's long recordings."""

    query: str = Field(
        min_length=1,
        max_length=QUERY_MAX_CHARS,
        pattern=NOT_BLANK,
        description=f"Free text in any served language, 1–{QUERY_MAX_CHARS} characters after trimming.",
        examples=["les cloches de l'église sonnent"],
    )
    lang: str | None = LANG_FIELD
    k: HitCount = K_FIELD
    min_score: Score | None = MIN_SCORE_FIELD
    filter: ClipFilterField = FILTER_FIELD


class MomentHitOut(BaseModel):
    id: str = Field(description="The recording's clip id.", examples=["walk-017.wav"])
    start: float = Field(description="Start of the moment, seconds from the recording's start.", examples=[12.5])
    end: float = Field(description="End of the moment, seconds from the recording's start.", examples=[18.0])
    score: float = Field(description="The moment's score: the cosine of the query and its best window (`scorer` "
                                     "`windows`), or the moment head's relevance probability (`scorer` `head`).",
                         examples=[0.42])
    uri: str | None = Field(None, description="Recording location recorded at indexing, when known.")


class MomentSearchResponse(BaseModel):
    bundle_id: str
    query: str | None = Field(None, description="The text query (absent for an audio snippet).")
    lang: str | None = None
    duration_seconds: float | None = Field(None, description="Decoded duration of the snippet (audio query).")
    window_seconds: float = Field(description="The index's window: boundaries are resolved to about half of it.")
    hop_seconds: float = Field(description="Seconds between the starts of consecutive windows.")
    scorer: Literal["head", "windows"] = Field(
        description="What placed and scored the moments: `head`, the bundle's trained moment head (scores are its "
                    "relevance probabilities, 0–1), or `windows`, the sliding-window scorer (scores are cosines of "
                    "the query and the moment's best window). docs/service.md, Moments.",
        examples=["windows"])
    hits: list[MomentHitOut] = Field(description="Moments, best first; several may come from one recording.")


class CaptionHitOut(BaseModel):
    clip_id: str = Field(examples=["synth-000123"])
    lang: str = Field(examples=["jpn"])
    text: str = Field(examples=["犬が二回吠える"])
    score: float = Field(examples=[0.48])
    uri: str | None = None


class AudioSearchResponse(BaseModel):
    bundle_id: str
    duration_seconds: float = Field(description="Decoded duration of the upload.")
    format: str = Field(description="Container detected from the file's magic bytes.", examples=["wav"])
    hits: list[CaptionHitOut] = Field(
        description="Up to `k` captions per requested language, grouped by language in request order "
        "(default: the bundle's languages), best first within a language. Scores are comparable "
        "within a language only."
    )


class ConsistencyRequest(_Request):
    """A query group: one caption and its translations, optionally with the clip it describes."""

    captions: dict[str, QueryText] = Field(
        min_length=1,
        max_length=CAPTIONS_MAX,
        description="Language code → caption text (translations of each other).",
        examples=[{"eng": "a dog barks twice", "fra": "un chien aboie deux fois", "jpn": "犬が二回吠える"}],
    )
    target_id: str | None = Field(
        None, min_length=1, max_length=256, description="Clip id whose rank is reported per language."
    )
    k: HitCount = K_FIELD


class LanguageDiagnosisOut(BaseModel):
    hits: list[AudioHitOut]
    target_rank: int | None = Field(None, description="1-based rank of the target (pessimistic ties).")


class ConsistencyResponse(BaseModel):
    bundle_id: str
    target_id: str | None
    languages: dict[str, LanguageDiagnosisOut]
    mrv: float | None = Field(None, description="Variance of the target's rank across languages (ATRI Eq. 16).")
    mean_rank_std: float | None = None
    gap: dict[str, float] = Field(description="‖eng − lang‖ of the query embeddings (needs `eng`).")
    dis: dict[str, float] = Field(description="Same as gap for one query group (ATRI Eq. 15).")


class LanguageMetrics(BaseModel):
    t2a: dict[str, float] = Field(description="R@1, R@5, R@10, mAP@10 text→audio.")
    a2t: dict[str, float] = Field(description="R@1, R@5, R@10, mAP@10 audio→text.")


class HeldoutReportResponse(BaseModel):
    bundle_id: str
    source: Literal["manifest", "computed"]
    convention: str
    per_language: dict[str, LanguageMetrics]
    mrv_t2a: float | None = None
    mrv_a2t: float | None = None
    report: dict[str, float] = Field(description="Every key of index.metrics.retrieval.retrieval_report.")


class IndexOut(BaseModel):
    """One FAISS index of a bundle as its manifest records it (recall measured at export)."""

    factory: str
    ntotal: int
    search_params: dict[str, int]
    ann_recall_at_10: float = Field(description="Recall@10 against exact search, measured when the bundle was exported.")


class BundleOut(BaseModel):
    bundle_id: str
    path: str
    state: Literal["active", "previous", "available", "invalid"]
    created: str | None = None
    languages: list[str] | None = None
    embed_dim: int | None = None
    n_clips: int | None = None
    indices: dict[str, IndexOut] | None = Field(None, description="`audio` (clips) and `text` (captions) indices.")
    moment_scorer: Literal["head", "windows"] | None = Field(
        None, description="What `/v1/search/moments` scores with on this bundle: `head` (it carries a trained "
                          "moment head, `tonearm train-moments`) or `windows` (the sliding-window scorer).")
    moments_heldout: dict[Literal["windows", "head"], dict[str, float]] | None = Field(
        None, description="The bundle's held-out moment report per scorer, on the same queries: `windows` "
                          "(`moments.heldout`) and, with a trained head, `head` (`moment_head.heldout`); keys "
                          "`moment_{R1@0.5,R1@0.7,mAP,…}_{lang|mean}` (docs/metrics.md). Null: none was measured.")
    error: str | None = None


class BundleListResponse(BaseModel):
    active: str | None
    previous: str | None
    bundles: list[BundleOut]


class ActivateRequest(_Request):
    bundle_id: str = Field(min_length=1, max_length=200, examples=["demo-small-1"])
    force: StrictBool = Field(False, description="Activate even if the quality gate rejects (the verdict is still reported).")


class GateSetOut(BaseModel):
    source: Literal["active-held-out", "configured"]
    name: str = Field(description="Which set: the active bundle's held-out set, or the TONEARM_GATE_SET path.")
    n_clips: int
    n_queries: int = Field(description="Caption queries in the compared languages.")
    languages: list[str]


class GateIntervalOut(BaseModel):
    metric: str
    delta: float = Field(description="candidate − active on the whole set.")
    low: float
    high: float
    confidence: float
    samples: int
    seed: int
    unit: str = Field(description="What the bootstrap resamples (clips).")


class GateMomentsOut(BaseModel):
    metric: str = Field(description="The compared moment metric (TONEARM_GATE_MOMENT_METRIC).")
    max_drop: float = Field(description="The largest drop allowed (TONEARM_GATE_MAX_MOMENT_DROP).")
    candidate: dict[str, float] = Field(description="The candidate's moment metrics (means over the languages).")
    active: dict[str, float]
    candidate_scorer: Literal["head", "windows"]
    active_scorer: Literal["head", "windows"]
    n_recordings: int
    n_queries: int = Field(description="Moment queries in the compared languages.")


class GateVerdictOut(BaseModel):
    passed: bool
    forced: bool
    reasons: list[str]
    languages: list[str]
    candidate: dict[str, float]
    active: dict[str, float]
    compared_to: str | None
    set: GateSetOut | None = None
    interval: GateIntervalOut | None = None
    moments: GateMomentsOut | None = Field(
        None, description="The moment comparison, when the gate set has moment queries and both bundles answer "
                          "moments (docs/service.md, \"Quality gate\").")


class ActivationResponse(BaseModel):
    bundle_id: str = Field(description="Bundle now active.")
    previous: str | None
    changed: bool
    verdict: GateVerdictOut | None = None


class HealthResponse(BaseModel):
    status: Literal["ok", "ready"]
    bundle_id: str | None = None


class Problem(BaseModel):
    """RFC 9457 problem details (media type application/problem+json)."""

    type: str = Field(examples=["urn:tonearm:problem:unknown-language"])
    title: str
    status: int
    detail: str
    instance: str | None = None
    model_config = ConfigDict(extra="allow")


class ItemOut(BaseModel):
    """One item of the catalogue: added through the API or a clip of the active bundle."""

    id: str = Field(examples=["foley-000042"])
    source: Literal["added", "bundle"] = Field(description="`added` through `POST /v1/items`, or a `bundle` clip.")
    added_at: str | None = Field(None, description="UTC time its write-ahead record was written (added items).")
    metadata: dict[str, Any] = Field(description="The filterable metadata (docs/service.md, Filters).")
    captions: dict[str, list[str]] | None = Field(None, description="Captions per language, when it has any.")
    bundle_id: str = Field(description="The active bundle whose encoders embedded it.")
    duration_seconds: float | None = Field(None, description="Decoded duration of the upload (POST).")


class ItemBatchResponse(BaseModel):
    bundle_id: str
    items: list[ItemOut]


class ItemDeleted(BaseModel):
    id: str
    source: Literal["added", "bundle"] = Field(description="`bundle`: a clip of the bundle, now hidden (a takedown).")
    deleted_at: str


class QuarantinedItem(BaseModel):
    id: str
    added_at: str = Field(description="UTC time of the record that cannot be embedded.")
    audio: str | None = Field(description="Its stored audio (`<sha256>.<format>` under the log's `audio/`).")
    reason: Literal["missing-audio", "over-limit", "undecodable", "unreadable", "embedding-failed"]
    detail: str
    metadata: dict[str, Any]


class CorruptLineOut(BaseModel):
    offset: int = Field(description="Byte offset of the line in the log's current file.")
    length: int
    reason: str


class ItemsStatusResponse(BaseModel):
    """Items that no search returns although the log holds them, and log lines every reader skipped."""

    status: Literal["quarantined"]
    bundle_id: str
    items: list[QuarantinedItem]
    corrupt_lines: list[CorruptLineOut] = Field(
        description="Lines of the item log that are not records (a crash's NULs, lost bytes); a compaction drops them.")


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries documenting application/problem+json errors."""
    schema = Problem.model_json_schema()
    return {
        s: {"description": "Problem details (RFC 9457)", "content": {"application/problem+json": {"schema": schema}}}
        for s in statuses
    }
