# One image for every concatfl container. In Flower's default `subprocess` isolation the SuperLink
# runs the ServerApp and each SuperNode runs the ClientApp as subprocesses, so all of them need
# concatfl and its dependencies (this is what Flower's Docker guide does by extending the
# flwr/superlink and flwr/supernode images with the app's dependencies, through concatfl's install
# script, which pins torch first). The image also carries the `flwr` CLI (services `register` and
# `submit`).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY scripts ./scripts
COPY concatfl ./concatfl
# TORCH_VERSION may name a CUDA build for GPU hosts (see docs/deployment.md, "GPUs").
ARG TORCH_VERSION=2.13.0
RUN PYTHON=python3 TORCH_VERSION=${TORCH_VERSION} bash scripts/install.sh \
    && rm -rf /root/.cache/pip
COPY deploy/healthcheck.py deploy/register-supernodes.sh ./deploy/
# Like Flower's images: run as the unprivileged user `app` (uid 49999), which must be able to read
# the mounted certificates (chown 49999 deploy/certs) and owns the state and output volumes.
RUN useradd --create-home --uid 49999 app \
    && mkdir -p /var/lib/flwr /outputs \
    && chown app:app /var/lib/flwr /outputs
USER app
# FLWR_SUPEREXEC_TASK_POLL_INTERVAL: the SuperExec looks for new ServerApp/ClientApp tasks every
# 0.1 s instead of 1 s (measured in docs/deployment.md, "Latency").
ENV PATH=/app/.venv/bin:$PATH \
    FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1
