"""Bundle registry: the active and previous bundle, activation with a quality gate, rollback.

Swap protocol (docs/service.md):

1. **load beside** — the candidate is opened while the active bundle keeps serving;
2. **verify** — ``LoadedBundle.open(verify=True)`` checks every file's sha256 and the
   manifest; here we also check the encoders' output width against ``embed_dim``;
3. **warm up** — one text and one audio inference, so the first request is not slow;
4. **gate** — :func:`service.gate.run_gate` (unless forced);
5. **swap** — one reference assignment under a lock. A request *leases* the bundle
   it started with (reference count), so in-flight requests finish on the old
   one; a bundle pushed out of the (active, previous) pair is closed when its
   last lease ends. The previous bundle stays loaded so rollback is instant.

Activations are serialized; a second concurrent one gets ``activation-in-progress``.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from index.bundle.format import read_manifest
from index.engines.milvus_windows import published_windows
from index.errors import BundleError, BundleNotPublished, IndexBackendError
from service.allocator import freeze_long_lived, trim
from service.cache import QueryCache
from service.errors import ServiceError
from service.gate import GateThresholds, GateVerdict, run_gate
from service.limits import QUERY_MAX_CHARS
from service.metrics import ServiceMetrics
from service.searcher import BundleLike, Searcher, index_unavailable
from service.settings import Settings

log = logging.getLogger(__name__)

STARTUP_RETRY_MAX_S = 30.0
STARTUP_RETRIED = ("index-unavailable", "index-timeout", "bundle-not-published")
"""Problems the first bundle's load waits out at startup (anything else fails at once)."""
BUNDLE_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

Opener = Callable[[Path], BundleLike]
Publisher = Callable[[str], None]


@dataclass
class _Entry:
    """A loaded bundle with its searcher and lease count."""

    bundle: Any
    searcher: Searcher
    refs: int = 0
    retired: bool = False

    @property
    def bundle_id(self) -> str:
        return self.bundle.bundle_id


@dataclass(frozen=True)
class BundleSummary:
    bundle_id: str
    path: str
    state: str  # active | previous | available | invalid
    created: str | None = None
    languages: list[str] | None = None
    embed_dim: int | None = None
    n_clips: int | None = None
    indices: dict[str, dict[str, Any]] | None = None
    moment_scorer: str | None = None  # head | windows
    moments_heldout: dict[str, dict[str, float]] | None = None  # {"windows": report, "head": report}
    error: str | None = None


@dataclass(frozen=True)
class ActivationResult:
    bundle_id: str
    previous_id: str | None
    changed: bool
    verdict: GateVerdict | None


def default_opener(settings: Settings) -> Opener:
    """``LoadedBundle.open`` with checksum verification and the configured ONNX threads and providers;
    its encoder calls hold one of the process's encoder slots (:func:`encoder_slots`)."""

    def open_bundle(path: Path) -> BundleLike:
        import faiss

        from index.cpus import available_cores
        from index.runtime.loader import LoadedBundle

        faiss.omp_set_num_threads(settings.faiss_threads)  # process-wide; set before the first search
        providers = [name.strip() for name in settings.onnx_providers.split(",") if name.strip()]
        cores = available_cores()
        threads = onnx_threads_for(settings, encoder_bytes(Path(path)), cores)
        bundle = LoadedBundle.open(
            path, device="cpu", verify=True, providers=providers, milvus=milvus_target(settings),
            session=session_config(settings, threads=threads),
        )
        calls = encoder_calls_for(settings, threads, cores)
        log.info("bundle %s: %d ONNX Runtime thread(s) per encoder call, %s encoder call(s) at once",
                 Path(path).name, threads, calls or "any number of")
        return GatedBundle(bundle, encoder_slots(calls)) if calls else bundle

    return open_bundle


LARGE_ENCODER_BYTES = 16 * 2**20
"""An encoder file at least this big (the demo's are ~3 MB, the smallest real-size one, int8 HTS-AT,
37 MB) runs long enough per call for intra-op threads to pay (``TONEARM_ONNX_THREADS=0``)."""


def encoder_bytes(bundle: Path) -> int:
    """Size of the bundle's largest encoder (``NAME.onnx`` plus its external ``NAME.onnx.data``)."""
    sizes = [sum(f.stat().st_size for f in (bundle / name, bundle / f"{name}.data") if f.exists())
             for name in ("text_encoder.onnx", "audio_encoder.onnx")]
    return max(sizes)


def onnx_threads_for(settings: Settings, largest_encoder_bytes: int, cores: int) -> int:
    """Intra-op threads per encoder call: ``TONEARM_ONNX_THREADS``, or with 0 (auto) every core for a
    bundle with a large encoder (one call spans the cores) and 1 for small ones (the batch workers
    give the parallelism; per-call thread hand-offs would cost more than they save)."""
    if settings.onnx_threads:
        return settings.onnx_threads
    return max(1, cores) if largest_encoder_bytes >= LARGE_ENCODER_BYTES else 1


def encoder_calls_for(settings: Settings, threads: int, cores: int) -> int | None:
    """Encoder calls allowed at once in the process (text and audio together): ``TONEARM_ENCODER_CALLS``;
    with 0, and threads chosen automatically (``TONEARM_ONNX_THREADS=0``) at several per call,
    ``cores // threads`` so calls × threads never exceeds the cores; otherwise None (no limit: the
    batch workers bound the calls, as before the auto mode existed)."""
    if settings.encoder_calls:
        return settings.encoder_calls
    return max(1, cores // threads) if settings.onnx_threads == 0 and threads > 1 else None


_SLOTS: dict[int, threading.BoundedSemaphore] = {}
_SLOTS_LOCK = threading.Lock()


def encoder_slots(calls: int) -> threading.BoundedSemaphore:
    """The process-wide semaphore of ``calls`` encoder slots (shared by every bundle loaded, so two
    bundles during a hot swap do not double the threads)."""
    with _SLOTS_LOCK:
        return _SLOTS.setdefault(calls, threading.BoundedSemaphore(calls))


class GatedBundle:
    """A loaded bundle whose encoder calls wait for an encoder slot; everything else passes through.

    With several batch workers and multi-threaded ONNX Runtime sessions, two calls at once would put
    2 × threads on the cores; the slot keeps the encoders to the cores while a worker's tokenizing,
    FAISS search and answering overlap the other worker's encoder call."""

    def __init__(self, bundle: Any, slots: threading.BoundedSemaphore) -> None:
        self._bundle = bundle
        self._slots = slots

    def encode_text(self, texts: Any) -> np.ndarray:
        with self._slots:
            return self._bundle.encode_text(texts)  # type: ignore[no-any-return]

    def encode_audio(self, waveforms: Any) -> np.ndarray:
        with self._slots:
            return self._bundle.encode_audio(waveforms)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bundle, name)


def session_config(settings: Settings, *, threads: int | None = None) -> Any:
    """The encoders' ONNX Runtime options from the settings (:class:`index.runtime.loader.SessionConfig`);
    ``threads`` overrides ``onnx_threads`` (the resolved value when that is 0, auto)."""
    from index.runtime.loader import SessionConfig

    return SessionConfig(
        threads=threads if threads is not None else settings.onnx_threads or None,
        optimization=settings.onnx_graph_optimization, spinning=settings.onnx_spinning,
        memory_arena=settings.onnx_memory_arena,
    )


def milvus_target(settings: Settings, *, items: bool = False) -> Any:
    """The Milvus the bundles' vectors live in, or None for the FAISS backend (``items``: the Milvus
    the added items live in, whichever backend serves the bundles)."""
    if not settings.milvus_uri or (settings.index_backend != "milvus" and not items):
        return None
    from index.engines.milvus_index import MilvusTarget

    token = settings.milvus_token.get_secret_value() if settings.milvus_token else None
    return MilvusTarget(
        uri=settings.milvus_uri, token=token, timeout_s=settings.milvus_timeout_s,
        bulk_timeout_s=settings.milvus_bulk_timeout_s, release_closed=settings.milvus_release_closed,
        probe_timeout_s=settings.milvus_probe_timeout_s, probe_attempts=settings.milvus_probe_attempts,
        hold_off_s=settings.milvus_hold_off_s, recall_batch=settings.milvus_recall_batch,
    )


def _moments_heldout(manifest: Any) -> dict[str, dict[str, float]] | None:
    """Both scorers' held-out moment reports, side by side (None when the bundle has neither)."""
    found = {"windows": manifest.moments.heldout if manifest.moments is not None else None,
             "head": manifest.moment_head.heldout if manifest.moment_head is not None else None}
    kept = {scorer: dict(report) for scorer, report in found.items() if report}
    return kept or None


def thresholds_from(settings: Settings) -> GateThresholds:
    return GateThresholds(
        metric=settings.gate_metric,
        max_recall_drop=settings.gate_max_recall_drop,
        max_mrv_ratio=settings.gate_max_mrv_ratio,
        mrv_slack=settings.gate_mrv_slack,
        min_clips=settings.gate_min_clips,
        confidence=settings.gate_confidence,
        bootstrap_samples=settings.gate_bootstrap_samples,
        seed=settings.gate_seed,
        gate_set=settings.gate_set,
        moment_metric=settings.gate_moment_metric,
        max_moment_drop=settings.gate_max_moment_drop,
    )


class BundleRegistry:
    """Owns every loaded bundle of the process; thread-safe."""

    def __init__(
        self,
        *,
        settings: Settings,
        bundles_dir: Path | None,
        cache: QueryCache,
        metrics: ServiceMetrics,
        opener: Opener | None = None,
    ) -> None:
        self.settings = settings
        self.bundles_dir = bundles_dir
        self.cache = cache
        self.metrics = metrics
        self.opener = opener or default_opener(settings)
        self.publisher: Publisher | None = None
        self.prepare: Callable[[Searcher], object] | None = None
        """Run on a bundle's searcher before it goes live (service.items: sync the added items)."""
        self.live_lock = threading.Lock()
        """Held by :meth:`_swap` from its final catch-up with the item log to the switch: a writer that
        reads the active bundle under it either precedes the catch-up or sees the new bundle."""
        self.ready = threading.Event()
        self._active: _Entry | None = None
        self._previous: _Entry | None = None
        self._known_paths: dict[str, Path] = {}
        self._ref_lock = threading.Lock()
        self._activation_lock = threading.Lock()
        self._closing = threading.Event()

    # ------------------------------------------------------------------ state

    @property
    def active_id(self) -> str | None:
        entry = self._active
        return entry.bundle_id if entry else None

    def active_languages(self) -> list[str] | None:
        """Languages of the active bundle (None before one is loaded)."""
        entry = self._active
        return entry.searcher.languages if entry else None

    def active_filter_fields(self) -> dict[str, str] | None:
        """Metadata fields (name → kind) of the active bundle's clips (None before one is loaded)."""
        entry = self._active
        return entry.searcher.catalogue_fields() if entry else None

    def active_searcher(self) -> Searcher | None:
        entry = self._active
        return entry.searcher if entry else None

    def _prepare(self, entry: _Entry) -> None:
        """Bring the added items into ``entry`` (re-embedded with its encoders) before it goes live."""
        if self.prepare is not None:
            self.prepare(entry.searcher)

    @property
    def previous_id(self) -> str | None:
        entry = self._previous
        return entry.bundle_id if entry else None

    def acquire(self) -> _Entry:
        """Lease the active bundle (``not-ready`` when none); pair with :meth:`release`."""
        with self._ref_lock:
            entry = self._active
            if entry is None:
                raise ServiceError("not-ready", "no bundle is loaded yet; retry shortly")
            entry.refs += 1
            return entry

    def release(self, entry: _Entry) -> None:
        with self._ref_lock:
            entry.refs -= 1
            close_now = entry.retired and entry.refs == 0
        if close_now:
            _close(entry)

    # ------------------------------------------------------------------ discovery

    def find(self, bundle_id: str) -> Path:
        """Directory of ``bundle_id`` (``bundle-not-found`` otherwise; ids never escape the directory)."""
        known = self._known_paths.get(bundle_id)
        if known is not None:
            return known
        if not BUNDLE_ID_PATTERN.match(bundle_id) or self.bundles_dir is None:
            raise ServiceError("bundle-not-found", f"no bundle {bundle_id!r} in {self.bundles_dir}")
        path = self.bundles_dir / bundle_id
        if not (path / "manifest.json").is_file():
            raise ServiceError("bundle-not-found", f"no bundle {bundle_id!r} in {self.bundles_dir}")
        return path

    def list_bundles(self) -> list[BundleSummary]:
        """Every bundle directory under ``bundles_dir`` plus the loaded ones, with their state."""
        paths = dict(self._known_paths)
        if self.bundles_dir is not None and self.bundles_dir.is_dir():
            for child in sorted(self.bundles_dir.iterdir()):
                if child.is_dir() and not child.name.startswith(".") and (child / "manifest.json").is_file():
                    paths.setdefault(child.name, child)
        return [self._summary(name, path) for name, path in sorted(paths.items())]

    def _summary(self, name: str, path: Path) -> BundleSummary:
        state = {self.active_id: "active", self.previous_id: "previous"}.get(name, "available")
        try:
            m = read_manifest(path)
        except BundleError as err:
            return BundleSummary(bundle_id=name, path=str(path), state="invalid", error=str(err))
        return BundleSummary(
            bundle_id=m.bundle_id,
            path=str(path),
            state=state,
            created=m.created,
            languages=list(m.languages),
            embed_dim=m.embed_dim,
            n_clips=m.audio_index.ntotal,
            indices={
                name: _index_summary(info)
                for name, info in (("audio", m.audio_index), ("text", m.text_index))
                if info is not None
            },
            moment_scorer="head" if m.moment_head is not None else "windows",
            moments_heldout=_moments_heldout(m),
        )

    # ------------------------------------------------------------------ loading

    def load(self, path: Path) -> _Entry:
        """Open (verifying checksums), check dimensions and warm up; ``bundle-invalid`` on failure."""
        try:
            bundle = self.opener(Path(path))
        except BundleNotPublished as err:
            raise ServiceError("bundle-not-published", str(err)) from None
        except BundleError as err:
            raise ServiceError("bundle-invalid", str(err)) from None
        except IndexBackendError as err:  # Milvus unreachable: nothing wrong with the bundle
            raise index_unavailable(err) from None
        except Exception as err:  # a bundle that cannot load must never take the service down
            log.exception("loading bundle %s failed", path)
            raise ServiceError("bundle-invalid", f"{path}: cannot be loaded: {err}") from None
        try:
            _check_and_warm(bundle)
        except IndexBackendError as err:
            bundle.close()
            raise index_unavailable(err) from None
        except Exception as err:
            bundle.close()
            raise ServiceError("bundle-invalid", f"{path}: failed its warm-up check: {err}") from None
        self._known_paths[bundle.bundle_id] = Path(path)
        searcher = Searcher(
            bundle, cache=self.cache, key_prefix=self.settings.key_prefix,
            max_query_chars=QUERY_MAX_CHARS,
        )
        try:  # served from Milvus: the moment windows too, when publish wrote them (no copy held here)
            searcher.bundle_window_source = published_windows(bundle)
        except IndexBackendError as err:
            bundle.close()
            raise index_unavailable(err) from None
        return _Entry(bundle=bundle, searcher=searcher)

    # ------------------------------------------------------------------ activation

    def start(self, path: Path) -> None:
        """Load and activate the first bundle without a gate (startup).

        While the index backend cannot be reached (Milvus down, ``index-unavailable``) or does not
        hold the bundle yet (``bundle-not-published``: a publish job still running beside the
        deployment, or a Milvus just restarted that answers before it has recovered its registry —
        seen in CI) it tries again, 1 s then doubling up to 30 s, until the registry is closed:
        the service becomes ready when Milvus and the bundle are there, without a restart. Every
        retry logs why, so an unpublished bundle reads as such in the log."""
        delay = 1.0
        while True:
            try:
                with self._activation_lock:
                    entry = self.load(path)
                    self._prepare(entry)
                    self._swap(entry)
                break
            except ServiceError as err:
                if err.slug not in STARTUP_RETRIED:
                    raise
                log.warning("initial bundle not loaded yet (%s); retrying in %.0f s", err.detail, delay)
                if self._closing.wait(delay):
                    raise
                delay = min(2 * delay, STARTUP_RETRY_MAX_S)
        self.metrics.activations.labels(outcome="startup").inc()
        log.info("serving bundle %s", self.active_id)

    def activate(self, bundle_id: str, *, force: bool = False) -> ActivationResult:
        """Admin activation: load beside, verify, warm up, gate, swap, publish to replicas."""
        if not self._activation_lock.acquire(blocking=False):
            raise ServiceError("activation-in-progress", "another activation is running; retry later")
        try:
            result = self._activate_locked(bundle_id, force=force)
        finally:
            self._activation_lock.release()
        if result.changed:
            self._publish(result.bundle_id)
        return result

    def _activate_locked(self, bundle_id: str, *, force: bool) -> ActivationResult:
        active = self._active
        if active is not None and active.bundle_id == bundle_id:
            return ActivationResult(bundle_id, self.previous_id, changed=False, verdict=None)
        previous = self._previous
        reuse = previous is not None and previous.bundle_id == bundle_id
        candidate = previous if reuse and previous is not None else self._load_counted(self.find(bundle_id), bundle_id)
        try:
            verdict = run_gate(
                candidate.bundle, active.bundle if active else None, thresholds_from(self.settings), force=force
            )
        except Exception as err:
            if not reuse:
                _close(candidate)
            self.metrics.activations.labels(outcome="invalid").inc()
            raise ServiceError("bundle-invalid", f"quality gate could not evaluate {bundle_id}: {err}") from None
        if not verdict.passed:
            if not reuse:
                _close(candidate)
            self.metrics.activations.labels(outcome="rejected").inc()
            raise ServiceError(
                "quality-gate-rejected",
                f"bundle {bundle_id} rejected: " + "; ".join(verdict.reasons),
                verdict=verdict.as_dict(),
            )
        try:
            self._prepare(candidate)  # after the gate: it judges the bundle without the added items
            self._swap(candidate)
        except Exception:
            if not reuse:
                _close(candidate)
            raise
        self.metrics.activations.labels(outcome="forced" if force else "activated").inc()
        log.info("activated bundle %s (gate: %s)", bundle_id, "; ".join(verdict.reasons) or "passed")
        return ActivationResult(bundle_id, self.previous_id, changed=True, verdict=verdict)

    def _load_counted(self, path: Path, bundle_id: str) -> _Entry:
        try:
            return self.load_id(path, bundle_id)
        except ServiceError:
            self.metrics.activations.labels(outcome="invalid").inc()
            raise

    def load_id(self, path: Path, bundle_id: str) -> _Entry:
        """:meth:`load`, refusing a directory whose manifest names another bundle id."""
        entry = self.load(path)
        if entry.bundle_id != bundle_id:
            _close(entry)
            raise ServiceError(
                "bundle-invalid", f"{path}: manifest bundle_id {entry.bundle_id!r} does not match {bundle_id!r}"
            )
        return entry

    def rollback(self) -> ActivationResult:
        """Return to the previous bundle (already loaded: instant, no gate) and publish it."""
        if not self._activation_lock.acquire(blocking=False):
            raise ServiceError("activation-in-progress", "another activation is running; retry later")
        try:
            if self._previous is None:
                raise ServiceError("no-previous-bundle", "nothing to roll back to: no previous bundle")
            self._prepare(self._previous)  # items added or deleted since it was active
            self._swap(self._previous)
        finally:
            self._activation_lock.release()
        self.metrics.activations.labels(outcome="rollback").inc()
        target = self.active_id
        assert target is not None
        self._publish(target)
        log.info("rolled back to bundle %s", target)
        return ActivationResult(target, self.previous_id, changed=True, verdict=None)

    def apply_remote(self, bundle_id: str) -> None:
        """Follow another replica's activation (its gate already ran): swap to ``bundle_id``."""
        with self._activation_lock:
            if self.active_id == bundle_id:
                return
            previous = self._previous
            if previous is not None and previous.bundle_id == bundle_id:
                self._prepare(previous)
                self._swap(previous, mark=False)
            else:
                entry = self.load_id(self.find(bundle_id), bundle_id)
                try:
                    self._prepare(entry)
                    self._swap(entry, mark=False)
                except Exception:
                    _close(entry)
                    raise
        self.metrics.activations.labels(outcome="remote").inc()
        log.info("followed activation of bundle %s from another replica", bundle_id)

    def _swap(self, new: _Entry, *, mark: bool = True) -> None:
        """Make ``new`` active; the old active becomes previous; the bundle pushed out is retired.

        Where the vectors live in Milvus, its active aliases are switched first (both or neither):
        a failure there leaves this replica on its current bundle. A follower (``mark=False``)
        swaps only: the replica that activated already switched them."""
        with self.live_lock:
            # records appended while ``new`` re-embedded the items: caught up now, before it goes live
            self._prepare(new)
            mark_active = getattr(new.bundle, "mark_active", None) if mark else None  # a follower: already marked
            if callable(mark_active):
                try:
                    mark_active()
                except Exception as err:
                    raise index_unavailable(f"cannot activate {new.bundle_id}: {err}") from None
            with self._ref_lock:
                old_active, old_previous = self._active, self._previous
                self._active = new
                self._previous = old_active if old_active is not new else old_previous
                pushed_out = old_previous if old_previous not in (new, self._previous) else None
                close_now = False
                if pushed_out is not None:
                    pushed_out.retired = True
                    close_now = pushed_out.refs == 0
        if pushed_out is not None and close_now:
            _close(pushed_out)
        self.metrics.set_active_bundle(
            bundle_id=new.bundle_id, embed_dim=int(new.bundle.embed_dim), languages=list(new.bundle.languages)
        )
        if self.settings.gc_freeze:  # before ready: the first requests must not pay the collection
            frozen = freeze_long_lived()
            log.debug("%d objects frozen out of the cyclic GC after the swap to %s", frozen, new.bundle_id)
        self.ready.set()
        trim()  # the gate's evaluation batches and a closed bundle were just freed

    def _publish(self, bundle_id: str) -> None:
        if self.publisher is not None:
            self.publisher(bundle_id)

    def close(self) -> None:
        self._closing.set()
        with self._ref_lock:
            entries = [e for e in (self._active, self._previous) if e is not None]
            self._active = self._previous = None
        for entry in entries:
            _close(entry)


def _index_summary(info: Any) -> dict[str, Any]:
    return {"factory": info.factory, "ntotal": info.ntotal, "search_params": dict(info.search_params),
            "ann_recall_at_10": info.ann_recall_at_10}


def _check_and_warm(bundle: Any) -> None:
    """Encoders answer with ``embed_dim`` columns; run each once so the first request is warm."""
    bundle.warmup()
    text = np.asarray(bundle.encode_text(["warm up"]))
    audio = np.asarray(bundle.encode_audio([np.zeros(bundle.sample_rate, dtype=np.float32)]))
    for name, emb in (("text", text), ("audio", audio)):
        if emb.shape != (1, bundle.embed_dim) or not np.isfinite(emb).all():
            raise BundleError(f"{name} encoder returned shape {emb.shape}, expected (1, {bundle.embed_dim})")
    scores, rows = bundle.search_audio(text, 1)
    if len(bundle.audio_items) and rows.shape != (1, 1):
        raise BundleError(f"audio index answered shape {rows.shape} for k=1")


def _close(entry: _Entry) -> None:
    try:
        entry.bundle.close()
        release = getattr(entry.searcher.bundle_window_source, "release", None)  # its windows' Milvus memory
        if callable(release):
            release()
    except Exception:  # closing must not break a swap
        log.exception("closing bundle %s failed", entry.bundle_id)
