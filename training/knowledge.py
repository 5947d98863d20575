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

from index.faiss_index import faiss_gpu_count

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
    index: faiss.Index
    max_per_clip: int
    """Largest number of entries sharing one non-negative clip id (0 when there is none)."""

    @classmethod
    def create(cls, keys: Tensor, partners: Tensor, clip: Tensor, *, partner_row: Tensor | None = None) -> KBSide:
        """Index ``keys``; entry i's partner is ``partners[partner_row[i]]`` (``partner_row`` defaults to i)."""
        keys, partners = keys.detach().float(), partners.detach().float()
        device = keys.device
        partner_row = torch.arange(keys.shape[0], device=device) if partner_row is None else partner_row.long().to(device)
        if keys.shape[0] != clip.shape[0] or keys.shape[0] != partner_row.shape[0] or keys.shape[1] != partners.shape[1]:
            raise ValueError(f"KB side shapes disagree: keys {tuple(keys.shape)}, partners {tuple(partners.shape)}, "
                             f"partner_row {tuple(partner_row.shape)}, clip {tuple(clip.shape)}")
        n, dim = keys.shape
        index = faiss.IndexFlatIP(dim)
        index.add(_as_faiss(keys))
        if device.type == "cpu" and n > 0:
            keys = torch.from_numpy(faiss.rev_swig_ptr(index.get_xb(), n * dim).reshape(n, dim))
        own = clip[clip >= 0]
        max_per_clip = int(torch.unique(own, return_counts=True)[1].max()) if own.numel() else 0
        return cls(keys=keys, partner_table=partners, partner_row=partner_row, clip=clip.long().to(device),
                   index=index, max_per_clip=max_per_clip)

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    def partners_of(self, rows: Tensor) -> Tensor:
        """Partner embeddings of the given entry rows (any shape) → (*rows.shape, d)."""
        return self.partner_table[self.partner_row[rows]]

    @property
    def partners(self) -> Tensor:
        """Partner of every entry (N, d) (materialised; for inspection)."""
        return self.partner_table[self.partner_row]

    def _top_rows(self, queries: Tensor, fetch: int) -> Tensor:
        """Exact top-``fetch`` rows by inner product over the Flat index's own vectors.

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
        assert best_rows is not None
        return best_rows

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
            len(side) - (side.max_per_clip if exclude else 0) for side in (self.audio, self.text)
        )
        if limit < 1:
            raise ValueError("knowledge base too small: no neighbour left after self-exclusion")
        return min(k, limit)

    def retrieve(self, u: Tensor, v: Tensor, *, k: int, exclude_clip: Tensor | None = None) -> Neighbours:
        """Neighbours of audio u (B, d) on the audio side and of text v (B, d) on the text side."""
        rows_a = self.audio.search(u, k, exclude_clip=exclude_clip)
        rows_t = self.text.search(v, k, exclude_clip=exclude_clip)
        # The KB is float32 (FAISS); neighbours come back in the queries' dtype (float64 tests, AMP).
        return Neighbours(
            audio=self.audio.keys[rows_a].to(u.dtype),
            audio_partner=self.audio.partners_of(rows_a).to(v.dtype),
            text=self.text.keys[rows_t].to(v.dtype),
            text_partner=self.text.partners_of(rows_t).to(u.dtype),
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


def build_fine_kb(audio: Tensor, text: Tensor, clip: Tensor) -> KnowledgeBase:
    """Fine KB (ASK Eq. 6) from source pairs audio (N, d), text (N, d), clip ids (N,)."""
    audio, text, clip = audio.detach().float(), text.detach().float(), clip.long().to(audio.device)
    clip_audio, clip_text, ids, entry = unique_audio(audio, text, clip)
    return KnowledgeBase(
        audio=KBSide.create(clip_audio, clip_text, ids),
        text=KBSide.create(text, clip_audio, clip, partner_row=entry),
    )


def kmeans_labels(points: np.ndarray, n_clusters: int, *, seed: int, iters: int, redo: int = 1) -> np.ndarray:
    """FAISS K-Means (L2, best of ``redo`` runs) on points (N, D) float32 → nearest-centroid label (N,) int64."""
    kmeans = faiss.Kmeans(
        points.shape[1], n_clusters, niter=iters, nredo=redo, seed=seed, verbose=False, max_points_per_centroid=256,
        min_points_per_centroid=1, gpu=faiss_gpu_count() > 0,  # faiss-gpu when importable
    )
    kmeans.train(points)
    _, labels = kmeans.index.search(points, 1)
    return labels[:, 0].astype(np.int64)


def max_pool_prototypes(embeddings: Tensor, labels: Tensor, n_clusters: int) -> Tensor:
    """Element-wise max of each cluster's members, re-normalised: (N, d), (N,) → (n_clusters, d)."""
    index = labels.to(embeddings.device).unsqueeze(1).expand_as(embeddings)
    pooled = torch.full((n_clusters, embeddings.shape[1]), -torch.inf, dtype=embeddings.dtype, device=embeddings.device)
    pooled.scatter_reduce_(0, index, embeddings, reduce="amax", include_self=True)
    return F.normalize(pooled, dim=-1)


def build_coarse_kb(
    audio: Tensor, text: Tensor, *, n_clusters: int, seed: int = 0, iters: int = 20, redo: int = 1,
) -> KnowledgeBase:
    """Coarse KB (ASK Eq. 7): K-Means on ``[u; v]`` (N, 2d), paired max-pooled prototypes.

    ``n_clusters`` is clamped to N (logged); clusters left empty by the final
    assignment are dropped. Prototype clip ids are −1 (never excluded).
    """
    audio, text = audio.detach().float(), text.detach().float()
    n_pairs = int(audio.shape[0])
    if n_clusters > n_pairs:
        log.info("ASK coarse KB: %d clusters requested but only %d pairs; using %d", n_clusters, n_pairs, n_pairs)
        n_clusters = n_pairs
    labels_np = kmeans_labels(_as_faiss(torch.cat([audio, text], dim=1)), n_clusters, seed=seed, iters=iters, redo=redo)
    used, labels = np.unique(labels_np, return_inverse=True)
    labels_t = torch.from_numpy(labels.astype(np.int64))
    proto_audio = max_pool_prototypes(audio, labels_t, len(used))
    proto_text = max_pool_prototypes(text, labels_t, len(used))
    none = torch.full((len(used),), -1, dtype=torch.long, device=audio.device)
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
