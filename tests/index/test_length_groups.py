"""Length-grouped encoder calls: the cheapest split of a sorted batch, and encode_texts keeps order."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from index.runtime.length_groups import length_groups, padded_cost
from index.runtime.loader import LoadedBundle, encode_texts


def _brute_force(lengths: list[int], max_group: int, overhead: int) -> int:
    """Cheapest cost over every split of the sorted lengths into runs of at most ``max_group``."""
    ordered = sorted(lengths)
    n, best = len(ordered), None
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        runs = [ordered[a:b] for a, b in itertools.pairwise(bounds)]
        if any(len(r) > max_group for r in runs):
            continue
        cost = sum(overhead + len(r) * max(r) for r in runs)
        best = cost if best is None else min(best, cost)
    assert best is not None
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_split_is_the_cheapest_and_covers_every_item_once(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 11))
    lengths = rng.integers(1, 80, size=n).tolist()
    max_group, overhead = int(rng.integers(1, 6)), int(rng.integers(0, 40))
    groups = length_groups(lengths, max_group=max_group, call_overhead=overhead)
    assert sorted(np.concatenate(groups).tolist()) == list(range(n))
    assert all(1 <= len(g) <= max_group for g in groups)
    assert padded_cost(lengths, groups, call_overhead=overhead) == _brute_force(lengths, max_group, overhead)


def test_mixed_languages_are_split_short_from_long():
    lengths = [32, 57, 33, 52, 34, 32]  # four Latin-script queries and two CJK ones
    groups = length_groups(lengths, max_group=64)
    assert [sorted(g.tolist()) for g in groups] == [[0, 2, 4, 5], [1, 3]]
    assert padded_cost(lengths, groups) < padded_cost(lengths, [np.arange(6)])


def test_the_overhead_sets_how_far_it_splits():
    lengths = [5, 9, 9, 20, 31]
    assert len(length_groups(lengths, max_group=64, call_overhead=0)) == 4  # one call per distinct length
    chunks = length_groups(lengths, max_group=2, call_overhead=10**6)
    assert [len(g) for g in chunks] == [1, 2, 2] or [len(g) for g in chunks] == [2, 2, 1]
    assert len(length_groups(lengths, max_group=64, call_overhead=10**6)) == 1
    assert length_groups([], max_group=4) == []
    with pytest.raises(ValueError, match="max_group"):
        length_groups([3], max_group=0)


TEXTS = ["a dog", "犬が吠える、そしてサイレンが遠くで鳴り響く", "rain", "une sirène passe au loin puis un chien aboie",
         "bells", "狗叫", "a whistle and fast clapping far away in the rain", "drum"]


def test_encode_texts_returns_each_text_in_its_place_as_if_alone(tiny_bundle):
    bundle = LoadedBundle.open(tiny_bundle, intra_op_threads=1, verify=False)
    encoder, tokenizer, dim = bundle._text_encoder, bundle.tokenizer, bundle.embed_dim
    _, mask = tokenizer.encode(TEXTS)
    lengths = mask.sum(axis=1)
    assert len(length_groups(lengths, max_group=64)) > 1, "the texts must need more than one call"
    grouped = encode_texts(encoder, tokenizer, TEXTS, embed_dim=dim)
    alone = np.concatenate([encode_texts(encoder, tokenizer, [t], embed_dim=dim) for t in TEXTS])
    np.testing.assert_allclose(grouped, alone, atol=1e-5)
    assert grouped.shape == (len(TEXTS), dim)
    np.testing.assert_allclose(np.linalg.norm(grouped, axis=1), 1.0, atol=1e-5)
    assert encode_texts(encoder, tokenizer, [], embed_dim=dim).shape == (0, dim)
