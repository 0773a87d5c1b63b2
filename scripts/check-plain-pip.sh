#!/usr/bin/env bash
# Installs concatfl the plain-pip way (`pip install -e .`, no install script) into a fresh
# virtual environment and runs a short simulation with it through `flwr run`. Proves that
# pyproject.toml declares everything a simulation needs (Ray included, via flwr[simulation]) and
# resolves to the Flower version concatfl is tested with.
#   scripts/check-plain-pip.sh    (everything it creates goes to a temporary directory, removed after)
set -euo pipefail
cd "$(dirname "$0")/.."
scratch="$(mktemp -d -t concatfl-pip-check-XXXXXX)"
trap 'rm -rf "$scratch"' EXIT
unset PYTHONPATH
started=$SECONDS
"${PYTHON:-python3}" -m venv "$scratch/venv"
pip=("$scratch/venv/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first: a CPU build here; an unpinned torch would pull the newest (CUDA) build.
"${pip[@]}" "torch==${TORCH_VERSION:-2.13.0}"
"${pip[@]}" -e .
"$scratch/venv/bin/python" -c "import flwr, ray; assert flwr.__version__.startswith('1.42.'), flwr.__version__"
installed=$SECONDS
(cd "$scratch" && "$scratch/venv/bin/python" -m concatfl.launch --num-supernodes 2 --run-config "num-server-rounds=2")
test -f "$scratch/outputs/metrics.json"
echo "plain pip install: $((installed - started)) s; 2-round simulation: $((SECONDS - installed)) s"
