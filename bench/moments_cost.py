"""Cost of moment search against recording length (docs/BENCHMARKS.md, "moments_cost").

One long recording of 10 min … 10 h indexed as windows of ``--window`` s every half window
(index/moments/windows.py), random unit vectors of ``--dim`` (the scan's cost does not depend on the
values), a planted event of 30 s so the post-processing has a moment to merge and refine. Reports
the bundle files' size (windows + spans) and the latency of one moment search (exact scan + merge,
refine, NMS), p50/p95 over ``--repeats`` queries. The scan is the same on either clip backend
(FAISS or Milvus): the windows are not in the clip index.

    python -m bench.moments_cost [--dim 512] [--window 10] [--repeats 200]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from index.moments.postprocess import window_spans
from index.moments.windows import WindowIndex, write_windows

HOURS = (1 / 6, 1.0, 3.0, 10.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print("| recording | windows | files (MB) | search p50 (ms) | search p95 (ms) |")  # noqa: T201
    print("|---|---|---|---|---|")  # noqa: T201
    for hours in HOURS:
        seconds = hours * 3600
        spans = window_spans(seconds, args.window, args.window / 2)
        vectors = rng.normal(size=(len(spans), args.dim)).astype(np.float32)
        query = rng.normal(size=args.dim).astype(np.float32)
        query /= np.linalg.norm(query)
        event = (spans[:, 0] > seconds / 2) & (spans[:, 1] < seconds / 2 + 30)
        vectors[event] = query * 5 + vectors[event] * 0.1  # a 30-s event the query matches
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        with tempfile.TemporaryDirectory() as tmp:
            write_windows(Path(tmp), [(0, spans, vectors)])
            size = sum(p.stat().st_size for p in Path(tmp).rglob("*.npy")) / 1e6
            index = WindowIndex.load(Path(tmp))
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                hits = index.search(query, 10)
                times.append(1000 * (time.perf_counter() - start))
        assert hits and abs(hits[0].start - seconds / 2) < 2 * args.window, hits[0]
        label = f"{int(round(hours * 60))} min" if hours < 1 else f"{hours:g} h"
        print(f"| {label} | {len(spans):,} | {size:.1f} | {np.percentile(times, 50):.2f} | "  # noqa: T201
              f"{np.percentile(times, 95):.2f} |")


if __name__ == "__main__":
    main()
