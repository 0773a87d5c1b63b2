"""Settings of the deployment tests, and reading their misses. Certificates, authenticated
SuperNodes, bounded waits and restarts are `concatfl.deployment.fleet`'s (the soak uses them too).

Every deployment test runs real `flower-superlink`/`flower-supernode` processes through
`concatfl.deployment.session.FlowerSession` (which stops them all on exit).
"""

from __future__ import annotations

import os
from typing import Any

# Flower 1.42's one latency setting (see docs/deployment.md): the SuperExec asks for new tasks every
# 0.1 s instead of every 1 s. Deployment tests set it because with the stock executor every hop pays
# that delay (the warm executor polls every 0.1 s by itself).
FAST_POLLING = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1"}

# How the deployment tests' SuperNodes run ClientApps (concatfl.deployment.commands.EXECUTORS): concatfl's warm
# executor by default (one process per SuperNode: hops without a process start each);
# CONCATFL_DEPLOY_EXECUTOR=stock runs them with Flower's own SuperExec (a process per message).
DEPLOY_EXECUTOR = os.environ.get("CONCATFL_DEPLOY_EXECUTOR", "warm")

# A short deployed run on digits: with the stock executor hops take 10-40 s on a loaded 2-core
# machine (one ClientApp process, importing torch, per message), as does a warm worker's first task;
# the timeout leaves room for a slow but healthy node.
DEPLOY_RUN = {"local-epochs": 1, "batch-size": 32, "lr": 0.1, "round-timeout": 90.0, "seed": 0}


def misses_of(metrics: dict[str, Any], node_id: int) -> list[tuple[int, str]]:
    """(round, reason) of every miss of `node_id` in metrics.json's rounds."""
    return [
        (record["round"], miss["reason"])
        for record in metrics["rounds"]
        for hop in record["hops"]
        for miss in hop["misses"]
        if int(miss["node"]) == node_id
    ]
