"""The page a browser gets at ``/`` while the first demo bundle builds (service/web/building.html).

Rendered on the server from the same status ``/readyz`` reports (so it is complete without
JavaScript, and a ``<noscript>`` refresh reloads it every 5 s); with JavaScript it polls
``/readyz`` and updates itself, then reloads into the demo page when the service is ready.
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any

from tonearm.demo_progress import STAGES

TEMPLATE = Path(__file__).resolve().parents[1] / "service" / "web" / "building.html"
TAIL_BYTES = 4096


def wants_html(accept: str) -> bool:
    """A browser's navigation (``Accept: text/html,…``) — not an API client (``*/*``, JSON)."""
    return "text/html" in accept.lower()


def log_tail(path: Path) -> str:
    """The last non-empty line of the build log ('' when there is none yet)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, os.fstat(handle.fileno()).st_size - TAIL_BYTES))
            lines = handle.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return next((line for line in reversed(lines) if line.strip()), "")


def building_page(status: dict[str, Any]) -> str:
    """The page for one build ``status`` (:meth:`tonearm.demo_progress.BuildProgress.status` + log)."""
    step, percent = int(status["step"]), round(100 * float(status["progress"]))
    stage = f"Step {step}/{status['steps']}: {status['stage']}" if step else f"Starting: {status['detail']}"
    steps = "".join(
        f'<li class="{"done" if i + 1 < step else "current" if i + 1 == step else ""}">{html.escape(name)}</li>'
        for i, name in enumerate(STAGES)
    )
    values = {
        "__STAGE__": html.escape(stage),
        "__PROGRESS__": f"{float(status['progress']):.3f}",
        "__PERCENT__": f"{percent} %",
        "__SUMMARY__": html.escape(f"{percent} % after {status['elapsed_seconds']:.0f} s — {status['detail']}"),
        "__STEPS__": steps,
        "__LOG__": html.escape(str(status.get("log", "-"))),
        "__LOG_TAIL__": html.escape(str(status.get("log_tail", ""))),
    }
    page = TEMPLATE.read_text(encoding="utf-8")
    for key, value in values.items():
        page = page.replace(key, value)
    return page
