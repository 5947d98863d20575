"""ATRI 1-to-K contrastive learning (KCL): every language of a clip in the same batch.

Each clip contributes K text views, one per configured language, all at the same
caption position (a *query group*: a caption and its translations). For each language
k the base loss runs on (audio, language-k texts), so with InfoNCE

    L = 1/(2K) Σ_k [L_a2t^k + L_t2a^k]   (per-language means over the batch rows),

Eq. 9–11's ``1/(2NK) Σ_k Σ_i`` with the sums taken per language. Clips lacking
language k are masked out of language k's term only (:func:`.base.select_rows`); every
language with at least two rows in the batch has the same weight.

Args: none (the languages are ``data.languages``).

Shapes: views → K texts per clip; pairs → K audio–text pairs of ≤ B rows each.

References: Yin et al., "ATRI", §4.1, Eq. 9 (total), Eq. 10 (audio→text), Eq. 11
(text→audio); SPEC §4.3.

Relations: replaces :mod:`.random_language` (ML-CLAP, one random language per clip);
:mod:`.cacl` is its cheaper sibling. Composes with any base loss and with SVR.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from training.objectives.base import AlignedPair, EmbeddingBatch, Strategy, select_rows


def query_group(
    captions: Mapping[str, Sequence[str]], languages: Sequence[str], rng: random.Random
) -> list[str | None]:
    """One caption per language at one random caption position (translations of each other).

    A language with fewer captions than the drawn position falls back to a random caption
    of its own; a language the clip lacks gives None.
    """
    positions = max((len(captions.get(lang) or ()) for lang in languages), default=0)
    if positions == 0:
        return [None] * len(languages)
    index = rng.randrange(positions)
    group: list[str | None] = []
    for lang in languages:
        texts = list(captions.get(lang) or ())
        if not texts:
            group.append(None)
        else:
            group.append(texts[index] if index < len(texts) else rng.choice(texts))
    return group


class OneToK(Strategy):
    name = "kcl"

    @property
    def num_views(self) -> int:
        return len(self.languages)

    def views(self, captions: Mapping[str, Sequence[str]], rng: random.Random) -> list[str | None]:
        return query_group(captions, self.languages, rng)

    def pairs(self, batch: EmbeddingBatch) -> list[AlignedPair]:
        pairs = (select_rows(batch, k, name=f"kcl_{lang}", weight=1.0) for k, lang in enumerate(self.languages))
        return [pair for pair in pairs if pair is not None]
