"""`tonearm bench NAME [ARGS]`: run ``bench/NAME.py`` of the source checkout with ARGS.

Benchmarks live beside the packages in the repository (they are not installed with the
wheel); each one parses its own arguments (``tonearm bench quality --help``).
"""

from __future__ import annotations

import argparse
import re
import runpy
import sys
from pathlib import Path

from tonearm.errors import TonearmError

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def cli_bench(args: argparse.Namespace) -> int:
    name = args.name
    script = BENCH_DIR / f"{name}.py"
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or not script.is_file():
        known = sorted(p.stem for p in BENCH_DIR.glob("*.py")  # scripts, not their helper modules
                       if '__name__ == "__main__"' in p.read_text(encoding="utf-8")) if BENCH_DIR.is_dir() else []
        raise TonearmError(f"unknown benchmark {name!r}; known: {', '.join(known) or f'none ({BENCH_DIR} is missing: use a source checkout)'}")
    root = str(BENCH_DIR.parent)
    saved = sys.argv, list(sys.path)
    sys.argv = [f"tonearm bench {name}", *args.args]
    sys.path[:0] = [root, str(BENCH_DIR)]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:
        return int(done.code or 0) if not isinstance(done.code, str) else 2
    finally:
        sys.argv, sys.path[:] = saved[0], saved[1]
    return 0
