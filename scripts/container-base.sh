#!/usr/bin/env bash
# Make (once) and import a local Debian bookworm base image for offline builders:
# debootstrap --variant=minbase with python3, venv, pip and ca-certificates, plus this
# host's CA certificates (HTTPS from a build behind a TLS-inspecting proxy needs them).
# The root filesystem is cached as a tarball under $TONEARM_CONTAINER_CACHE (default
# ~/.cache/tonearm/containers), keyed by the host's CA bundle, so reruns skip debootstrap.
# Prints the image name on stdout (progress on stderr). Needs root (debootstrap, podman).
set -euo pipefail
cache="${TONEARM_CONTAINER_CACHE:-$HOME/.cache/tonearm/containers}"
ca_bundle=/etc/ssl/certs/ca-certificates.crt
[ -r "$ca_bundle" ] || { echo "error: $ca_bundle not found: install ca-certificates on the host" >&2; exit 1; }
key="$( (cat "$ca_bundle"; echo bookworm-minbase-v1) | sha256sum | cut -c1-12)"
image="localhost/tonearm-base:bookworm-$key"
tarball="$cache/base-bookworm-$key.tar"

if podman image exists "$image"; then
  echo "$image"; exit 0
fi

host_mirror() {
  # The host's Debian mirror: first URIs of a deb822 .sources file, else a `deb URL` line.
  local uri
  uri="$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -n1 || true)"
  [ -n "$uri" ] || uri="$(grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}' | grep -v security | head -n1 || true)"
  echo "${uri:-http://deb.debian.org/debian}"
}

if [ ! -s "$tarball" ]; then
  command -v debootstrap >/dev/null || { echo "error: debootstrap not found: run scripts/ensure-container-tools.sh" >&2; exit 1; }
  mirror="$(host_mirror)"
  rootfs="$(mktemp -d /var/tmp/tonearm-rootfs.XXXXXX)"
  trap 'rm -rf "$rootfs"' EXIT
  echo "making the local base image (debootstrap bookworm minbase from $mirror, ~2 min, cached) ..." >&2
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 \
    || { tail -n 20 "$rootfs.log" >&2; echo "error: debootstrap failed (log above)" >&2; exit 1; }
  rm -f "$rootfs.log"
  # The host's trust store (it holds the proxy's CA when there is one) replaces the image's,
  # and its local CAs are kept so update-ca-certificates inside the image keeps them.
  cp "$ca_bundle" "$rootfs/etc/ssl/certs/ca-certificates.crt"
  if compgen -G "/usr/local/share/ca-certificates/*" >/dev/null; then
    cp -r /usr/local/share/ca-certificates/. "$rootfs/usr/local/share/ca-certificates/"
  fi
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  mkdir -p "$cache"
  tar -C "$rootfs" --numeric-owner -cf "$tarball.part" .
  mv "$tarball.part" "$tarball"
fi
echo "importing $tarball as $image ..." >&2
podman import --change 'CMD ["/bin/bash"]' "$tarball" "$image" >/dev/null
echo "$image"
