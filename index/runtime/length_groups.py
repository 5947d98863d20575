"""Split a batch of token sequences into encoder calls of similar length (docs/service.md, "Batching").

A text encoder call costs about (items × padded length) token-steps plus a fixed cost per call.
Padding a micro-batch to its longest query makes every short query pay for the long one: with
the benchmark's mixed-language queries (32–57 tokens) a batch of four costs RoBERTa-base about
a quarter more than its own tokens. Sorting by length and cutting the sorted run where the
saved padding outweighs one more call's fixed cost gives the cheapest partition; on a CPU,
where a batch of n costs nearly n single calls, the extra calls are cheap.

:func:`length_groups` is an exact dynamic programme over the sorted lengths (O(n²) for a batch
of n, n ≤ a few hundred). Pure numpy: no torch, no onnxruntime.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

CALL_OVERHEAD_TOKENS = 16
"""Fixed cost of one encoder call in token-steps (items × padded length).

Measured for RoBERTa-base (CLAP's text tower) on one ONNX Runtime thread: a call of one
39-token query costs 46 ms, one item of a batch of eight 31 ms, so a call carries about
17 ms ≈ 21 token-steps beyond its items; 16 keeps a little bias toward fewer calls (a tiny
model's call overhead is larger relative to its tokens, and splitting it gains nothing anyway)."""


def padded_cost(lengths: Sequence[int] | np.ndarray, groups: Sequence[np.ndarray], *,
                call_overhead: int = CALL_OVERHEAD_TOKENS) -> int:
    """Token-steps of running ``groups`` (index arrays into ``lengths``) as separate padded calls."""
    values = np.asarray(lengths, dtype=np.int64)
    return int(sum(call_overhead + len(g) * int(values[g].max()) for g in groups if len(g)))


def length_groups(lengths: Sequence[int] | np.ndarray, *, max_group: int,
                  call_overhead: int = CALL_OVERHEAD_TOKENS) -> list[np.ndarray]:
    """Index arrays (into ``lengths``) of the cheapest calls: each group is a run of the lengths
    sorted ascending, at most ``max_group`` long; every index appears in exactly one group.

    ``call_overhead`` 0 puts every distinct length in its own call (the least padding);
    a huge one gives the fewest calls (plain chunks of ``max_group`` of the sorted order)."""
    if max_group < 1:
        raise ValueError(f"max_group must be >= 1, got {max_group}")
    values = np.asarray(lengths, dtype=np.int64)
    n = len(values)
    if n == 0:
        return []
    order = np.argsort(values, kind="stable")
    ordered = values[order].tolist()
    # best[i]: the cheapest cost of the first i sorted items; cut[i]: where its last group starts
    best = [0] + [0] * n
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        longest = ordered[end - 1]  # sorted: the group's last item is its longest
        candidates = range(max(0, end - max_group), end)
        start = min(candidates, key=lambda s: best[s] + call_overhead + (end - s) * longest)
        best[end] = best[start] + call_overhead + (end - start) * longest
        cut[end] = start
    groups: list[np.ndarray] = []
    end = n
    while end > 0:
        groups.append(order[cut[end] : end])
        end = cut[end]
    return groups[::-1]
