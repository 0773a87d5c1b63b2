# One image for every concatfl container. In Flower's default `subprocess` isolation the SuperLink
# runs the ServerApp and each SuperNode runs the ClientApp as subprocesses, so all of them need
# concatfl and its dependencies (Flower's Docker guide extends its images with the app's
# dependencies the same way). The image also carries the `flwr` CLI (services `register` and
# `submit`), concatfl's warm ClientApp executor (deploy/supernode.sh) and HAProxy (service
# `fleet-door`).
#
#   docker build -t concatfl:0.1.0 .                     # from the package index (needs internet)
#   deploy/build-images.sh                               # offline: local base image and wheelhouse
#
# BASE_IMAGE: any Debian-like image with python3 (3.11+) and its venv module. TORCH_VERSION may
# name a CUDA build for GPU hosts (see docs/deployment.md, "GPUs"); CPU wheels by default.
ARG BASE_IMAGE=python:3.11-slim

# The dependencies pyproject.toml declares, except Ray (flwr[simulation] becomes flwr: containers
# run real SuperLinks and SuperNodes, never Ray's simulation; 220 MB less). A stage of its own, so
# that the environment below is rebuilt only when this list changes, not with every edit of
# pyproject.toml.
FROM ${BASE_IMAGE} AS requirements
COPY pyproject.toml /tmp/
RUN python3 -c 'import tomllib; print("\n".join(tomllib.load(open("/tmp/pyproject.toml", "rb"))["project"]["dependencies"]))' \
        | sed 's/^flwr\[simulation\]/flwr/' > /requirements.txt

# The virtual environment. deploy/wheelhouse/ (filled by deploy/build-images.sh) holds every wheel
# needed; when it has none, pip uses the package index. The wheelhouse stays in this stage: the
# final image copies only the environment.
FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
COPY --from=requirements /requirements.txt /tmp/requirements.txt
COPY deploy/wheelhouse /wheelhouse
RUN set -e; \
    if ls /wheelhouse/*.whl >/dev/null 2>&1; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse; \
    else export PIP_EXTRA_INDEX_URL="$TORCH_INDEX_URL"; fi; \
    python3 -m venv /app/.venv; \
    /app/.venv/bin/pip install --no-cache-dir --disable-pip-version-check "torch==$TORCH_VERSION" -r /tmp/requirements.txt

FROM ${BASE_IMAGE}
WORKDIR /app
# HAProxy from Debian's packages: the fleet door in front of the SuperLink (deploy/haproxy.cfg).
# deploy/build-images.sh's debootstrap base has it already; another base gets it from its apt.
RUN command -v haproxy >/dev/null || { apt-get update \
        && apt-get install -y --no-install-recommends haproxy && rm -rf /var/lib/apt/lists/*; }
# Like Flower's images: run as the unprivileged user `app` (uid 49999), which must be able to read
# the mounted certificates (chown 49999 deploy/certs) and owns the state and output volumes.
RUN useradd --create-home --uid 49999 app \
    && mkdir -p /var/lib/flwr /outputs \
    && chown app:app /var/lib/flwr /outputs
COPY --from=build /app/.venv /app/.venv
# The project's source, not installed: Flower runs the ServerApp and ClientApp from the app bundle
# it installs (`flwr run /app`, service `submit`, builds that bundle from here), and the warm
# executor runs as `python -m concatfl.deployment.warm_executor` from /app. So a code change rebuilds only
# these small layers, never the environment.
COPY pyproject.toml README.md ./
COPY concatfl ./concatfl
COPY deploy/healthcheck.py deploy/register-supernodes.sh deploy/supernode.sh deploy/haproxy.cfg ./deploy/
USER app
# FLWR_SUPEREXEC_TASK_POLL_INTERVAL: the SuperExec looks for new ServerApp/ClientApp tasks every
# 0.1 s instead of 1 s (measured in docs/deployment.md, "Latency").
ENV PATH=/app/.venv/bin:$PATH \
    FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1
