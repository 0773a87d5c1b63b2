#!/usr/bin/env bash
# A SuperNode container's entrypoint:  deploy/supernode.sh flower-supernode ARG...
#
# CONCATFL_EXECUTOR=warm (default): the SuperNode runs with --isolation=process and concatfl's warm
# executor (concatfl/warm_executor.py) runs its ClientApp tasks beside it, in one long-lived
# process. CONCATFL_EXECUTOR=stock: Flower's own executor (a new ClientApp process per message).
# When either process ends, the other is stopped and the container exits with the first one's
# status, so the container's restart policy restarts both.
set -euo pipefail
executor=${CONCATFL_EXECUTOR:-warm}
case $executor in
    stock) exec "$@" ;;
    warm) ;;
    *) echo "supernode.sh: CONCATFL_EXECUTOR must be 'warm' or 'stock', got '$executor'" >&2; exit 2 ;;
esac
runtime_port=9094  # flower-supernode's default --port (its Runtime API)
for arg in "$@"; do
    case $arg in --port=*) runtime_port=${arg#--port=} ;; esac
done
"$@" --isolation=process &
supernode=$!
(cd "$(dirname "$0")/.." && exec python -m concatfl.warm_executor --runtime-api-address="127.0.0.1:$runtime_port" --insecure \
    --parent-pid="$supernode") &
executor_pid=$!
trap 'kill -TERM "$supernode" "$executor_pid" 2>/dev/null || true' TERM INT
status=0
wait -n "$supernode" "$executor_pid" || status=$?
kill -TERM "$supernode" "$executor_pid" 2>/dev/null || true
wait || true
exit "$status"
