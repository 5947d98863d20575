"""Service settings (pydantic-settings, environment prefix ``TONEARM_``).

Built once inside :func:`service.app.create_app` — never at import time — and
validated there: unsafe combinations (admin routes enabled without a token
outside development, several workers without Redis) are refused with a
message naming the variable to set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from index.errors import TonearmError
from service.memory_budget import RESERVE_FRACTION


class SettingsError(TonearmError):
    """Settings that would start an unsafe or non-working service."""


def default_home() -> Path:
    """``$TONEARM_HOME`` default: the per-user cache directory."""
    return Path.home() / ".cache" / "tonearm"


class Settings(BaseSettings):
    """Every knob of the service; each field is ``TONEARM_<NAME>`` in the environment."""

    model_config = SettingsConfigDict(env_prefix="TONEARM_", extra="ignore", frozen=True)

    environment: Literal["development", "production"] = "production"
    """`development` allows admin routes without a token (with a warning)."""
    home: Path = Field(default_factory=default_home)
    """Cache directory of the embedded demo bundle (`tonearm serve` with nothing configured)."""

    # --- bundles ---
    bundles_dir: Path | None = None
    """Directory holding bundle directories; activation is by bundle id among them."""
    bundle: str | None = None
    """Bundle served at start: a bundle id inside `bundles_dir` or a bundle directory path."""
    items_dir: Path | None = None
    """Write-ahead log and stored audio of the items added through `POST /v1/items`; default
    `<bundles_dir>/.items` (on the bundles volume every replica mounts: they share it)."""
    items_enabled: bool | None = None
    """Items (`/v1/items`, takedowns) on or off; default: on wherever there is a directory for the log
    (`items_dir`, else `<bundles_dir>/.items`). When on, a replica that cannot open and write the log
    is not ready (`/readyz` 503 with the reason): it never serves without the takedowns. `false`:
    no item log at all (a read-only catalogue; `/v1/items` answers 503 `items-unavailable`)."""
    items_store: Literal["auto", "log", "milvus"] = "auto"
    """Where added items live: `log` (the write-ahead log in `items_dir` and a per-replica overlay),
    `milvus` (collections in the Milvus of `milvus_uri`: replicas share them through the engine, no
    shared volume), `auto`: `milvus` with `index_backend=milvus`, else `log` (docs/service.md, "Items")."""
    items_audio_url: str | None = None
    """Milvus item store: where the uploaded audio is kept (content-addressed), read through fsspec —
    `s3://bucket/prefix` (credentials from the usual AWS_* variables), `gs://…`, or a local path; default
    `<items_dir>/audio` (one replica, or a volume they share). Needed to re-embed items for a bundle of
    another model."""
    items_poll_s: float = Field(default=0.2, gt=0, le=10)
    """How often a replica checks the item log for records other replicas appended (one `stat`)."""
    items_stale_s: float = Field(default=10.0, gt=0, le=600)
    """A replica that has not been able to read the item log for this long (the volume went away, an
    NFS server stopped answering) is not ready (`/readyz` 503 `items-unavailable`) until it reads it
    again: it may be missing another replica's takedowns, and must not serve them meanwhile."""
    items_compact_min: int = Field(default=10_000, ge=0)
    """A replica's follower compacts the item log (`tonearm items compact`) once it holds at least
    this many records a compaction would drop and they are at least half the log; 0: never
    automatically (docs/service.md, "Compaction")."""
    audio_root: Path | None = None
    """Directory the clips' audio URIs are relative to (`GET /v1/audio/{clip_id}`); default: the
    directory of the bundle's data manifest. Nothing outside it is ever served."""
    onnx_threads: int = Field(default=1, ge=0, le=64)
    """onnxruntime intra-op threads per encoder call; 0 = auto: every core for a bundle whose largest
    encoder file is ≥ 16 MiB, else 1 (docs/service.md, "Threads"; measured in docs/BENCHMARKS.md, real_size)."""
    encoder_calls: int = Field(default=0, ge=0, le=64)
    """Most encoder calls (text and audio together) running at once; 0: with `onnx_threads=0` (auto) at
    several threads per call, cores // threads (calls × threads ≤ cores), otherwise no limit."""
    onnx_graph_optimization: Literal["disable", "basic", "extended", "all"] = "all"
    """onnxruntime graph optimisation level of the encoder sessions (`all`: layout and fused
    attention/GELU kernels; lower levels only to debug an export)."""
    onnx_spinning: bool = False
    """Let idle onnxruntime intra-op threads busy-wait for work (lower latency on a dedicated
    machine; off: the spinning threads take cores FAISS and the HTTP worker need)."""
    onnx_memory_arena: bool = False
    """onnxruntime's CPU memory arena for the encoder sessions. Off by default: the service's calls
    vary in shape (text lengths, batch sizes, clip lengths, the gate's evaluation batches), the
    arena keeps every high-water mark it reaches and never gives memory back, and resident memory
    crept up for the whole of a 30-min soak with it on (docs/service.md, "Memory")."""
    malloc_arenas: int = Field(default=2, ge=0, le=1024)
    """glibc malloc arenas of the service process (`mallopt(M_ARENA_MAX)` at start; 0: glibc's
    default, 8 per core); `MALLOC_ARENA_MAX` in the environment wins (docs/service.md, "Memory")."""
    malloc_trim_interval_s: float = Field(default=60.0, ge=0.0)
    """Seconds between `malloc_trim(0)` calls that hand freed heap pages back to the kernel (0: only
    after bundle swaps); glibc alone returns only the top of a heap (docs/service.md, "Memory")."""
    gc_freeze: bool = True
    """After each bundle swap, move the objects alive then (the bundles' clip and caption rows) out of
    CPython's cyclic garbage collector (`gc.freeze`): full collections stop walking millions of them
    with the GIL held (~75 ms pauses once a second under load on the demo; docs/service.md, "Memory")."""
    faiss_threads: int = Field(default=1, ge=1, le=256)
    """OpenMP threads of FAISS searches; a micro-batch is one search, and the batch workers already
    run in parallel, so more threads only contend with the encoders on small machines."""
    onnx_providers: str = "CPUExecutionProvider"
    """Comma-separated onnxruntime execution providers, best first, e.g.
    ``CUDAExecutionProvider,CPUExecutionProvider`` (needs onnxruntime-gpu; a provider this
    onnxruntime lacks stops the bundle from loading, with the available ones named)."""
    search_threads: int = Field(default=4, ge=1, le=256)
    """Threads for blocking work outside the micro-batchers (uploads' decoding, cache look-ups via Redis, admin)."""
    batch_max_size: int = Field(default=32, ge=1, le=1024)
    """Most queries (texts or clips) one micro-batch encodes together (docs/service.md, batching)."""
    batch_max_queue: int = Field(default=256, ge=1)
    """Queries waiting per encoder beyond which requests get 503 + Retry-After (backpressure)."""
    batch_workers: int = Field(default=0, ge=0, le=64)
    """Threads per encoder queue, each running one micro-batch at a time; 0 = auto: the cores this
    process may use (affinity and cgroup quota), at least 2 and at most 64 (docs/service.md, "Threads")."""

    # --- index backend (docs/service.md, "Index backends") ---
    index_backend: Literal["faiss", "milvus"] = "faiss"
    """Where bundle vectors are searched: `faiss` (the bundle's own files) or `milvus` (published collections)."""
    milvus_uri: str | None = None
    """e.g. http://milvus:19530 (a local *.db path uses Milvus Lite); needed with index_backend=milvus."""
    milvus_token: SecretStr | None = None
    """Milvus credentials (`user:password` or an API key); mount from a secret."""
    milvus_timeout_s: float = Field(default=2.0, gt=0, le=60)
    """Deadline of every Milvus call on the request path (search, alias reads and switches). A call past
    it while Milvus answers a probe fails alone: 504 `index-timeout` (Retry-After). No pymilvus retries."""
    milvus_bulk_timeout_s: float = Field(default=120.0, gt=0)
    """Deadline of each bulk Milvus call: loading a bundle (load_collection, reading all vectors) and, for
    `tonearm bundle publish`, every create/insert/flush and each batch of the recall@10 check."""
    milvus_probe_timeout_s: float = Field(default=0.5, gt=0, le=60)
    """Deadline of the cheap probe (GetVersion) run after a request-path call missed its deadline."""
    milvus_probe_attempts: int = Field(default=2, ge=1, le=10)
    """Probes that must all fail before Milvus counts as unreachable: then every search answers 503
    `index-unavailable` (Retry-After) until it answers again (connection refused / UNAVAILABLE: at once)."""
    milvus_hold_off_s: float = Field(default=1.0, gt=0, le=60)
    """After Milvus was found unreachable, calls fail at once for this long before one call tries again."""
    milvus_recall_batch: int = Field(default=16, ge=1, le=1024)
    """Queries per search call of the recall@10 check of `tonearm bundle publish` (bulk work)."""
    milvus_release_closed: bool = True
    """Release a bundle's collections from Milvus memory once it is neither active nor the rollback target."""
    milvus_items_flush: Literal["auto", "write", "off"] = "auto"
    """Whether the Milvus item store flushes an item write before acknowledging it: `write` (what a
    write needs to survive a killed Milvus 2.3 standalone), `off` (acknowledged once Milvus holds it in
    its write-ahead log), `auto` (`write` before Milvus 2.4 and on Milvus Lite; `off` from 2.4, which
    limits flushes to 0.1 per second per collection by default). docs/service.md, "Milvus item store"."""

    # --- server ---
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    workers: int = Field(default=1, ge=1, le=64)
    """uvicorn worker processes; >1 needs Redis (each worker is a replica)."""
    access_log: bool = False
    """uvicorn's per-request access log (off: it costs throughput; /metrics has the counts)."""

    # --- admin ---
    admin_token: SecretStr | None = None
    """Bearer token of the /v1/bundles routes (mount it from a secret)."""
    admin_enabled: bool | None = None
    """Admin routes on/off; default: on when `admin_token` is set."""
    items_token: SecretStr | None = None
    """Bearer token of the item routes only (`/v1/items`: add, replace, delete, read), for the
    application that uploads users' sounds: it cannot activate, force or roll back bundles. The
    admin token keeps working on the item routes too (docs/service.md, "Tokens")."""

    # --- redis / cache ---
    redis_url: str | None = None
    """e.g. redis://redis:6379/0; unset → in-process cache and a single replica."""
    redis_socket_timeout: float = Field(default=0.1, gt=0, le=10)
    """Connect/read timeout (s): a dead Redis must not add latency."""
    redis_backoff_max: float = Field(default=10.0, gt=0)
    """Longest pause (s) between reconnection attempts after Redis failures."""
    key_prefix: str = Field(default="tonearm", min_length=1, max_length=64)
    pubsub_channel: str = "tonearm:activations"
    cache_ttl_seconds: int = Field(default=3600, ge=1)
    cache_max_entries: int = Field(default=20_000, ge=0)
    """In-process cache size bound (entries); Redis keys are bounded by TTL instead."""
    cache_max_payload_bytes: int = Field(default=16_384, ge=256)
    """Larger values are not cached."""

    # --- request limits (query length, k and batch size are API constants: service/limits.py) ---
    max_upload_bytes: int = Field(default=10 * 1024 * 1024, ge=1024)
    """Most bytes of one search upload (`search/audio`, `search/similar`, `search/moments/audio`) and of each
    file of `items:batch` (whose body may hold 8 of them)."""
    max_audio_seconds: float = Field(default=60.0, gt=0)
    """Longest search upload (its duration, from the header and counted while decoding). Item writes have
    their own limit, `max_item_audio_seconds`."""
    max_item_audio_seconds: float = Field(default=3600.0, gt=0)
    """Longest recording an item write (`POST /v1/items`, `items:batch`) takes: an hour by default. Items
    longer than `max_audio_seconds` are decoded and embedded by blocks (docs/service.md, "Long recordings"),
    so their length costs time, not memory."""
    max_item_upload_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """Most bytes of the audio file of `POST /v1/items` (one item; a batch's files keep `max_upload_bytes`
    each): 64 MiB holds an hour of 128-kbit/s MP3 (57.6 MB) or of Vorbis at ~140 kbit/s — an hour of WAV or
    FLAC does not fit; send it compressed. The body is held in the memory budget like every upload's: the
    limit applied is at most what the bodies may hold (three quarters of `decode_memory_bytes`, less 64 KiB of
    form; :attr:`item_upload_limit`)."""
    max_item_decode_samples: int = Field(default=3600 * 192_000 * 2, ge=1000)
    """`max_decode_samples` of item writes (frames × channels: the CPU a decode costs): an hour of 192-kHz
    stereo by default."""
    max_sample_rate: int = Field(default=192_000, ge=8000)
    max_channels: int = Field(default=8, ge=1)
    max_decode_samples: int = Field(default=60 * 192_000 * 2, ge=1000)
    """Most samples one upload may decode (frames × channels, from its header, and counted while
    decoding): what its decoding costs in CPU. Default: a minute of 192-kHz stereo; a minute of
    192-kHz 8-channel audio (a 93-KB FLAC when silent) is refused (docs/service.md, "Limits")."""
    max_decoded_bytes: int = Field(default=32 * 1024 * 1024, ge=1 << 20)
    """Most memory one decode may allocate (index.audio.decode.decode_estimate: one block of every channel
    and the mono output at the model's rate), checked from the header."""
    decode_memory_bytes: int = Field(default=128 * 1024 * 1024, ge=1 << 20)
    """Memory budget of the uploads a process holds at once (service/memory_budget.py): the bodies of
    the audio routes (search/audio, search/similar, search/moments/audio, items, items:batch: reserved
    from `Content-Length` before they are read, or as they stream), their decodes and their decoded
    audio until it is encoded, and the item sync's decodes. Bodies may fill three quarters of it; the
    last quarter is kept for decodes. A body waits `upload_wait_s`, a decode `decode_wait_s`, for room,
    then gets 503 `overloaded` with Retry-After. Size the pod's memory limit from it (docs/service.md,
    "Memory: what a replica may hold")."""
    decode_wait_s: float = Field(default=10.0, gt=0, le=300)
    """How long a decode waits for room in `decode_memory_bytes` before it is refused."""
    upload_wait_s: float = Field(default=2.0, gt=0, le=60)
    """How long a request body waits for room in `decode_memory_bytes` before the request is refused
    (503 `overloaded`, Retry-After: 1; the body is not read): short, so that a crowd is told to come back
    (or go to another replica) instead of queueing behind the budget."""

    # --- quality gate ---
    gate_metric: str = Field(default="t2a_R@10_mean", pattern=r"^(t2a|a2t)_(R@\d+|mAP@10)_mean$")
    """Recall metric compared by the gate (a per-query key of index.metrics.retrieval.retrieval_report)."""
    gate_max_recall_drop: float = Field(default=0.02, ge=0, le=1)
    """Reject when the lower end of the bootstrap interval of (candidate − active) recall is below −this."""
    gate_set: Path | None = None
    """Bundle directory whose held-out set the gate uses (default: the active bundle's)."""
    gate_min_clips: int = Field(default=100, ge=1)
    """A gate set with fewer clips is refused without --force (100 clips: chance R@10 ≤ 10 %)."""
    gate_confidence: float = Field(default=0.95, gt=0, lt=1)
    """Two-sided confidence of the paired bootstrap interval."""
    gate_bootstrap_samples: int = Field(default=2000, ge=100, le=100_000)
    gate_seed: int = 0
    """Seed of the bootstrap draws (same bundles, same set, same seed → same verdict)."""
    gate_max_mrv_ratio: float = Field(default=1.10, ge=1)
    gate_mrv_slack: float = Field(default=1.0, ge=0)
    """Reject when candidate MRV > active MRV × ratio + slack (rank², slack absorbs tiny-set noise)."""
    gate_moment_metric: str = Field(default="moment_R1@0.7_mean",
                                    pattern=r"^moment_(R1@0\.5|R1@0\.7|mAP|mAP@0\.5|mAP@0\.75)_mean$")
    """Moment metric compared by the gate when the gate set has moment queries (index.metrics.moments)."""
    gate_max_moment_drop: float = Field(default=0.05, ge=0, le=1)
    """Reject when the candidate's moment metric is lower than the active's by more than this (point values:
    each bundle answers the gate set's moment queries with the scorer it serves them with)."""

    @model_validator(mode="after")
    def _check_safety(self) -> Settings:
        if self.admin_on and self.admin_token is None and self.environment != "development":
            raise SettingsError(
                "admin routes are enabled but no token is set: set TONEARM_ADMIN_TOKEN "
                "(from a secret), or TONEARM_ADMIN_ENABLED=false, or TONEARM_ENVIRONMENT=development"
            )
        if self.admin_token is not None and len(self.admin_token.get_secret_value()) < 16:
            if self.environment != "development":
                raise SettingsError("TONEARM_ADMIN_TOKEN is shorter than 16 characters")
        if self.items_token is not None and self.environment != "development":
            if len(self.items_token.get_secret_value()) < 16:
                raise SettingsError("TONEARM_ITEMS_TOKEN is shorter than 16 characters")
            if self.admin_token is not None and self.items_token == self.admin_token:
                raise SettingsError("TONEARM_ITEMS_TOKEN equals TONEARM_ADMIN_TOKEN: give the item writer its own "
                                    "token, or set only TONEARM_ADMIN_TOKEN")
        if self.items_store == "milvus" and not self.milvus_uri:
            raise SettingsError("TONEARM_ITEMS_STORE=milvus needs TONEARM_MILVUS_URI (e.g. http://milvus:19530)")
        if self.index_backend == "milvus" and not self.milvus_uri:
            raise SettingsError("TONEARM_INDEX_BACKEND=milvus needs TONEARM_MILVUS_URI (e.g. http://milvus:19530)")
        if self.workers > 1 and self.redis_url is None:
            raise SettingsError(
                "TONEARM_WORKERS > 1 needs TONEARM_REDIS_URL: each worker is a replica "
                "that learns activations over Redis pub/sub"
            )
        return self

    @property
    def item_upload_limit(self) -> int:
        """The byte limit of an item's audio file: `max_item_upload_bytes`, or less when the bodies' share of
        `decode_memory_bytes` (three quarters) cannot hold it with 64 KiB of form (a body is read into the
        budget: a larger one could never be held)."""
        bodies = self.decode_memory_bytes - self.decode_memory_bytes // RESERVE_FRACTION
        return max(self.max_upload_bytes, min(self.max_item_upload_bytes, bodies - (64 << 10)))

    @property
    def items_in_milvus(self) -> bool:
        """Whether added items live in Milvus (:attr:`items_store`, ``auto`` resolved)."""
        return self.items_store == "milvus" or (self.items_store == "auto" and self.index_backend == "milvus")

    @property
    def items_on(self) -> bool:
        """Whether the /v1/items routes are served: with the admin routes, or with an items token."""
        return self.admin_on or self.items_token is not None

    @property
    def admin_on(self) -> bool:
        """Whether the /v1/bundles routes are served."""
        return self.admin_token is not None if self.admin_enabled is None else self.admin_enabled
