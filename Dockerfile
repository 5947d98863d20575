# syntax=docker/dockerfile:1
# tonearm images (docs/deploy.md). Two targets:
#   service — search service: the core + `service` extra (onnxruntime, faiss, tokenizers,
#             soundfile, FastAPI). No torch, no training code.
#   train   — training + export: the `train` extra (torch). VARIANT=cuda swaps in the GPU
#             builds of faiss and onnxruntime; use a CUDA BASE_IMAGE with it.
#
#   docker build --target service -t tonearm:service .
#   docker build --target service --build-arg SERVICE_EXTRAS="service milvus" -t tonearm:service-milvus .
#   docker build --target train -t tonearm:train .
#   docker build --target train --build-arg VARIANT=cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 -t tonearm:train-cuda .
#
# BASE_IMAGE: any Debian/Ubuntu image; python3 (>= 3.11) is installed with apt when it lacks
# one. Offline builders pass a locally made base (scripts/container-base.sh).
# PIP_* build arguments are pip's own environment variables (index mirror, certificates).
ARG BASE_IMAGE=python:3.11-slim-bookworm
# Global defaults; each stage that runs pip declares them again to see them.
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_TRUSTED_HOST=
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt

# ---------------------------------------------------------------- base: python venv + user
FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Plain Debian/Ubuntu/CUDA bases have no python: install the distribution's (>= 3.11 needed).
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null || ! python3 -c 'import venv, ensurepip' 2>/dev/null; then \
      apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv python3-pip ca-certificates && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -c 'import sys; assert sys.version_info >= (3, 11), "tonearm needs Python >= 3.11, base has " + sys.version' \
    && python3 -m venv /opt/venv \
    && groupadd --gid 10001 tonearm \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin tonearm \
    && mkdir -p /app /bundles /items /var/lib/tonearm \
    && chown 10001:10001 /var/lib/tonearm /items
WORKDIR /app

# ---------------------------------------------------------------- requirements lists
# Derived from pyproject.toml in a stage of their own: the dependency layers below are
# cached on these lists, so editing pyproject.toml elsewhere (another extra, a tool's
# settings) does not reinstall them.
FROM base AS requirements
# Extras of the service image: add `milvus` for TONEARM_INDEX_BACKEND=milvus.
ARG SERVICE_EXTRAS=service
COPY pyproject.toml constraints.txt ./
COPY scripts/requirements.py scripts/
# hadolint ignore=SC2086
RUN python scripts/requirements.py $SERVICE_EXTRAS > requirements-service.txt \
    && python scripts/requirements.py train service > requirements-train.txt

# ---------------------------------------------------------------- service
FROM base AS service
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_TRUSTED_HOST
ARG PIP_CERT
# Dependency layer first: code changes do not reinstall it.
COPY --from=requirements /app/requirements-service.txt /app/constraints.txt /tmp/
RUN pip install --no-compile -c /tmp/constraints.txt -r /tmp/requirements-service.txt \
    && rm /tmp/requirements-service.txt /tmp/constraints.txt
COPY tonearm/ tonearm/
COPY index/ index/
COPY service/ service/
# Compiled now: the root filesystem is read-only at run time.
RUN python -m compileall -q /app /opt/venv \
    && printf '#!/opt/venv/bin/python\nfrom tonearm.cli import main\nraise SystemExit(main())\n' > /opt/venv/bin/tonearm \
    && chmod 755 /opt/venv/bin/tonearm
ENV PYTHONPATH=/app \
    HOME=/tmp \
    TONEARM_HOST=0.0.0.0 \
    TONEARM_PORT=8000 \
    TONEARM_ENVIRONMENT=production \
    TONEARM_ADMIN_ENABLED=true \
    TONEARM_BUNDLES_DIR=/bundles \
    TONEARM_HOME=/var/lib/tonearm
VOLUME ["/bundles", "/var/lib/tonearm"]
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('TONEARM_PORT', '8000'), timeout=4)"]
CMD ["tonearm", "serve"]

# ---------------------------------------------------------------- train
FROM base AS train
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_TRUSTED_HOST
ARG PIP_CERT
ARG VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG GPU_PACKAGES="faiss-gpu-cu12 onnxruntime-gpu"
COPY --from=requirements /app/requirements-train.txt /app/constraints.txt /tmp/
# torch comes from TORCH_INDEX_URL alone (pinned by constraints.txt), so an unreachable CPU
# index fails the build instead of falling back to PyPI's multi-GB CUDA build. The GPU
# packages are a build argument: pin them there (e.g. "faiss-gpu-cu12==1.10.0").
# hadolint ignore=DL3013
RUN case "$VARIANT" in cpu|cuda) ;; *) echo "VARIANT must be cpu or cuda, not $VARIANT" >&2; exit 1;; esac \
    && pip install --no-compile --index-url "$TORCH_INDEX_URL" -c /tmp/constraints.txt torch \
    && pip install --no-compile -c /tmp/constraints.txt -r /tmp/requirements-train.txt \
    && if [ "$VARIANT" = cuda ]; then \
         pip uninstall -y faiss-cpu onnxruntime && pip install --no-compile $GPU_PACKAGES; \
       fi \
    && rm /tmp/requirements-train.txt /tmp/constraints.txt
COPY tonearm/ tonearm/
COPY index/ index/
COPY service/ service/
COPY training/ training/
COPY configs/ configs/
RUN python -m compileall -q /app \
    && printf '#!/opt/venv/bin/python\nfrom tonearm.cli import main\nraise SystemExit(main())\n' > /opt/venv/bin/tonearm \
    && chmod 755 /opt/venv/bin/tonearm \
    && mkdir -p /runs && chown 10001:10001 /runs
ENV PYTHONPATH=/app \
    HOME=/tmp \
    TONEARM_HOME=/var/lib/tonearm
VOLUME ["/bundles", "/runs"]
USER 10001:10001
CMD ["tonearm", "--help"]
