#!/usr/bin/env bash
# Build (podman's layer cache makes a rebuild of unchanged sources a no-op) the images the
# container checks run: the repository's Dockerfile `service` target as localhost/tonearm:service-test
# and a Redis image from the same local base. Shared by scripts/container-test.sh and
# scripts/k8s-rehearsal.sh, so both run the same image. Prints "SERVICE_IMAGE REDIS_IMAGE" on
# stdout; progress and build-log tails on stderr. Needs root (rootful podman).
#
#   scripts/container-image.sh [LOG_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
work="${1:-$(mktemp -d /var/tmp/tonearm-image.XXXXXX)}"
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3
die() { echo "container-image: error: $*" >&2; exit 1; }
step() { echo "[container-image] $*" >&2; }
if [ -z "${CONTAINERS_CONF:-}" ]; then  # the settings of scripts/container-test.sh (runc, cgroupfs)
  cat >"$work/containers.conf" <<'EOF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
  export CONTAINERS_CONF="$work/containers.conf"
fi

step "base image ..."
base="$(scripts/container-base.sh)"
step "base image: $base"

# pip inside the build reaches the index the way this host does; file:// indexes are local
# to the host and cannot be seen from a build, so they are left out.
pip_setting() {
  "$python" -m pip config list 2>/dev/null | sed -n "s/^[^.]*\.$1='\(.*\)'\$/\1/p" | head -n1
}
reachable() { tr ' ' '\n' | grep -v '^file:' | grep -v '^$' | paste -sd' ' || true; }
index_url="$(echo "${PIP_INDEX_URL:-$(pip_setting index-url)}" | reachable)"
extra_urls="$(echo "${PIP_EXTRA_INDEX_URL:-$(pip_setting extra-index-url)}" | reachable)"
trusted="${PIP_TRUSTED_HOST:-$(pip_setting trusted-host)}"
build_args=(--build-arg "BASE_IMAGE=$base" --build-arg "PIP_EXTRA_INDEX_URL=$extra_urls" --build-arg "PIP_TRUSTED_HOST=$trusted")
[ -n "$index_url" ] && build_args+=(--build-arg "PIP_INDEX_URL=$index_url")
image="localhost/tonearm:service-test"
step "building the service target (${index_url:-default index}) ..."
# --format docker keeps HEALTHCHECK (the OCI image format has no such field).
podman build --force-rm --format docker --network host --target service "${build_args[@]}" -t "$image" . \
  >"$work/build.log" 2>&1 || { tail -n 40 "$work/build.log" >&2; die "podman build of the service target failed (log tail above)"; }
redis_image="localhost/tonearm-redis-test:${base##*:}"
if ! podman image exists "$redis_image"; then
  step "building a redis image from the same base (apt-get install redis-server) ..."
  printf 'FROM %s\nRUN apt-get update && apt-get install -y --no-install-recommends redis-server && rm -rf /var/lib/apt/lists/*\nUSER 999:999\n' "$base" \
    | podman build --force-rm --network host -t "$redis_image" -f - "$work" >"$work/redis-build.log" 2>&1 \
    || { tail -n 40 "$work/redis-build.log" >&2; die "redis image build failed (log tail above)"; }
fi
step "images built"
echo "$image $redis_image"
