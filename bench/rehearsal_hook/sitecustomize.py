"""Bench-only instrumentation of ``bench/multinode_rehearsal.py`` (never on a user's path).

Imported at interpreter start when this folder is on ``PYTHONPATH``; it acts only in a torchrun rank
(``RANK`` set) with ``REHEARSAL_OUT`` set, and then:

- appends the ids of every clip the rank *trained* (the batch :meth:`StreamBatches.lockstep` hands
  the step, after any hold-back) to ``$REHEARSAL_OUT/served.<RANK>.jsonl``, one line per step with
  the epoch — the set of ids actually served, which the bench counts duplicates and coverage from;
- writes the rank's peak RSS and its loader workers' (``getrusage``) to ``$REHEARSAL_OUT/rss.<RANK>.json``
  at exit.

The training code is not changed: the wrapper calls the real ``lockstep`` and records its result.
"""

from __future__ import annotations

import os

if os.environ.get("REHEARSAL_OUT") and "RANK" in os.environ:
    import atexit
    import json
    import resource
    from pathlib import Path

    _out = Path(os.environ["REHEARSAL_OUT"])
    _rank = os.environ["RANK"]
    _out.mkdir(parents=True, exist_ok=True)

    def _rss() -> None:
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        (_out / f"rss.{_rank}.json").write_text(json.dumps({"rank": int(_rank), "peak_rss_bytes": own,
                                                             "peak_worker_rss_bytes": children}))

    atexit.register(_rss)

    from training.data import stream as _stream

    _lockstep = _stream.StreamBatches.lockstep

    def _recorded(self, batch):  # type: ignore[no-untyped-def]
        agreed = _lockstep(self, batch)
        if agreed is not None:
            ids = [self.stream.plan.ids[int(i)] for i in agreed.clip_index]
            with open(_out / f"served.{_rank}.jsonl", "a") as sink:
                sink.write(json.dumps({"epoch": self.epoch, "ids": ids}) + "\n")
        return agreed

    _stream.StreamBatches.lockstep = _recorded  # type: ignore[method-assign]
