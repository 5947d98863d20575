"""Milvus backend: a bundle's vectors in Milvus collections, for collections beyond one node.

The bundle directory keeps the encoders, id files and held-out set; only the vectors move.
``publish`` writes them into two collections named by bundle id (``<prefix>_<bundle>_audio``:
``row`` = row of ``audio_ids.jsonl``; ``<prefix>_<bundle>_text``: ``row``, ``lang``,
``clip_row``), measures the ANN recall@10 of each against the bundle's exact vectors, then
records the bundle in ``<prefix>_published`` — last, so a half-written bundle never counts as
published. The service (``TONEARM_INDEX_BACKEND=milvus``) searches the collections of the
bundle a request leased, so in-flight requests finish on their bundle during a hot swap;
activation points the aliases ``<prefix>_active_audio`` / ``<prefix>_active_text`` at the new
bundle's collections, which is what other consumers and replicas read (docs/service.md,
"Milvus backend").

* **Deadlines** — every call carries ``timeout`` (:attr:`MilvusTarget.timeout_s`, serving calls;
  :attr:`MilvusTarget.bulk_timeout_s`, publish / load) and ``retry_times=0``: pymilvus would
  otherwise retry an unreachable server 75 times (minutes), and it ignores a float ``timeout``
  as a retry budget. Failures become :class:`index.errors.IndexUnavailable` (transient:
  unreachable, deadline, collection not loaded yet) or :class:`index.errors.IndexBackendError`,
  inside this module.
* **Activation** switches both aliases or neither: an alias already right is left alone (a
  follower replica rewrites nothing), and when the second switch fails the first is undone.
  Alias errors are told apart by code: Milvus ``1600`` alias not found, ``1602`` alias exists
  (a concurrent first activation: then it is altered); milvus-lite 3.x answers ``100`` / ``1``
  with "alias ... does not exist / already exists".
* **Registry reads** are ``Strong`` (a bundle just published is visible at once).
* **Ties**: hits are ordered by score, then row; each search fetches ``k + TIE_MARGIN`` and
  widens while the last fetched score still ties the k-th, so the cut at k is deterministic.
* **Index types**: ``FLAT`` (exact; the parity tests), ``HNSW`` (``M``, ``efConstruction``;
  search ``ef``), ``IVF_FLAT`` (``nlist``; search ``nprobe``), ``AUTOINDEX``.
* Hits are read from the entity's ``row`` field (milvus-lite 3.x keys hits by the primary
  field's name, the server by ``id``).
* **Filters** are evaluated by Milvus: publish writes each clip's metadata (a caption row: its
  clip's) into the JSON field :data:`META_FIELD` and its fields and kinds into the registry
  (``meta_fields``); :meth:`MilvusVectorIndex.expression` writes a filter as Milvus's ``filter``
  expression (:func:`index.engines.filters.milvus_expr`). Both publish paths (:func:`publish` and the Ray
  writers) lay the rows out with :func:`catalogue_metas`. Collections published without it (before
  issue 40, or by the Ray writers before they carried it) are filtered on our side
  (:func:`index.runtime.loader.filtered_search`).
* **Index-only bundles** (`tonearm index`, no captions) publish an audio collection and an
  empty text one (the aliases always name both collections of one bundle).
* **Many writers** (`tonearm index --ray --milvus-uri`): :func:`begin_audio_publish` creates the
  collections, each Ray actor writes its vectors and their clips' metadata (computed on the driver
  by :func:`catalogue_metas`, travelling with the rows) through a :class:`CollectionSink` (the same
  :func:`write_rows` as :func:`publish`, by upsert), and :func:`finish_audio_publish` checks the
  count, measures recall against exact search streamed out of the collection and writes the
  same registry row. Such a bundle has no FAISS file (``manifest.milvus_only``; its ``gaps``
  are collection rows with no vector, mapped away by :class:`MilvusVectorIndex`). The long files' moment
  windows go the same way, into the windows collections `bundle publish` writes
  (:mod:`index.catalogue.milvus_pass_windows`), registered in the same row.

pymilvus is imported lazily: only the ``milvus`` extra needs it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from index.bundle import format as fmt
from index.bundle.evalset import read_jsonl
from index.bundle.format import BundleManifest, IndexInfo, read_manifest
from index.engines.filters import Filter, MetadataTable, milvus_expr, milvus_metadata
from index.errors import (
    BundleError,
    BundleNotPublished,
    IndexBackendError,
    IndexInputRefused,
    IndexTimeout,
    IndexUnavailable,
    TonearmError,
)
from index.ids import check_catalogue_ids

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "tonearm"
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_BULK_TIMEOUT_S = 120.0
DEFAULT_HOLD_OFF_S = 1.0
DEFAULT_PROBE_TIMEOUT_S = 0.5
DEFAULT_PROBE_ATTEMPTS = 2
DEFAULT_RECALL_BATCH = 16
INSERT_CHUNK = 5000
QUERY_CHUNK = 10_000
MAX_LIMIT = 16_384  # Milvus's topk ceiling
TIE_MARGIN = 8
LANG_MAX = 32
META_FIELD = "meta"
"""The JSON field holding each row's metadata (a clip's; a caption row: its clip's), published since
filters are evaluated by Milvus; the registry's ``meta_fields`` lists its fields and their kinds."""
KINDS = ("audio", "text")
INDEX_TYPES = ("FLAT", "IVF_FLAT", "HNSW", "AUTOINDEX")
RECALL_QUERIES = 256
ALIAS_NOT_FOUND = 1600  # Milvus merr.ErrAliasNotFound
ALIAS_EXISTS = 1602  # Milvus merr.ErrAliasAlreadyExist
NOT_LOADED = 101  # collection not loaded (yet: after a restart)
ACTIVATION_ATTEMPTS = 4
_NAME = re.compile(r"[^A-Za-z0-9_]")

__all__ = ["BundleNotPublished", "MilvusTarget", "active_bundle", "publish", "set_active"]


@dataclass(frozen=True)
class MilvusTarget:
    """Where the vectors live: ``uri`` (``http://host:19530`` or a milvus-lite ``*.db`` file).

    The deadlines and the circuit's knobs are settings (``TONEARM_MILVUS_*``, :data:`ENV`), read
    by the service and the CLI alike (:func:`target_options_from_env`)."""

    uri: str
    token: str | None = None
    prefix: str = DEFAULT_PREFIX
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Deadline of every serving call (search, query, alias reads and switches)."""
    bulk_timeout_s: float = DEFAULT_BULK_TIMEOUT_S
    """Deadline of each bulk call (create, insert, flush, load, the recall check's searches) of
    publish and bundle loading. Bulk calls never open the circuit."""
    release_closed: bool = True
    """Release a bundle's collections from Milvus memory when the service closes it (it is then
    neither active nor the rollback target)."""
    hold_off_s: float = DEFAULT_HOLD_OFF_S
    """After Milvus was found unreachable, calls fail at once for this long, then one call probes
    it (the others keep failing at once until it answers): a frozen Milvus costs one deadline, not
    one per queued request."""
    probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S
    """Deadline of the cheap probe (``GetVersion``, answered by the proxy alone) run after a serving
    call missed its deadline: answered → that call was slow and fails alone (:class:`IndexTimeout`);
    every attempt failed → Milvus is unreachable and the circuit opens."""
    probe_attempts: int = DEFAULT_PROBE_ATTEMPTS
    """Probes that must all fail (deadline or refused) before a missed deadline opens the circuit."""
    recall_batch: int = DEFAULT_RECALL_BATCH
    """Queries per search call of publish's recall@10 check (bulk work under :attr:`bulk_timeout_s`)."""

    def client(self) -> Any:
        """The process's one client for this URI and token (thread-safe, never closed here).

        pymilvus keys connections by URI and token: closing one client would close the
        connection every other client of the same Milvus uses. A failed connect is not cached:
        the next call tries again (recovery without a restart)."""
        key = (self.uri, self.token)
        with _CLIENTS_LOCK:
            if key not in _CLIENTS:
                _CLIENTS[key] = _connect(self.uri, self.token, self.timeout_s)
            return _CLIENTS[key]

    def collection(self, bundle_id: str, kind: str) -> str:
        """``<prefix>_<bundle id made name-safe>_<hash>_<kind>``: Milvus names allow [A-Za-z0-9_] only."""
        digest = hashlib.sha1(bundle_id.encode()).hexdigest()[:8]
        return f"{self.prefix}_{_NAME.sub('_', bundle_id)}_{digest}_{kind}"

    @property
    def registry(self) -> str:
        return f"{self.prefix}_published"

    def alias(self, kind: str) -> str:
        return f"{self.prefix}_active_{kind}"

    def call(self, method: str, *args: Any, bulk: bool = False, **kwargs: Any) -> Any:
        """``client.<method>(*args, **kwargs)`` under this target's deadline, pymilvus retries off.

        The circuit (per URI and token): while it is open every call fails at once
        (:class:`IndexUnavailable`); after :attr:`hold_off_s` one serving call tries (the others
        keep failing at once until it answers). It opens only when Milvus is unreachable —
        connection refused, UNAVAILABLE, or a missed deadline whose probes all fail too. A serving
        call past its deadline while the probe answers fails alone: the error is marked slow and
        :func:`_mapped` raises :class:`IndexTimeout`. Bulk calls (``bulk=True``: their own, longer
        deadline) fail at once while the circuit is open but never open it, nor probe."""
        key = (self.uri, self.token)
        timeout = self.bulk_timeout_s if bulk else self.timeout_s
        with _CLIENTS_LOCK:
            down = _DOWN.get(key)
            if down is not None:
                now = time.monotonic()
                if now < down[0] or bulk:
                    if now < down[0]:
                        raise IndexUnavailable(f"Milvus at {self.uri} is not answering ({down[1]}); retry later")
                    down = None  # a bulk call past the hold-off runs without being the trial
                else:
                    trial = self.timeout_s + self.probe_attempts * self.probe_timeout_s + self.hold_off_s
                    _DOWN[key] = (now + trial, down[1])  # this call tries (and may probe); others wait
        started = time.monotonic()
        try:
            result = getattr(self.client(), method)(*args, timeout=timeout, retry_times=0, **kwargs)
        except Exception as err:
            answered = True  # Milvus sent an error (an alias not found, ...): it is up
            if not bulk and (_deadline(err) or _unreachable(err)):  # a slow bulk call is not an outage
                answered = _deadline(err) and self._answers(started)
                if answered:
                    err.tonearm_slow = True  # type: ignore[attr-defined]
                    err.tonearm_loading = (  # type: ignore[attr-defined]
                        self._not_loaded(method, args, kwargs) or _recovering(key, trial=down is not None))
                else:
                    with _CLIENTS_LOCK:
                        _DOWN[key] = (time.monotonic() + self.hold_off_s, _reason(err))
            if answered and down is not None:  # the trial call was answered (or slow): close the circuit
                _close_circuit(key)
            raise
        if down is not None:
            _close_circuit(key)
        return result

    def _not_loaded(self, method: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
        """Why a search or query that ran past its deadline, while the proxy answers, could not have been
        served: its collection is not loaded (yet) — a Milvus that restarted reloads its collections
        for seconds to minutes, and a call on one still loading waits out its deadline. None when the
        collection is loaded (the call was slow), for other calls, or when the state cannot be read."""
        collection = args[0] if args else kwargs.get("collection_name")
        if method not in ("search", "query") or not isinstance(collection, str):
            return None
        try:
            state = self.client().get_load_state(collection, timeout=self.probe_timeout_s)
        except Exception as err:  # noqa: BLE001 - no verdict: keep the slow-call reading
            log.info("Milvus load state of %s unread: %s", collection, _reason(err))
            return None
        name = getattr(state.get("state"), "name", str(state.get("state")))
        if name == "Loaded":
            return None
        progress = state.get("progress")
        return f"collection {collection} is {name}" + (f" ({progress} %)" if progress is not None else "")

    def _answers(self, since: float) -> bool:
        """Whether Milvus answers a cheap call (``GetVersion``) within :attr:`probe_timeout_s`, in
        up to :attr:`probe_attempts` tries. Concurrent callers share one probe: a caller that
        waited for another's uses its verdict when that probe started after its own call did."""
        key = (self.uri, self.token)
        with _CLIENTS_LOCK:
            lock = _PROBE_LOCKS.setdefault(key, threading.Lock())
        with lock:
            last = _PROBES.get(key)
            if last is not None and last[0] >= since:
                return last[1]
            begun, answered = time.monotonic(), False
            for _ in range(max(1, self.probe_attempts)):
                try:
                    self.client().get_server_version(timeout=self.probe_timeout_s, retry_times=0)
                    answered = True
                    break
                except Exception as err:  # noqa: BLE001 - any failure of the probe counts as no answer
                    log.info("Milvus probe at %s failed: %s", self.uri, _reason(err))
            _PROBES[key] = (begun, answered)
            return answered


_CLIENTS: dict[tuple[str, str | None], Any] = {}
_CLIENTS_LOCK = threading.Lock()
_DOWN: dict[tuple[str, str | None], tuple[float, str]] = {}
"""(uri, token) -> (monotonic time until which calls fail at once, the failure's reason)."""
_RECOVERED: dict[tuple[str, str | None], float] = {}
"""When each Milvus last came back after its circuit was open (monotonic seconds)."""
RECOVERY_GRACE_S = 30.0
"""For this long after Milvus came back from an outage, a serving call past its deadline is 503
``index-unavailable`` (retry), not 504: a restarted Milvus answers the probe at once but its query
nodes still recover collections whose load state already reads ``Loaded`` (the outage test saw 504s
~6 s after the restart although every collection said ``Loaded``)."""


def _close_circuit(key: tuple[str, str | None]) -> None:
    with _CLIENTS_LOCK:
        if _DOWN.pop(key, None) is not None:
            _RECOVERED[key] = time.monotonic()


def _recovering(key: tuple[str, str | None], *, trial: bool) -> str | None:
    """Why a call past its deadline is not "slow": Milvus is back from an outage only just now."""
    if trial:
        return "Milvus is answering again after an outage and may still be recovering its collections"
    with _CLIENTS_LOCK:
        since = _RECOVERED.get(key)
    if since is None or time.monotonic() - since > RECOVERY_GRACE_S:
        return None
    return (f"Milvus came back from an outage {time.monotonic() - since:.0f} s ago and may still be "
            "recovering its collections")


_PROBE_LOCKS: dict[tuple[str, str | None], threading.Lock] = {}
_PROBES: dict[tuple[str, str | None], tuple[float, bool]] = {}
"""(uri, token) -> (monotonic time the last probe began, whether Milvus answered it)."""

ENV = {
    "timeout_s": "TONEARM_MILVUS_TIMEOUT_S",
    "bulk_timeout_s": "TONEARM_MILVUS_BULK_TIMEOUT_S",
    "probe_timeout_s": "TONEARM_MILVUS_PROBE_TIMEOUT_S",
    "probe_attempts": "TONEARM_MILVUS_PROBE_ATTEMPTS",
    "hold_off_s": "TONEARM_MILVUS_HOLD_OFF_S",
    "recall_batch": "TONEARM_MILVUS_RECALL_BATCH",
}
""":class:`MilvusTarget` option -> the environment variable (service.settings.Settings reads the same
names, ``TONEARM_`` + field) that sets it, for the CLI (`tonearm bundle publish`, `tonearm index`)."""


def target_options_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The :data:`ENV` settings present in ``environ`` (default ``os.environ``), parsed and checked."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for option, name in ENV.items():
        raw = environ.get(name)
        if raw is None or raw.strip() == "":
            continue
        integer = option in ("probe_attempts", "recall_batch")
        try:
            value: float = int(raw) if integer else float(raw)
        except ValueError:
            raise TonearmError(f"{name}={raw!r}: expected {'an integer' if integer else 'a number of seconds'}") from None
        if not value > 0 or not math.isfinite(value):
            raise TonearmError(f"{name}={raw!r}: must be > 0")
        out[option] = value
    return out


def _connect(uri: str, token: str | None, timeout_s: float) -> Any:
    try:
        from pymilvus import MilvusClient
    except ModuleNotFoundError as err:
        raise TonearmError("the Milvus backend needs pymilvus: pip install 'tonearm[milvus]'") from err
    # pymilvus logs every failed call at ERROR, expected ones too (the first activation's "alias
    # not found"); the errors this module raises carry the reason, once, where it is handled.
    for name in ("pymilvus.decorators", "pymilvus.milvus_client.milvus_client"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        return MilvusClient(uri=uri, token=token or "", timeout=timeout_s)
    except Exception as err:  # pymilvus raises its own exception family, or grpc's
        raise IndexUnavailable(f"cannot connect to Milvus at {uri}: {_reason(err)}") from None


def _code(err: BaseException) -> Any:
    code = getattr(err, "code", None)
    return code() if callable(code) else code  # pymilvus stores grpc's bound code() method


def _reason(err: BaseException) -> str:
    """One line saying why: a gRPC error's status and details (its ``str`` is a multi-line
    repr whose first line says nothing), else pymilvus's message or the exception's text."""
    code, details = getattr(err, "code", None), getattr(err, "details", None)
    if callable(code) and callable(details):  # grpc.RpcError (a grpc.Call)
        try:
            status, detail = code(), details()
        except Exception:  # noqa: BLE001 - an RpcError that is not a Call: fall back to its text
            status, detail = None, None
        if status is not None:
            first = str(detail).splitlines()[0] if detail else ""
            return f"gRPC {getattr(status, 'name', status)}: {first}"[:300]
    text = getattr(err, "message", None) or str(err) or type(err).__name__
    return str(text).splitlines()[0][:300]


def _unreachable(err: BaseException) -> bool:
    """No answer at all: the connection failed or the deadline passed (not an error Milvus sent)."""
    import grpc

    if isinstance(err, IndexUnavailable):
        return True  # from connecting
    for cause in (err, err.__cause__):
        if isinstance(cause, grpc.RpcError) or isinstance(_code(cause) if cause is not None else None, grpc.StatusCode):
            return True
    return False


def _deadline(err: BaseException) -> bool:
    """The call ran past its deadline: slow, or a frozen server. Either the client's gRPC deadline
    passed (DEADLINE_EXCEEDED), or the proxy saw the propagated deadline pass first and answered with
    an error status ("proxy TaskCondition context Done", "context deadline exceeded")."""
    import grpc

    for cause in (err, err.__cause__):
        if cause is None:
            continue
        if _code(cause) == grpc.StatusCode.DEADLINE_EXCEEDED:
            return True
        text = _reason(cause).lower()
        if "context done" in text or "context deadline exceeded" in text:
            return True
    return False


INVALID_PARAMETER = 1100
"""Milvus's error code for a value it refuses (2.3+, ``ErrParameterInvalid``): 2.3.5 answers an upsert of a
768-byte id into a 512-byte VARCHAR key with it ("the length (768) of 0th string exceeds max length (512):
invalid parameter")."""


def _refused_input(err: BaseException) -> bool:
    """Milvus answered, refusing a value of the call: code :data:`INVALID_PARAMETER`, a string over its
    field's ``max_length`` (milvus-lite says "value length 513 exceeds max_length=512", under its own code), or
    pymilvus's client-side check of a row's values (DataNotMatchException)."""
    from pymilvus.exceptions import DataNotMatchException

    for cause in (err, err.__cause__):
        if cause is None:
            continue
        if isinstance(cause, DataNotMatchException) or _code(cause) == INVALID_PARAMETER:
            return True
        text = _reason(cause).lower()
        if "exceeds max_length" in text or "exceeds max length" in text:
            return True
    return False


def _transient(err: BaseException) -> bool:
    """Unreachable, past its deadline, or not loaded yet: worth retrying later."""
    import grpc

    if _deadline(err):
        return True

    for cause in (err, err.__cause__):
        if isinstance(cause, grpc.RpcError):
            return True  # transport-level: connection refused, deadline, reset
        code = _code(cause) if cause is not None else None
        if isinstance(code, grpc.StatusCode) or code in (2, NOT_LOADED):  # 2: connect failed
            return True
    return False


@contextmanager
def _mapped(what: str, target: MilvusTarget) -> Iterator[None]:
    """Turn pymilvus / grpc failures into :class:`IndexUnavailable` / :class:`IndexBackendError` (a value
    Milvus refuses: :class:`IndexInputRefused`)."""
    try:
        yield
    except TonearmError:
        raise
    except Exception as err:
        message = f"{what} (Milvus at {target.uri}): {_reason(err)}"
        loading = getattr(err, "tonearm_loading", None)
        if loading:  # Milvus is up but cannot serve this yet (reloading after a restart): retry, not a timeout
            raise IndexUnavailable(f"{message}; {loading} (Milvus loads collections after a restart)") from None
        if getattr(err, "tonearm_slow", False):
            raise IndexTimeout(f"{message}; Milvus answers other calls: this one ran past its "
                               f"{target.timeout_s:g} s deadline") from None
        if _transient(err):
            raise IndexUnavailable(message) from None
        if _refused_input(err):
            raise IndexInputRefused(message) from None
        raise IndexBackendError(message) from None


# ----------------------------------------------------------------------------- publish


def _schema(dim: int, *, text: bool, meta: bool = False) -> Any:
    from pymilvus import DataType, MilvusClient

    schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("row", DataType.INT64, is_primary=True)
    if text:
        schema.add_field("lang", DataType.VARCHAR, max_length=LANG_MAX)
        schema.add_field("clip_row", DataType.INT64)
    if meta:
        schema.add_field(META_FIELD, DataType.JSON)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=dim)
    return schema


def build_params(index_type: str, n: int) -> dict[str, int]:
    """Build parameters: HNSW ``M``/``efConstruction``; IVF_FLAT ``nlist`` ≈ 4√n (FAISS's rule of thumb)."""
    if index_type == "HNSW":
        return {"M": 16, "efConstruction": 200}
    if index_type == "IVF_FLAT":
        return {"nlist": int(min(65_536, max(1, round(4 * math.sqrt(max(n, 1))))))}
    return {}


def search_params(index_type: str, build: dict[str, int], k: int) -> dict[str, int]:
    """Search parameters for top-``k``: HNSW ``ef`` ≥ k (64 at least); IVF ``nprobe`` = nlist/4 (≥ 16)."""
    if index_type == "HNSW":
        return {"ef": max(64, k)}
    if index_type == "IVF_FLAT":
        nlist = int(build.get("nlist", 1))
        return {"nprobe": min(nlist, max(16, nlist // 4))}
    return {}


def _index_params(client: Any, index_type: str, params: dict[str, int]) -> Any:
    index = client.prepare_index_params()
    index.add_index(field_name="vector", index_type=index_type, metric_type="IP", params=params)
    return index


def _registry_schema() -> Any:
    from pymilvus import DataType, MilvusClient

    schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("key", DataType.VARCHAR, is_primary=True, max_length=256)
    schema.add_field("bundle_id", DataType.VARCHAR, max_length=256)
    schema.add_field("info", DataType.VARCHAR, max_length=4096)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=2)  # Milvus collections need one vector field
    return schema


def _ensure_registry(target: MilvusTarget) -> None:
    if not target.call("has_collection", target.registry):
        target.call(
            "create_collection", target.registry, schema=_registry_schema(),
            index_params=_index_params(target.client(), "FLAT", {}), bulk=True,
        )
    target.call("load_collection", target.registry, bulk=True)


def _registry_rows(target: MilvusTarget, expression: str) -> list[dict[str, Any]]:
    """Registry rows matching ``expression``, read with Strong consistency (a publish is visible at once)."""
    if not target.call("has_collection", target.registry):
        return []
    target.call("load_collection", target.registry, bulk=True)  # a no-op when loaded
    return list(target.call(
        "query", target.registry, filter=expression, output_fields=["bundle_id", "info"], consistency_level="Strong",
    ))


def published_info(target: MilvusTarget, bundle_id: str) -> dict[str, Any] | None:
    """What the registry recorded at publish (sizes, index type and parameters, recall), or None."""
    with _mapped(f"reading the registry for {bundle_id}", target):
        rows = _registry_rows(target, f"key == {json.dumps(bundle_id)}")
    return json.loads(rows[0]["info"]) if rows else None


def caption_index(manifest: BundleManifest) -> IndexInfo | None:
    """The caption index; None for an index-only bundle (`tonearm index`): no captions."""
    return manifest.text_index


def bundle_vectors(root: Path, manifest: BundleManifest) -> tuple[np.ndarray, np.ndarray]:
    """(audio, text) vectors of a bundle, read back from its FAISS indices (exact for Flat/HNSW);
    text is (0, d) for an index-only bundle."""
    from index.engines.faiss_index import all_vectors, load_index, parse_factory

    if manifest.milvus_only is not None:
        raise BundleError(
            f"bundle {manifest.bundle_id} has no vectors of its own: they were published straight to "
            f"Milvus at {manifest.milvus_only.uri} (`tonearm index --milvus-uri`); index the audio again to publish elsewhere"
        )
    out = []
    for info in (manifest.audio_index, caption_index(manifest)):
        if info is None:
            out.append(np.zeros((0, manifest.embed_dim), np.float32))
            continue
        index = load_index(root / info.file, spec=parse_factory(info.factory, info.dim), search_params={})
        out.append(all_vectors(index))
    return out[0], out[1]


def exact_top(vectors: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """Exact top-``k`` rows by inner product, ties by row (the bundle's exact index, in numpy)."""
    return exact_top_chunks([(np.arange(vectors.shape[0]), vectors)], queries, k)


def exact_top_chunks(chunks: Iterable[tuple[np.ndarray, np.ndarray]], queries: np.ndarray, k: int) -> np.ndarray:
    """Exact top-``k`` rows over ``(rows, vectors)`` chunks, ties by row, holding one chunk at a time
    (a collection streamed out of Milvus, or one array)."""
    best_scores = np.zeros((len(queries), 0), np.float32)
    best_rows = np.zeros((len(queries), 0), np.int64)
    for rows, vectors in chunks:
        scores = np.concatenate([best_scores, queries @ vectors.T], axis=1)
        ids = np.concatenate([best_rows, np.broadcast_to(np.asarray(rows, np.int64), (len(queries), len(rows)))], axis=1)
        order = np.lexsort((ids, -scores))[:, :k]
        best_scores, best_rows = np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)
    return best_rows


def _check_index_type(index_type: str) -> None:
    if index_type not in INDEX_TYPES:
        raise TonearmError(f"unknown Milvus index type {index_type!r}; one of {', '.join(INDEX_TYPES)}")


def create_collection(target: MilvusTarget, name: str, *, dim: int, text: bool, index_type: str,
                      n: int, meta: bool = False) -> dict[str, int]:
    """(Re)create collection ``name`` for about ``n`` vectors; its build parameters. A collection
    left by a publish interrupted before its registry row is dropped first (start over). ``meta``:
    with the JSON field :data:`META_FIELD` (each row's metadata, for filters evaluated by Milvus)."""
    build = build_params(index_type, n)
    if target.call("has_collection", name):
        target.call("drop_collection", name, bulk=True)
    target.call(
        "create_collection", name, schema=_schema(dim, text=text, meta=meta),
        index_params=_index_params(target.client(), index_type, build), bulk=True,
    )
    return build


def write_rows(target: MilvusTarget, name: str, keys: Sequence[int] | np.ndarray, vectors: np.ndarray,
               text_items: Sequence[dict[str, Any]] | None = None, *, upsert: bool = False,
               metas: Sequence[dict[str, Any]] | None = None) -> None:
    """The one write path of vectors into a collection: ``keys[i]`` is the ``row`` field of
    ``vectors[i]`` (and ``text_items[i]`` its ``lang`` / ``clip_row``, ``metas[i]`` its
    :data:`META_FIELD`), in chunks of :data:`INSERT_CHUNK`. ``upsert``: a batch written twice (a Ray
    task retried) leaves one copy."""
    method = "upsert" if upsert else "insert"
    for start in range(0, len(vectors), INSERT_CHUNK):
        rows = []
        for i in range(start, min(start + INSERT_CHUNK, len(vectors))):
            record: dict[str, Any] = {"row": int(keys[i]), "vector": vectors[i].tolist()}
            if text_items is not None:
                record["lang"] = str(text_items[i]["lang"])
                record["clip_row"] = int(text_items[i]["clip_row"])
            if metas is not None:
                record[META_FIELD] = metas[i]
            rows.append(record)
        target.call(method, name, rows, bulk=True)


def _register(target: MilvusTarget, bundle_id: str, info: dict[str, Any]) -> None:
    """Record ``bundle_id`` as published — the last write of a publish — and flush it.

    Unflushed rows live only in Milvus's write-ahead log until a segment seals, and a Milvus
    killed and restarted can come back without them (seen in CI: a bundle published before a
    SIGKILL stayed "not published" for minutes after the restart; milvus-io/milvus#38284 is the
    same class). A publish returns only once its registry row is in a flushed segment."""
    _ensure_registry(target)
    target.call("upsert", target.registry, [
        {"key": bundle_id, "bundle_id": bundle_id, "info": json.dumps(info), "vector": [0.0, 0.0]}
    ], bulk=True)
    target.call("flush", target.registry, bulk=True)


def catalogue_metas(audio_items: Sequence[Mapping[str, Any]]) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """The one layout of the :data:`META_FIELD` column, for both publish paths: the fields a filter can
    use in Milvus with their kinds (the clips' filterable metadata, :class:`MetadataTable`; a field
    holding several kinds is left out: filtered on our side) and each clip's JSON object
    (:func:`index.engines.filters.milvus_metadata`). A caption row carries its clip's object."""
    fields = {name: kind for name, kind in MetadataTable.from_items(audio_items).fields().items() if kind != "mixed"}
    return fields, [milvus_metadata(item, fields) for item in audio_items]


def kept_fields(written: Mapping[str, str], kept_items: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The registry's ``meta_fields`` of a collection whose rows were written with the layout of
    :func:`catalogue_metas` over more items than it keeps (the Ray writers lay out every candidate
    file before decoding; files that fail to decode leave gaps): the fields of the kept clips that
    the rows hold with the same kind. Without gaps this is exactly what :func:`publish` records; a
    field that only a dropped file made ``mixed`` is left out (filtered on our side, same answers)."""
    fields, _ = catalogue_metas(kept_items)
    return {name: kind for name, kind in fields.items() if written.get(name) == kind}


PublishStep = Callable[[Path, BundleManifest, np.ndarray], dict[str, Any]]
"""More collections a publish writes before it registers the bundle (``(bundle dir, manifest, caption vectors)``
→ entries merged into the registry row): :func:`index.engines.milvus_windows.publish_windows`, the moment windows."""


def publish(bundle_dir: Path, target: MilvusTarget, *, index_type: str = "FLAT",
            steps: Sequence[PublishStep] = ()) -> bool:
    """Write a bundle's vectors to Milvus; False when it was already published (nothing written).

    The recall@10 of each collection against the bundle's exact vectors is measured on up to
    :data:`RECALL_QUERIES` queries (captions for the audio collection, clips for the text one;
    an index-only bundle, which has no captions and an empty text collection: clips for the
    audio one) and recorded with the build and search parameters in the registry. ``steps`` write
    further collections (the moment windows) before the registry row, which stays the last write."""
    _check_index_type(index_type)
    root = Path(bundle_dir)
    manifest = read_manifest(root)
    if published_info(target, manifest.bundle_id) is not None:
        return False
    audio, text = bundle_vectors(root, manifest)
    captions = caption_index(manifest)
    text_items = read_jsonl(root / captions.ids_file, required=("lang", "clip_row")) if captions else []
    audio_items = read_jsonl(root / manifest.audio_index.ids_file, required=("id",))
    check_catalogue_ids((str(item["id"]) for item in audio_items), f"publishing {manifest.bundle_id} to Milvus")
    fields, clip_metas = catalogue_metas(audio_items)
    metas = {"audio": clip_metas, "text": [clip_metas[int(t["clip_row"])] for t in text_items]}
    info: dict[str, Any] = {"n_audio": len(audio), "n_text": len(text), "index_type": index_type,
                            "dim": manifest.embed_dim, "build_params": {}, "recall_at_10": {},
                            "meta_fields": fields}
    with _mapped(f"publishing {manifest.bundle_id}", target):
        for kind, vectors, queries in (("audio", audio, text if len(text) else audio), ("text", text, audio)):
            name = target.collection(manifest.bundle_id, kind)
            build = create_collection(target, name, dim=manifest.embed_dim, text=kind == "text",
                                      index_type=index_type, n=len(vectors), meta=True)
            info["build_params"][kind] = build
            write_rows(target, name, np.arange(len(vectors)), vectors, text_items if kind == "text" else None,
                       metas=metas[kind])
            target.call("flush", name, bulk=True)
            index = MilvusVectorIndex(target, name, ntotal=len(vectors), dim=manifest.embed_dim,
                                      index_type=index_type, build=build)
            sample = _recall_sample(queries)
            info["recall_at_10"][kind] = _measure_recall(index, sample, exact_top(vectors, sample, 10))
        for step in steps:
            info.update(step(root, manifest, text))
        _register(target, manifest.bundle_id, info)
    return True


def _recall_sample(queries: np.ndarray) -> np.ndarray:
    """Up to :data:`RECALL_QUERIES` rows of ``queries``, evenly spaced."""
    return queries[_sample_rows(len(queries))]


def _sample_rows(n: int) -> np.ndarray:
    return np.unique(np.linspace(0, n - 1, min(RECALL_QUERIES, n)).astype(int)) if n else np.zeros(0, int)


def _measure_recall(index: MilvusVectorIndex, queries: np.ndarray, exact: np.ndarray) -> float:
    """Recall@10 of ``index`` (loaded for it, released afterwards) against the ``exact`` top rows.

    Bulk work, not serving: :attr:`MilvusTarget.recall_batch` queries per search call, each under
    the bulk deadline, outside the serving circuit — a FLAT search of a large collection on a small
    machine takes seconds, which must neither fail the publish nor mark Milvus down."""
    k = min(10, index.ntotal)
    if k == 0 or len(queries) == 0:
        return 1.0
    index.target.call("load_collection", index.collection, bulk=True)
    try:
        batch = max(1, index.target.recall_batch)
        found = np.concatenate([index.search(queries[start : start + batch], k, bulk=True)[1]
                                for start in range(0, len(queries), batch)])
    finally:
        index.target.call("release_collection", index.collection, bulk=True)
    exact = exact[:, :k]
    hits = sum(len(set(f.tolist()) & set(e.tolist())) for f, e in zip(found, exact, strict=True))
    return round(hits / exact.size, 4)


# ----------------------------------------------------------------------------- publish from many writers


def is_lite(uri: str) -> bool:
    """A Milvus Lite file (``*.db`` or a path): one process may open it, never several."""
    return "://" not in uri or uri.endswith(".db")


@dataclass(frozen=True)
class CollectionSink:
    """Writes vectors and their rows' metadata (:data:`META_FIELD`, laid out by :func:`catalogue_metas`)
    into one collection from any process (a Ray actor): picklable, connects on first use, writes
    through :func:`write_rows` with upsert (a retried batch leaves one copy)."""

    target: MilvusTarget
    collection: str

    def __call__(self, keys: np.ndarray, vectors: np.ndarray, metas: Sequence[dict[str, Any]]) -> None:
        with _mapped(f"writing vectors into {self.collection}", self.target):
            write_rows(self.target, self.collection, keys, vectors, upsert=True, metas=metas)


def check_new_bundle(target: MilvusTarget, bundle_id: str, index_type: str) -> None:
    """What :func:`begin_audio_publish` refuses, checked before any work: an unknown index type, a
    Milvus Lite file (the writers are other processes), pymilvus missing or Milvus unreachable, and
    a bundle id already published."""
    _check_index_type(index_type)
    if is_lite(target.uri):
        raise TonearmError(
            f"--milvus-uri {target.uri}: a Milvus Lite file can be opened by one process only, and the Ray "
            "workers are other processes; publish to a Milvus server (http://HOST:19530), or drop --milvus-uri "
            "and run `tonearm bundle publish` on the bundle written"
        )
    if published_info(target, bundle_id) is not None:
        raise BundleError(f"bundle {bundle_id} is already published to Milvus at {target.uri}; "
                          "bundles are never overwritten: choose another --out name")


def begin_audio_publish(target: MilvusTarget, bundle_id: str, *, dim: int, index_type: str,
                        n: int) -> CollectionSink:
    """Start publishing an index-only bundle whose vectors other processes write (`tonearm index
    --ray --milvus-uri`): refuses a bundle id already published, (re)creates its audio collection
    (``n``: at most this many vectors, for the build parameters) and its empty text collection
    (the active aliases always name both), both with the :data:`META_FIELD` column as :func:`publish`
    makes them, and returns the sink the writers use."""
    check_new_bundle(target, bundle_id, index_type)
    with _mapped(f"publishing {bundle_id}", target):
        for kind in KINDS:
            create_collection(target, target.collection(bundle_id, kind), dim=dim, text=kind == "text",
                              index_type=index_type, n=n if kind == "audio" else 0, meta=True)
    return CollectionSink(target, target.collection(bundle_id, "audio"))


def finish_audio_publish(target: MilvusTarget, bundle_id: str, *, dim: int, index_type: str, n_max: int,
                         n: int, gaps: Sequence[int], meta_fields: Mapping[str, str],
                         extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """After the writers of :func:`begin_audio_publish`: flush, check the collection holds exactly the
    ``n`` vectors expected (keys ``0 .. n + len(gaps)`` but ``gaps``), measure recall@10 on a sample of
    its own vectors against exact search streamed out of it (the driver never holds them all), and
    record the bundle in the registry with ``meta_fields`` (:func:`kept_fields`) and ``extra`` (entries of
    collections written beside it: the moment windows, :mod:`index.catalogue.milvus_pass_windows`). Returns
    the registry info."""
    audio, text = target.collection(bundle_id, "audio"), target.collection(bundle_id, "text")
    build = build_params(index_type, n_max)
    with _mapped(f"publishing {bundle_id}", target):
        for name in (audio, text):
            target.call("flush", name, bulk=True)
        held = target.call("query", audio, filter="", output_fields=["count(*)"], consistency_level="Strong",
                           bulk=True)[0]["count(*)"]
        if int(held) != n:
            raise IndexBackendError(f"{audio} holds {held} vectors after the writers finished, expected {n}; "
                                    "index the audio again")
        index = MilvusVectorIndex(target, audio, ntotal=n, dim=dim, index_type=index_type, build=build, gaps=gaps)
        target.call("load_collection", audio, bulk=True)
        try:
            queries = index.rows(_sample_rows(n))
            exact = exact_top_chunks(index.chunks(), queries, 10)
        finally:
            target.call("release_collection", audio, bulk=True)
        info: dict[str, Any] = {
            "n_audio": n, "n_text": 0, "index_type": index_type, "dim": dim,
            "build_params": {"audio": build, "text": build_params(index_type, 0)},
            "recall_at_10": {"audio": _measure_recall(index, queries, exact), "text": 1.0},
            "meta_fields": dict(meta_fields), **(extra or {}),
        }
        _register(target, bundle_id, info)
    return info


# ----------------------------------------------------------------------------- search


class MilvusVectorIndex:
    """One collection searched by inner product; rows are the bundle's row numbers.

    The collection's ``row`` field is the bundle row, except in a bundle published straight from
    Ray workers with ``gaps`` (keys no vector was written for): there bundle row ``r`` is the
    ``r``-th key not in ``gaps`` (the order, and so the tie order, is the same)."""

    def __init__(
        self, target: MilvusTarget, collection: str, *, ntotal: int, dim: int,
        index_type: str = "FLAT", build: dict[str, int] | None = None, gaps: Sequence[int] = (),
        meta_fields: Mapping[str, str] | None = None,
    ) -> None:
        self.target = target
        self.meta_fields = dict(meta_fields) if meta_fields is not None else None
        """The :data:`META_FIELD` fields and kinds; None for a collection published without metadata
        (before filters were evaluated by Milvus, or by `tonearm index --ray --milvus-uri`)."""
        self.collection = collection
        self.ntotal = ntotal
        self.d = dim
        self.index_type = index_type
        self.build = dict(build or {})
        self._gaps = np.unique(np.asarray(gaps, dtype=np.int64))

    def _rows_of(self, keys: np.ndarray) -> np.ndarray:
        return keys - np.searchsorted(self._gaps, keys) if len(self._gaps) else keys

    def _keys_of(self, rows: np.ndarray) -> np.ndarray:
        if not len(self._gaps):
            return rows
        return rows + np.searchsorted(self._gaps - np.arange(len(self._gaps)), rows, side="right")

    def expression(self, flt: Filter) -> str | None:
        """``flt`` as this collection's Milvus expression (:func:`index.engines.filters.milvus_expr`); None when
        the collection has no metadata or the filter cannot be written as one (filter on our side)."""
        if self.meta_fields is None:
            return None
        return milvus_expr(flt, self.meta_fields, json_field=META_FIELD, row_field="row",
                           in_operator=not is_lite(self.target.uri))

    def search(
        self, queries: np.ndarray, k: int, languages: Sequence[str] | None = None, *, bulk: bool = False,
        where: str = "", keep: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` (scores (n, k) float32, rows (n, k) int64; -1 / -inf where fewer hits), ties by row.

        ``where``: a Milvus expression (:meth:`expression`) the rows must pass, evaluated by Milvus.
        ``keep``: a boolean mask over the rows checked on the hits as well (a filter's mask made
        stricter on our side: the query's own clip excluded, a takedown): hits it drops are
        replaced by fetching further. ``bulk``: a search of bulk work (publish's recall check)
        under the bulk deadline, outside the serving circuit (:meth:`MilvusTarget.call`)."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        matrix = np.ascontiguousarray(queries, dtype=np.float32)
        parts = [f"lang in {json.dumps(sorted(languages))}"] if languages else []
        if where:
            parts.append(f"({where})")
        expression = " and ".join(parts)
        scores = np.full((len(matrix), k), -np.inf, dtype=np.float32)
        rows = np.full((len(matrix), k), -1, dtype=np.int64)
        if len(matrix) == 0 or self.ntotal == 0:
            return scores, rows
        cap = min(self.ntotal, MAX_LIMIT)
        first = min(cap, k + TIE_MARGIN)
        hits = self._fetch(matrix, first, expression, bulk=bulk)
        for q, found in enumerate(hits):
            # A tie at the cut may continue past what was fetched, and ``keep`` may drop hits:
            # widen this query while more rows exist and the k-th kept hit is not settled.
            limit = first
            kept = _kept(found, keep)
            while limit < cap and len(found) == limit and (
                    len(kept) < k or (len(found) > k and found[-1][0] == kept[k - 1][0])):
                limit = min(cap, limit * 2)
                found = self._fetch(matrix[q : q + 1], limit, expression, bulk=bulk)[0]
                kept = _kept(found, keep)
            for j, (score, row) in enumerate(kept[:k]):
                scores[q, j] = score
                rows[q, j] = row
        return scores, rows

    def _fetch(self, matrix: np.ndarray, limit: int, expression: str, *,
               bulk: bool = False) -> list[list[tuple[float, int]]]:
        """Per query: (score, row) pairs ordered by score descending, then row ascending."""
        with _mapped(f"searching {self.collection}", self.target):
            found = self.target.call(
                "search", self.collection, data=matrix.tolist(), limit=limit, filter=expression,
                search_params={"metric_type": "IP", "params": search_params(self.index_type, self.build, limit)},
                output_fields=["row"], bulk=bulk,
            )
        out = []
        for hits in found:
            pairs = [(float(hit["distance"]), _row(hit)) for hit in hits]
            rows = self._rows_of(np.array([row for _, row in pairs], dtype=np.int64)).tolist()
            out.append(sorted(((score, row) for (score, _), row in zip(pairs, rows, strict=True)),
                              key=lambda h: (-h[0], h[1])))
        return out

    def vectors(self) -> np.ndarray:
        """Every vector (row order), for the consistency diagnostics' exact ranks."""
        out = np.zeros((self.ntotal, self.d), dtype=np.float32)
        for rows, vectors in self.chunks():
            out[rows] = vectors
        return out

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every (rows, vectors), :data:`QUERY_CHUNK` keys at a time (one chunk in memory)."""
        for start in range(0, self.ntotal + len(self._gaps), QUERY_CHUNK):
            yield self._read(f"row >= {start} and row < {start + QUERY_CHUNK}")

    def rows(self, rows: np.ndarray) -> np.ndarray:
        """The vectors of bundle ``rows`` (in that order)."""
        out = np.zeros((len(rows), self.d), dtype=np.float32)
        if len(rows):
            got, vectors = self._read(f"row in {json.dumps(self._keys_of(np.asarray(rows, np.int64)).tolist())}")
            position = {int(row): i for i, row in enumerate(rows)}
            for row, vector in zip(got.tolist(), vectors, strict=True):
                out[position[row]] = vector
        return out

    def _read(self, expression: str) -> tuple[np.ndarray, np.ndarray]:
        with _mapped(f"reading the vectors of {self.collection}", self.target):
            records = self.target.call("query", self.collection, filter=expression, output_fields=["row", "vector"],
                                       consistency_level="Strong", bulk=True)
        keys = np.array([int(record["row"]) for record in records], dtype=np.int64)
        vectors = np.array([record["vector"] for record in records], dtype=np.float32).reshape(len(records), self.d)
        return self._rows_of(keys), vectors

    def release(self) -> None:
        """Free the collection's Milvus memory (the bundle is closed: neither active nor rollback target)."""
        if not self.target.release_closed:
            return
        try:
            with _mapped(f"releasing {self.collection}", self.target):
                self.target.call("release_collection", self.collection, bulk=True)
        except TonearmError as err:  # releasing must never break a swap; Milvus frees it on restart anyway
            log.warning("%s", err)


def _kept(found: list[tuple[float, int]], keep: np.ndarray | None) -> list[tuple[float, int]]:
    return found if keep is None else [hit for hit in found if keep[hit[1]]]


def _row(hit: Any) -> int:
    """The hit's bundle row: the entity's ``row`` field (the server keys hits ``id``, milvus-lite 3.x ``row``)."""
    entity = hit.get("entity") or {}
    if "row" in entity:
        return int(entity["row"])
    return int(hit["row"] if "row" in hit else hit["id"])


def open_bundle_indices(
    target: MilvusTarget, manifest: BundleManifest
) -> tuple[MilvusVectorIndex, MilvusVectorIndex | None]:
    """(audio index, text index or None for an index-only bundle) of a published bundle, loaded;
    :class:`BundleNotPublished` otherwise."""
    info = published_info(target, manifest.bundle_id)
    if info is None:
        how = ("run `tonearm index --ray --milvus-uri` again" if manifest.milvus_only is not None
               else f"run: tonearm bundle publish BUNDLE_DIR --milvus-uri {target.uri}")
        raise BundleNotPublished(f"bundle {manifest.bundle_id} is not published to Milvus at {target.uri}; {how}")
    captions = caption_index(manifest)
    expected = {"n_audio": manifest.audio_index.ntotal, "n_text": captions.ntotal if captions else 0}
    if any(info.get(key) != value for key, value in expected.items()):
        raise BundleError(f"Milvus holds {info} for bundle {manifest.bundle_id}, its manifest {expected}")
    gaps = manifest.milvus_only.gaps if manifest.milvus_only is not None else []
    indices: list[MilvusVectorIndex | None] = []
    with _mapped(f"loading bundle {manifest.bundle_id}", target):
        for kind, n in (("audio", expected["n_audio"]), ("text", expected["n_text"])):
            if kind == "text" and captions is None:  # an empty collection: only for the aliases
                indices.append(None)
                continue
            name = target.collection(manifest.bundle_id, kind)
            target.call("load_collection", name, bulk=True)
            indices.append(MilvusVectorIndex(
                target, name, ntotal=n, dim=manifest.embed_dim, index_type=str(info.get("index_type", "FLAT")),
                build=dict(info.get("build_params", {}).get(kind, {})), gaps=gaps if kind == "audio" else (),
                meta_fields=info.get("meta_fields"),
            ))
    audio, text = indices
    assert audio is not None
    return audio, text


# ----------------------------------------------------------------------------- active aliases


def _alias_error(err: BaseException, which: str) -> bool:
    """``which`` = "missing" | "exists": the alias error, by code (and milvus-lite 3.x's message)."""
    code, text = _code(err), _reason(err).lower()  # pymilvus prefixes "[call] Retry run out of 0 retry times"
    if which == "missing":
        return code == ALIAS_NOT_FOUND or (code == 100 and "alias" in text and "does not exist" in text)
    return code == ALIAS_EXISTS or (code == 1 and "alias" in text and "already exist" in text)


def alias_target(target: MilvusTarget, kind: str) -> str | None:
    """The collection the ``kind`` alias names, None when the alias does not exist."""
    try:
        return str(target.call("describe_alias", target.alias(kind))["collection_name"])
    except Exception as err:
        if _alias_error(err, "missing"):
            return None
        raise


_LITE_ALIAS_WRITES = threading.Lock()
"""milvus-lite 3.x rewrites its aliases file through one fixed temporary name, so two alias writes at
once (two threads' first activations) can fail with ``aliases.json.tmp`` missing: on a Lite file,
which only this process opens, alias writes take turns. A server needs no such lock."""


@contextmanager
def _alias_write(target: MilvusTarget) -> Iterator[None]:
    if is_lite(target.uri):
        with _LITE_ALIAS_WRITES:
            yield
    else:
        yield


def _point(target: MilvusTarget, kind: str, collection: str, *, exists: bool) -> None:
    alias = target.alias(kind)
    with _alias_write(target):
        if exists:
            target.call("alter_alias", collection_name=collection, alias=alias)
            return
        try:
            target.call("create_alias", collection_name=collection, alias=alias)
        except Exception as err:
            if not _alias_error(err, "exists"):
                raise
            target.call("alter_alias", collection_name=collection, alias=alias)  # a concurrent first activation won


def set_active(target: MilvusTarget, bundle_id: str) -> bool:
    """Point both active aliases at ``bundle_id``'s collections, or neither; True when one changed.

    An alias already right is not rewritten. When a switch fails, those already switched are
    pointed back (or dropped, where there was none), so audio and text never name different
    bundles after a failed activation. Both are read back after switching: a concurrent
    activation (another replica's first one) that switched one of them meanwhile is overwritten,
    so the last activation to finish owns both."""
    wanted = {kind: target.collection(bundle_id, kind) for kind in KINDS}
    changed = False
    with _mapped(f"activating {bundle_id}", target):
        for attempt in range(ACTIVATION_ATTEMPTS):
            if attempt:
                time.sleep(random.uniform(0.0, 0.05))  # break the symmetry of two racing activations
            before = {kind: alias_target(target, kind) for kind in KINDS}
            if before == wanted:
                return changed
            if attempt and _same_bundle(before):
                log.warning("activation of %s overtaken by a concurrent one (%s)", bundle_id, before["audio"])
                return changed
            switched: list[str] = []
            try:
                for kind in KINDS:
                    if before[kind] != wanted[kind]:
                        _point(target, kind, wanted[kind], exists=before[kind] is not None)
                        switched.append(kind)
            except Exception:
                _undo(target, before, switched)
                raise
            changed = True  # read back: a concurrent activation may have switched one alias meanwhile
    raise IndexBackendError(f"activating {bundle_id}: another activation kept switching the aliases; retry")


def _same_bundle(names: dict[str, str | None]) -> bool:
    """Both aliases name the collections of one bundle (``<prefix>_<bundle>_<hash>_<kind>``)."""
    audio, text = names["audio"], names["text"]
    return audio is not None and text is not None and audio.removesuffix("_audio") == text.removesuffix("_text")


def _undo(target: MilvusTarget, before: dict[str, str | None], switched: list[str]) -> None:
    for kind in reversed(switched):
        try:
            previous = before[kind]
            with _alias_write(target):
                if previous is None:
                    target.call("drop_alias", target.alias(kind))
                else:
                    target.call("alter_alias", collection_name=previous, alias=target.alias(kind))
        except Exception as err:  # the original failure is what the caller must see
            log.error("could not undo the %s alias switch (%s); re-run the activation", kind, _reason(err))


def active_bundle(target: MilvusTarget) -> str | None:
    """The bundle id both active aliases name; None when unset; :class:`IndexBackendError` when
    they disagree; :class:`IndexUnavailable` when Milvus cannot be asked."""
    with _mapped("reading the active aliases", target):
        names = {kind: alias_target(target, kind) for kind in KINDS}
        if names["audio"] is None and names["text"] is None:
            return None
        by_collection = {
            target.collection(str(row["bundle_id"]), kind): str(row["bundle_id"])
            for row in _registry_rows(target, "key != ''") for kind in KINDS
        }
    bundles = {kind: by_collection.get(name or "") for kind, name in names.items()}
    if bundles["audio"] != bundles["text"] or bundles["audio"] is None:
        raise IndexBackendError(f"the active aliases disagree ({names}); activate a bundle again")
    return bundles["audio"]


# ----------------------------------------------------------------------------- CLI


def target_from_args(uri: str, token_env: str | None) -> MilvusTarget:
    """The CLI's target: ``--milvus-uri``, the token from ``--milvus-token-env``, and the deadlines
    and circuit settings from the same ``TONEARM_MILVUS_*`` variables the service reads (:data:`ENV`)."""
    token = None
    if token_env:
        token = os.environ.get(token_env)
        if not token:
            raise TonearmError(f"--milvus-token-env {token_env}: that environment variable is not set")
    return MilvusTarget(uri=uri, token=token, **target_options_from_env())


def cli_publish(args: argparse.Namespace, *, steps: Sequence[PublishStep] = ()) -> int:
    """`tonearm bundle publish BUNDLE --milvus-uri URI [--milvus-token-env VAR] [--milvus-index TYPE]`
    (``steps``: :func:`publish`'s; the command runs :func:`index.engines.milvus_windows.cli_publish`)."""
    root = Path(args.bundle)
    if not (root / fmt.MANIFEST_NAME).is_file():
        raise BundleError(f"{root}: not a bundle directory (no {fmt.MANIFEST_NAME})")
    target = target_from_args(args.milvus_uri, args.milvus_token_env)
    manifest = read_manifest(root)
    written = publish(root, target, index_type=args.milvus_index, steps=steps)
    info = published_info(target, manifest.bundle_id) or {}
    state = "published" if written else "already published (nothing written)"
    Console().print(
        f"{manifest.bundle_id}: {state} to {target.uri} as {target.collection(manifest.bundle_id, 'audio')} "
        f"({manifest.audio_index.ntotal} clips) and {target.collection(manifest.bundle_id, 'text')} "
        f"({info.get('n_text', '?')} captions); {info.get('index_type', '?')} "
        f"recall@10 {info.get('recall_at_10', {})}", highlight=False, soft_wrap=True,
    )
    windows = info.get("windows")
    if windows:
        Console().print(
            f"{manifest.bundle_id}: {windows['n_windows']:,} moment windows of {windows['n_recordings']:,} recordings in "
            f"{target.collection(manifest.bundle_id, 'windows')} ({windows['index_type']}, best-recording recall@10 "
            f"{windows['recall_at_10']})", highlight=False, soft_wrap=True)
    return 0

