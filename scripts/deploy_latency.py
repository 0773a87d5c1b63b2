"""Per-hop latency of FedCat and FedSeq in deployment (real SuperLink/SuperNodes on loopback).

For each settings variant, one SuperLink and N SuperNodes run a short FedCat run (K = N: one hop
of N parallel messages per round) and a short FedSeq run (N clients in one superclient: N
sequential hops per round, plus the pre-training hop). The ServerApp (scripts/latency_app) logs
each hop's wall time and the ClientApps' "train-seconds"; the rest of a hop is overhead. Before
submitting, the nodes' processes (SuperNodes with their SuperExec or warm executor) idle for
`--idle-seconds`: their CPU use then is the cost of their polling. With the warm executor, each
sequential hop is split further with the executor's task records (concatfl/deployment/warm_executor.py,
logged by the SuperNode whose process runs it):
until the task was claimed, inside the executor (by step), after its reply was handed over.
Also measured in isolation: what a fresh ClientApp process pays before training (interpreter,
imports), and serializing a train message.

    python scripts/deploy_latency.py --nodes 3 --rounds 2 --out results/deploy-latency.json
    python scripts/deploy_latency.py --variants flower-defaults,warm-executor
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import psutil

from concatfl import PROJECT_DIR
from concatfl.deployment.commands import superlink_security
from concatfl.deployment.fleet import make_certificates, start_authenticated_nodes
from concatfl.deployment.processes import exit_on_signals
from concatfl.deployment.session import FlowerSession
from concatfl.metrics import read_metrics
from concatfl.deployment.warm_executor import task_records

APP = PROJECT_DIR / "scripts/latency_app"



class Variant(NamedTuple):
    """Settings of one measured deployment: extra environment of every process, how the
    SuperNodes run ClientApps (concatfl.deployment.commands.EXECUTORS), whether the SuperLink keeps its
    state in an SQLite file (`--database`) instead of memory (Flower's default), whether TLS and
    SuperNode authentication are on (registered keys, as in docker-compose.yml), and whether the
    SuperNodes reach the SuperLink through the fleet door (HAProxy, deploy/haproxy.cfg; needs TLS)."""

    env: dict[str, str]
    executor: str = "stock"
    state_db: bool = False
    tls: bool = False
    fleet_door: bool = False


# FLWR_SUPEREXEC_TASK_POLL_INTERVAL is Flower 1.42's own setting (SuperExec's task polling,
# default 1 s); CONCATFL_FLOWER_GRID=1 makes the ServerApp wait for replies as Flower's own Grid
# does (see scripts/latency_app); CONCATFL_SUPERNODE_WAITS=flower keeps Flower's SuperNode waits
# under the warm executor (concatfl/deployment/supernode.py). The warm executor runs inside the
# launcher: woken by every stored message, or polling every 0.1 s under Flower's waits.
VARIANTS: dict[str, Variant] = {
    "flower-defaults": Variant({"CONCATFL_FLOWER_GRID": "1"}),
    "server-pull-0.1s": Variant({}),
    "server-pull-0.1s+superexec-poll-0.1s": Variant({"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1"}),
    "warm-executor+flower-supernode-waits": Variant({"CONCATFL_SUPERNODE_WAITS": "flower"}, executor="warm"),
    "warm-executor": Variant({}, executor="warm"),
    "warm-executor+supernode-poll-0.1s": Variant({"CONCATFL_SUPERNODE_IDLE_POLL": "0.1"}, executor="warm"),
    "warm-executor+superlink-state-db": Variant({}, executor="warm", state_db=True),
    "warm-executor+tls": Variant({}, executor="warm", tls=True),
    "warm-executor+tls+fleet-door": Variant({}, executor="warm", tls=True, fleet_door=True),
}


def strategy_runs(nodes: int, rounds: int) -> dict[str, dict[str, Any]]:
    """Run configs of the two measured strategies."""
    common = {"num-server-rounds": rounds, "round-timeout": 300.0, "local-epochs": 1}
    return {
        "fedcat": {**common, "strategy": "fedcat", "fedcat-k": nodes},
        # |D_S|min above the whole training set: every client joins the one superclient.
        "fedseq": {**common, "strategy": "fedseq", "fedseq-pretrain-epochs": 1, "fedseq-min-samples": 100_000},
    }


# pylint: disable=too-many-arguments,too-many-locals
def measure_variant(
    name: str, variant: Variant, nodes: int, rounds: int, idle_seconds: float, workdir: Path
) -> dict[str, Any]:
    """Run both strategies under one settings variant; per-hop figures for each."""
    results: dict[str, Any] = {"load_average_before": os.getloadavg()}
    hop_log = workdir / "hops.jsonl"  # the ServerApp inherits the SuperLink's environment
    hop_log.touch()
    env = {**variant.env, "CONCATFL_HOP_LOG": str(hop_log)}
    database = workdir / "state.db" if variant.state_db else None
    certificates = make_certificates(workdir / "certs", nodes) if variant.tls else None
    security = {
        "superlink_args": superlink_security(certificates, supernode_auth=True),
        "root_certificates": certificates.ca_cert,
        "fleet_door": certificates if variant.fleet_door else None,
    } if certificates is not None else {}
    with FlowerSession(
        workdir, simulation=False, env=env, database=database, executor=variant.executor, **security
    ) as session:
        if certificates is not None:
            registered = start_authenticated_nodes(session, certificates, list(range(nodes)), nodes)
            node_processes = [node.process for node in registered.values()]
        else:
            node_processes = [session.start_supernode(partition_id, nodes) for partition_id in range(nodes)]
        deadline = time.monotonic() + 120
        while sum(node["status"] == "online" for node in session.supernodes()) < nodes:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{nodes} SuperNodes were not online within 120 s")
            time.sleep(1)
        idle = idle_cores({"nodes": node_processes, "fleet_door": [session.door] if session.door else []}, idle_seconds)
        results["idle_cores"] = idle["nodes"]
        if session.door is not None:
            results["fleet_door_idle_cores"] = idle["fleet_door"]
        print(f"{name:40s} idle: {idle} cores ({nodes} nodes)", flush=True)
        for strategy, run_config in strategy_runs(nodes, rounds).items():
            logged_before = len(hop_log.read_text().splitlines())
            output = workdir / strategy
            started = time.perf_counter()
            run_id = session.submit({**run_config, "output-dir": str(output)}, app_dir=APP)
            session.wait(run_id, timeout=1800)
            hops = [json.loads(line) for line in hop_log.read_text().splitlines()[logged_before:]]
            results[strategy] = summarize_hops(hops, read_metrics(output), time.perf_counter() - started)
            print(f"{name:40s} {strategy}: {results[strategy]['summary']}", flush=True)
        if variant.executor == "warm":
            tasks = [task for log in workdir.glob("supernode-*.log") for task in task_records(log.read_text())]
            results["sequential_hop_parts"] = sequential_hop_parts(
                [hop for strategy in strategy_runs(nodes, rounds) for hop in results[strategy]["hops"]], tasks
            )
            results["executor_tasks"] = tasks
            print(f"{name:40s} sequential hop parts: {results['sequential_hop_parts']}", flush=True)
    results["load_average_after"] = os.getloadavg()
    return results


def idle_cores(groups: dict[str, list[Any]], seconds: float) -> dict[str, float]:
    """CPU cores used by each group of processes (and their descendants) over the same `seconds`
    of idling."""

    def cpu_seconds(processes: list[Any]) -> float:
        total = 0.0
        for process in processes:
            try:
                root = psutil.Process(process.pid)
                for member in [root, *root.children(recursive=True)]:
                    times = member.cpu_times()
                    total += times.user + times.system
            except psutil.NoSuchProcess:
                continue
        return total

    before = {name: cpu_seconds(processes) for name, processes in groups.items()}
    time.sleep(seconds)
    return {name: round((cpu_seconds(processes) - before[name]) / seconds, 4) for name, processes in groups.items()}


def sequential_hop_parts(hops: list[dict[str, Any]], tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean parts of the one-message hops, matched to the executor task that served each.

    before_claim: from the hop's start until an executor claimed the task (ServerApp push,
    SuperNode's idle poll and message download, executor's poll); executor steps (pull, load,
    app minus training, push; "handover" is the rest of the claim-to-report time); training;
    after_report: until the ServerApp had the reply (SuperNode's reply wait and upload,
    ServerApp's pull).
    """
    parts: dict[str, list[float]] = {}
    for hop in hops:
        if hop["messages"] != 1 or len(hop["train_seconds"]) != 1:
            continue
        started = hop["ended_at"] - hop["seconds"]
        served = [t for t in tasks if t["steps"] and started <= t["claimed_at"] <= hop["ended_at"]]
        if len(served) != 1:
            continue
        task, train = served[0], hop["train_seconds"][0]
        steps = {step: task["steps"].get(step, 0.0) for step in ("connect", "pull", "load", "app", "push")}
        measured = {
            "hop": hop["seconds"],
            "before_claim": task["claimed_at"] - started,
            "executor_pull": steps["connect"] + steps["pull"],
            "executor_load": steps["load"],
            "training": train,
            "app_besides_training": steps["app"] - train,
            "executor_push": steps["push"],
            "handover": task["seconds"] - sum(steps.values()),
            "after_report": hop["ended_at"] - (task["claimed_at"] + task["seconds"]),
        }
        for key, value in measured.items():
            parts.setdefault(key, []).append(value)
    return {"hops": len(parts.get("hop", []))} | {key: round(statistics.mean(v), 3) for key, v in parts.items()}


def summarize_hops(hops: list[dict[str, Any]], metrics: dict[str, Any], wall: float) -> dict[str, Any]:
    """Mean hop time, mean slowest training inside it, and the overhead between the two."""
    seconds = [hop["seconds"] for hop in hops]
    training = [max(hop["train_seconds"], default=0.0) for hop in hops]
    overhead = [s - t for s, t in zip(seconds, training)]
    sequential = [(s, t) for hop, s, t in zip(hops, seconds, training) if hop["messages"] == 1]
    return {
        "hops": hops,
        "mean_hop_seconds": round(statistics.mean(seconds), 2),
        "mean_train_seconds": round(statistics.mean(training), 2),
        "mean_overhead_seconds": round(statistics.mean(overhead), 2),
        "sequential_hops": sequential_summary(sequential),
        "run_wall_seconds": round(wall, 1),
        "metrics_wall_seconds": metrics["wall_seconds"],
        "summary": (
            f"{len(hops)} hops, hop {statistics.mean(seconds):.2f} s = train {statistics.mean(training):.2f} s"
            f" + overhead {statistics.mean(overhead):.2f} s (run {wall:.0f} s); one-message hops:"
            f" {sequential_summary(sequential) or 'none'}"
        ),
    }


def sequential_summary(hops: list[tuple[float, float]]) -> dict[str, float]:
    """Mean, std and min of the one-message hops (seconds, training seconds); {} when none."""
    if not hops:
        return {}
    seconds, training = [s for s, _ in hops], [t for _, t in hops]
    overhead = [s - t for s, t in hops]
    return {
        "count": len(hops),
        "mean": round(statistics.mean(seconds), 2),
        "std": round(statistics.pstdev(seconds), 2),
        "min": round(min(seconds), 2),
        "mean_train": round(statistics.mean(training), 2),
        "mean_overhead": round(statistics.mean(overhead), 2),
        "std_overhead": round(statistics.pstdev(overhead), 2),
    }


def client_process_start(repeats: int = 3) -> dict[str, float]:
    """Seconds a fresh Python process needs for the ClientApp's imports (paid per message)."""
    probes = {
        "python": "pass",
        "flwr-clientapp runtime": "import flwr.supernode.runtime.run_clientapp",
        "torch": "import torch",
        "concatfl client_app (torch, flwr, sklearn)": "import concatfl.client_app",
    }
    timings = {}
    for label, code in probes.items():
        runs = []
        for _ in range(repeats):
            started = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            runs.append(time.perf_counter() - started)
        timings[label] = round(statistics.median(runs), 3)
    return timings


def serialization() -> dict[str, float]:
    """Bytes and seconds to serialize one train message of the default digits model."""
    from flwr.app import ArrayRecord, Message, MessageType
    from flwr.supercore.task_identity import TaskIdentity

    from concatfl.config import RunConfig
    from concatfl.runtime import load_data, make_model
    from concatfl.strategies.common import message_bytes, train_content

    # Outside a Flower runtime a Message needs a task identity (the ServerApp's: run 1, node 0).
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    config = RunConfig()
    arrays = ArrayRecord(make_model(config, load_data(config)).state_dict())
    started = time.perf_counter()
    message = Message(content=train_content(arrays, {"lr": 0.1}), dst_node_id=1, message_type=MessageType.TRAIN)
    size = message_bytes(message)
    return {"bytes": size, "seconds": round(time.perf_counter() - started, 4)}


def main(argv: list[str] | None = None) -> int:
    """Measure every variant and write the figures as JSON."""
    exit_on_signals()  # SIGTERM (`timeout`, a scheduler) unwinds the sessions: nothing is left running
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    parser.add_argument("--idle-seconds", type=float, default=20.0, help="idle time over which node CPU is measured")
    parser.add_argument("--out", default="results/deploy-latency.json")
    args = parser.parse_args(argv)
    unknown = [name for name in args.variants.split(",") if name not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    report: dict[str, Any] = {
        "nodes": args.nodes,
        "rounds": args.rounds,
        "client_process_start_seconds": client_process_start(),
        "train_message": serialization(),
        "variants": {},
    }
    print(json.dumps({k: report[k] for k in ("client_process_start_seconds", "train_message")}, indent=1), flush=True)
    for name in args.variants.split(","):
        with tempfile.TemporaryDirectory(prefix="cfl-latency-") as workdir:
            report["variants"][name] = measure_variant(
                name, VARIANTS[name], args.nodes, args.rounds, args.idle_seconds, Path(workdir)
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
