"""Embedding diagnostics of a trained model on the test split: collapse and hubness.

Computed at evaluation for every `tonearm bench quality` job (bench/quality.py) and shown
for every method in docs/results (bench/quality_report.py):

* **spread** — standard deviation of all audio–caption cosine similarities of the test split.
  A model whose embeddings collapsed to one point scores every pair alike (VSE++'s hardest-
  negative triplet from scratch: every similarity 0.309, spread 0.000); its recall is chance
  and says nothing about the method it is compared with. A run with spread below
  ``COLLAPSE_SPREAD`` is flagged *collapsed* and left out of the tables and claims.
* **hubness** — skewness of ``N_10``, the number of audios whose 10 nearest captions include a
  given caption (Radovanović et al. 2010), per caption language, averaged over languages.
  Near 0: every caption is retrieved about equally often; large: a few "hub" captions sit in
  most audios' top 10. Balanced OT is blind to a per-caption offset of the cost, so a model
  trained with it can grow hubs (the diagnostic behind docs/results/laggards.md's IOT analysis).

Pure numpy: (N, d) audio and (Q, d) caption embeddings, L2-normalised.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

COLLAPSE_SPREAD = 0.01
"""Spread of test similarities below which a run counts as collapsed (trained InfoNCE models: ~0.2)."""
HUB_K = 10


def similarity_spread(similarity: np.ndarray) -> float:
    """Standard deviation of every entry of an (N, Q) similarity matrix."""
    return float(np.std(similarity)) if similarity.size else 0.0


def hubness(similarity: np.ndarray, *, k: int = HUB_K) -> float:
    """Skewness of the k-occurrence ``N_k`` of the columns (captions) in the rows' (audios') top k.

    (N, Q) → float; 0 when every caption occurs equally often (including a zero variance).
    """
    n_audio, n_text = similarity.shape
    k = min(k, n_text)
    if n_audio == 0 or k == 0:
        return 0.0
    top = np.argpartition(-similarity, k - 1, axis=1)[:, :k]
    counts = np.bincount(top.ravel(), minlength=n_text).astype(np.float64)
    centred = counts - counts.mean()
    variance = float(np.mean(centred**2))
    if variance <= 1e-12:
        return 0.0
    return float(np.mean(centred**3) / variance**1.5)


def embedding_diagnostics(audio: np.ndarray, text: np.ndarray, caption_lang: Sequence[str]) -> dict[str, float]:
    """``similarity_spread``, ``hubness`` (mean over caption languages) and ``collapsed`` (0/1)."""
    similarity = np.asarray(audio, dtype=np.float64) @ np.asarray(text, dtype=np.float64).T
    langs = np.asarray(caption_lang)
    per_language = [hubness(similarity[:, langs == lang]) for lang in dict.fromkeys(langs.tolist())]
    spread = similarity_spread(similarity)
    return {
        "similarity_spread": spread,
        "hubness": float(np.mean(per_language)) if per_language else 0.0,
        "collapsed": float(spread < COLLAPSE_SPREAD),
    }
