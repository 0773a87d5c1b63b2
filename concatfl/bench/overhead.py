"""The `overhead` suite: what the framework itself costs, measured against plain PyTorch.

    python -m concatfl.bench overhead --out results [--parts 1,2,3,4] [--rounds 10] ...

Parts (`--parts` picks some; results of parts run earlier stay in overhead.json):

1. FedAvg through a real `flwr run` simulation (the way the other suites run their
   cells) against a bare single-process loop doing the same local training (concatfl's own
   data, partition, model and `train`), the same weighted averaging and the same central
   evaluation. Reported: the simulation's total wall time, its one-time start-up, its rounds,
   the bare loop's rounds, their ratio, and where the difference goes per round.
2. FedConcat: what a classifier round costs next to an encoder round, in wall
   seconds and bytes, read from the per-round records of one simulation's metrics.json.
3. 100 and 500 simulated clients with the same number training per round: peak memory of the
   simulation's whole process tree and the per-round time.
4. One FedSeq round through real processes: `scripts/deploy_latency.py` (SuperLink and
   SuperNodes on loopback), or the JSON it wrote earlier (`--latency-json`).

Parts 1 and 2 train on digits with the default model unless `--dataset`, `--data-dir`,
`--subsample`, `--model` and `--concat-model` say otherwise: Flower's cost per round is about
fixed, so their ratios depend on how much computation and how large a model each round carries.
Parts 3 and 4 always use digits.

Writes `<out>/overhead/overhead.json` and `<out>/overhead/table.md`; each part records the
command, the machine and the load average at its start and end (the figures are wall times on
a possibly shared machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from flwr.app import ArrayRecord

from ..config import RunConfig
from ..data.datasets import DATASETS
from .. import PROJECT_DIR
from ..metrics import METRICS_FILE
from ..runtime import ServerEnv, load_client_data
from ..strategies.common import weighted_average
from ..training import train
from .data import Subsample, shown_path, write_subsample
from .overhead_report import PARTS, render_table
from .runner import DATA_CACHE, measure_and_print, simulate_with_flower

SUITE = "overhead"
JSON_FILE = "overhead.json"
TABLE_FILE = "table.md"
RATIO_TARGET = 1.15  # part 1: simulated rounds at most this many times the bare loop's
CHEAPER_TARGET = 20.0  # part 2: a classifier round at least this many times cheaper than an encoder round
LATENCY_SCRIPT = PROJECT_DIR / "scripts" / "deploy_latency.py"
# deploy_latency.py's variants with concatfl's own settings: Flower's executor, and concatfl's warm
# executor with its SuperNode launcher (what docker-compose.yml runs).
LATENCY_VARIANTS = "server-pull-0.1s,warm-executor"
Metrics = dict[str, Any]


@dataclass(frozen=True)
class Options:
    """The suite's knobs and their defaults (see `parse_options` for their meaning)."""

    out: Path = Path("results")
    parts: tuple[str, ...] = PARTS
    rounds: int = 10
    clients: int = 10
    local_epochs: int = 1
    dataset: str = "digits"
    data_dir: Path | None = None
    subsample: tuple[int, ...] | None = None  # (train, test) images kept of a real dataset
    model: str | None = None  # part 1; None: the dataset's default
    concat_model: str | None = None  # part 2
    concat_local_epochs: int | None = None  # part 2; None: the run config's default
    concat_clients: int = 20
    encoder_rounds: int = 3
    classifier_rounds: int = 6
    many_clients: tuple[int, ...] = (100, 500)
    scale_rounds: int = 3
    latency_json: Path | None = None
    latency_nodes: int = 3
    seed: int = 0
    cpus_per_client: int = 1
    timeout: float = 1800.0

    @property
    def suite_dir(self) -> Path:
        """`<out>/overhead`: the JSON, the table and one folder per simulation."""
        return self.out / SUITE


# --------------------------------------------------------------------------- the machine


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's `model name` from /proc/cpuinfo ("unknown" where there is none)."""
    with contextlib.suppress(OSError):
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    return "unknown"


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages."""
    return [round(value, 2) for value in os.getloadavg()]


# --------------------------------------------------------------------------- memory


def simulation_processes() -> list[psutil.Process]:
    """Every process under the SuperLinks this process started: the SuperLink, the simulation
    runtime and Ray's processes. The short-lived `flwr` CLI calls of the launcher are not part
    of the simulation and are left out."""
    family = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if any("flower-superlink" in part for part in child.cmdline()):
                family += [child, *child.children(recursive=True)]
    return family


def process_label(command: Sequence[str]) -> str:
    """A short name for a command line: the script or module a Python process runs
    (`flwr-simulation`, `log_monitor.py`), else the program or title (Ray renames its workers,
    e.g. `ray::ClientAppActor`)."""
    if not command:
        return "?"
    if not Path(command[0]).name.startswith("python"):
        return Path(command[0]).name
    arguments = iter(command[1:])
    for word in arguments:
        if word == "-m":
            return next(arguments, word)
        if not word.startswith("-"):
            return Path(word).name
    return Path(command[0]).name


class PeakTreeMemory:
    """Peak of the RSS summed over the simulation's processes, sampled in a thread.

    Summed RSS counts pages shared between processes (libraries, Ray's object store) once per
    process, so it is an upper bound of what the tree really holds.
    """

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.peak_bytes = 0
        self.at_peak: dict[str, int] = {}  # process label → summed RSS at the peak sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakTreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            by_label: dict[str, int] = {}
            for process in simulation_processes():
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    label = process_label(process.cmdline())
                    by_label[label] = by_label.get(label, 0) + process.memory_info().rss
            if sum(by_label.values()) > self.peak_bytes:
                self.peak_bytes, self.at_peak = sum(by_label.values()), by_label


# --------------------------------------------------------------------------- reading metrics.json


def round_times(metrics: Metrics) -> dict[str, Any]:
    """Per-round wall seconds of a run: every round, the first, the mean of the later ones, and
    the mean of its hops (send → last reply)."""
    seconds = [record["seconds"] for record in metrics["rounds"]]
    hops = [hop["seconds"] for record in metrics["rounds"] for hop in record["hops"]]
    return {
        "round_seconds": seconds,
        "rounds_seconds": round(sum(seconds), 3),
        "first_round_seconds": seconds[0],
        "later_rounds_mean_seconds": round(statistics.fmean(seconds[1:]), 4) if len(seconds) > 1 else None,
        "hop_mean_seconds": round(statistics.fmean(hops), 4),
    }


def simulation_breakdown(metrics: Metrics, started: float, server_finished: float, finished: float) -> dict[str, Any]:
    """Where a simulation's wall time went, from metrics.json and three wall-clock instants
    (`time.time()`): the launcher's start, the ServerApp's end (metrics.json written) and the
    launcher's return.

    The ServerApp started `wall_seconds` before its end. Start-up is everything before round 1:
    SuperLink, `flwr run`, the simulation runtime and the ServerApp's own set-up (data, model,
    waiting for and identifying the nodes, initial evaluation); the few milliseconds of
    checkpoint writing between rounds fall into it too. After the last round come the
    launcher's completion poll (up to 5 s) and the teardown of every process.
    """
    times = round_times(metrics)
    before_server = server_finished - metrics["wall_seconds"] - started
    return {
        "wall_seconds": round(finished - started, 3),
        "startup_seconds": round(before_server + metrics["wall_seconds"] - times["rounds_seconds"], 3),
        "before_serverapp_seconds": round(before_server, 3),
        "serverapp_seconds": metrics["wall_seconds"],
        **times,
        "after_serverapp_seconds": round(finished - server_finished, 3),
        "final_accuracy": metrics["final_accuracy"],
    }


def fedconcat_costs(metrics: Metrics) -> dict[str, Any]:
    """Mean wall seconds and bytes (down + up) of FedConcat's encoder rounds, its classifier
    rounds, and the classifier round(s) that first broadcast the encoders; the ratios
    encoder / classifier round.

    A round's kind comes from its `stage` and its `stage_bytes` hop kinds: a classifier round
    that also sent the frozen encoders is counted apart, as a one-time cost.
    """
    kinds: dict[str, list[Metrics]] = {"encoder": [], "classifier": [], "encoder broadcast + classifier": []}
    for record in metrics["rounds"]:
        if record["stage"] == "encoders":
            kinds["encoder"].append(record)
        elif "encoder-broadcast" in record["stage_bytes"]:
            kinds["encoder broadcast + classifier"].append(record)
        else:
            kinds["classifier"].append(record)
    costs = {
        kind: {
            "rounds": len(records),
            "mean_seconds": round(statistics.fmean(r["seconds"] for r in records), 4),
            "mean_hop_seconds": round(statistics.fmean(h["seconds"] for r in records for h in r["hops"]), 4),
            "mean_bytes": round(statistics.fmean(r["bytes_sent"] + r["bytes_received"] for r in records)),
        }
        for kind, records in kinds.items()
        if records
    }
    encoder, classifier = costs.get("encoder"), costs.get("classifier")
    ratios = (
        {
            "seconds": round(encoder["mean_seconds"] / classifier["mean_seconds"], 2),
            "bytes": round(encoder["mean_bytes"] / classifier["mean_bytes"], 2),
        }
        if encoder and classifier
        else None
    )
    return {"rounds": costs, "encoder_over_classifier": ratios, "target": CHEAPER_TARGET}


def fedseq_latency(report: Mapping[str, Any]) -> dict[str, Any]:
    """FedSeq's sequential hops per settings variant of a `scripts/deploy_latency.py` report.

    Its hop log starts with the pre-training hop (every node at once); the one-message hops
    after it are the superclient's chain. Overhead = hop seconds − the ClientApp's train-seconds.
    """
    variants = {}
    for name, results in report["variants"].items():
        chain = [hop for hop in results["fedseq"]["hops"][1:] if hop["messages"] == 1]
        seconds = [hop["seconds"] for hop in chain]
        training = [sum(hop["train_seconds"]) for hop in chain]
        variants[name] = {
            "chain_hops": len(chain),
            "hop_seconds": [round(s, 2) for s in seconds],
            "train_seconds": [round(t, 2) for t in training],
            "mean_hop_seconds": round(statistics.fmean(seconds), 2),
            "mean_train_seconds": round(statistics.fmean(training), 2),
            "mean_overhead_seconds": round(statistics.fmean(s - t for s, t in zip(seconds, training)), 2),
        }
    return {
        "nodes": report["nodes"],
        "rounds": report["rounds"],
        "variants": variants,
        "client_process_start_seconds": report["client_process_start_seconds"],
        "train_message": report["train_message"],
    }


# --------------------------------------------------------------------------- running


def client_generator(seed: int, server_round: int, partition_id: int) -> torch.Generator:
    """The generator concatfl's ClientApp trains with for this round and partition (same
    formula as `client_app.train_handler`), so the bare loop draws the same mini-batches."""
    return torch.Generator().manual_seed(seed * 1_000_003 + server_round * 100_003 + partition_id)


def bare_fedavg(run_config: Mapping[str, Any], num_clients: int) -> dict[str, Any]:
    """FedAvg with every client training every round, in this process, without Flower.

    Same initial model (the ServerApp seeds torch before building it), same client data, same
    `train` call and mini-batch order, same num-examples-weighted `weighted_average` on
    ArrayRecords, same central evaluation. The clients train one after another. Data loading
    and the initial evaluation are timed apart (`setup_seconds`), like the simulation's
    start-up.
    """
    config = RunConfig.from_mapping(run_config)
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    env = ServerEnv.from_config(config)
    model = env.make_model()
    arrays = ArrayRecord(model.state_dict())
    clients = [load_client_data(config, partition, num_clients) for partition in range(num_clients)]
    env.evaluate(model)
    setup_seconds = time.perf_counter() - started
    rounds = []
    for server_round in range(1, config.num_server_rounds + 1):
        round_started = time.perf_counter()
        replies, weights, train_seconds = [], [], 0.0
        for partition, data in enumerate(clients):
            model.load_state_dict(arrays.to_torch_state_dict())
            train_started = time.perf_counter()
            train(
                model,
                data.x_train,
                data.y_train,
                epochs=config.local_epochs,
                batch_size=config.batch_size,
                lr=config.lr,
                momentum=config.momentum,
                weight_decay=config.weight_decay,
                normalization=data.normalization,
                device=env.device,
                generator=client_generator(config.seed, server_round, partition),
                augmentation=data.augmentation,
            )
            train_seconds += time.perf_counter() - train_started
            replies.append({key: tensor.detach().numpy().copy() for key, tensor in model.state_dict().items()})
            weights.append(len(data.y_train))
        aggregate_started = time.perf_counter()
        arrays = weighted_average(replies, weights)
        evaluate_started = time.perf_counter()
        model.load_state_dict(arrays.to_torch_state_dict())
        _, accuracy = env.evaluate(model)
        finished = time.perf_counter()
        rounds.append(
            {
                "seconds": round(finished - round_started, 4),
                "train_seconds": round(train_seconds, 4),
                "aggregate_seconds": round(evaluate_started - aggregate_started, 4),
                "evaluate_seconds": round(finished - evaluate_started, 4),
                "accuracy": accuracy,
            }
        )
    seconds = [r["seconds"] for r in rounds]
    return {
        "setup_seconds": round(setup_seconds, 3),
        "rounds_seconds": round(sum(seconds), 3),
        "first_round_seconds": seconds[0],
        "later_rounds_mean_seconds": round(statistics.fmean(seconds[1:]), 4) if len(seconds) > 1 else None,
        "rounds": rounds,
        "final_accuracy": rounds[-1]["accuracy"],
        "torch_threads": torch.get_num_threads(),
    }


def per_round_difference(simulation: Metrics, bare: Metrics) -> dict[str, float]:
    """Mean seconds per round, simulation vs bare loop, split into the training hop (send →
    last reply) against the bare training, and the server's side (validation, aggregation,
    evaluation, the round's record) against the bare averaging and evaluation."""
    rounds = simulation["rounds"]
    hop = statistics.fmean(sum(h["seconds"] for h in r["hops"]) for r in rounds)
    whole = statistics.fmean(r["seconds"] for r in rounds)
    bare_train = statistics.fmean(r["train_seconds"] for r in bare["rounds"])
    bare_server = statistics.fmean(r["aggregate_seconds"] + r["evaluate_seconds"] for r in bare["rounds"])
    return {
        "simulation_round": round(whole, 4),
        "bare_round": round(bare_train + bare_server, 4),
        "simulation_hop": round(hop, 4),
        "bare_train": round(bare_train, 4),
        "simulation_server_side": round(whole - hop, 4),
        "bare_aggregate_and_evaluate": round(bare_server, 4),
    }


def simulate(options: Options, name: str, run_config: dict[str, Any], clients: int) -> tuple[Metrics, dict[str, Any]]:
    """One `flwr run` simulation in `<suite dir>/<name>` (emptied first: a timing is never
    reused), as the other suites run their cells; returns metrics.json and the breakdown of its
    wall time, with the peak memory of its process tree."""
    workdir = options.suite_dir / name
    shutil.rmtree(workdir, ignore_errors=True)
    with PeakTreeMemory() as memory:
        started = time.time()
        metrics = simulate_with_flower(options.timeout, options.cpus_per_client)(run_config, clients, workdir)
        finished = time.time()
    server_finished = (workdir / "output" / METRICS_FILE).stat().st_mtime
    return metrics, {
        **simulation_breakdown(metrics, started, server_finished, finished),
        "peak_rss_bytes": memory.peak_bytes,
        "peak_rss_by_process": dict(sorted(memory.at_peak.items(), key=lambda item: -item[1])),
    }


def data_config(options: Options, model: str | None) -> dict[str, Any]:
    """The run-config keys of parts 1 and 2's data and model; a real dataset's subsample is
    written under `<out>/data/` once, as the other suites do."""
    config: dict[str, Any] = {"dataset": options.dataset}
    if options.dataset != "digits":
        data_dir = Path(str(options.data_dir)).expanduser().resolve()  # parse_options requires it
        if options.subsample is not None:
            subsample = Subsample(*options.subsample)
            data_dir = write_subsample(options.dataset, data_dir, subsample, options.out / DATA_CACHE)
        config["data-dir"] = str(data_dir)
    if model is not None:
        config["model"] = model
    return config


def part_fedavg(options: Options) -> dict[str, Any]:
    """Part 1: the simulation's rounds against the bare loop's (default partition, every client
    every round)."""
    config = {
        "strategy": "fedavg",
        **data_config(options, options.model),
        "num-server-rounds": options.rounds,
        "local-epochs": options.local_epochs,
        "fraction-train": 1.0,
        "min-available-nodes": options.clients,
        "seed": options.seed,
    }
    bare = bare_fedavg(config, options.clients)
    metrics, simulation = simulate(options, "fedavg-simulation", config, options.clients)
    return {
        "run_config": config,
        "clients": options.clients,
        "concurrent_clients": max(1, (os.cpu_count() or 1) // options.cpus_per_client),
        "simulation": simulation,
        "bare": bare,
        "ratio_rounds_to_bare": round(simulation["rounds_seconds"] / bare["rounds_seconds"], 2),
        # Round 1 carries one-time warm-up on both sides (first forward/backward, the actors' imports).
        "ratio_later_rounds_to_bare": (
            round(simulation["later_rounds_mean_seconds"] / bare["later_rounds_mean_seconds"], 2)
            if options.rounds > 1
            else None
        ),
        "target": RATIO_TARGET,
        "per_round": per_round_difference(metrics, bare),
    }


def part_fedconcat(options: Options) -> dict[str, Any]:
    """Part 2: one FedConcat simulation, #C=2; its rounds' costs by kind."""
    config = {
        "strategy": "fedconcat",
        **data_config(options, options.concat_model),
        "partition": "classes",
        "classes-per-client": 2,
        "min-available-nodes": options.concat_clients,
        "fedconcat-encoder-rounds": options.encoder_rounds,
        "fedconcat-classifier-rounds": options.classifier_rounds,
        "seed": options.seed,
    }
    if options.concat_local_epochs is not None:
        config["local-epochs"] = options.concat_local_epochs
    metrics, simulation = simulate(options, "fedconcat-simulation", config, options.concat_clients)
    return {
        "run_config": config,
        "clients": options.concat_clients,
        "clusters": metrics["setup"]["k"],
        "wall_seconds": simulation["wall_seconds"],
        **fedconcat_costs(metrics),
    }


def part_scale(options: Options) -> dict[str, Any]:
    """Part 3: the same number of clients per round out of 100 and 500. iid (which has no
    minimum partition size): each of 500 clients still gets 2–3 of digits' 1,437 samples."""
    runs = []
    for clients in options.many_clients:
        config = {
            "strategy": "fedavg",
            "dataset": "digits",
            "num-server-rounds": options.scale_rounds,
            "fraction-train": options.clients / clients,
            "min-available-nodes": clients,
            "local-test-fraction": 0.0,  # 2–3 samples per client at 500: all of them train
            "seed": options.seed,
        }
        metrics, simulation = simulate(options, f"clients-{clients}", config, clients)
        runs.append(
            {"clients": clients, "per_round": len(metrics["rounds"][0]["selected"]), "run_config": config, **simulation}
        )
    return {"runs": runs}


def part_latency(options: Options) -> dict[str, Any]:
    """Part 4: FedSeq's sequential hops through real processes, from deploy_latency.py's JSON
    (`--latency-json`), or from a fresh one-round run of it with concatfl's own settings
    (LATENCY_VARIANTS)."""
    path = options.latency_json
    if path is None:
        path = (options.suite_dir / "deploy-latency.json").resolve()  # the script runs in the project folder
        command = [sys.executable, str(LATENCY_SCRIPT), "--nodes", str(options.latency_nodes), "--rounds", "1"]
        subprocess.run([*command, "--variants", LATENCY_VARIANTS, "--out", str(path)], check=True, cwd=PROJECT_DIR)
    return {"source": shown_path(path), **fedseq_latency(json.loads(path.read_text()))}


PART_RUNNERS: dict[str, Callable[[Options], dict[str, Any]]] = {
    "1": part_fedavg,
    "2": part_fedconcat,
    "3": part_scale,
    "4": part_latency,
}


# --------------------------------------------------------------------------- command line


def measure(options: Options, command: str) -> Path:
    """Run the chosen parts, merge them into overhead.json, write table.md; returns its path."""
    options.suite_dir.mkdir(parents=True, exist_ok=True)
    json_path = options.suite_dir / JSON_FILE
    document = json.loads(json_path.read_text()) if json_path.exists() else {"parts": {}}
    for part in options.parts:
        run = {"command": command, "cpu_model": cpu_model(), "cores": os.cpu_count()}
        run["load_average_start"] = load_average()
        print(f"overhead part {part} …", flush=True)
        result = PART_RUNNERS[part](options)
        document["parts"][part] = {**result, "run": {**run, "load_average_end": load_average()}}
        # Written after every part, so a later part's failure keeps the earlier ones.
        json_path.write_text(json.dumps(document, indent=1))
        (options.suite_dir / TABLE_FILE).write_text(render_table(document))
    return options.suite_dir / TABLE_FILE


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(value) for value in text.split(","))


def parse_options(argv: Sequence[str]) -> Options:
    """`python -m concatfl.bench overhead [options]` → Options."""
    default = Options()
    parser = argparse.ArgumentParser(prog="python -m concatfl.bench overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=default.out, help="results folder (default results)")
    parser.add_argument("--parts", default=",".join(default.parts), help="comma-separated, of 1,2,3,4 (default all)")
    parser.add_argument(
        "--rounds", type=int, default=default.rounds, help="part 1: FedAvg rounds (default %(default)s)"
    )
    parser.add_argument(
        "--clients",
        type=int,
        default=default.clients,
        help="part 1: clients; part 3: clients training per round (default %(default)s)",
    )
    parser.add_argument("--local-epochs", type=int, default=default.local_epochs, help="part 1 (default %(default)s)")
    parser.add_argument("--dataset", default=default.dataset, help="parts 1 and 2 (default %(default)s)")
    parser.add_argument("--data-dir", type=Path, help="parts 1 and 2: the real dataset's folder")
    parser.add_argument("--subsample", type=_ints, help="parts 1 and 2: TRAIN,TEST images kept of a real dataset")
    parser.add_argument("--model", help="part 1 (default: the dataset's)")
    parser.add_argument("--concat-model", help="part 2 (default: the dataset's)")
    parser.add_argument("--concat-local-epochs", type=int, help="part 2 (default: the run config's)")
    parser.add_argument(
        "--concat-clients", type=int, default=default.concat_clients, help="part 2: clients (default %(default)s)"
    )
    parser.add_argument(
        "--encoder-rounds", type=int, default=default.encoder_rounds, help="part 2 (default %(default)s)"
    )
    parser.add_argument(
        "--classifier-rounds", type=int, default=default.classifier_rounds, help="part 2 (default %(default)s)"
    )
    parser.add_argument(
        "--many-clients", type=_ints, default=default.many_clients, help="part 3: client counts (default 100,500)"
    )
    parser.add_argument(
        "--scale-rounds", type=int, default=default.scale_rounds, help="part 3: rounds per run (default %(default)s)"
    )
    parser.add_argument(
        "--latency-json", type=Path, help="part 4: the JSON scripts/deploy_latency.py wrote, instead of running it"
    )
    parser.add_argument(
        "--latency-nodes", type=int, default=default.latency_nodes, help="part 4: SuperNodes (default %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=default.seed)
    parser.add_argument("--cpus-per-client", type=int, default=default.cpus_per_client)
    parser.add_argument(
        "--timeout", type=float, default=default.timeout, help="seconds one simulation may take (default %(default)s)"
    )
    args = parser.parse_args(argv)
    parts = tuple(dict.fromkeys(part.strip() for part in args.parts.split(",")))
    if not set(parts) <= set(PARTS):
        parser.error(f"--parts takes some of {','.join(PARTS)}, got {args.parts!r}")
    if args.dataset not in DATASETS:
        parser.error(f"--dataset takes one of {', '.join(DATASETS)}, got {args.dataset!r}")
    if args.dataset != "digits" and args.data_dir is None:
        parser.error(f"--dataset {args.dataset} needs --data-dir")
    if args.subsample is not None and len(args.subsample) != 2:
        parser.error(f"--subsample takes TRAIN,TEST, got {args.subsample!r}")
    if "3" in parts and args.clients > min(args.many_clients):
        parser.error("--clients (per round in part 3) exceeds a --many-clients count")
    return Options(**{**vars(args), "parts": parts})


def main(argv: Sequence[str]) -> int:
    """Measure the chosen parts, print the table."""
    return measure_and_print(SUITE, argv, parse_options, measure)
