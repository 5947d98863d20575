"""Print the requirements of tonearm's core plus the given extras, one per line (pyproject.toml).

The Dockerfile installs them in a layer of its own, before the code is copied, so a code
change does not reinstall dependencies. Usage: ``python3 scripts/requirements.py service``.
Standard library only (the image has nothing else yet).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in optional]
    if unknown:
        raise SystemExit(f"{pyproject}: no extra named {', '.join(unknown)} (known: {', '.join(optional)})")
    lines = list(project["dependencies"])
    for extra in extras:
        lines += optional[extra]
    return lines


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[1]
    sys.stdout.write("\n".join(requirements(root / "pyproject.toml", sys.argv[1:])) + "\n")
