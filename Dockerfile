# One image for every concatfl container: the SuperLink runs the ServerApp and each SuperNode
# runs the ClientApp as subprocesses (Flower's `subprocess` isolation), so all of them need
# concatfl and its dependencies installed; the same image also carries the `flwr` CLI.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY requirements ./requirements
COPY scripts ./scripts
COPY concatfl ./concatfl
# TORCH_VERSION may name a CUDA build for GPU hosts, e.g. 2.13.0 from the CUDA wheel index.
ARG TORCH_VERSION=2.13.0
RUN PYTHON=python3 TORCH_VERSION=${TORCH_VERSION} bash scripts/install.sh \
    && rm -rf /root/.cache/pip
ENV PATH=/app/.venv/bin:$PATH \
    FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
