#!/usr/bin/env bash
# A SuperNode container's entrypoint:  deploy/supernode.sh flower-supernode ARG...
#
# CONCATFL_EXECUTOR=warm (default): the SuperNode runs through concatfl's launcher with --warm-executor
# (Flower's SuperNode with short waits, concatfl/deployment/supernode.py, running concatfl's warm
# executor, concatfl/deployment/warm_executor.py, in its own process: one long-lived ClientApp process
# for all tasks, a child of the SuperNode that exits with it). CONCATFL_EXECUTOR=stock: Flower's own
# SuperNode and executor (a new ClientApp process per message), the command as given.
set -euo pipefail
executor=${CONCATFL_EXECUTOR:-warm}
case $executor in
    stock) exec "$@" ;;
    warm) ;;
    *) echo "supernode.sh: CONCATFL_EXECUTOR must be 'warm' or 'stock', got '$executor'" >&2; exit 2 ;;
esac
if [[ ${1:-} != flower-supernode ]]; then
    echo "supernode.sh: the command must start with flower-supernode, got '${1:-}'" >&2; exit 2
fi
shift
app_dir=$(cd "$(dirname "$0")/.." && pwd)
PYTHONPATH="$app_dir${PYTHONPATH:+:$PYTHONPATH}" exec python -m concatfl.deployment.supernode --warm-executor "$@"
