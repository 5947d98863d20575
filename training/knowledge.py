"""ASK knowledge bases: building (FAISS K-Means, max-pooled prototypes) and top-K search.

A knowledge base holds paired audio/text embeddings computed without gradient by the
current encoders. It has two searchable *sides*: the audio side (keys = audio
embeddings, partners = their paired text) and the text side (keys = text, partners =
paired audio). Each side is a FAISS inner-product index (``IndexFlatIP``) over the
keys plus torch copies of keys and partners on the training device, so that search
returns row indices and the neighbours are gathered as tensors.

* **Fine KB** (ASK Eq. 6): the text side holds every (clip, caption) pair of the
  sources; the audio side holds one entry per clip (a clip has one audio but many
  captions, in up to eight languages — indexing it once per caption would fill its
  top-K with copies of one clip), paired with the re-normalised mean of its caption
  embeddings. With one caption per clip this is exactly the paper's set of pairs.
* **Coarse KB** (Eq. 7): FAISS K-Means with ``N_c`` clusters over the concatenated
  ``[u; v]`` of every source pair (``N_c`` is clamped to the number of pairs, and
  logged); per non-empty cluster the element-wise max of its members' audio and,
  separately, text embeddings, re-normalised, kept as a pair.

Entries carry a clip id: the training-set clip index (≥ 0), or a negative id for
clips of extra manifests. Search can exclude the query clip's own entries (ASK's
self-exclusion for the in-domain source); negative ids are never excluded.

Shapes: source pairs audio (N, d), text (N, d), clip ids (N,); search queries (B, d) →
row indices (B, K); :class:`Neighbours` fields (B, K, d).

References: ASK (Guo et al. 2025) §4.1 (Eq. 6–7), §4.2 (top-K retrieval), §3.3 and
Eq. 3–4 (representation drift, :func:`representation_drift`); Johnson, Douze & Jégou,
FAISS; SPEC §4.6.

**Partitioned** (``objective.knowledge.partition: auto`` under torchrun, docs/objectives.md "ASK
at scale"): each rank builds its sides from the pairs it embedded itself (a clip's pairs are all
on one rank), so it holds about 1/R of the rows. A search is answered by every rank on its own
rows (top-K after self-exclusion, which is a per-row predicate and so exact locally); the R
local (B, K) score lists are all-gathered, every rank takes the same top-K of the R·K
candidates, and the winners' vectors (key ‖ partner, (B, K, 2d)) are summed over ranks from
zero buffers filled by their owners: one all-gather of scores and one all-reduce per side and
step. The merged top-K is the whole-KB top-K (ties aside). The queries must be the same on
every rank (ASK sees the global batch; it refuses ``distributed.loss: local``). The coarse KB's
K-Means runs once, on rank 0, over the same input rows a single process would use (all pairs,
or a seeded sample of ``256·N_c`` of them, by global row), and its centroids are broadcast;
each rank assigns its own pairs, and the max-pooled prototypes are reduced with a max over
ranks. The coarse KB (N_c prototypes) is then whole on every rank.

Relations: built and searched by :mod:`training.objectives.ask`; holds no loss.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import faiss
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from index.engines.faiss_index import faiss_gpu_count
from training import distributed

log = logging.getLogger(__name__)


def _as_faiss(x: Tensor) -> np.ndarray:
    return np.ascontiguousarray(x.detach().to("cpu", torch.float32).numpy())


SEARCH_BLOCK_ROWS = 262_144
"""Keys scored per block in :meth:`KBSide.search` (64 queries × this many floats ≈ 64 MiB)."""


@dataclass
class KBSide:
    """One searchable side: keys (N, d) in a FAISS inner-product index, their partners and clip ids (N,).

    Partners are stored as a table (M, d) and a row per entry (N,), so the text side of
    the fine KB keeps each clip's audio once. On CPU ``keys`` is a view of the FAISS
    index's own storage (no second copy).
    """

    keys: Tensor
    partner_table: Tensor
    partner_row: Tensor
    clip: Tensor
    index: faiss.Index | None
    """The FAISS Flat index whose storage ``keys`` views on CPU; None on CUDA (the search is a
    torch matmul over the device keys, so a host copy would only cost memory)."""
    max_per_clip: int
    """Largest number of entries sharing one non-negative clip id (0 when there is none); over
    every rank when partitioned."""
    total: int = -1
    """Entries of the whole side (over every rank when partitioned; ``len(self)`` otherwise)."""
    partitioned: bool = False
    """This rank holds only its own rows; :meth:`neighbours` merges every rank's (module doc)."""

    def __post_init__(self) -> None:
        if self.total < 0:
            self.total = int(self.keys.shape[0])

    @classmethod
    def create(cls, keys: Tensor, partners: Tensor, clip: Tensor, *, partner_row: Tensor | None = None,
               partitioned: bool = False) -> KBSide:
        """Index ``keys``; entry i's partner is ``partners[partner_row[i]]`` (``partner_row`` defaults to i).

        ``partitioned``: these are this rank's rows of a side split over the ranks (a collective:
        every rank calls it); ``total`` and ``max_per_clip`` are then the whole side's.
        """
        keys, partners = keys.detach().float(), partners.detach().float()
        device = keys.device
        partner_row = torch.arange(keys.shape[0], device=device) if partner_row is None else partner_row.long().to(device)
        if keys.shape[0] != clip.shape[0] or keys.shape[0] != partner_row.shape[0] or keys.shape[1] != partners.shape[1]:
            raise ValueError(f"KB side shapes disagree: keys {tuple(keys.shape)}, partners {tuple(partners.shape)}, "
                             f"partner_row {tuple(partner_row.shape)}, clip {tuple(clip.shape)}")
        n, dim = keys.shape
        index = None
        if device.type == "cpu":
            index = faiss.IndexFlatIP(dim)
            index.add(_as_faiss(keys))
            if n > 0:
                keys = torch.from_numpy(faiss.rev_swig_ptr(index.get_xb(), n * dim).reshape(n, dim))
        own = clip[clip >= 0]
        max_per_clip = int(torch.unique(own, return_counts=True)[1].max()) if own.numel() else 0
        total = n
        if partitioned:
            total = int(distributed.all_reduce_sum(torch.tensor([n], dtype=torch.long, device=device)).item())
            max_per_clip = int(distributed.all_reduce_max(
                torch.tensor([max_per_clip], dtype=torch.long, device=device)).item())
        return cls(keys=keys, partner_table=partners, partner_row=partner_row, clip=clip.long().to(device),
                   index=index, max_per_clip=max_per_clip, total=total, partitioned=partitioned)

    def __len__(self) -> int:
        """Entries held by this process (this rank's share when partitioned; see ``total``)."""
        return int(self.keys.shape[0])

    def partners_of(self, rows: Tensor) -> Tensor:
        """Partner embeddings of the given entry rows (any shape) → (*rows.shape, d)."""
        return self.partner_table[self.partner_row[rows]]

    @property
    def partners(self) -> Tensor:
        """Partner of every entry (N, d) (materialised; for inspection)."""
        return self.partner_table[self.partner_row]

    def _top_rows(self, queries: Tensor, fetch: int) -> Tensor:
        """Exact top-``fetch`` rows by inner product (:meth:`_top`)."""
        return self._top(queries, fetch)[1]

    def _top(self, queries: Tensor, fetch: int) -> tuple[Tensor, Tensor]:
        """Exact top-``fetch`` (scores, rows), each (B, fetch), by inner product over the keys.

        The same exact search as ``IndexFlatIP.search``, done as a blocked matmul + top-k
        in torch: 2.4× faster at a training batch against ~100k keys on this CPU (FAISS's
        per-query heaps dominate there; docs/objectives.md). Blocks bound the score memory.
        """
        queries = queries.detach().to(self.keys.device, self.keys.dtype)
        best_scores: Tensor | None = None
        best_rows: Tensor | None = None
        for start in range(0, len(self), SEARCH_BLOCK_ROWS):
            block = self.keys[start : start + SEARCH_BLOCK_ROWS]
            scores, rows = (queries @ block.t()).topk(min(fetch, block.shape[0]), dim=1)
            rows = rows + start
            if best_scores is not None and best_rows is not None:
                scores, order = torch.cat([best_scores, scores], 1).topk(fetch, dim=1)
                rows = torch.gather(torch.cat([best_rows, rows], 1), 1, order)
            best_scores, best_rows = scores, rows
        if best_scores is None or best_rows is None:  # no keys (a rank's empty share)
            empty = queries.new_zeros((queries.shape[0], 0))
            return empty, empty.long()
        return best_scores, best_rows

    def search(self, queries: Tensor, k: int, *, exclude_clip: Tensor | None = None) -> Tensor:
        """Row indices (B, k) of the top-k keys by inner product, best first.

        With ``exclude_clip`` (B,), entries whose clip id equals the query's are skipped
        (negative query ids exclude nothing).
        """
        extra = self.max_per_clip if exclude_clip is not None else 0
        fetch = min(len(self), k + extra)
        if k > len(self) - extra:
            raise ValueError(f"cannot return {k} neighbours from {len(self)} entries with up to {extra} excluded")
        rows = self._top_rows(queries, fetch)
        if exclude_clip is None:
            return rows[:, :k]
        own = self.clip[rows] == exclude_clip.to(rows.device).long().unsqueeze(1)
        order = torch.sort(own.to(torch.int8), dim=1, stable=True).indices  # valid entries first, rank kept
        return torch.gather(rows, 1, order[:, :k])

    def local_top(self, queries: Tensor, k: int, *, exclude_clip: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """This process's best ``k`` (scores, rows), each (B, k), best first, self-exclusion applied;
        slots without a valid entry (a share of fewer than k rows) score −inf."""
        extra = self.max_per_clip if exclude_clip is not None else 0
        fetch = min(len(self), k + extra)
        scores, rows = self._top(queries, fetch)
        if exclude_clip is not None and fetch:
            own = self.clip[rows] == exclude_clip.to(rows.device).long().unsqueeze(1)
            scores = scores.masked_fill(own, -torch.inf)
            order = torch.sort(own.to(torch.int8), dim=1, stable=True).indices
            scores, rows = torch.gather(scores, 1, order), torch.gather(rows, 1, order)
        scores, rows = scores[:, :k], rows[:, :k]
        if scores.shape[1] < k:
            pad = k - scores.shape[1]
            scores = torch.cat([scores, scores.new_full((scores.shape[0], pad), -torch.inf)], 1)
            rows = torch.cat([rows, rows.new_zeros((rows.shape[0], pad))], 1)
        return scores, rows

    def neighbours(self, queries: Tensor, k: int, *, exclude_clip: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(keys, partners) of the top-k entries, each (B, k, d), best first.

        Partitioned (a collective: every rank calls it with the same queries): every rank's
        :meth:`local_top`, merged — one all-gather of the (B, k) scores, the same top-k of the
        R·k candidates on every rank, and one all-reduce (sum) of (B, k, 2d) buffers that only
        each winner's owner fills (adding zeros is exact).
        """
        if not self.partitioned:
            rows = self.search(queries, k, exclude_clip=exclude_clip)
            return self.keys[rows], self.partners_of(rows)
        if k > self.total - (self.max_per_clip if exclude_clip is not None else 0):
            raise ValueError(f"cannot return {k} neighbours from {self.total} entries")
        scores, rows = self.local_top(queries, k, exclude_clip=exclude_clip)
        everyone = distributed.all_gather_no_grad(scores.unsqueeze(0))  # (R, B, k), rank order
        batch, ranks, dim = scores.shape[0], everyone.shape[0], self.keys.shape[1]
        best = everyone.permute(1, 0, 2).reshape(batch, ranks * k).topk(k, dim=1).indices
        owner, slot = best // k, best % k
        mine = owner == distributed.rank()
        picked = torch.gather(rows, 1, slot)[mine]
        found = self.keys.new_zeros((batch, k, 2 * dim))
        if picked.numel():
            found[mine] = torch.cat([self.keys[picked], self.partners_of(picked)], dim=-1)
        found = distributed.all_reduce_sum(found)
        return found[..., :dim], found[..., dim:]


@dataclass
class Neighbours:
    """Top-K neighbours of a batch on both sides of one knowledge base, each (B, K, d)."""

    audio: Tensor
    """Audio-side neighbours of u_i (the set U_r)."""
    audio_partner: Tensor
    """Their paired texts."""
    text: Tensor
    """Text-side neighbours of v_i."""
    text_partner: Tensor
    """Their paired audios (the u'_j of ASK Eq. 10–12)."""


@dataclass
class KnowledgeBase:
    audio: KBSide
    text: KBSide

    def effective_k(self, k: int, *, exclude: bool) -> int:
        """``k`` clamped so every query still finds k neighbours after self-exclusion."""
        limit = min(
            side.total - (side.max_per_clip if exclude else 0) for side in (self.audio, self.text)
        )
        if limit < 1:
            raise ValueError("knowledge base too small: no neighbour left after self-exclusion")
        return min(k, limit)

    def retrieve(self, u: Tensor, v: Tensor, *, k: int, exclude_clip: Tensor | None = None) -> Neighbours:
        """Neighbours of audio u (B, d) on the audio side and of text v (B, d) on the text side."""
        audio, audio_partner = self.audio.neighbours(u, k, exclude_clip=exclude_clip)
        text, text_partner = self.text.neighbours(v, k, exclude_clip=exclude_clip)
        # The KB is float32 (FAISS); neighbours come back in the queries' dtype (float64 tests, AMP).
        return Neighbours(
            audio=audio.to(u.dtype),
            audio_partner=audio_partner.to(v.dtype),
            text=text.to(v.dtype),
            text_partner=text_partner.to(u.dtype),
        )


def group_identical_rows(audio: Tensor, *, offset: int = 0) -> Tensor:
    """Negative clip ids ``−1 − offset − g`` (N,) grouping bit-identical audio rows (extra manifests)."""
    _, inverse = torch.unique(audio.detach(), dim=0, return_inverse=True)
    return -1 - offset - inverse


def unique_audio(audio: Tensor, text: Tensor, clip: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One entry per clip id, in ascending id order.

    Returns (audio (C, d), re-normalised mean caption (C, d), ids (C,), the entry of each
    input row (N,)).
    """
    ids, inverse = torch.unique(clip, return_inverse=True)
    first = torch.full((ids.numel(),), clip.numel(), dtype=torch.long, device=clip.device)
    first.scatter_reduce_(0, inverse, torch.arange(clip.numel(), device=clip.device), reduce="amin")
    text_sum = torch.zeros(ids.numel(), text.shape[1], dtype=text.dtype, device=text.device)
    text_sum.index_add_(0, inverse.to(text.device), text)
    return audio[first.to(audio.device)], F.normalize(text_sum, dim=-1), ids, inverse


def build_fine_kb(audio: Tensor, text: Tensor, clip: Tensor, *, partitioned: bool = False) -> KnowledgeBase:
    """Fine KB (ASK Eq. 6) from source pairs audio (N, d), text (N, d), clip ids (N,).

    ``partitioned``: the pairs are this rank's (every pair of a clip on the same rank); each rank
    keeps its own rows (a collective: every rank calls it).
    """
    audio, text, clip = audio.detach().float(), text.detach().float(), clip.long().to(audio.device)
    clip_audio, clip_text, ids, entry = unique_audio(audio, text, clip)
    return KnowledgeBase(
        audio=KBSide.create(clip_audio, clip_text, ids, partitioned=partitioned),
        text=KBSide.create(text, clip_audio, clip, partner_row=entry, partitioned=partitioned),
    )


KMEANS_POINTS_PER_CENTROID = 256
"""K-Means trains on at most this many points per cluster (FAISS's own default cap)."""


def kmeans_sample(n_points: int, n_clusters: int, *, seed: int) -> np.ndarray | None:
    """Global rows of the K-Means input, ascending: None (all rows) up to ``256·n_clusters`` points,
    else a seeded sample of that many. Ours, not FAISS's internal one, so that a partitioned build
    selects the same rows as one process does."""
    cap = KMEANS_POINTS_PER_CENTROID * n_clusters
    if n_points <= cap:
        return None
    return np.sort(np.random.default_rng(seed).choice(n_points, cap, replace=False))


def kmeans_centroids(points: np.ndarray, n_clusters: int, *, seed: int, iters: int, redo: int = 1) -> np.ndarray:
    """FAISS K-Means (L2, best of ``redo`` runs) on points (n, D) float32 → centroids (n_clusters, D)."""
    kmeans = faiss.Kmeans(
        points.shape[1], n_clusters, niter=iters, nredo=redo, seed=seed, verbose=False,
        max_points_per_centroid=max(KMEANS_POINTS_PER_CENTROID, -(-points.shape[0] // n_clusters)),
        min_points_per_centroid=1, gpu=faiss_gpu_count() > 0,  # faiss-gpu when importable
    )
    kmeans.train(points)
    return np.ascontiguousarray(kmeans.centroids, dtype=np.float32)


def nearest_centroid(points: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Label (N,) int64 of each point (N, D): its nearest centroid by L2 (exact, FAISS Flat)."""
    index = faiss.IndexFlatL2(centroids.shape[1])
    index.add(centroids)
    if points.shape[0] == 0:
        return np.zeros(0, np.int64)
    _, labels = index.search(points, 1)
    return labels[:, 0].astype(np.int64)


def kmeans_labels(points: np.ndarray, n_clusters: int, *, seed: int, iters: int, redo: int = 1) -> np.ndarray:
    """FAISS K-Means on points (N, D) float32 (on :func:`kmeans_sample` of them) → nearest-centroid label (N,)."""
    sample = kmeans_sample(points.shape[0], n_clusters, seed=seed)
    train = points if sample is None else np.ascontiguousarray(points[sample])
    return nearest_centroid(points, kmeans_centroids(train, n_clusters, seed=seed, iters=iters, redo=redo))


def max_pool_prototypes(embeddings: Tensor, labels: Tensor, n_clusters: int) -> Tensor:
    """Element-wise max of each cluster's members, re-normalised: (N, d), (N,) → (n_clusters, d)."""
    return F.normalize(_max_pool(embeddings, labels, n_clusters), dim=-1)


def _max_pool(embeddings: Tensor, labels: Tensor, n_clusters: int) -> Tensor:
    """Element-wise max of each cluster's members (n_clusters, d); −inf rows for empty clusters."""
    index = labels.to(embeddings.device).unsqueeze(1).expand_as(embeddings)
    pooled = torch.full((n_clusters, embeddings.shape[1]), -torch.inf, dtype=embeddings.dtype, device=embeddings.device)
    pooled.scatter_reduce_(0, index, embeddings, reduce="amax", include_self=True)
    return pooled


def build_coarse_kb(
    audio: Tensor, text: Tensor, *, n_clusters: int, seed: int = 0, iters: int = 20, redo: int = 1,
    rows: Tensor | None = None, partitioned: bool = False,
) -> KnowledgeBase:
    """Coarse KB (ASK Eq. 7): K-Means on ``[u; v]`` (N, 2d), paired max-pooled prototypes.

    ``n_clusters`` is clamped to N (logged); clusters left empty by the final assignment are
    dropped. Prototype clip ids are −1 (never excluded). K-Means trains on :func:`kmeans_sample`
    of the pairs by global row.

    ``partitioned`` (a collective): audio/text are this rank's pairs and ``rows`` (N_local,) their
    rows in the whole, single-process order; the sampled rows are gathered on rank 0 in that
    order, rank 0 alone runs K-Means and broadcasts the centroids, every rank labels its own
    pairs, and the prototypes are max-reduced over ranks — the single-process KB, whole on
    every rank.
    """
    audio, text = audio.detach().float(), text.detach().float()
    device = audio.device
    n_local = int(audio.shape[0])
    n_pairs = n_local
    if partitioned:
        n_pairs = int(distributed.all_reduce_sum(torch.tensor([n_local], dtype=torch.long, device=device)).item())
    if n_clusters > n_pairs:
        log.info("ASK coarse KB: %d clusters requested but only %d pairs; using %d", n_clusters, n_pairs, n_pairs)
        n_clusters = n_pairs
    points = _as_faiss(torch.cat([audio, text], dim=1))
    sample = kmeans_sample(n_pairs, n_clusters, seed=seed)
    if not partitioned:
        train = points if sample is None else np.ascontiguousarray(points[sample])
        centroids = kmeans_centroids(train, n_clusters, seed=seed, iters=iters, redo=redo)
    else:
        if rows is None:
            raise ValueError("a partitioned coarse KB needs the global row of each pair")
        own_rows = rows.detach().long().cpu().numpy()
        chosen = np.arange(n_local) if sample is None else np.flatnonzero(np.isin(own_rows, sample))
        sent_rows = distributed.gather_rows_to(torch.from_numpy(own_rows[chosen]).to(device))
        sent_points = distributed.gather_rows_to(torch.from_numpy(points[chosen]).to(device))
        placeholder = torch.zeros((n_clusters, points.shape[1]), dtype=torch.float32, device=device)
        if sent_rows is not None and sent_points is not None:  # rank 0: the single-process input order
            train = _as_faiss(sent_points[torch.argsort(sent_rows)])
            placeholder = torch.from_numpy(kmeans_centroids(train, n_clusters, seed=seed, iters=iters, redo=redo))
        centroids = _as_faiss(distributed.broadcast(placeholder.to(device), src=0))
    labels = torch.from_numpy(nearest_centroid(points, centroids))
    pooled = torch.cat([_max_pool(audio, labels, n_clusters), _max_pool(text, labels, n_clusters)], dim=1)
    counts = torch.bincount(labels, minlength=n_clusters).to(device)
    if partitioned:
        pooled, counts = distributed.all_reduce_max(pooled), distributed.all_reduce_sum(counts)
    used = counts > 0
    dim = audio.shape[1]
    proto_audio = F.normalize(pooled[used, :dim], dim=-1)
    proto_text = F.normalize(pooled[used, dim:], dim=-1)
    none = torch.full((int(used.sum()),), -1, dtype=torch.long, device=device)
    return KnowledgeBase(
        audio=KBSide.create(proto_audio, proto_text, none),
        text=KBSide.create(proto_text, proto_audio, none),
    )


def representation_drift(current: Tensor, stale: Tensor, *, tau: float = 1.0) -> float:
    """RDM (ASK Eq. 3–4) on a sample: ``mean_i KL(P_ideal(·|i) ‖ P_actual(·|i))``.

    ``P_ideal(j|i) = softmax_j(e_i·e_j / τ)`` with the current embeddings e = ``current``
    (n, d) and ``P_actual(j|i) = softmax_j(e_i·o_j / τ)`` with the stale ones o = ``stale``
    (n, d) of the same clips (the embeddings the knowledge base was built from). ``τ = 1``
    is the paper's literal cosine similarity.
    """
    current, stale = current.detach().double(), stale.detach().double().to(current.device)
    log_ideal = (current @ current.t() / tau).log_softmax(dim=1)
    log_actual = (current @ stale.t() / tau).log_softmax(dim=1)
    return float((log_ideal.exp() * (log_ideal - log_actual)).sum(dim=1).mean())
