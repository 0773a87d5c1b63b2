#!/usr/bin/env bash
# Creates .venv (if missing) and installs concatfl with everything it needs to run and test.
#
# - torch is installed first and pinned, so that nothing later pulls another (CUDA) build.
# - Then concatfl itself, editable, with the dependencies pyproject.toml declares (flwr[simulation]
#   1.42 brings Ray) and the `test` extra.
# - .venv/.concatfl-install records what was installed: a hash of pyproject.toml, this script, the
#   torch version and the Python. When it matches and concatfl imports from this checkout, nothing
#   is installed again (`make demo` / `make test` start at once); delete the file to force it.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
torch_version="${TORCH_VERSION:-2.13.0}"
stamp=.venv/.concatfl-install
key="$({ cat pyproject.toml scripts/install.sh; echo "torch==$torch_version"; "$python" --version; } | sha256sum | cut -d' ' -f1)"
report() {  # the installed versions (from the package metadata: no slow imports), then $1
  .venv/bin/python -c "from importlib.metadata import version as v; print(f'concatfl ready: flwr {v(\"flwr\")}, torch {v(\"torch\")}$1')"
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && .venv/bin/python -c \
  "import concatfl, sys; sys.exit(concatfl.__file__ != '$PWD/concatfl/__init__.py')" 2>/dev/null; then
  report " (already installed; delete $stamp to reinstall)"
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
rm -f "$stamp"
# pip byte-compiles every module it installs, one file after another (~35 s of torch, Ray and
# Flower on 2 cores); compileall does the same on every core once pip is done. Like pip, it
# leaves a file it cannot compile (a few packages ship Python 2 examples) to Python's import.
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-compile)
"${pip[@]}" "torch==$torch_version"
"${pip[@]}" -e ".[test]"
.venv/bin/python -m compileall -q -j 0 .venv/lib/python3*/site-packages >/dev/null || true
.venv/bin/python -c "import concatfl, flwr, ray, torch"
report ""
echo "$key" > "$stamp"
