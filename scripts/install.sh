#!/usr/bin/env bash
# Creates .venv (if missing) and installs concatfl with everything it needs to run and test.
#
# - torch is installed first and pinned, so that nothing later pulls another (CUDA) build.
# - flwr 1.42.0 pins certifi>=2026.10.19, which the package registry does not serve yet (flwr never
#   imports certifi): its other requirements come from requirements/flwr-runtime.txt and flwr
#   itself is installed with --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" "torch==${TORCH_VERSION:-2.13.0}"
"${pip[@]}" -r requirements/flwr-runtime.txt -r requirements/app.txt -r requirements/test.txt
"${pip[@]}" --no-deps "flwr==1.42.0"
"${pip[@]}" --no-deps -e .
.venv/bin/python -c "import concatfl, flwr, torch; print(f'concatfl ready: flwr {flwr.__version__}, torch {torch.__version__}')"
