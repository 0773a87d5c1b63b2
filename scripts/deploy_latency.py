"""Per-hop latency of FedCat and FedSeq in deployment (real SuperLink/SuperNodes on loopback).

For each settings variant, one SuperLink and N SuperNodes run a short FedCat run (K = N: one hop
of N parallel messages per round) and a short FedSeq run (N clients in one superclient: N
sequential hops per round, plus the pre-training hop). The ServerApp (scripts/latency_app) logs
each hop's wall time and the ClientApps' "train-seconds"; the rest of a hop is overhead.
Also measured in isolation: what a fresh ClientApp process pays before training (interpreter,
imports), and serializing a train message.

    python scripts/deploy_latency.py --nodes 3 --rounds 2 --out results/deploy-latency.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from concatfl.launch import PROJECT_DIR, FlowerSession
from concatfl.metrics import read_metrics

APP = PROJECT_DIR / "scripts/latency_app"

# name -> extra environment of every process. FLWR_SUPEREXEC_TASK_POLL_INTERVAL is Flower 1.42's
# own setting (SuperExec's task polling, default 1 s); CONCATFL_PULL_INTERVAL sets how often the
# ServerApp pulls replies (concatfl: 0.1 s; Flower's own Grid: 3 s; see scripts/latency_app).
VARIANTS: dict[str, dict[str, str]] = {
    "flower-defaults": {"CONCATFL_PULL_INTERVAL": "3"},
    "server-pull-0.1s": {},
    "server-pull-0.1s+superexec-poll-0.1s": {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1"},
}


def strategy_runs(nodes: int, rounds: int) -> dict[str, dict[str, Any]]:
    """Run configs of the two measured strategies."""
    common = {"num-server-rounds": rounds, "round-timeout": 300.0, "local-epochs": 1}
    return {
        "fedcat": {**common, "strategy": "fedcat", "fedcat-k": nodes},
        # |D_S|min above the whole training set: every client joins the one superclient.
        "fedseq": {**common, "strategy": "fedseq", "fedseq-pretrain-epochs": 1, "fedseq-min-samples": 100_000},
    }


def measure_variant(name: str, env: dict[str, str], nodes: int, rounds: int, workdir: Path) -> dict[str, Any]:
    """Run both strategies under one settings variant; per-hop figures for each."""
    results: dict[str, Any] = {}
    hop_log = workdir / "hops.jsonl"  # the ServerApp inherits the SuperLink's environment
    hop_log.touch()
    with FlowerSession(workdir, simulation=False, env={**env, "CONCATFL_HOP_LOG": str(hop_log)}) as session:
        for partition_id in range(nodes):
            session.start_supernode(partition_id, nodes)
        for strategy, run_config in strategy_runs(nodes, rounds).items():
            logged_before = len(hop_log.read_text().splitlines())
            output = workdir / strategy
            started = time.perf_counter()
            run_id = session.submit({**run_config, "output-dir": str(output)}, app_dir=APP)
            session.wait(run_id, timeout=1800)
            hops = [json.loads(line) for line in hop_log.read_text().splitlines()[logged_before:]]
            results[strategy] = summarize_hops(hops, read_metrics(output), time.perf_counter() - started)
            print(f"{name:40s} {strategy}: {results[strategy]['summary']}", flush=True)
    return results


def summarize_hops(hops: list[dict[str, Any]], metrics: dict[str, Any], wall: float) -> dict[str, Any]:
    """Mean hop time, mean slowest training inside it, and the overhead between the two."""
    seconds = [hop["seconds"] for hop in hops]
    training = [max(hop["train_seconds"], default=0.0) for hop in hops]
    overhead = [s - t for s, t in zip(seconds, training)]
    return {
        "hops": hops,
        "mean_hop_seconds": round(statistics.mean(seconds), 2),
        "mean_train_seconds": round(statistics.mean(training), 2),
        "mean_overhead_seconds": round(statistics.mean(overhead), 2),
        "run_wall_seconds": round(wall, 1),
        "metrics_wall_seconds": metrics["wall_seconds"],
        "summary": (
            f"{len(hops)} hops, hop {statistics.mean(seconds):.2f} s = train {statistics.mean(training):.2f} s"
            f" + overhead {statistics.mean(overhead):.2f} s (run {wall:.0f} s)"
        ),
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    parser.add_argument("--out", default="results/deploy-latency.json")
    args = parser.parse_args(argv)
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
            report["variants"][name] = measure_variant(name, VARIANTS[name], args.nodes, args.rounds, Path(workdir))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
