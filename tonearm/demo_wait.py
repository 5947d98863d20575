"""Wait for the demo bundle on build *progress*, not on a wall-clock limit.

A demo build takes about 5 minutes on two idle cores and far longer on a loaded machine
(over 30 minutes was seen at load 10), so a fixed timeout either fails slow-but-healthy
builds or waits forever on a stuck one. :func:`wait_for_demo_bundle` runs the build
(``python -m tonearm.demo --home HOME``, which takes the build lock: a second caller
waits for the first one's build instead of starting another) and watches
``HOME/demo/build.log``: every stage, training epoch and tenth of the synthesis and
export appends a line. It fails when the builder exits with an error, or when the log
has not grown for ``stall_seconds`` (then the builder is stopped). Used by the test
suite's ``demo_home`` fixture and usable by CI scripts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tonearm.demo import build_log_path, cached_demo_bundle
from tonearm.errors import TonearmError

DEFAULT_STALL_SECONDS = 900.0
"""No new build-log line for this long = stuck (the longest gap between lines, one training
epoch of the demo, is about 25 s on two idle cores)."""
POLL_SECONDS = 2.0


def _log_state(log: Path) -> tuple[int, float] | None:
    try:
        stat = log.stat()
    except FileNotFoundError:
        return None
    return stat.st_size, stat.st_mtime


def wait_for_demo_bundle(
    home: Path, *, stall_seconds: float = DEFAULT_STALL_SECONDS, output: Path | None = None
) -> Path:
    """The demo bundle of ``home``, built (or waited for) in a subprocess watched for progress.

    ``output`` receives the builder's stdout/stderr (default ``HOME/demo/builder.out``)."""
    home = Path(home).expanduser()
    found = cached_demo_bundle(home)
    if found is not None:
        return found
    log = build_log_path(home)
    log.parent.mkdir(parents=True, exist_ok=True)
    output = output or log.parent / "builder.out"
    command = [sys.executable, "-m", "tonearm.demo", "--home", str(home)]
    with open(output, "ab") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        last_state, last_change = _log_state(log), time.monotonic()
        while process.poll() is None:
            time.sleep(POLL_SECONDS)
            state = _log_state(log)
            if state != last_state:
                last_state, last_change = state, time.monotonic()
            elif time.monotonic() - last_change > stall_seconds:
                raise TonearmError(
                    f"the demo build made no progress for {stall_seconds:.0f} s ({log} did not grow); "
                    f"stopped it — see {log} and {output}"
                )
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    found = cached_demo_bundle(home)
    if process.returncode != 0 or found is None:
        tail = output.read_text(encoding="utf-8", errors="replace")[-2000:]
        raise TonearmError(f"the demo build failed (exit {process.returncode}); last output:\n{tail}")
    return found
