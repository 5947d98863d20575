"""Noisy correspondences: replace a fraction of the training captions with captions of other clips.

The setting of the correspondence, DART and ASK papers (DART Table 2: "captions replaced
by unrelated ones"). A *caption slot* is one position of a clip's captions, i.e. one
query group (the caption in every language); a noisy slot takes the whole query group
of another training clip from another scene family, so the replacement is unrelated
to the audio and the translations stay translations of each other. Only the ``train``
split is touched: validation and test measure retrieval of the true captions.

Each corrupted clip records its noisy slots in ``meta.noisy_captions`` (a list of
``{"position": i, "source": clip id, "source_position": j}``), so a benchmark can tell
noisy from clean pairs after training (docs/corpus.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from training.data.manifest import ClipRecord

NOISY_META_KEY = "noisy_captions"
NOISY_SPLIT = "train"


def caption_slots(record: ClipRecord) -> int:
    """How many caption positions (query groups) a clip has: its longest language."""
    return max(len(texts) for texts in record.captions.values())


def inject_caption_noise(records: Sequence[ClipRecord], fraction: float, *, seed: int) -> int:
    """Corrupt ``round(fraction × train slots)`` train caption slots in place; return that count.

    Sources are drawn from the original captions (never from an already-corrupted slot) of a
    train clip in another family (``meta.family``; any other clip when absent).
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"noise fraction must be in [0, 1), got {fraction}")
    train = [r for r in records if r.split == NOISY_SPLIT]
    slots = [(clip, pos) for clip, r in enumerate(train) for pos in range(caption_slots(r))]
    count = int(round(fraction * len(slots)))
    if count == 0:
        return 0
    if len(train) < 2:
        raise ValueError("noise needs at least two training clips to swap captions between")
    rng = np.random.default_rng([seed, 4])
    original = [{lang: list(texts) for lang, texts in r.captions.items()} for r in train]
    chosen = rng.choice(len(slots), size=count, replace=False)
    for slot in sorted(int(i) for i in chosen):
        clip, position = slots[slot]
        target = train[clip]
        family = target.meta.get("family")
        while True:
            source = int(rng.integers(len(train)))
            if source != clip and (family is None or train[source].meta.get("family") != family):
                break
        source_position = int(rng.integers(caption_slots(train[source])))
        for lang, texts in target.captions.items():
            donor = original[source].get(lang)
            if position < len(texts) and donor:
                texts[position] = donor[source_position % len(donor)]
        target.meta.setdefault(NOISY_META_KEY, []).append(
            {"position": position, "source": train[source].id, "source_position": source_position}
        )
    return count


def noisy_positions(record: ClipRecord) -> set[int]:
    """The caption positions of a clip that ``tonearm synth --noise`` replaced."""
    return {int(entry["position"]) for entry in record.meta.get(NOISY_META_KEY, [])}
