"""ML-CLAP multilingual baseline: one caption in a uniformly random language per clip and epoch.

Each clip contributes one text view: a random language among those the clip has,
then a random caption of that language. The batch is a single audio–text pair set,
so the base loss sees an ordinary CLAP batch.

References: ATRI §3.1 / §5 ("ML-CLAP" baseline: random-language captions), SPEC §4.3.

Relations: the first of the strategies; :mod:`.kcl` and :mod:`.cacl` replace it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from training.objectives.base import AlignedPair, EmbeddingBatch, Strategy, select_rows


class RandomLanguage(Strategy):
    name = "random"

    @property
    def num_views(self) -> int:
        return 1

    def views(self, captions: Mapping[str, Sequence[str]], rng: random.Random) -> list[str | None]:
        available = [lang for lang in self.languages if captions.get(lang)]
        if not available:
            return [None]
        lang = rng.choice(available)
        return [rng.choice(list(captions[lang]))]

    def pairs(self, batch: EmbeddingBatch) -> list[AlignedPair]:
        pair = select_rows(batch, 0, name="random", weight=1.0)
        return [pair] if pair is not None else []
