"""Command line: run one suite over the given seeds, write and print its table.

`python -m concatfl.bench overhead [options]` measures the framework itself instead
(`concatfl.bench.overhead`, with options of its own); `python -m concatfl.bench scale [options]`
what every strategy costs from 100 to 10,000 clients (`concatfl.bench.scale`);
`python -m concatfl.bench soak [options]` runs a real deployment under sustained faults
(`concatfl.bench.soak`).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from ..data.datasets import DATASETS
from ..deployment.cli import plain_flower_logs
from ..deployment.processes import exit_on_signals
from ..launch import parse_overrides
from . import overhead, robustness, scale, soak, stability, swap
from .inprocess import simulate_in_process
from .report import write_report
from .runner import BenchError, cell_config, run_suite, select_cells, simulate_with_flower
from .suites import BLUEPRINTS, SCALES, SUITE_NAMES, Suite, get_suite


# Suites built in code of their own (one scale each), by name.
OWN_SUITES = {**stability.SUITES, robustness.SUITE: robustness.suite, swap.SUITE: swap.suite}


def parse_data_dirs(values: list[str]) -> dict[str, Path]:
    """`--data-dir DIR` (every dataset) and `--data-dir DATASET=DIR` → {dataset or "*": folder}."""
    folders = {}
    for value in values:
        dataset, sep, folder = value.partition("=")
        if sep and dataset in DATASETS:
            folders[dataset] = Path(folder)
        else:
            folders["*"] = Path(value)
    return folders


def dry_run(
    suite: Suite, seeds: list[int], methods: list[str], settings: list[str], overrides: dict[str, Any]
) -> None:
    """Print the suite's notes and every run it would make, without running or touching data."""
    cells = select_cells(suite, methods, settings)
    runs = len(cells) * len(seeds)
    print(f"{suite.name} (scale {suite.scale}): {len(cells)} cells × {len(seeds)} seed(s) = {runs} runs")
    for note in suite.notes:
        print(f"- {note}")
    for cell in cells:
        config = cell_config(cell, seeds[0], {}, overrides)
        if cell.dataset != "digits":
            config["data-dir"] = "<from --data-dir>"
        settings_text = " ".join(f"{k}={v!r}" for k, v in config.items() if k != "seed")
        print(f"{cell.setting.label or suite.name} · {cell.method}: {cell.num_supernodes} clients; {settings_text}")


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser for the suites (overhead, soak and scale have their own)."""
    parser = argparse.ArgumentParser(prog="python -m concatfl.bench", description=__doc__)
    parser.add_argument(
        "suite",
        choices=(*SUITE_NAMES, *OWN_SUITES, overhead.SUITE),
        help=f"{overhead.SUITE} comes first, before its own options",
    )
    parser.add_argument(
        "--scale", choices=SCALES, help=f"for {', '.join(BLUEPRINTS)} (default smoke); the digits suites have one"
    )
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated (default 0,1,2)")
    parser.add_argument("--out", default="results", help="results folder (default results)")
    parser.add_argument(
        "--data-dir", action="append", default=[], metavar="[DATASET=]DIR",
        help="folder of the real datasets, or of one dataset (repeatable); made absolute for the runs",
    )
    parser.add_argument(
        "--method", action="append", default=[], help="run only this method (label or folder name; repeatable)"
    )
    parser.add_argument(
        "--setting", action="append", default=[], help="run only this setting (name or label; repeatable)"
    )
    parser.add_argument("--dry-run", action="store_true", help="list the runs and the scale's changes, run nothing")
    parser.add_argument(
        "--report-only", action="store_true",
        help="write the table from the finished runs, run nothing; with --method/--setting, of just those cells"
    )
    parser.add_argument(
        "--in-process", action="store_true",
        help="run each cell in this process (concatfl.bench.inprocess), not as a flwr run simulation: "
        "same accuracy and bytes, without a simulation's ~30 s start per run",
    )
    parser.add_argument(
        "--torch-threads", type=int, default=1, help="with --in-process: torch threads for the training (default 1)"
    )
    parser.add_argument(
        "--set", default="", metavar="\"KEY=VALUE ...\"",
        help="run-config values for every cell, over the suite's (e.g. \"update-clip=0\"; use another --out)",
    )
    parser.add_argument("--cell-timeout", type=float, default=6 * 3600, help="seconds one run may take (default 6 h)")
    parser.add_argument("--cpus-per-client", type=int, default=1)
    parser.add_argument("--gpus-per-client", type=float, default=0.0, help="GPU share of each simulated client")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run (or list) the suite, print its table."""
    exit_on_signals()
    plain_flower_logs()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [overhead.SUITE]:
        return overhead.main(argv[1:])
    if argv[:1] == [soak.SUITE]:
        return soak.main(argv[1:])
    if argv[:1] == [scale.SUITE]:
        return scale.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.suite == overhead.SUITE:
        parser.error(f"put {overhead.SUITE} first: python -m concatfl.bench {overhead.SUITE} [options]")
    try:
        suite = OWN_SUITES[args.suite]() if args.suite in OWN_SUITES else get_suite(args.suite, args.scale)
    except ValueError as error:
        parser.error(str(error))
    seeds = [int(seed) for seed in args.seeds.split(",")]
    try:
        overrides = parse_overrides(args.set)
    except ValueError as error:
        parser.error(str(error))
    started = time.perf_counter()
    try:
        if args.dry_run:
            dry_run(suite, seeds, args.method, args.setting, overrides)
            return 0
        if args.report_only:
            if args.method or args.setting:  # a table of just the cells asked for
                suite = replace(suite, cells=tuple(select_cells(suite, args.method, args.setting)))
            path = write_report(suite, seeds, Path(args.out) / suite.name)
            print(path.read_text())
            return 0
        in_process = suite.in_process or args.in_process
        path = run_suite(
            suite,
            seeds,
            Path(args.out),
            data_dirs=parse_data_dirs(args.data_dir),
            methods=args.method,
            settings=args.setting,
            overrides=overrides,
            simulate=partial(simulate_in_process, torch_threads=args.torch_threads)
            if in_process
            else simulate_with_flower(args.cell_timeout, args.cpus_per_client, args.gpus_per_client),
        )
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path.read_text())
    print(f"suite wall time: {time.perf_counter() - started:.0f} s; table: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
