#!/usr/bin/env bash
# The service tests need the redis-server binary (they start their own servers on free
# ports, and use 127.0.0.1:6379 when it answers). Install it when missing and we are root.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "redis-server not found: installing it with apt-get ..."
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
else
  echo "redis-server is required by the service tests. Install it first, e.g.:" >&2
  echo "  sudo apt-get install redis-server    (Debian/Ubuntu)" >&2
  echo "  brew install redis                   (macOS)" >&2
  exit 1
fi
