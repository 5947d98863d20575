"""ATRI audio–English co-anchor contrastive learning (CACL).

Each clip contributes two text views: its caption in the anchor language (English) and
the translation of that caption in one uniformly random other language the clip has
(view 1). The batch yields three row-aligned pairs of equal weight, and the base loss
(symmetric) runs on each:

    L = ⅓ [L(audio, eng) + L(audio, other) + L(eng, other)]

which with InfoNCE is Eq. 12's ``1/(6N) (L_ae + L_at + L_et)`` (each ``L_uv`` of Eq. 13
sums both directions). The third pair is ``text-text``: audio-only regularizers (SVR)
skip it. Clips lacking English or every other language are masked out of the pairs
that need the missing view.

Args:
    anchor: the anchor language, default ``eng`` (must be in ``data.languages`` with at
        least one other language).

Shapes: views → 2 texts per clip; pairs → audio–eng, audio–other (audio-text) and
eng–other (text-text), ≤ B rows each.

References: Yin et al., "ATRI", §4.2, Eq. 12 (total) and Eq. 13 (pairwise symmetric
loss); SPEC §4.3; SupCLAP Table 8 (SVR on top of CACL).

Relations: a cheaper alternative to :mod:`.kcl` (2 text views instead of K);
replaces :mod:`.random_language`. Composes with any base loss and with SVR.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from index.languages import ENGLISH
from training.config import ConfigError
from training.objectives.base import (
    AlignedPair,
    BuildEnv,
    EmbeddingBatch,
    Strategy,
    TermConfig,
    select_rows,
)
from training.objectives.kcl import query_group


class CACLConfig(TermConfig):
    anchor: str = ENGLISH


class CoAnchor(Strategy):
    name = "cacl"
    Config = CACLConfig

    def __init__(self, config: CACLConfig, env: BuildEnv) -> None:
        super().__init__(config, env)
        if config.anchor not in env.languages:
            raise ConfigError(
                f"objective.strategy (cacl): anchor language {config.anchor!r} is not in data.languages {list(env.languages)}"
            )
        self.anchor = config.anchor
        self.others = tuple(lang for lang in env.languages if lang != config.anchor)
        if not self.others:
            raise ConfigError("objective.strategy (cacl): data.languages needs a language besides the anchor")

    @property
    def num_views(self) -> int:
        return 2

    def views(self, captions: Mapping[str, Sequence[str]], rng: random.Random) -> list[str | None]:
        group = dict(zip((self.anchor, *self.others), query_group(captions, (self.anchor, *self.others), rng), strict=True))
        available = [lang for lang in self.others if group[lang] is not None]
        other = group[rng.choice(available)] if available else None
        return [group[self.anchor], other]

    def pairs(self, batch: EmbeddingBatch) -> list[AlignedPair]:
        pairs = (
            select_rows(batch, 0, name="cacl_audio_anchor", weight=1.0),
            select_rows(batch, 1, name="cacl_audio_other", weight=1.0),
            select_rows(batch, 1, left_view=0, name="cacl_anchor_other", weight=1.0),
        )
        return [pair for pair in pairs if pair is not None]
