"""FAISS indices of a bundle (docs/bundle.md): the factory string is the index configuration.

* :func:`choose_factory` picks by collection size: exact ``Flat`` up to
  :data:`EXACT_MAX` vectors, ``IVF{nlist},SQfp16`` (inverted lists over
  half-precision vectors) up to :data:`IVF_SQ_MAX`, ``IVF{nlist},PQ{m}`` beyond.
  IVF-SQfp16 builds 1 M × 256 vectors in seconds on two cores and keeps recall@10
  near IVF-Flat's at half its memory; SQ8 was measured to cap recall@10 at about
  0.96 on clustered data (docs/BENCHMARKS.md, index_scale), too close to the 0.95 floor.
* ``nprobe`` (IVF) / ``efSearch`` (HNSW) is tuned at build time: doubled from a
  small start until the measured recall@10 against exact search reaches
  :data:`RECALL_TARGET` (or all lists are probed / :data:`HNSW_EF_SEARCH_MAX`), so
  the speed/recall trade-off is measured, not guessed. For the caption index the
  recall is the worst over the unfiltered and each language-filtered search.
* Builds run with every core the process may use (:func:`faiss_threads`):
  importing torch sets the OpenMP runtime FAISS shares to torch's thread count
  (often 1), which is why HNSW once built at 756 vectors/s in the export bench.
* Only factory forms checked for inner product are accepted
  (:func:`parse_factory`); everything else is rejected with the accepted forms.
* Search parameters (``nprobe`` / ``efSearch``) are fixed when the index is built
  or loaded and passed read-only into each search: nothing shared is mutated per
  request, so concurrent searches are safe.
* :func:`ann_recall_at_k` measures an approximate index against exact search with
  a tie-tolerant comparison: a returned neighbour counts when its true score is
  at least the exact k-th best score (minus a small tolerance), so equal scores
  in a different order are not counted as misses.
* Large index files are memory-mapped at load (:func:`load_index`).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import faiss
import numpy as np

from index.cpus import available_cores
from index.errors import BundleError, TonearmError

log = logging.getLogger(__name__)
_faiss: Any = faiss  # the SWIG stubs miss SearchParameters kwargs and several index fields

Kind = Literal["flat", "hnsw", "ivf_flat", "ivf_sq", "ivf_pq"]

EXACT_MAX = 50_000
"""Collections up to this size get an exact ``Flat`` index (≤ ~2.5 ms a query on one core at
d=256); beyond it exact search dominates a request (10 ms at 100 k, 100 ms at 1 M)."""
IVF_SQ_MAX = 20_000_000
"""Collections up to this size get ``IVF{nlist},SQfp16`` (512 bytes a vector at d=256);
larger ones ``IVF{nlist},PQ{m}`` (compressed 8×, lower recall)."""
RECALL_TARGET = 0.97
"""``nprobe`` is raised until the measured recall@10 reaches this (a margin above 0.95)."""
DEFAULT_MMAP_THRESHOLD = 256 << 20
"""Index files larger than this (bytes) are memory-mapped when loaded."""
HNSW_EF_CONSTRUCTION = 80
HNSW_EF_SEARCH = 128
HNSW_EF_SEARCH_MAX = 4096
"""efSearch is doubled from HNSW_EF_SEARCH up to this while recall is short of the target
(language-filtered HNSW search needs far more: the graph walk visits every language)."""
RECALL_QUERIES = 1000
MAX_TRAIN_VECTORS = 100_000
"""IVF / PQ training uses at most this many vectors (a seeded sample); adding uses all."""
TIE_TOLERANCE = 1e-5

_FORMS: dict[Kind, re.Pattern[str]] = {
    "flat": re.compile(r"^Flat$"),
    "hnsw": re.compile(r"^HNSW(?P<m>\d+),Flat$"),
    "ivf_flat": re.compile(r"^IVF(?P<nlist>\d+),Flat$"),
    "ivf_sq": re.compile(r"^IVF(?P<nlist>\d+),SQ(?:8|fp16)$"),
    "ivf_pq": re.compile(r"^IVF(?P<nlist>\d+),PQ(?P<m>\d+)$"),
}
ACCEPTED_FORMS = "Flat, HNSW<M>,Flat, IVF<nlist>,Flat, IVF<nlist>,SQ8, IVF<nlist>,SQfp16, IVF<nlist>,PQ<m>"


class IndexConfigError(TonearmError):
    """A FAISS factory string that is not accepted for this collection."""


@dataclass(frozen=True)
class FactorySpec:
    """A parsed, accepted factory string."""

    factory: str
    kind: Kind
    nlist: int = 0
    m: int = 0

    @property
    def min_vectors(self) -> int:
        """Fewest vectors the index can be trained on."""
        if self.kind == "ivf_pq":
            return max(self.nlist, 256)
        return self.nlist if self.kind in ("ivf_flat", "ivf_sq") else 0

    @property
    def is_ivf(self) -> bool:
        return self.kind in ("ivf_flat", "ivf_sq", "ivf_pq")


def parse_factory(factory: str, dim: int) -> FactorySpec:
    """Accept only the forms whose inner-product behaviour is checked; validate their numbers."""
    for kind, pattern in _FORMS.items():
        match = pattern.match(factory.strip())
        if match is None:
            continue
        groups = {k: int(v) for k, v in match.groupdict().items()}
        spec = FactorySpec(factory=factory.strip(), kind=kind, **groups)
        _check_numbers(spec, dim)
        return spec
    raise IndexConfigError(
        f"index factory {factory!r} is not accepted for inner-product search; use one of: {ACCEPTED_FORMS}"
    )


def _check_numbers(spec: FactorySpec, dim: int) -> None:
    if spec.is_ivf and spec.nlist < 1:
        raise IndexConfigError(f"index factory {spec.factory!r}: nlist must be >= 1")
    if spec.kind in ("hnsw", "ivf_pq") and spec.m < 1:
        raise IndexConfigError(f"index factory {spec.factory!r}: M/m must be >= 1")
    if spec.kind == "ivf_pq" and dim % spec.m != 0:
        raise IndexConfigError(f"index factory {spec.factory!r}: PQ{spec.m} must divide embed_dim {dim}")


def choose_factory(n: int, dim: int) -> str:
    """Default factory for ``n`` vectors of dimension ``dim`` (see module docstring)."""
    if n <= EXACT_MAX:
        return "Flat"
    if n <= IVF_SQ_MAX:
        # ~sqrt(n) lists: assigning n vectors costs n * nlist dot products (seconds at 1 M).
        nlist = 2 ** round(math.log2(math.sqrt(n)))
        return f"IVF{min(max(nlist, 256), 16384)},SQfp16"
    nlist = 2 ** round(math.log2(4 * math.sqrt(n)))
    m = max(c for c in range(1, dim // 4 + 1) if dim % c == 0)
    return f"IVF{min(max(nlist, 1024), 65536)},PQ{m}"


def default_search_params(spec: FactorySpec) -> dict[str, int]:
    """Search parameters an index starts with (IVF ``nprobe`` is then tuned by :func:`build_index`)."""
    if spec.kind == "hnsw":
        return {"efSearch": HNSW_EF_SEARCH}
    if spec.is_ivf:
        return {"nprobe": min(spec.nlist, max(8, spec.nlist // 64))}
    return {}


@contextmanager
def faiss_threads(threads: int | None = None) -> Iterator[None]:
    """Run FAISS's OpenMP loops on ``threads`` (default: every available core), then restore.

    torch, once imported, sets the OpenMP runtime FAISS shares to torch's own thread
    count; an export run in a torch process would otherwise build on one thread."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(threads or available_cores())
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)


# ----------------------------------------------------------------------------- build


@dataclass(frozen=True)
class BuiltIndex:
    """An index with the configuration the manifest records."""

    index: faiss.Index
    spec: FactorySpec
    search_params: dict[str, int] = field(default_factory=dict)
    ann_recall_at_10: float = 1.0


def _as_matrix(vectors: np.ndarray, dim: int | None = None) -> np.ndarray:
    matrix = np.ascontiguousarray(vectors, dtype=np.float32)
    if matrix.ndim != 2 or (dim is not None and matrix.shape[1] != dim):
        raise ValueError(f"expected a (n, {dim or 'd'}) matrix, got shape {matrix.shape}")
    return matrix


def faiss_gpu_count() -> int:
    """GPUs FAISS can use here (0 with the CPU-only wheel, which lacks the GPU API)."""
    get_num_gpus = getattr(faiss, "get_num_gpus", None)
    return int(get_num_gpus()) if get_num_gpus is not None else 0


def _train_on_gpus(index: faiss.Index) -> None:
    """Run an IVF index's K-Means on the GPUs (faiss-gpu); the trained index stays a CPU index."""
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None and faiss_gpu_count() > 0:
        ivf.clustering_index = faiss.index_cpu_to_all_gpus(faiss.IndexFlatL2(ivf.d))


def build_index(
    vectors: np.ndarray,
    factory: str | None = None,
    *,
    queries: np.ndarray | None = None,
    seed: int = 0,
    max_train_vectors: int = MAX_TRAIN_VECTORS,
    recall_target: float = RECALL_TARGET,
    threads: int | None = None,
    language_ranges: dict[str, tuple[int, int]] | None = None,
) -> BuiltIndex:
    """Build an inner-product index over L2-normalized ``vectors`` and measure its recall@10.

    ``queries`` (e.g. the other modality's embeddings) drive the recall check;
    by default a sample of the vectors themselves. Trained indices (IVF, PQ)
    learn from at most ``max_train_vectors`` of them; IVF ``nprobe`` is doubled
    until recall@10 reaches ``recall_target``. With ``language_ranges`` (the caption
    index's rows per language) the recall is the worst of the unfiltered search and
    each language-filtered one, since the service searches captions one language at
    a time. FAISS uses ``threads`` OpenMP threads (default: every available core).
    """
    with faiss_threads(threads):
        return _build_index(
            vectors, factory, queries=queries, seed=seed, max_train_vectors=max_train_vectors,
            recall_target=recall_target, language_ranges=language_ranges or {},
        )


def _build_index(
    vectors: np.ndarray,
    factory: str | None,
    *,
    queries: np.ndarray | None,
    seed: int,
    max_train_vectors: int,
    recall_target: float,
    language_ranges: dict[str, tuple[int, int]],
) -> BuiltIndex:
    matrix = _as_matrix(vectors)
    n, dim = matrix.shape
    spec = parse_factory(factory or choose_factory(n, dim), dim)
    if n < spec.min_vectors:
        raise IndexConfigError(
            f"index factory {spec.factory!r} needs at least {spec.min_vectors} vectors to train, got {n}"
        )
    index = faiss.index_factory(dim, spec.factory, faiss.METRIC_INNER_PRODUCT)
    concrete: Any = faiss.downcast_index(index)
    if spec.kind == "hnsw":
        concrete.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
    if spec.kind == "ivf_pq":
        # Polysemous codes only serve Hamming pre-filtering, which we never enable;
        # their training costs minutes and changes no search result.
        concrete.do_polysemous_training = False
    if not index.is_trained:
        _train_on_gpus(index)
        index.train(_sample_rows(matrix, max(max_train_vectors, spec.min_vectors), seed))
    index.add(matrix)
    params = default_search_params(spec)
    apply_search_params(index, params)
    sample = _sample_rows(matrix if queries is None else _as_matrix(queries, dim), RECALL_QUERIES, seed)
    if spec.kind == "flat":
        recall = 1.0
    else:
        probe = _RecallProbe(index, matrix, sample, language_ranges)
        recall = probe.recall(params)
        key, limit = ("nprobe", spec.nlist) if spec.is_ivf else ("efSearch", HNSW_EF_SEARCH_MAX)
        while key in params and recall < recall_target and params[key] < limit:
            params = {key: min(limit, 2 * params[key])}
            apply_search_params(index, params)
            recall = probe.recall(params)
    log.info("built %s over %d x %d vectors: ANN recall@10 = %.4f", spec.factory, n, dim, recall)
    return BuiltIndex(index=index, spec=spec, search_params=params, ann_recall_at_10=recall)


class _RecallProbe:
    """Worst recall@10 over the unfiltered search and each language's filtered one (exact part computed once)."""

    def __init__(
        self, index: faiss.Index, matrix: np.ndarray, queries: np.ndarray, ranges: dict[str, tuple[int, int]]
    ) -> None:
        self.index, self.matrix, self.queries = index, matrix, queries
        self.cases: list[tuple[faiss.IDSelector | None, np.ndarray]] = [(None, exact_top_k(matrix, queries, 10))]
        for lo, hi in ranges.values():
            if hi - lo >= 10 and hi - lo < len(matrix):
                self.cases.append((faiss.IDSelectorRange(lo, hi), exact_top_k(matrix[lo:hi], queries, 10)))

    def recall(self, params: dict[str, int]) -> float:
        return min(
            ann_recall_at_k(self.index, self.matrix, self.queries, k=10, params=params, exact_scores=exact,
                            selector=selector)
            for selector, exact in self.cases
        )


def _sample_rows(matrix: np.ndarray, count: int, seed: int) -> np.ndarray:
    """At most ``count`` rows, drawn without replacement in their original order (seeded)."""
    if len(matrix) <= count:
        return matrix
    rows = np.random.default_rng(seed).choice(len(matrix), count, replace=False)
    return matrix[np.sort(rows)]


def ann_recall_at_k(
    index: faiss.Index,
    vectors: np.ndarray,
    queries: np.ndarray,
    *,
    k: int = 10,
    params: dict[str, int] | None = None,
    tolerance: float = TIE_TOLERANCE,
    exact_scores: np.ndarray | None = None,
    selector: faiss.IDSelector | None = None,
) -> float:
    """Tie-tolerant recall@k of ``index`` against exact inner-product search over ``vectors``.

    A returned row is a hit when its exact score is >= the exact k-th best
    score minus ``tolerance``; duplicates and ``-1`` rows never count.
    ``exact_scores`` (from :func:`exact_top_k`) saves the exact search when
    several settings are measured on the same queries; with ``selector`` they must
    be the exact scores over the selected rows only.
    """
    matrix = _as_matrix(vectors)
    queries = _as_matrix(queries, matrix.shape[1])
    k_eff = min(k, len(matrix))
    if k_eff == 0 or len(queries) == 0:
        return 1.0
    if exact_scores is None:
        exact_scores = exact_top_k(matrix, queries, k_eff)
    _, rows = search(index, queries, k_eff, params=params or {}, selector=selector)
    hits = 0
    for q, found in enumerate(rows):
        valid = np.unique(found[found >= 0])
        true_scores = matrix[valid] @ queries[q]
        hits += min(int(np.sum(true_scores >= exact_scores[q, -1] - tolerance)), k_eff)
    return hits / (k_eff * len(queries))


def exact_top_k(vectors: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """(n, k) exact inner-product scores of the best ``k`` vectors per query."""
    exact = faiss.IndexFlatIP(vectors.shape[1])
    exact.add(vectors)
    scores, _ = exact.search(queries, min(k, len(vectors)))
    return scores


# ----------------------------------------------------------------------------- search


def apply_search_params(index: faiss.Index, params: dict[str, int]) -> None:
    """Set ``nprobe`` / ``efSearch`` once, at build or load time (never per request)."""
    if params:
        text = ",".join(f"{key}={value}" for key, value in sorted(params.items()))
        _faiss.ParameterSpace().set_index_parameters(index, text)


def _search_parameters(
    index: faiss.Index, params: dict[str, int], selector: faiss.IDSelector | None
) -> faiss.SearchParameters | None:
    """A fresh per-call parameter object (carrying the fixed nprobe/efSearch) for a filtered search."""
    if selector is None:
        return None
    concrete: Any = faiss.downcast_index(index)
    if isinstance(concrete, faiss.IndexIVF):
        return _faiss.SearchParametersIVF(sel=selector, nprobe=params.get("nprobe", concrete.nprobe))
    if isinstance(concrete, faiss.IndexHNSW):
        return _faiss.SearchParametersHNSW(sel=selector, efSearch=params.get("efSearch", concrete.hnsw.efSearch))
    return _faiss.SearchParameters(sel=selector)


def search(
    index: faiss.Index,
    queries: np.ndarray,
    k: int,
    *,
    params: dict[str, int],
    selector: faiss.IDSelector | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` (scores (n, k) float32, rows (n, k) int64; -1 where fewer hits); read-only."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    queries = _as_matrix(queries, index.d)
    search_params = _search_parameters(index, params, selector)
    if search_params is None:
        scores, rows = index.search(queries, k)
    else:
        scores, rows = index.search(queries, k, params=search_params)
    scores = np.where(rows >= 0, scores, -np.inf).astype(np.float32)
    return scores, rows.astype(np.int64)


def all_vectors(index: faiss.Index) -> np.ndarray:
    """Every stored vector (N, d) in row order: exact for Flat/HNSW, the quantized value for SQ/PQ."""
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None and isinstance(_faiss.downcast_InvertedLists(ivf.invlists), faiss.OnDiskInvertedLists):
        return _vectors_by_list(ivf)  # on-disk lists (index.engines.faiss_ondisk) cannot be cloned
    if ivf is not None and not ivf.direct_map.type:
        # Reading vectors back from IVF lists needs a direct map; build it once on a
        # copy so the serving index stays untouched.
        index = faiss.clone_index(index)
        faiss.extract_index_ivf(index).make_direct_map()
    return np.asarray(index.reconstruct_n(0, index.ntotal), dtype=np.float32)


def _vectors_by_list(ivf: faiss.IndexIVF) -> np.ndarray:
    """Decode an IVF index list by list, placing each vector at its id (read-only; ~10 µs a vector)."""
    out = np.zeros((ivf.ntotal, ivf.d), dtype=np.float32)
    lists: Any = ivf.invlists
    concrete: Any = ivf
    for list_no in range(ivf.nlist):
        size = lists.list_size(list_no)
        if size:
            ids = faiss.rev_swig_ptr(lists.get_ids(list_no), size)
            for offset, row in enumerate(ids.tolist()):
                concrete.reconstruct_from_offset(list_no, offset, faiss.swig_ptr(out[row]))
    return out


# ----------------------------------------------------------------------------- io


def save_index(index: faiss.Index, path: Path) -> None:
    faiss.write_index(index, str(path))


def _mmap_flags(spec: FactorySpec) -> int:
    """IVF indices map their inverted lists; Flat/HNSW map their flat code storage."""
    if spec.is_ivf:
        return faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY
    return faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY


def load_index(
    path: Path,
    *,
    spec: FactorySpec,
    search_params: dict[str, int],
    mmap_threshold_bytes: int = DEFAULT_MMAP_THRESHOLD,
) -> faiss.Index:
    """Read an index (memory-mapped above the threshold) and fix its search parameters."""
    path = Path(path)
    mmap = path.stat().st_size > mmap_threshold_bytes
    flags = _mmap_flags(spec) if mmap else 0
    if path.with_suffix(".ivfdata").exists():  # on-disk inverted lists (index.engines.faiss_ondisk), found beside it
        flags = faiss.IO_FLAG_ONDISK_SAME_DIR
    try:
        index = faiss.read_index(str(path), flags)
    except RuntimeError as err:
        raise BundleError(f"{path}: cannot read FAISS index ({str(err).splitlines()[-1]})") from None
    if index.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise BundleError(f"{path}: index metric is not inner product")
    apply_search_params(index, search_params)
    log.debug("loaded %s (%s, mmap=%s)", path, spec.factory, mmap)
    return index
