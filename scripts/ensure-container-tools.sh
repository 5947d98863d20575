#!/usr/bin/env bash
# The container test (scripts/container-test.sh) builds and runs the image with podman, and
# makes its base image with debootstrap. Install them (with buildah, runc and curl) when
# missing and we are root; otherwise say what to install. Never fails `make test` by itself:
# the container test decides (it fails under CI=true, and skips with the reason elsewhere).
set -euo pipefail
tools=(podman buildah runc debootstrap curl)
missing=()
for tool in "${tools[@]}"; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
[ "${#missing[@]}" = 0 ] && exit 0
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "container tools missing (${missing[*]}): installing them with apt-get ..."
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
else
  echo "note: the container test needs root and ${missing[*]}; it will be skipped. Install with:" >&2
  echo "  sudo apt-get install ${missing[*]}    (Debian/Ubuntu)" >&2
fi
