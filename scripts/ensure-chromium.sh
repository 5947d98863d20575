#!/usr/bin/env bash
# The demo page's browser test drives Debian's `chromium` through Playwright (no browser
# download). Install the distribution package when missing and we are root, with a CJK font
# so the Japanese and Chinese examples render in the screenshots.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "chromium not found: installing it with apt-get ..."
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-wqy-zenhei >/dev/null
else
  echo "chromium is required by the demo page's browser test. Install it first, e.g.:" >&2
  echo "  sudo apt-get install chromium    (Debian)" >&2
  exit 1
fi
