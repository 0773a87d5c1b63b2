"""Resident memory of warm ClientApp executors over many messages (real processes on loopback).

A SuperLink and `--nodes` SuperNodes, each with concatfl's warm executor, run a FedAvg job on
digits: every round sends each node a train and an evaluate message. The executors' task
records (concatfl/deployment/warm_executor.py) give the worker's RSS after every task; the report shows,
per node, the RSS after the first task and after the warm-up, the peak, the last, and the
least-squares slope over the second half of the tasks (MiB per 100 messages).

    python scripts/warm_executor_memory.py --nodes 4 --rounds 30 --out results/warm-executor-memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from concatfl.deployment.session import FlowerSession
from concatfl.deployment.warm_executor import task_records


def rss_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """RSS figures of one executor's task records (MiB); the slope is per 100 messages."""
    rss = [record["worker_rss_mib"] for record in records]
    second_half = rss[len(rss) // 2 :]
    slope = statistics.linear_regression(range(len(second_half)), second_half).slope if len(second_half) > 1 else 0.0
    return {
        "messages": len(rss),
        "worker_pids": sorted({record["worker_pid"] for record in records}),
        "statuses": sorted({record["status"] for record in records}),
        "rss_first_mib": rss[0],
        "rss_after_warmup_mib": rss[min(9, len(rss) - 1)],
        "rss_max_mib": max(rss),
        "rss_last_mib": rss[-1],
        "slope_second_half_mib_per_100": round(100 * slope, 2),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the job, summarize every executor's RSS, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default="results/warm-executor-memory.json")
    args = parser.parse_args(argv)
    run_config = {
        "strategy": "fedavg",
        "num-server-rounds": args.rounds,
        "fraction-evaluate": 1.0,
        "local-epochs": 1,
        "round-timeout": 300.0,
    }
    with tempfile.TemporaryDirectory(prefix="cfl-memory-") as workdir:
        with FlowerSession(workdir, simulation=False, executor="warm") as session:
            for partition_id in range(args.nodes):
                session.start_supernode(partition_id, args.nodes)
            started = time.perf_counter()
            run_id = session.submit({**run_config, "output-dir": str(Path(workdir) / "output")})
            session.wait(run_id, timeout=3600)
            wall = time.perf_counter() - started
        nodes = {
            partition_id: rss_summary(task_records((Path(workdir) / f"supernode-{partition_id}.log").read_text()))
            for partition_id in range(args.nodes)
        }
    report = {"run_config": run_config, "nodes": nodes, "run_wall_seconds": round(wall, 1), "load_average": os.getloadavg()}
    print(json.dumps(report, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
