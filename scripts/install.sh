#!/usr/bin/env bash
# Create .venv (if needed) and install tonearm with the given extras, torch pinned to the
# CPU build by constraints.txt. Re-running is cheap: a stamp file skips pip when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-train,service}"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
fi
stamp=".venv/.tonearm-installed-$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)-${extras//,/_}"
if [ ! -f "$stamp" ]; then
  echo "installing tonearm[$extras] into .venv (torch pinned by constraints.txt) ..."
  .venv/bin/python -m pip install --quiet -c constraints.txt -e ".[$extras]"
  touch "$stamp"
fi
