#!/usr/bin/env bash
# A SuperNode container's entrypoint:  deploy/supernode.sh flower-supernode ARG...
#
# CONCATFL_EXECUTOR=warm (default): the SuperNode runs through concatfl's launcher (Flower's SuperNode
# with short fixed waits, concatfl/deployment/supernode.py) with --isolation=process, and concatfl's warm
# executor (concatfl/deployment/warm_executor.py) runs its ClientApp tasks beside it, in one long-lived
# process. CONCATFL_EXECUTOR=stock: Flower's own SuperNode and executor (a new ClientApp process
# per message), the command as given.
# When either process ends, the other is stopped and the container exits with the first one's
# status, so the container's restart policy restarts both.
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
runtime_port=9094  # flower-supernode's default --port (its Runtime API)
for arg in "$@"; do
    case $arg in --port=*) runtime_port=${arg#--port=} ;; esac
done
PYTHONPATH="$app_dir${PYTHONPATH:+:$PYTHONPATH}" python -m concatfl.deployment.supernode "$@" --isolation=process &
supernode=$!
(cd "$app_dir" && exec python -m concatfl.deployment.warm_executor --runtime-api-address="127.0.0.1:$runtime_port" --insecure \
    --parent-pid="$supernode") &
executor_pid=$!
trap 'kill -TERM "$supernode" "$executor_pid" 2>/dev/null || true' TERM INT
status=0
wait -n "$supernode" "$executor_pid" || status=$?
kill -TERM "$supernode" "$executor_pid" 2>/dev/null || true
wait || true
exit "$status"
