"""`python -m concatfl.bench soak`: a real deployment under sustained faults, and what it survived.

A private SuperLink (TLS, SuperNode authentication, its state in an SQLite file) and N
authenticated SuperNodes on this machine (loopback only), each with concatfl's warm executor
(`--executor stock`: Flower's), run FedAvg, FedCat, FedSeq and FedConcat on digits one after
another, while a seeded chaos loop keeps injecting faults:

- every `--kill-every` seconds, ~`--kill-share` of the running SuperNodes are SIGKILLed (the
  SuperNode, its executor and its ClientApp worker: a crashed host), and each is started again
  after a random 5–30 s (then as soon as the SuperLink accepts its key again: it lists a dead
  node as online for up to two 30 s heartbeats);
- once, in the run named by `--superlink-restart` after its checkpoint passed round
  `--superlink-restart-after`, the SuperLink is SIGKILLed (the ServerApp dies with it) and
  started again on its database; the user's step is to submit the same run with `resume=true`
  (concatfl's checkpoint); the soak does that and checks that the resumed run started from the
  very model of the checkpoint it found (`resumed.model` in metrics.json, a SHA-256 prefix);
- every run's replies are fuzzed (`--fuzz-share` of them malformed or poisoned, concatfl.fuzz,
  drawn uniformly from every kind);
- one SuperNode's ClientApp hangs (`fuzz-kinds='hang'` in its node config): from its first hung
  message on it answers nothing; every hop it is in waits for `--round-timeout`;
- `--late-nodes` SuperNodes of every run connect `--late-delay` seconds after the run was
  submitted (their keys registered then, as an operator adds a node that arrives): each run has
  its own late nodes, so a sequence of runs needs `--late-nodes` × the runs of them. A run
  starts once every node already started is connected (`expected-nodes`).

Everything is bounded (`--time-limit`, default 30 min) and stopped at the end, on SIGTERM,
SIGINT or the time limit; the soak then checks that no process it started is left. The report
(`<out>/soak/report.json` and `report.md`) gives per run: completed or not, rounds, final
accuracy against the same run without faults (in one process, `concatfl.bench.inprocess`),
faults injected, replies rejected / clipped / down-weighted, malformed replies accepted (0 is
the target) and the hops lost to dead or hung nodes; and for the SuperLink restart, what the
user did and what was lost.

`--paired` measures what the faults cost: for every seed (`--seeds`) and strategy, the same run
(`PAIRED_RUN`: a setting where every strategy ends above 0.85 without faults) on a fresh
deployment three times: *clean* (every node there at the start, no fault), *faults* (the kills
and restarts, a SuperLink restart with resume after round `--superlink-restart-after`, 10 %
fuzzed replies, a hung node, and `PAIRED_LATE_NODES` nodes that connect 30 s late) and *late*
(half the nodes at the start, the other half 30 s later, nothing else). `<out>/soak/paired.json`
and `paired.md` give, per strategy, the accuracy of each condition (mean ± std over the seeds),
the cost in points against *clean*, and where it went: rounds redone, partitions that never
trained, replies rejected, clipped and missing. `--conditions` runs some of the three only
(e.g. `clean,late`: the faults condition's sequential hops at dead nodes take ~45 min a run
here); runs already in `<out>` are read, not run again.

`--capacity` measures instead how many SuperNodes this machine holds: for growing N, N nodes
idle (CPU per node, and the SuperLink's) and then run one FedSeq round (peak resident memory
per node, RSS and PSS, and wall time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import ssl
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from ..checkpoint import load_checkpoint
from ..deployment.commands import EXECUTORS, superlink_security
from ..deployment.fleet import Node, make_certificates, online_node_ids, restart_when_possible, start_authenticated_nodes, wait_for
from ..deployment.processes import SimulationError, kill_process_tree, leftover_processes
from ..deployment.session import FlowerSession
from ..metrics import read_metrics
from ..strategies.common import fingerprint
from .inprocess import simulate_in_process
from .overhead import cpu_model, load_average
from .robustness import hop_records, malformed_accepted, outsized_taken

SUITE = "soak"
STRATEGIES = ("fedavg", "fedcat", "fedseq", "fedconcat")
# Flower 1.42's SuperExec polls for tasks every 1 s unless told otherwise (the stock executor only).
FAST_POLLING = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1"}
# Short runs on digits; FedSeq's superclients of ~3 nodes, FedConcat's short stages.
SOAK_RUN = {
    "dataset": "digits",
    "partition": "classes",
    "classes-per-client": 2,
    "local-epochs": 1,
    "batch-size": 32,
    "lr": 0.05,
    "momentum": 0.9,
    "local-test-fraction": 0.0,
    "fedseq-pretrain-epochs": 2,
    "fedseq-max-clients": 3,
    "fedseq-min-samples": 200,
    "fedconcat-encoder-rounds": 3,
    "fedconcat-classifier-rounds": 3,
    "device": "cpu",
}
RESTART_DELAY = (5.0, 30.0)
# The paired measure's runs: 10 nodes of four classes each, 30 rounds (FedConcat 8 + 12), where
# every strategy ended at 0.85 or more without faults (in one process, seeds 0 and 1: FedAvg 0.91
# and 0.86 at 20 rounds, FedCat with K = 4 0.91 and 0.89, FedSeq 0.94, FedConcat 0.92 and 0.93).
PAIRED_RUN = {
    "classes-per-client": 4,
    "fedcat-k": 4,
    "fedconcat-encoder-rounds": 8,
    "fedconcat-classifier-rounds": 12,
}
PAIRED_NODES = 10
PAIRED_ROUNDS = 30
PAIRED_ROUND_TIMEOUT = 20.0  # a hung or killed node's hop waits this long, in every condition
PAIRED_LATE_NODES = 2  # of the faults condition
PAIRED_SEEDS = (0, 1, 2)
CONDITIONS = ("clean", "faults", "late")


@dataclass
class Settings:
    """What the soak does (the command line's options)."""

    nodes: int = 8
    rounds: int = 6
    strategies: tuple[str, ...] = STRATEGIES
    fuzz_share: float = 0.1
    kill_share: float = 0.1
    kill_every: float = 30.0
    max_kills: int | None = None  # None: as many as the time allows
    round_timeout: float = 30.0
    superlink_restart: str = "fedcat"
    superlink_restart_after: int = 2
    hang: bool = True
    late_nodes: int = 0  # per run: nodes that connect `late_delay` s after it was submitted
    late_delay: float = 30.0
    late_after_round: int = 0  # > 0: and not before the run's checkpoint has passed this round
    executor: str = "warm"
    time_limit: float = 1800.0
    seed: int = 0
    run: dict[str, Any] = field(default_factory=dict)  # run-config keys over SOAK_RUN
    baseline: bool = True  # also run each strategy without faults in one process

    def late_partitions(self, run_index: int) -> list[int]:
        """The partitions that join run `run_index` late: the last late_nodes × runs are reserved,
        late_nodes per run, in order."""
        first = self.nodes - (len(self.strategies) - run_index) * self.late_nodes
        return list(range(first, first + self.late_nodes))

    @property
    def started_at_first(self) -> list[int]:
        """The partitions whose SuperNodes start with the session."""
        return list(range(self.nodes - len(self.strategies) * self.late_nodes))


@dataclass
class Chaos:
    """The seeded fault loop: kills and restarts SuperNodes while the runs go on (a thread)."""

    session: FlowerSession
    certificates: Any
    nodes: dict[int, Node]
    settings: Settings
    protected: set[int]
    events: list[dict[str, Any]] = field(default_factory=list)
    _rng: np.random.Generator = field(init=False)
    _stop: threading.Event = field(default_factory=threading.Event)
    _paused: threading.Event = field(default_factory=threading.Event)
    _down: set[int] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)
    _started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.settings.seed)

    def start(self) -> None:
        """Begin injecting faults in the background."""
        self._spawn(self._loop)

    def pause(self, paused: bool) -> None:
        """Stop (True) or resume (False) new kills, e.g. while the SuperLink restarts; a kill due
        meanwhile happens on resuming."""
        (self._paused.set if paused else self._paused.clear)()

    def stop(self, wait: float = 180.0) -> None:
        """No more kills; wait up to `wait` seconds for pending restarts (the session's exit stops
        whatever is still starting: it refuses new processes from then on)."""
        self._stop.set()
        deadline = time.monotonic() + wait
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def note(self, kind: str, **details: Any) -> None:
        """Record an event with its time since the soak started."""
        with self._lock:
            self.events.append({"t": round(time.monotonic() - self._started, 1), "kind": kind, **details})

    def _spawn(self, target, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _loop(self) -> None:
        count = max(1, math.ceil(self.settings.kill_share * len(self.nodes)))
        while not self._stop.wait(self.settings.kill_every):
            # A kill that falls due during a pause happens when the pause ends, not a period later:
            # a short run would otherwise see none (the SuperLink's restart outlasts a period).
            while self._paused.is_set():
                if self._stop.wait(0.5):
                    return
            with self._lock:
                killed = sum(event["kind"] == "supernode-killed" for event in self.events)
                if self.settings.max_kills is not None and killed >= self.settings.max_kills:
                    return
                up = sorted(set(self.nodes) - self._down - self.protected)
                # Never more than half the nodes down at once: the runs need their minimum.
                room = max(0, len(self.nodes) // 2 - len(self._down))
                victims = [int(v) for v in self._rng.choice(up, size=min(count, len(up), room), replace=False)]
                delays = [float(self._rng.uniform(*RESTART_DELAY)) for _ in victims]
                self._down.update(victims)
            for victim, delay in zip(victims, delays):
                kill_process_tree(self.nodes[victim].process)
                self.note("supernode-killed", node=victim)
                self._spawn(self._restart, victim, delay)

    def join_later(self, partitions: list[int], delay: float, ready: Callable[[], bool] = lambda: True) -> None:
        """Start these SuperNodes (their keys registered then) `delay` s from now, and once
        `ready()`, in the background; from then on they are nodes like the others (they may be
        killed)."""
        def join() -> None:
            if self._stop.wait(delay):
                return
            while not ready():
                if self._stop.wait(1.0):
                    return
            try:
                started = start_authenticated_nodes(self.session, self.certificates, partitions, self.settings.nodes)
            except (AssertionError, RuntimeError, SimulationError) as error:  # the session is stopping
                self.note("supernodes-not-joined", nodes=partitions, reason=str(error).splitlines()[0])
                return
            with self._lock:
                self.nodes.update(started)
            self.note("supernodes-joined", nodes=partitions, seconds_after_submit=delay)

        if partitions:
            self._spawn(join)

    def _restart(self, victim: int, delay: float) -> None:
        if self._stop.wait(delay):
            self.note("supernode-not-restarted", node=victim, reason="the soak ended first")
            return
        try:
            seconds = restart_when_possible(self.session, self.certificates, self.nodes[victim], len(self.nodes))
            self.note("supernode-restarted", node=victim, seconds_after_kill=round(delay + seconds, 1))
        except (AssertionError, RuntimeError) as error:  # RuntimeError: the session is stopping
            self.note("supernode-restart-failed", node=victim, reason=str(error))
        with self._lock:
            self._down.discard(victim)


def run_config(settings: Settings, strategy: str, output: Path, expected_nodes: int = 0) -> dict[str, Any]:
    """One soak run's run config (its outputs and fuzz log in `output`); it starts once
    `expected_nodes` are connected (0: the start policy's default)."""
    return {
        **SOAK_RUN,
        **settings.run,
        "strategy": strategy,
        "num-server-rounds": settings.rounds,
        "round-timeout": settings.round_timeout,
        "min-available-nodes": max(2, min(settings.nodes // 2, expected_nodes or settings.nodes)),
        "expected-nodes": expected_nodes,
        "fraction-train": 0.5 if strategy == "fedavg" else 1.0,
        "fuzz-share": settings.fuzz_share,
        "fuzz-seed": settings.seed,
        "fuzz-log": str(output / "fuzz.jsonl"),
        "seed": settings.seed,
        "output-dir": str(output),
    }


# pylint: disable=too-many-arguments
def run_one(
    session: FlowerSession, chaos: Chaos, settings: Settings, strategy: str, output: Path, deadline: float,
    late: list[int],
) -> dict[str, Any]:
    """Submit one run (it waits for every node started so far), let the `late` nodes join it,
    restart the SuperLink in it if asked, wait for it; its summary."""
    config = run_config(settings, strategy, output, expected_nodes=len(chaos.nodes))
    started = time.monotonic()
    outcome: dict[str, Any] = {"strategy": strategy, "completed": False, "late_nodes": late}
    run_id = None
    try:
        run_id = session.submit(config)
        chaos.join_later(late, settings.late_delay, lambda: checkpointed_round(output) >= settings.late_after_round)
        if strategy == settings.superlink_restart:
            outcome["superlink_restart"] = restart_superlink(session, chaos, settings, config, output, deadline, run_id)
            run_id = outcome["superlink_restart"]["resumed_run"]
        session.wait(run_id, timeout=max(1.0, deadline - time.monotonic()))
        outcome["completed"] = True
    except (SimulationError, AssertionError) as error:
        outcome["error"] = str(error).splitlines()[0]
    if run_id is not None:  # where a slow or failed run's time went
        with contextlib.suppress(SimulationError, subprocess.TimeoutExpired):
            (output / "run.log").write_text(session.run_log(run_id))
    outcome["wall_seconds"] = round(time.monotonic() - started, 1)
    if (output / "metrics.json").exists():
        outcome.update(describe(read_metrics(output)))
    return outcome


def restart_superlink(
    session: FlowerSession, chaos: Chaos, settings: Settings, config: dict[str, Any], output: Path, deadline: float,
    run_id: str,
) -> dict[str, Any]:
    """Wait for the checkpoint of round `superlink_restart_after` of run `run_id`, SIGKILL the
    SuperLink, start it again on its database, stop the killed run, wait for the SuperNodes,
    resubmit the run with resume=true."""
    def checkpointed() -> int:
        return checkpointed_round(output)

    wait_for(lambda: checkpointed() >= settings.superlink_restart_after, deadline - time.monotonic(),
             f"round {settings.superlink_restart_after} of the {config['strategy']} run")
    chaos.pause(True)
    killed = time.monotonic()
    session.kill_superlink()
    checkpoint = load_checkpoint(output)  # written atomically: what a resumed run will read
    found = {"round": checkpoint.server_round, "model": fingerprint_state(checkpoint.arrays)}
    chaos.note("superlink-killed", run=config["strategy"], checkpoint_round=found["round"])
    session.start_superlink()
    session.stop(run_id)
    wait_for(lambda: len(online_node_ids(session)) >= config["min-available-nodes"], 180,
             "the SuperNodes to reconnect to the restarted SuperLink", interval=2.0)
    reconnected = time.monotonic()
    resumed_run = session.submit({**config, "resume": True})
    chaos.note("run-resumed", run=config["strategy"], after_round=found["round"])
    chaos.pause(False)
    # What the crash cost: the round in flight is done again; how long until it is.
    wait_for(lambda: checkpointed() > found["round"], deadline - time.monotonic(),
             f"round {found['round'] + 1} of the resumed run")
    return {
        "checkpoint": found,
        "round_redone": found["round"] + 1,
        "seconds_until_nodes_back": round(reconnected - killed, 1),
        "nodes_back": len(online_node_ids(session)),
        "seconds_until_redone_round": round(time.monotonic() - killed, 1),
        "resumed_run": resumed_run,
    }


def checkpointed_round(output: Path) -> int:
    """The last round of the run in `output` that its checkpoint holds (0: none yet)."""
    try:
        return load_checkpoint(output).server_round
    except (FileNotFoundError, EOFError, RuntimeError):  # none yet, or being replaced
        return 0


def fingerprint_state(state: dict[str, Any]) -> str:
    """The fingerprint of a torch state dict, as concatfl's ServerApp records the model it resumed from."""
    from flwr.app import ArrayRecord  # pylint: disable=import-outside-toplevel

    return fingerprint(ArrayRecord(state))


def describe(metrics: dict[str, Any]) -> dict[str, Any]:
    """What a run's metrics.json says about the faults it met."""
    misses = [miss for record in metrics["rounds"] for hop in record["hops"] for miss in hop["misses"]]
    setup_misses = [miss for hop in hop_records(metrics["setup"]) for miss in hop["misses"]]
    guard = [record.get("guard", {}) for record in [metrics["setup"], *metrics["rounds"]]]
    return {
        "rounds": len(metrics["rounds"]),
        "final_accuracy": round(metrics["final_accuracy"], 4),
        "replies_rejected": sum(m["reason"].startswith("rejected") for m in misses + setup_misses),
        "replies_missing": sum(not m["reason"].startswith("rejected") for m in misses + setup_misses),
        "replies_clipped": sum(len(g.get("clipped", [])) for g in guard),
        "replies_down_weighted": sum(len(g.get("down-weighted", [])) for g in guard),
        "malformed_accepted": malformed_accepted(metrics),
        "outsized_taken_as_sent": outsized_taken(metrics),
        "resumed": metrics.get("resumed"),
        "never_trained": metrics.get("membership", {}).get("never_trained"),
        "rested": sum(len(record.get("membership", {}).get("resting", [])) for record in metrics["rounds"]),
        "joined": sorted({node for record in metrics["rounds"] for node in record.get("membership", {}).get("joined", [])}),
    }


def baseline(settings: Settings, strategy: str, workdir: Path) -> float:
    """The same run without faults (no kills, no fuzzing, no hang), in one process."""
    config = {k: v for k, v in run_config(settings, strategy, workdir).items() if not k.startswith("fuzz-")}
    return round(simulate_in_process(config, settings.nodes, workdir)["final_accuracy"], 4)


def soak(settings: Settings, out: Path) -> dict[str, Any]:
    """Run the soak (module docstring); returns the report, also written to `out`."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started, load_before = time.monotonic(), load_average()
    deadline = started + settings.time_limit
    certificates = make_certificates(out / "certs", settings.nodes)
    session = FlowerSession(
        out / "session",
        simulation=False,
        superlink_args=superlink_security(certificates, supernode_auth=True),
        root_certificates=certificates.ca_cert,
        env=FAST_POLLING,
        database=out / "superlink.db",
        executor=settings.executor,
    )
    first = settings.started_at_first
    hang_node = first[-1] if settings.hang else None
    runs = []
    with session:
        nodes = start_authenticated_nodes(
            session, certificates, first, settings.nodes,
            node_config=lambda i: "fuzz-share=1.0 fuzz-kinds='hang'" if i == hang_node else "",
        )
        wait_for(lambda: len(online_node_ids(session)) == len(first), 180, "every SuperNode online")
        chaos = Chaos(session, certificates, nodes, settings, protected={hang_node} - {None})
        if hang_node is not None:
            chaos.note("clientapp-hangs", node=hang_node)
        chaos.start()
        try:
            for index, strategy in enumerate(settings.strategies):
                if time.monotonic() > deadline:
                    runs.append({"strategy": strategy, "completed": False, "error": "time limit reached before it started"})
                    continue
                late = settings.late_partitions(index)
                runs.append(run_one(session, chaos, settings, strategy, out / strategy, deadline, late))
        except BaseException:  # SIGTERM, SIGINT: stop at once, the session's exit stops every process
            chaos.stop(wait=0.0)
            raise
        chaos.stop()
    leftovers = leftover_processes(out)
    for run in runs:
        if settings.baseline:
            run["baseline_accuracy"] = baseline(settings, run["strategy"], out / "baseline" / run["strategy"])
    report = {
        "settings": asdict(settings),
        "machine": machine(),
        "load_average": {"start": load_before, "end": load_average()},
        "wall_seconds": round(time.monotonic() - started, 1),
        "runs": runs,
        "faults": faults_by_kind(chaos.events),
        "events": chaos.events,
        "processes_left": leftovers,
    }
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(render(report))
    return report


def faults_by_kind(events: list[dict[str, Any]]) -> dict[str, Any]:
    """How many of each event, and how long restarts took."""
    counts: dict[str, Any] = {}
    for event in events:
        counts[event["kind"]] = counts.get(event["kind"], 0) + 1
    restarts = [e["seconds_after_kill"] for e in events if e["kind"] == "supernode-restarted"]
    if restarts:
        counts["restart_seconds"] = {"median": round(statistics.median(restarts), 1), "max": max(restarts)}
    return counts


def machine() -> str:
    """The machine in one line: CPU model, cores, memory."""
    return f"{cpu_model()}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB"


def render(report: dict[str, Any]) -> str:
    """The report as markdown: one row per run, then the faults."""
    lines = [
        f"## soak: {report['settings']['nodes']} SuperNodes ({report['settings']['executor']} executor), "
        f"{report['wall_seconds']:.0f} s",
        "",
        f"{report['machine']}; load average {report['load_average']['start']} → {report['load_average']['end']}; "
        f"faults: {json.dumps(report['faults'])}; processes left: {len(report['processes_left'])}",
        "",
        "| run | completed | rounds | accuracy (no faults) | rejected | clipped / down-weighted | malformed accepted "
        "| missing replies | resumed from checkpoint |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        restart = run.get("superlink_restart")
        resumed = "–"
        if restart:
            same = (run.get("resumed") or {}).get("model") == restart["checkpoint"]["model"]
            resumed = f"after round {restart['checkpoint']['round']}, same model: {same}"
        lines.append(
            f"| {run['strategy']} | {run['completed']} | {run.get('rounds', '–')} | "
            f"{run.get('final_accuracy', '–')} ({run.get('baseline_accuracy', '–')}) | {run.get('replies_rejected', '–')} | "
            f"{run.get('replies_clipped', '–')} / {run.get('replies_down_weighted', '–')} | "
            f"{run.get('malformed_accepted', '–')} | {run.get('replies_missing', '–')} | {resumed} |"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ paired


def condition_settings(base: Settings, strategy: str, seed: int, condition: str) -> Settings:
    """The soak settings of one paired run: `base`'s nodes, rounds and limits, one strategy."""
    common = replace(base, strategies=(strategy,), seed=seed, baseline=False, run={**PAIRED_RUN, **base.run},
                     round_timeout=PAIRED_ROUND_TIMEOUT)
    if condition == "clean":
        return replace(common, fuzz_share=0.0, max_kills=0, superlink_restart="", hang=False, late_nodes=0)
    if condition == "late":
        return replace(common, fuzz_share=0.0, max_kills=0, superlink_restart="", hang=False,
                       late_nodes=base.nodes // 2)
    return replace(common, superlink_restart=strategy, hang=True, late_nodes=PAIRED_LATE_NODES)


def paired(
    base: Settings, seeds: tuple[int, ...], out: Path, conditions: tuple[str, ...] = CONDITIONS
) -> dict[str, Any]:
    """Every strategy of `base` under each of `conditions` (clean, with faults, with late nodes
    only), for every seed, each run on a fresh deployment (module docstring); the report, also
    written to `out`. A run whose folder already holds a report is not run again (an interrupted
    measure resumes)."""
    out = out.resolve()
    started, load_before = time.monotonic(), load_average()
    runs: list[dict[str, Any]] = []
    for seed in seeds:
        for strategy in base.strategies:
            for condition in conditions:
                folder = out / "paired" / f"seed-{seed}" / strategy / condition
                if (folder / "report.json").exists():
                    report = json.loads((folder / "report.json").read_text())
                else:
                    report = soak(condition_settings(base, strategy, seed, condition), folder)
                (run,) = report["runs"]
                runs.append({"seed": seed, "condition": condition, **run, "faults": report["faults"],
                             "processes_left": len(report["processes_left"]), "load_average": report["load_average"]})
    summary = {
        "settings": {**asdict(base), "run": {**PAIRED_RUN, **base.run}, "seeds": list(seeds)},
        "machine": machine(),
        "load_average": {"start": load_before, "end": load_average()},
        "wall_seconds": round(time.monotonic() - started, 1),
        "strategies": {strategy: paired_summary([r for r in runs if r["strategy"] == strategy]) for strategy in base.strategies},
        "runs": runs,
    }
    (out / "paired.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "paired.md").write_text(render_paired(summary))
    return summary


def paired_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per condition: accuracy mean ± std, the cost in points against clean, and where it went."""
    def figures(condition: str) -> dict[str, Any]:
        chosen = [run for run in runs if run["condition"] == condition]
        accuracies = [run["final_accuracy"] for run in chosen if run.get("completed") and "final_accuracy" in run]
        total = lambda key: sum(run.get(key) or 0 for run in chosen)  # noqa: E731
        return {
            "runs": len(chosen),
            "completed": sum(bool(run.get("completed")) for run in chosen),
            "accuracy": accuracies,
            "mean": round(statistics.fmean(accuracies), 4) if accuracies else None,
            "std": round(statistics.stdev(accuracies), 4) if len(accuracies) > 1 else 0.0,
            "rounds_redone": sum(1 for run in chosen if run.get("superlink_restart")),
            "never_trained": [len(run.get("never_trained") or []) for run in chosen],
            "joined_late": [len(run.get("joined") or []) for run in chosen],
            "replies_rejected": total("replies_rejected"),
            "replies_clipped": total("replies_clipped"),
            "replies_missing": total("replies_missing"),
            "rested": total("rested"),
            "malformed_accepted": total("malformed_accepted"),
            "minutes": [round((run.get("wall_seconds") or 0) / 60, 1) for run in chosen],
            "kills": sum(run["faults"].get("supernode-killed", 0) for run in chosen),
        }

    result = {condition: figures(condition) for condition in CONDITIONS}
    for condition in ("faults", "late"):
        if result[condition]["mean"] is not None and result["clean"]["mean"] is not None:
            result[condition]["cost_points"] = round(100 * (result["clean"]["mean"] - result[condition]["mean"]), 1)
    return result


def render_paired(summary: dict[str, Any]) -> str:
    """The paired measure as markdown: a row per strategy, then where the cost went."""
    settings = summary["settings"]
    lines = [
        f"## soak, paired: {settings['nodes']} SuperNodes, {settings['rounds']} rounds, seeds {settings['seeds']}, "
        f"{summary['wall_seconds']:.0f} s",
        "",
        f"{summary['machine']}; load average {summary['load_average']['start']} → {summary['load_average']['end']}",
        "",
        "| strategy | clean | faults | cost (points) | late nodes only | cost (points) |",
        "|---|---|---|---|---|---|",
    ]
    cell = lambda f: "–" if f["mean"] is None else f"{f['mean']:.3f} ± {f['std']:.3f} ({f['completed']}/{f['runs']})"  # noqa: E731
    for strategy, by_condition in summary["strategies"].items():
        lines.append(
            f"| {strategy} | {cell(by_condition['clean'])} | {cell(by_condition['faults'])} | "
            f"{by_condition['faults'].get('cost_points', '–')} | {cell(by_condition['late'])} | "
            f"{by_condition['late'].get('cost_points', '–')} |"
        )
    lines += ["", "| strategy, condition | kills | rounds redone | partitions never trained (per run) | nodes joined late (per run) "
              "| replies rejected | clipped | missing | node-rounds rested | malformed accepted | minutes (per run) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for strategy, by_condition in summary["strategies"].items():
        for condition in ("faults", "late"):
            f = by_condition[condition]
            lines.append(
                f"| {strategy}, {condition} | {f['kills']} | {f['rounds_redone']} | {f['never_trained']} | {f['joined_late']} | "
                f"{f['replies_rejected']} | {f['replies_clipped']} | {f['replies_missing']} | {f['rested']} | "
                f"{f['malformed_accepted']} | {f['minutes']} |"
            )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ capacity


def capacity(
    counts: list[int], executor: str, out: Path, idle_seconds: float = 15.0, settle_seconds: float = 40.0
) -> list[dict[str, Any]]:
    """For each N: N SuperNodes idle (CPU per node, and the SuperLink's), then one FedSeq round
    (peak memory, wall). Idle CPU is measured over `idle_seconds` once every node has been
    online for `settle_seconds` (the SuperNode launcher's idle polls lengthen over the first 30 s
    without a message: this is the steady state). The rows so far are written to
    `out/capacity-<executor>.json` after each N (a sweep stopped by a time limit keeps them),
    with the load average beside each."""
    rows = []
    for count in counts:
        workdir = (out / f"capacity-{executor}-{count}").resolve()
        certificates = make_certificates(workdir / "certs", count)
        session = FlowerSession(workdir / "session", simulation=False,
                                superlink_args=superlink_security(certificates, supernode_auth=True),
                                root_certificates=certificates.ca_cert, env=FAST_POLLING, executor=executor)
        row: dict[str, Any] = {"nodes": count, "executor": executor, "load_average_start": load_average()}
        started = time.monotonic()
        with session:
            start_authenticated_nodes(session, certificates, list(range(count)), count)
            try:
                wait_for(lambda: len(online_node_ids(session)) == count, 300, "every SuperNode online")
                row["seconds_until_online"] = round(time.monotonic() - started, 1)
                time.sleep(settle_seconds)
                row.update(_measure_capacity(session, count, workdir, idle_seconds))
            except AssertionError as error:
                row.update(ok=False, error=str(error))
        row["processes_left"] = len(leftover_processes(workdir))
        row["load_average"] = load_average()
        rows.append(row)
        (out / f"capacity-{executor}.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))
        if not row.get("ok") or psutil.virtual_memory().available < 2 * 2**30:
            break
    return rows


def _measure_capacity(session: FlowerSession, count: int, workdir: Path, idle_seconds: float) -> dict[str, Any]:
    """Idle CPU per node and of the SuperLink over `idle_seconds`, then one FedSeq round: its wall
    time and the nodes' peak memory (summed RSS and PSS: shared library pages counted once per
    process in RSS, divided among the processes sharing them in PSS), with what could starve the
    round (`_RoundWatch`: memory left, page faults, the SuperLink's CPU and answer time)."""
    row: dict[str, Any] = {}
    family = _family(session) + [psutil.Process(session.superlink.pid)]
    before = {p.pid: _cpu(p) for p in family}
    time.sleep(idle_seconds)
    used = {p.pid: _cpu(p) - before[p.pid] for p in family}
    superlink = used.pop(session.superlink.pid)
    row["idle_cpu_per_node"] = round(sum(used.values()) / idle_seconds / count, 4)
    row["idle_cpu_superlink"] = round(superlink / idle_seconds, 4)
    watch = _RoundWatch(session)
    config = {**run_config(Settings(nodes=count, rounds=1), "fedseq", workdir / "run"), "fuzz-share": 0.0,
              "min-available-nodes": count, "round-timeout": 600.0}
    started = time.monotonic()
    try:
        session.wait(session.submit(config), timeout=900)
        row["ok"] = True
    except SimulationError as error:
        row.update(ok=False, error=str(error).splitlines()[0], log_tail=str(error).splitlines()[1:][-40:])
    finally:
        row["fedseq_round_seconds"] = round(time.monotonic() - started, 1)
        row.update(watch.stop())
        row["peak_rss_mib_per_node"] = round(watch.rss / count / 2**20, 1)
        row["peak_pss_mib_per_node"] = round(watch.pss / count / 2**20, 1)
    return row


def _family(session: FlowerSession) -> list[psutil.Process]:
    """The SuperNodes, executors and workers of a session (the SuperLink left out)."""
    members = []
    for process in session.processes:
        if process is session.superlink:
            continue
        try:
            root = psutil.Process(process.pid)
            members += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return members


def _cpu(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()
        return times.user + times.system
    except psutil.NoSuchProcess:
        return 0.0


def resident_memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in bytes, from /proc/<pid>/smaps_rollup ((0, 0) once it is gone)."""
    figures = {"Rss:": 0, "Pss:": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as rollup:
            for line in rollup:
                field, *rest = line.split()
                if field in figures:
                    figures[field] = int(rest[0]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return figures["Rss:"], figures["Pss:"]


class _RoundWatch:
    """What the nodes and the machine do during a round, sampled in threads: the nodes' largest
    summed RSS and PSS and the least available memory (every second), the system's major page
    faults and the SuperLink tree's CPU seconds over the round, and the slowest TLS handshake
    with the SuperLink (every 2 s): a SuperLink too starved to answer misses the ServerApp's
    heartbeats, and Flower then fails the run (60 s without one)."""

    def __init__(self, session: FlowerSession) -> None:
        self.session, self.rss, self.pss, self._done = session, 0, 0, threading.Event()
        self.least_available = psutil.virtual_memory().available
        self.slowest_handshake = 0.0
        self._faults, self._superlink_cpu = _major_faults(), _tree_cpu(session.superlink.pid)
        self._threads = [threading.Thread(target=target, daemon=True) for target in (self._sample, self._probe)]
        for thread in self._threads:
            thread.start()

    def _sample(self) -> None:
        while not self._done.wait(1.0):
            sampled = [resident_memory(process.pid) for process in _family(self.session)]
            self.rss = max(self.rss, sum(rss for rss, _ in sampled))
            self.pss = max(self.pss, sum(pss for _, pss in sampled))
            self.least_available = min(self.least_available, psutil.virtual_memory().available)

    def _probe(self) -> None:
        host, port = self.session.address.rsplit(":", 1)
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # timed, not trusted
        while not self._done.wait(2.0):
            started = time.monotonic()
            with contextlib.suppress(OSError):
                with socket.create_connection((host, int(port)), timeout=60) as sock:
                    sock.settimeout(60)
                    context.wrap_socket(sock).close()
            self.slowest_handshake = max(self.slowest_handshake, time.monotonic() - started)

    def stop(self) -> dict[str, Any]:
        """Stop sampling; the row's figures."""
        self._done.set()
        for thread in self._threads:
            thread.join()
        return {
            "least_available_gib": round(self.least_available / 2**30, 2),
            "major_page_faults": _major_faults() - self._faults,
            "superlink_cpu_seconds": round(_tree_cpu(self.session.superlink.pid) - self._superlink_cpu, 1),
            "slowest_superlink_handshake_s": round(self.slowest_handshake, 2),
        }


def _major_faults() -> int:
    """Major page faults (pages read back from disk) since boot, all processes."""
    with open("/proc/vmstat", encoding="ascii") as vmstat:
        return next(int(line.split()[1]) for line in vmstat if line.startswith("pgmajfault "))


def _tree_cpu(pid: int) -> float:
    """CPU seconds of a process and its children (the SuperLink and its ServerApp)."""
    try:
        root = psutil.Process(pid)
        return sum(_cpu(process) for process in [root, *root.children(recursive=True)])
    except psutil.NoSuchProcess:
        return 0.0


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (`main` reads its arguments with it)."""
    parser = argparse.ArgumentParser(prog=f"python -m concatfl.bench {SUITE}", description=__doc__.split("\n\n")[0])
    defaults = Settings()
    parser.add_argument("--out", default="results", help="results folder (the soak writes <out>/soak)")
    parser.add_argument("--nodes", type=int, help=f"default {defaults.nodes} ({PAIRED_NODES} with --paired)")
    parser.add_argument("--rounds", type=int, help=f"default {defaults.rounds} ({PAIRED_ROUNDS} with --paired)")
    parser.add_argument("--strategies", default=",".join(defaults.strategies))
    parser.add_argument("--fuzz-share", type=float, default=defaults.fuzz_share)
    parser.add_argument("--kill-share", type=float, default=defaults.kill_share)
    parser.add_argument("--kill-every", type=float, default=defaults.kill_every, help="seconds between kills")
    parser.add_argument("--round-timeout", type=float, default=defaults.round_timeout)
    parser.add_argument("--superlink-restart", default=defaults.superlink_restart, help="the run whose SuperLink is killed ('' for none)")
    parser.add_argument("--superlink-restart-after", type=int, default=defaults.superlink_restart_after)
    parser.add_argument("--no-hang", action="store_true", help="no SuperNode whose ClientApp hangs")
    parser.add_argument("--executor", choices=EXECUTORS, default=defaults.executor)
    parser.add_argument("--time-limit", type=float, default=defaults.time_limit, help="seconds (default 1800)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--late-nodes", type=int, default=defaults.late_nodes, help="nodes per run that join late")
    parser.add_argument("--late-delay", type=float, default=defaults.late_delay, help="seconds after the run's submission")
    parser.add_argument("--capacity", default="", metavar="N,N,…", help="measure capacity for these node counts instead")
    parser.add_argument("--paired", action="store_true", help="measure what the faults cost (module docstring)")
    parser.add_argument("--seeds", default=",".join(map(str, PAIRED_SEEDS)), help="the paired measure's seeds")
    parser.add_argument("--conditions", default=",".join(CONDITIONS), help="the paired measure's conditions")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring)."""
    parser = build_parser()
    defaults = Settings()
    args = parser.parse_args(argv)
    args.nodes = args.nodes or (PAIRED_NODES if args.paired else defaults.nodes)
    args.rounds = args.rounds or (PAIRED_ROUNDS if args.paired else defaults.rounds)
    out = Path(args.out) / SUITE
    if args.capacity:
        rows = capacity([int(n) for n in args.capacity.split(",")], args.executor, out)
        print(json.dumps(rows, indent=1))
        return 0 if all(not row.get("processes_left") for row in rows) else 1
    strategies = tuple(s for s in args.strategies.split(",") if s)
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or args.nodes < 4:
        parser.error(f"--strategies from {', '.join(STRATEGIES)} (got {unknown}); --nodes at least 4")
    conditions = tuple(c for c in args.conditions.split(",") if c)
    if not conditions or set(conditions) - set(CONDITIONS):
        parser.error(f"--conditions from {', '.join(CONDITIONS)} (got {args.conditions!r})")
    if args.late_nodes * len(strategies) >= args.nodes // 2:
        parser.error(f"--late-nodes {args.late_nodes} x {len(strategies)} runs must stay below half the --nodes")
    settings = Settings(
        nodes=args.nodes, rounds=args.rounds, strategies=strategies, fuzz_share=args.fuzz_share,
        kill_share=args.kill_share, kill_every=args.kill_every, round_timeout=args.round_timeout,
        superlink_restart=args.superlink_restart, superlink_restart_after=args.superlink_restart_after,
        hang=not args.no_hang, late_nodes=args.late_nodes, late_delay=args.late_delay, executor=args.executor,
        time_limit=args.time_limit, seed=args.seed,
    )
    if args.paired:
        summary = paired(settings, tuple(int(seed) for seed in args.seeds.split(",")), out, conditions)
        print(render_paired(summary))
        return 0 if not any(run["processes_left"] for run in summary["runs"]) else 1
    report = soak(settings, out)
    print(render(report))
    return 0 if not report["processes_left"] else 1
