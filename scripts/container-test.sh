#!/usr/bin/env bash
# Build the `service` image from the repository's Dockerfile and run it for real with podman:
# read-only root, non-root user, a tmpfs for scratch, Redis beside it on a private network,
# a bundle mounted read-only from the host. Checks /readyz, a text search, an audio search,
# the admin listing, the HEALTHCHECK, that torch and the training code are absent, and that
# bad deployment input (no admin token, unreadable bundles volume) fails clearly at start.
# Cleans up every container, volume and network it started (also on failure).
#
#   sudo scripts/container-test.sh [BUNDLE_DIR]
#
# BUNDLE_DIR: a bundle directory (default: a tiny bundle built once with this repository's
# code and cached under ~/.cache/tonearm/containers). Needs root: podman runs rootful here,
# with runc and the cgroupfs manager (see containers.conf below); no system-wide change.
# The base image is made locally (scripts/container-base.sh) because no registry is needed.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
step() { echo "[container-test +$((SECONDS - started))s] $*"; }
die() { echo "container-test: error: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (rootful podman with runc); run: sudo scripts/container-test.sh"
for tool in podman debootstrap runc curl; do
  command -v "$tool" >/dev/null || die "$tool not found; run scripts/ensure-container-tools.sh (as root)"
done
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3

run_id="tonearm-test-$$"
work="$(mktemp -d /var/tmp/tonearm-container-test.XXXXXX)"
chmod 755 "$work"
cleanup() {
  podman rm -f -v -t 2 "$run_id-svc" "$run_id-ro" "$run_id-redis" >/dev/null 2>&1 || true
  podman volume rm -f "$run_id-home" "$run_id-items" >/dev/null 2>&1 || true
  podman network rm -f "$run_id" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Measured on Debian 12 VMs: crun cannot set RLIMIT_NOFILE and the cgroups are hybrid, so
# podman runs with runc, cgroupfs and explicit ulimits (only for this script's commands).
cat >"$work/containers.conf" <<'EOF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
export CONTAINERS_CONF="$work/containers.conf"

# ---------------------------------------------------------------- bundle
bundle="${1:-}"
if [ -z "$bundle" ]; then
  cache="${TONEARM_CONTAINER_CACHE:-$HOME/.cache/tonearm/containers}/test-bundles"
  bundle="$(find "$cache" -mindepth 2 -maxdepth 2 -name manifest.json -printf '%h\n' 2>/dev/null | head -n1 || true)"
  if [ -z "$bundle" ]; then
    step "building a tiny bundle with this repository's code (synth tiny -> train configs/tiny.yaml -> export) ..."
    PYTHONPATH="$PWD" "$python" - "$cache" "$work/build" <<'EOF'
import sys
from pathlib import Path

from training.config import load_train_config
from training.data.synth import generate_corpus
from training.bundle.export import export_bundle
from training.loop import train

cache, work = Path(sys.argv[1]), Path(sys.argv[2])
manifest = generate_corpus(size="tiny", seed=0, out_dir=work / "corpus")
cfg = load_train_config(Path("configs/tiny.yaml"), [f"data.manifest={manifest}", f"out_dir={work / 'run'}"])
run = train(cfg)
export_bundle(run / "best", manifest=manifest, out_dir=cache, progress=False)
EOF
    bundle="$(find "$cache" -mindepth 2 -maxdepth 2 -name manifest.json -printf '%h\n' | head -n1)"
  fi
fi
[ -f "$bundle/manifest.json" ] || die "$bundle: not a bundle directory (no manifest.json)"
bundle_id="$(basename "$bundle")"
# A world-readable copy: the service runs as uid 10001 and the host's copy may be private.
mkdir -p "$work/bundles" && cp -r "$bundle" "$work/bundles/$bundle_id" && chmod -R a+rX "$work/bundles"

# ---------------------------------------------------------------- images
step "images (base, service target, redis) ..."
read -r image redis_image < <(PYTHON="$python" scripts/container-image.sh "$work")
[ -n "$redis_image" ] || die "scripts/container-image.sh failed"
step "images built: $image, $redis_image"

# ---------------------------------------------------------------- image contents
user="$(podman image inspect --format '{{.Config.User}}' "$image")"
[[ "$user" =~ ^[1-9][0-9]*(:[0-9]+)?$ ]] || die "image USER is '$user', not a numeric non-root uid"
[ -n "$(podman image inspect --format '{{.Config.Healthcheck}}' "$image" | grep -v '<nil>')" ] || die "image has no HEALTHCHECK"
absent="$(podman run --rm --read-only --no-healthcheck "$image" python -c '
import importlib.util
print(" ".join(m for m in ("torch", "training", "transformers") if importlib.util.find_spec(m) is not None))')"
[ -z "$absent" ] || die "the service image contains: $absent"
step "image: USER $user, HEALTHCHECK set, no torch / training / transformers"

# ---------------------------------------------------------------- bad input fails at start
token="$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
expect_refusal() {  # NAME EXPECTED-TEXT podman-run-args...
  local name="$1" expected="$2" out rc=0
  shift 2
  out="$(timeout 60 podman run --rm --no-healthcheck --read-only --tmpfs /tmp "$@" "$image" 2>&1)" || rc=$?
  [ "$rc" != 0 ] || die "$name: the service started (exit 0); expected a refusal"
  grep -q "$expected" <<<"$out" || die "$name: exit $rc without '$expected' in: $out"
  step "refused as expected ($name): $(grep -m1 "$expected" <<<"$out")"
}
expect_refusal "no admin token" "TONEARM_ADMIN_TOKEN" -v "$work/bundles:/bundles:ro" -e "TONEARM_BUNDLE=$bundle_id"
mkdir -p "$work/private" && cp -r "$work/bundles/$bundle_id" "$work/private/" && chmod 700 "$work/private"
expect_refusal "unreadable bundles volume" "TONEARM_BUNDLES_DIR" -v "$work/private:/bundles:ro" \
  -e "TONEARM_BUNDLE=$bundle_id" -e "TONEARM_ADMIN_TOKEN=$token"

# ---------------------------------------------------------------- run: redis + service
podman network create "$run_id" >/dev/null
podman run -d --name "$run_id-redis" --network "$run_id" --network-alias redis --read-only "$redis_image" \
  redis-server --save '' --appendonly no --protected-mode no --maxmemory 64mb --maxmemory-policy allkeys-lru >/dev/null
for _ in $(seq 1 50); do
  podman exec "$run_id-redis" redis-cli ping >/dev/null 2>&1 && break
  sleep 0.2
done
podman exec "$run_id-redis" redis-cli ping >/dev/null || die "the redis container does not answer"
port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
podman volume create "$run_id-home" >/dev/null
podman volume create "$run_id-items" >/dev/null
# items default to <bundles>/.items: on the read-only bundles mount alone the replica must say it is
# not ready (items-unavailable), never serve without the takedowns
podman run -d --name "$run_id-ro" --network "$run_id" --health-interval disable --read-only \
  --tmpfs /tmp:rw,size=64m,mode=1777 -v "$work/bundles:/bundles:ro" \
  -e "TONEARM_BUNDLE=$bundle_id" -e "TONEARM_ADMIN_TOKEN=$token" "$image" >/dev/null
podman run -d --name "$run_id-svc" --network "$run_id" --health-interval disable -p "127.0.0.1:$port:8000" \
  --read-only --tmpfs /tmp:rw,size=64m,mode=1777 \
  -v "$work/bundles:/bundles:ro" -v "$run_id-home:/var/lib/tonearm" -v "$run_id-items:/items" \
  -e "TONEARM_BUNDLE=$bundle_id" -e "TONEARM_ADMIN_TOKEN=$token" -e "TONEARM_ITEMS_DIR=/items" \
  -e "TONEARM_REDIS_URL=redis://redis:6379/0" "$image" >/dev/null
url="http://127.0.0.1:$port"
for _ in $(seq 1 180); do
  curl -sf "$url/readyz" >/dev/null 2>&1 && break
  [ "$(podman inspect --format '{{.State.Running}}' "$run_id-svc")" = true ] \
    || { podman logs "$run_id-svc" >&2; die "the service container exited"; }
  sleep 0.5
done
curl -sf "$url/readyz" >/dev/null || { podman logs "$run_id-svc" >&2; die "/readyz not 200 after 90 s"; }
step "service ready at $url"
ro_ready=""
for _ in $(seq 1 180); do  # 90 s, as for the serving replica (a loaded CI machine)
  ro_ready="$(podman exec "$run_id-ro" python -c '
import urllib.error, urllib.request
try:
    urllib.request.urlopen("http://127.0.0.1:8000/readyz", timeout=2); print("200")
except urllib.error.HTTPError as err:
    print(err.code, err.read().decode())
except OSError:
    print("down")' 2>/dev/null || true)"
  case "$ro_ready" in 503*items-unavailable*) break ;; esac
  sleep 0.5
done
case "$ro_ready" in
  503*items-unavailable*) step "read-only item log: /readyz 503 items-unavailable (not ready, as it must be)" ;;
  *) podman logs "$run_id-ro" >&2; die "a replica on the read-only bundles mount alone answered /readyz: $ro_ready" ;;
esac
# the logs in a variable first: `podman logs | grep -q` under pipefail fails when grep stops reading
# early (SIGPIPE), and the line may land just after /readyz answers
ro_logged=""
for _ in $(seq 1 40); do
  ro_log="$(podman logs "$run_id-ro" 2>&1 || true)"
  if grep -q "cannot be opened for writing" <<<"$ro_log"; then ro_logged=1; break; fi
  sleep 0.5
done
[ -n "$ro_logged" ] || { echo "$ro_log" >&2; die "the read-only replica did not log why"; }

check() {  # NAME PYTHON-EXPRESSION-ON-r  (r = parsed JSON body)
  "$python" -c "import json, sys; r = json.load(sys.stdin); assert $2, r" \
    || { podman logs "$run_id-svc" >&2; die "$1 failed"; }
}
curl -sf "$url/v1/search/text" -H 'content-type: application/json' -d '{"query": "a dog barks", "k": 3}' \
  | check "text search" "r['bundle_id'] == '$bundle_id' and len(r['hits']) == 3"
"$python" - "$work/tone.wav" <<'EOF'
import math, struct, sys, wave
with wave.open(sys.argv[1], "wb") as w:
    w.setnchannels(1); w.setsampwidth(2); w.setframerate(16000)
    w.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * 440 * i / 16000))) for i in range(16000)))
EOF
curl -sf "$url/v1/search/audio?k=3&lang=eng" --data-binary "@$work/tone.wav" \
  | check "audio search" "r['bundle_id'] == '$bundle_id' and 0 < len(r['hits']) <= 3 and {h['lang'] for h in r['hits']} == {'eng'}"
curl -sf "$url/v1/bundles" -H "authorization: Bearer $token" \
  | check "admin listing" "r['active'] == '$bundle_id'"
# The cache goes through Redis: a repeated query is a Redis hit.
for _ in 1 2; do
  curl -sf "$url/v1/search/text" -H 'content-type: application/json' -d '{"query": "rain on a roof", "k": 3}' >/dev/null
done
metrics="$(curl -sf "$url/metrics")"
grep -q '^tonearm_redis_up 1' <<<"$metrics" || die "tonearm_redis_up is not 1 (redis beside the service unused)"
[ "$(podman exec "$run_id-redis" redis-cli dbsize)" -gt 0 ] || die "no key written to redis"
step "text search, audio search, admin listing and redis answered"

uid="$(podman exec "$run_id-svc" id -u)"
[ "$uid" != 0 ] || die "the service runs as root"
if podman exec "$run_id-svc" touch /app/probe 2>/dev/null; then die "the root filesystem is writable"; fi
podman exec "$run_id-svc" touch /tmp/probe || die "the /tmp tmpfs is not writable"
podman healthcheck run "$run_id-svc" >/dev/null || die "HEALTHCHECK failed"
step "runs as uid $uid, root filesystem read-only, /tmp writable, HEALTHCHECK passes"
step "PASS"
