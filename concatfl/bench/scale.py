"""`python -m concatfl.bench scale`: what every strategy costs from 100 to 10,000 clients.

    python -m concatfl.bench scale --data-dir DIR [--out results] [--clients 100,1000,10000]
        [--per-round 10,100] [--rounds 3] [--strategies fedavg,...] [--samples-per-client 6]

Every cell (strategy, N clients, m clients per round) is one real `flwr run` simulation
(`concatfl.launch.run_simulation`) of MNIST with LeNet-5, each client holding the same number of
images whatever N (a stratified subsample of N × `--samples-per-client` training images, iid; one
local epoch): the clients' work per round is the same at every N, so what grows with N is the
framework's. m sets: FedAvg, FedProx and SCAFFOLD's fraction-train (m/N), FedCat's K, FedSeq's
and FedSeqInter's superclients (10 clients each, m/10 selected per round), FedConcat's
fraction-train (m/N of each cluster). FedSeq pre-trains for one epoch; FedConcat-ID, and
FedConcat's label check (the same inference, on by default), infer from `--id-samples` random
inputs per client instead of 10,000: a server cost linear in N either way, and at 10,000 inputs
one LeNet-5 client takes seconds of the server's CPU (hours at N = 10,000).

Read from each run's metrics.json (`timing` included) and its process tree:
- start-up: from `flwr run` until the strategy's stage 1 begins (SuperLink, simulation runtime,
  ServerApp set-up, the identity query to every node, initial evaluation);
- stage 1 (FedSeq: pre-training every client and grouping; FedConcat: the label query or
  FedConcat-ID's training and inference, and the clustering): its hops (messaging and the clients'
  work) and the server's computation besides them;
- server seconds per round, apart from training: the round's wall time minus its hops (node
  listing, sampling, building messages, validating, bounding and aggregating replies, evaluation,
  records) plus writing the checkpoint after it; the hops' own seconds (send → last reply: Flower's
  messaging and the m clients' training) apart;
- peak memory: RSS summed over the simulation's whole process tree (`overhead.PeakTreeMemory`);
- metrics.json's and the checkpoint's size.

Writes `<out>/scale/scale.json` after every cell (a cell already there with the same run config is
not run again), `<out>/scale/table.md` and `<out>/scale/scale.png` (log-log: server seconds per
round, start-up and stage 1 against N, one line per strategy), each with the command, the machine
and the load average at the start and end of every cell.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..metrics import METRICS_FILE
from .data import Subsample, write_subsample
from .overhead import PeakTreeMemory, cpu_model, load_average, simulation_breakdown
from .runner import DATA_CACHE, measure_and_print, simulate_with_flower

SUITE = "scale"
JSON_FILE = "scale.json"
TABLE_FILE = "table.md"
PLOT_FILE = "scale.png"
STRATEGIES = ("fedavg", "fedprox", "scaffold", "fedcat", "fedseq", "fedseq-inter", "fedconcat", "fedconcat-id")
LABELS = {
    "fedavg": "FedAvg", "fedprox": "FedProx", "scaffold": "SCAFFOLD", "fedcat": "FedCat", "fedseq": "FedSeq",
    "fedseq-inter": "FedSeqInter", "fedconcat": "FedConcat", "fedconcat-id": "FedConcat-ID",
}
SUPERCLIENT = 10  # FedSeq's clients per superclient here
TEST_IMAGES = 1000  # the server's evaluation set: the same at every N
TARGET_RATIO = 2.0  # server seconds per round at the largest N over those at the next, m = 100
Record = dict[str, Any]


@dataclass(frozen=True)
class Options:
    """The benchmark's knobs (see `parse_options`)."""

    data_dir: Path
    out: Path = Path("results")
    clients: tuple[int, ...] = (100, 1000, 10000)
    per_round: tuple[int, ...] = (10, 100)
    rounds: int = 3
    strategies: tuple[str, ...] = STRATEGIES
    samples_per_client: int = 6
    id_samples: int = 200
    seed: int = 0
    timeout: float = 3 * 3600.0

    @property
    def suite_dir(self) -> Path:
        """`<out>/scale`: the JSON, the table, the plot and one folder per simulation."""
        return self.out / SUITE


def run_config(strategy: str, clients: int, per_round: int, options: Options, data_dir: Path) -> Record:
    """The run config of one cell (module docstring)."""
    config: Record = {
        "strategy": strategy,
        "dataset": "mnist",
        "data-dir": str(data_dir),
        "model": "lenet5",
        "partition": "iid",
        "local-test-fraction": 0.0,
        "local-epochs": 1,
        "batch-size": 32,
        "lr": 0.05,
        "num-server-rounds": options.rounds,
        "min-available-nodes": clients,
        "fraction-train": per_round / clients,
        "round-timeout": 3600.0,
        "seed": options.seed,
    }
    if strategy == "fedcat":
        config["fedcat-k"] = per_round
    elif strategy in ("fedseq", "fedseq-inter"):
        config.update({
            "fedseq-max-clients": SUPERCLIENT,
            "fedseq-min-samples": SUPERCLIENT * options.samples_per_client,
            "fedseq-pretrain-epochs": 1,
            "fraction-train": per_round / clients,  # of the N/10 superclients: m/10 chains of 10
        })
    elif strategy in ("fedconcat", "fedconcat-id"):
        # FedConcat's label check infers P^ID of every client's model as FedConcat-ID does.
        config.update({"fedconcat-encoder-rounds": options.rounds - 1, "fedconcat-classifier-rounds": 1,
                       "fedconcat-id-samples": options.id_samples})
    return config


def stage1_hop_seconds(metrics: Record) -> float:
    """Seconds of the hops before round 1 (pre-training, the label query, FedConcat-ID's training)."""
    entries = []
    for value in metrics["setup"].values():  # one hop (FedSeq's pre-training) or a list of them (FedConcat's)
        entries += value if isinstance(value, list) else [value]
    return sum(hop["seconds"] for hop in entries if isinstance(hop, dict) and "seconds" in hop and "sent" in hop)


def summarize(metrics: Record, breakdown: Record, output: Path) -> Record:
    """A cell's figures (module docstring) from its metrics.json and wall-time breakdown."""
    timing = metrics["timing"]
    rounds = metrics["rounds"]
    hops = [sum(hop["seconds"] for hop in record["hops"]) for record in rounds]
    server = [record["seconds"] - hop + checkpoint
              for record, hop, checkpoint in zip(rounds, hops, timing["checkpoint_seconds"])]
    setup = timing["setup_seconds"] or 0.0
    stage1_hops = stage1_hop_seconds(metrics)
    return {
        "startup_seconds": round(breakdown["startup_seconds"] - setup - sum(timing["checkpoint_seconds"]), 2),
        "stage1_seconds": round(setup, 2),
        "stage1_hop_seconds": round(stage1_hops, 2),
        "stage1_server_seconds": round(setup - stage1_hops, 2),
        "server_seconds_per_round": round(statistics.fmean(server), 4),
        "server_seconds": [round(s, 4) for s in server],
        "hop_seconds_per_round": round(statistics.fmean(hops), 3),
        "checkpoint_seconds": timing["checkpoint_seconds"],
        "selected_per_round": [sum(hop["sent"] for hop in record["hops"]) for record in rounds],
        "peak_rss_bytes": breakdown["peak_rss_bytes"],
        "peak_rss_by_process": breakdown["peak_rss_by_process"],
        "metrics_bytes": (output / METRICS_FILE).stat().st_size,
        "checkpoint_bytes": timing["checkpoint_bytes"],
        "wall_seconds": breakdown["wall_seconds"],
        "final_accuracy": metrics["final_accuracy"],
    }


def measure(options: Options, strategy: str, clients: int, per_round: int, data_dir: Path) -> Record:
    """Run one cell as a `flwr run` simulation in `<suite dir>/<strategy>-<N>-<m>` (emptied first)."""
    config = run_config(strategy, clients, per_round, options, data_dir)
    workdir = options.suite_dir / f"{strategy}-{clients}-{per_round}"
    shutil.rmtree(workdir, ignore_errors=True)
    load_start = load_average()
    with PeakTreeMemory() as memory:
        started = time.time()
        metrics = simulate_with_flower(options.timeout)(config, clients, workdir)
        finished = time.time()
    output = workdir / "output"
    server_finished = (output / METRICS_FILE).stat().st_mtime
    breakdown = {
        **simulation_breakdown(metrics, started, server_finished, finished),
        "peak_rss_bytes": memory.peak_bytes,
        "peak_rss_by_process": dict(sorted(memory.at_peak.items(), key=lambda item: -item[1])),
    }
    return {
        "strategy": strategy,
        "clients": clients,
        "per_round": per_round,
        "run_config": config,
        **summarize(metrics, breakdown, output),
        "load_average_start": load_start,
        "load_average_end": load_average(),
    }


def run(options: Options, command: str, log=print) -> Path:
    """Measure every cell not yet in scale.json, writing it (and the table and plot) after each."""
    options.suite_dir.mkdir(parents=True, exist_ok=True)
    json_path = options.suite_dir / JSON_FILE
    document = json.loads(json_path.read_text()) if json_path.exists() else {"cells": []}
    document.update({"command": command, "machine": f"{cpu_model()}, {os.cpu_count()} cores"})
    subsamples: dict[int, Path] = {}
    for clients in options.clients:
        for per_round in options.per_round:
            for strategy in options.strategies:
                if per_round > clients:
                    continue
                if clients not in subsamples:
                    train = min(60_000, clients * options.samples_per_client)
                    subsamples[clients] = write_subsample(
                        "mnist", options.data_dir.expanduser().resolve(), Subsample(train, TEST_IMAGES),
                        options.out / DATA_CACHE,
                    )
                config = run_config(strategy, clients, per_round, options, subsamples[clients])
                if any(cell["run_config"] == config for cell in document["cells"]):
                    log(f"{strategy} N={clients} m={per_round}: done earlier")
                    continue
                log(f"{strategy} N={clients} m={per_round} …")
                try:
                    cell = measure(options, strategy, clients, per_round, subsamples[clients])
                except Exception as error:  # pylint: disable=broad-exception-caught  # a failed cell is a finding
                    cell = {"strategy": strategy, "clients": clients, "per_round": per_round, "run_config": config,
                            "error": str(error).splitlines()[0] if str(error) else type(error).__name__,
                            "log_tail": str(error).splitlines()[1:][-40:],  # the ServerApp's own words
                            "load_average_end": load_average()}
                document["cells"] = [c for c in document["cells"] if c["run_config"] != config] + [cell]
                json_path.write_text(json.dumps(document, indent=1))
                write_outputs(document, options.suite_dir)
                log(f"  {_line(cell)}")
    return write_outputs(document, options.suite_dir)


def _line(cell: Record) -> str:
    if "error" in cell:
        return f"FAILED: {cell['error']}"
    return (
        f"start-up {cell['startup_seconds']:.1f} s, stage 1 {cell['stage1_seconds']:.1f} s, server "
        f"{cell['server_seconds_per_round']:.3f} s/round, hops {cell['hop_seconds_per_round']:.2f} s/round, "
        f"peak {cell['peak_rss_bytes'] / 2**30:.2f} GiB, metrics {cell['metrics_bytes'] / 1e3:.0f} kB, "
        f"checkpoint {cell['checkpoint_bytes'] / 1e6:.2f} MB (wall {cell['wall_seconds']:.0f} s)"
    )


# --------------------------------------------------------------------------- table and plot


def render_table(document: Record) -> str:
    """table.md: one row per cell, then the ratio the target speaks of."""
    lines = [
        "## scale — every strategy from 100 to 10,000 simulated clients",
        "",
        f"Command: `{document['command']}` — {document['machine']}. Load average (1 min) at each cell's start → end "
        "in the last column.",
        "",
        "| strategy | N | m | start-up s | stage 1 s (hops + server) | server s/round | hops s/round | "
        "peak RSS GiB | metrics.json kB | checkpoint MB | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cells = sorted(document["cells"], key=lambda c: (STRATEGIES.index(c["strategy"]), c["per_round"], c["clients"]))
    for cell in cells:
        name = f"{LABELS[cell['strategy']]} | {cell['clients']:,} | {cell['per_round']}"
        if "error" in cell:
            lines.append(f"| {name} | failed: {cell['error']} | | | | | | | |")
            continue
        stage1 = (f"{cell['stage1_seconds']:.1f} ({cell['stage1_hop_seconds']:.1f} + {cell['stage1_server_seconds']:.1f})"
                  if cell["stage1_seconds"] >= 0.05 else "–")
        lines.append(
            f"| {name} | {cell['startup_seconds']:.1f} | {stage1} | {cell['server_seconds_per_round']:.3f} | "
            f"{cell['hop_seconds_per_round']:.2f} | {cell['peak_rss_bytes'] / 2**30:.2f} | "
            f"{cell['metrics_bytes'] / 1e3:,.0f} | {cell['checkpoint_bytes'] / 1e6:.2f} | "
            f"{cell['load_average_start'][0]:.1f} → {cell['load_average_end'][0]:.1f} |"
        )
    lines += ["", *ratio_lines(document)]
    return "\n".join(lines) + "\n"


def ratio_lines(document: Record) -> list[str]:
    """Server seconds per round at the largest N over those at the next smaller N (m = 100)."""
    sizes = sorted({c["clients"] for c in document["cells"] if "error" not in c})
    if len(sizes) < 2:
        return []
    small, large = sizes[-2], sizes[-1]
    lines = [f"Server seconds per round at N = {large:,} over N = {small:,}, m = 100 (target ≤ {TARGET_RATIO:g}):", ""]
    for strategy in STRATEGIES:
        figures = {c["clients"]: c["server_seconds_per_round"] for c in document["cells"]
                   if c["strategy"] == strategy and c["per_round"] == 100 and "error" not in c}
        if small in figures and large in figures and figures[small] > 0:
            ratio = figures[large] / figures[small]
            lines.append(f"- {LABELS[strategy]}: {ratio:.2f} ({'met' if ratio <= TARGET_RATIO else 'missed'})")
    return lines


def plot(document: Record, path: Path) -> None:
    """Log-log panels against N: server seconds per round (m = 100 solid, m = 10 dashed, one
    colour per strategy), and start-up and stage 1 (m = 100)."""
    # pylint: disable=import-outside-toplevel
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.5))
    panels = figure.subplots(1, 3)
    titles = ("server s per round (apart from training)", "start-up s (until stage 1)", "stage 1 s")
    keys = ("server_seconds_per_round", "startup_seconds", "stage1_seconds")
    for panel, title, key in zip(panels, titles, keys):
        for colour, strategy in enumerate(STRATEGIES):
            for per_round, style in ((100, "-"), (10, "--")):
                if key != "server_seconds_per_round" and per_round != 100:
                    continue
                # a stage 1 under 0.05 s is none (the table's "–")
                points = sorted((c["clients"], c[key]) for c in document["cells"]
                                if c["strategy"] == strategy and c["per_round"] == per_round and "error" not in c
                                and c[key] >= 0.05)
                if points:
                    label = LABELS[strategy] + ("" if per_round == 100 else " (m=10)")
                    panel.plot(*zip(*points), style, marker="o", color=f"C{colour}", label=label)
        panel.set_xscale("log")
        panel.set_yscale("log")
        panel.set_xlabel("clients N")
        panel.set_title(title, fontsize=10)
        panel.grid(True, which="both", alpha=0.3)
    panels[0].legend(fontsize=7)
    figure.tight_layout()
    FigureCanvasAgg(figure).print_png(str(path))


def write_outputs(document: Record, folder: Path) -> Path:
    """table.md and scale.png from the document; returns the table's path."""
    (folder / TABLE_FILE).write_text(render_table(document))
    if any("error" not in cell for cell in document["cells"]):
        plot(document, folder / PLOT_FILE)
    return folder / TABLE_FILE


# --------------------------------------------------------------------------- command line


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(value) for value in text.split(","))


def parse_options(argv: Sequence[str]) -> Options:
    """`python -m concatfl.bench scale [options]` → Options."""
    parser = argparse.ArgumentParser(prog=f"python -m concatfl.bench {SUITE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True, help="the folder holding MNIST")
    parser.add_argument("--out", type=Path, default=Path("results"), help="results folder (default results)")
    parser.add_argument("--clients", type=_ints, default=Options.clients, help="N (default 100,1000,10000)")
    parser.add_argument("--per-round", type=_ints, default=Options.per_round, help="m (default 10,100)")
    parser.add_argument("--rounds", type=int, default=Options.rounds, help="rounds per run (default 3; at least 2)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated (default all)")
    parser.add_argument("--samples-per-client", type=int, default=Options.samples_per_client)
    parser.add_argument("--id-samples", type=int, default=Options.id_samples, help="FedConcat-ID's random inputs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=Options.timeout, help="seconds one simulation may take")
    args = parser.parse_args(argv)
    strategies = tuple(s for s in args.strategies.split(",") if s)
    if unknown := [s for s in strategies if s not in STRATEGIES]:
        parser.error(f"--strategies takes some of {','.join(STRATEGIES)}, got {unknown}")
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (FedConcat needs an encoder and a classifier round)")
    if max(args.clients) * args.samples_per_client > 60_000:
        parser.error("--clients × --samples-per-client exceeds MNIST's 60,000 training images")
    if any(m % SUPERCLIENT for m in args.per_round) and {"fedseq", "fedseq-inter"} & set(strategies):
        parser.error(f"--per-round must be multiples of {SUPERCLIENT} for FedSeq (its superclients' size)")
    return Options(**{**vars(args), "strategies": strategies})


def main(argv: Sequence[str]) -> int:
    """Measure the cells, print the table."""
    return measure_and_print(SUITE, argv, parse_options, run)
