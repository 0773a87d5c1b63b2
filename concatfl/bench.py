"""Benchmarks: named comparisons run as real Flower simulations, summarized as mean ± std.

Each (method, seed) cell is one `flwr run` simulation through concatfl's own ServerApp and
ClientApp (`concatfl.launch.run_simulation`); its metrics.json lands in
`<out>/<suite>/<method>/seed-<s>/output/`. Cells whose metrics.json exists are skipped, so an
interrupted suite resumes where it stopped. The table is written to `<out>/<suite>/table.md`.

    python -m concatfl.bench fedcat-digits --seeds 0,1,2 --out results
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .launch import exit_on_sigterm, run_simulation
from .metrics import METRICS_FILE, read_metrics


@dataclass(frozen=True)
class Method:
    """One row of a comparison: a label and the run-config overrides that make it."""

    label: str
    run_config: dict[str, Any]


@dataclass(frozen=True)
class Suite:
    """Methods compared on one setting (shared overrides, number of simulated clients)."""

    name: str
    description: str
    num_supernodes: int
    shared: dict[str, Any]
    methods: list[Method]
    extra_columns: dict[str, Callable[[dict[str, Any]], float | None]] = field(default_factory=dict)


def _mean_setup(key: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda metrics: metrics["setup"].get(key)


def _stage_megabytes(stage: str) -> Callable[[dict[str, Any]], float | None]:
    """FedConcat's running per-stage byte totals (down + up), from its last round, in MB."""

    def total(metrics: dict[str, Any]) -> float | None:
        stages = metrics["rounds"][-1].get("bytes_by_stage") if metrics["rounds"] else None
        return (stages[stage]["sent"] + stages[stage]["received"]) / 1e6 if stages else None

    return total


def _total_bytes(metrics: dict[str, Any]) -> float:
    return metrics["total_bytes_sent"] + metrics["total_bytes_received"]


DIGITS_DIRICHLET = {"dataset": "digits", "partition": "dirichlet", "alpha": 0.1, "num-server-rounds": 40}
SUITES = {
    "fedcat-digits": Suite(
        "fedcat-digits",
        "digits, 20 clients, Dirichlet α=0.1, 40 rounds, K=4 devices per round (FedAvg: fraction 0.2)",
        20,
        {**DIGITS_DIRICHLET, "fraction-train": 0.2, "min-available-nodes": 20},
        [
            Method("FedAvg", {"strategy": "fedavg"}),
            Method("FedCat", {"strategy": "fedcat", "fedcat-k": 4}),
            Method("FedCat w/ GC (no concatenation)", {"strategy": "fedcat", "fedcat-k": 4, "fedcat-concat": False}),
            Method("FedCat w/ DC (random selection)", {"strategy": "fedcat", "fedcat-k": 4, "fedcat-selection": "random"}),
        ],
    ),
    "fedseq-digits": Suite(
        "fedseq-digits",
        "digits, 50 clients, α=0 (one class per client), 30 rounds, fraction-train 0.2, "
        "no local test split, min-samples 270 (10 clients per superclient)",
        50,
        {
            "dataset": "digits",
            "partition": "dirichlet",
            "alpha": 0.0,
            "num-server-rounds": 30,
            "fraction-train": 0.2,
            "local-test-fraction": 0.0,
            "min-available-nodes": 50,
            "fedseq-min-samples": 270,
            "fedseq-pretrain-epochs": 10,
            "report-label-counts": True,
        },
        [
            Method("FedAvg", {"strategy": "fedavg"}),
            Method("FedSeq (greedy+KL, paper's ½/½ merge)", {"strategy": "fedseq"}),
            Method("FedSeq (greedy+KL, weighted merge)", {"strategy": "fedseq", "fedseq-greedy-merge": "weighted"}),
            Method("FedSeqInter (greedy+KL, paper's merge)", {"strategy": "fedseq-inter"}),
            Method("FedSeq (random grouping)", {"strategy": "fedseq", "fedseq-grouping": "random"}),
        ],
        {
            "balance ratio (true labels)": _mean_setup("mean_balance_ratio_true"),
            "balance ratio (estimated)": _mean_setup("mean_balance_ratio_estimated"),
        },
    ),
    "fedconcat-digits": Suite(
        "fedconcat-digits",
        "digits, 20 clients, #C=2 (two classes per client); FedConcat: K=5 clusters, 10 encoder + "
        "20 classifier rounds; FedAvg: 16 rounds ≈ the same total bytes (see the MB column)",
        20,
        {"dataset": "digits", "partition": "classes", "classes-per-client": 2, "min-available-nodes": 20},
        [
            Method("FedAvg", {"strategy": "fedavg", "num-server-rounds": 16}),
            Method("FedConcat", {"strategy": "fedconcat"}),
            Method("FedConcat-ID", {"strategy": "fedconcat-id"}),
        ],
        {
            "stage 1 MB (labels)": lambda m: (m["setup"].get("bytes_sent", 0) + m["setup"].get("bytes_received", 0)) / 1e6
            if m["strategy"].startswith("fedconcat")
            else None,
            "encoder-training MB": _stage_megabytes("encoder-training"),
            "encoder-broadcast MB": _stage_megabytes("encoder-broadcast"),
            "classifier MB": _stage_megabytes("classifier"),
        },
    ),
    "baselines-digits": Suite(
        "baselines-digits",
        "digits, 20 clients, Dirichlet α=0.1, 40 rounds for every method (FedConcat: 20 encoder + 20 "
        "classifier rounds), fraction-train 0.2 (FedAvg/SCAFFOLD: 4 clients per round, FedCat: K=4, "
        "FedSeq: 1 of ~5 superclients of ≥230 samples); FedProx μ=0.01, FedDyn α=0.1 (the FedSeq paper's), "
        "MOON μ=1 τ=0.5, FedRS α=0.5, FedLC τ=1",
        20,
        {
            **DIGITS_DIRICHLET,
            "fraction-train": 0.2,
            "min-available-nodes": 20,
            "fedcat-k": 4,
            "fedseq-min-samples": 230,
            "fedconcat-encoder-rounds": 20,
            "fedconcat-classifier-rounds": 20,
        },
        [
            Method("FedAvg", {"strategy": "fedavg"}),
            Method("FedProx", {"strategy": "fedprox", "proximal-mu": 0.01}),
            Method("SCAFFOLD", {"strategy": "scaffold"}),
            Method("FedCat", {"strategy": "fedcat"}),
            Method("FedSeq", {"strategy": "fedseq"}),
            Method("FedSeqInter", {"strategy": "fedseq-inter"}),
            Method("FedConcat", {"strategy": "fedconcat"}),
            Method("FedConcat-ID", {"strategy": "fedconcat-id"}),
            Method("FedSeq + FedDyn", {"strategy": "fedseq", "local-objective": "feddyn", "feddyn-alpha": 0.1}),
            Method("FedCat + FedProx", {"strategy": "fedcat", "local-objective": "fedprox", "proximal-mu": 0.01}),
            Method("FedAvg + FedDyn", {"strategy": "fedavg", "local-objective": "feddyn", "feddyn-alpha": 0.1}),
            Method("FedAvg + MOON", {"strategy": "fedavg", "local-objective": "moon"}),
            Method("FedAvg + FedRS", {"strategy": "fedavg", "local-objective": "fedrs"}),
            Method("FedAvg + FedLC", {"strategy": "fedavg", "local-objective": "fedlc"}),
        ],
    ),
}


def run_suite(suite: Suite, seeds: Sequence[int], out: Path) -> Path:
    """Run every missing (method, seed) cell, then write and return the table."""
    cells = [(method, seed) for method in suite.methods for seed in seeds]
    for done, (method, seed) in enumerate(cells, start=1):
        workdir = out / suite.name / _slug(method.label) / f"seed-{seed}"
        if (workdir / "output" / METRICS_FILE).exists():
            print(f"[{done}/{len(cells)}] {method.label} seed {seed}: done earlier", flush=True)
            continue
        started = time.perf_counter()
        metrics = run_simulation(
            {**suite.shared, **method.run_config, "seed": seed}, suite.num_supernodes, workdir=workdir
        )
        print(
            f"[{done}/{len(cells)}] {method.label} seed {seed}: accuracy {metrics['final_accuracy']:.4f} "
            f"({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    table = render_table(suite, {m.label: _load(out, suite, m, seeds) for m in suite.methods})
    path = out / suite.name / "table.md"
    path.write_text(table)
    return path


def _load(out: Path, suite: Suite, method: Method, seeds: Sequence[int]) -> list[dict[str, Any]]:
    return [read_metrics(out / suite.name / _slug(method.label) / f"seed-{seed}" / "output") for seed in seeds]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def render_table(suite: Suite, runs: dict[str, list[dict[str, Any]]]) -> str:
    """Markdown table: final accuracy, total bytes and wall seconds as mean ± std per method."""
    columns = {
        "final accuracy": lambda m: m["final_accuracy"],
        "total MB (down+up)": lambda m: _total_bytes(m) / 1e6,
        "wall s": lambda m: m["wall_seconds"],
        **suite.extra_columns,
    }
    seeds = len(next(iter(runs.values())))
    lines = [
        f"## {suite.name}",
        "",
        f"{suite.description}; {seeds} seeds, mean ± std.",
        "",
        "| method | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for label, metrics_list in runs.items():
        cells = []
        for extract in columns.values():
            values = [v for v in (extract(m) for m in metrics_list) if v is not None]
            cells.append(_format(*mean_std(values)) if values else "–")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _format(mean: float, std: float) -> str:
    if abs(mean) >= 1e4:
        return f"{mean:,.0f} ± {std:,.0f}"
    return f"{mean:.4f} ± {std:.4f}" if abs(mean) < 10 else f"{mean:.1f} ± {std:.1f}"


def _slug(label: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in label.lower()).strip("-")


def main(argv: list[str] | None = None) -> int:
    """Command line: run one suite over the given seeds and print its table."""
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", default="results")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    path = run_suite(SUITES[args.suite], [int(s) for s in args.seeds.split(",")], Path(args.out))
    print(path.read_text())
    print(f"suite wall time: {time.perf_counter() - started:.0f} s; table: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
