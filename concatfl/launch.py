"""Run concatfl as a real Flower simulation (`flwr run`) and return its metrics.json.

`flwr run` submits the app to a SuperLink and returns at once; it even exits 0 when the run
later fails. This launcher therefore owns the whole life cycle: it starts a private simulation
SuperLink (own ports, own FLWR_HOME, no runtime dependency installation), submits the run,
streams the run's log if asked, waits until the SuperLink reports the run finished, requires
`finished:completed`, and stops every process it started (the machinery is
`concatfl.deployment`; this module is the simulation command line).

    python -m concatfl.launch --num-supernodes 10 --run-config "num-server-rounds=20"
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import PROJECT_DIR
from .config import RunConfig
from .deployment.cli import plain_flower_logs
from .deployment.processes import SimulationError
from .deployment.processes import exit_on_signals
from .deployment.session import FlowerSession
from .metrics import read_metrics


def run_simulation(
    run_config: Mapping[str, Any],
    num_supernodes: int,
    *,
    workdir: str | os.PathLike | None = None,
    app_dir: str | os.PathLike = PROJECT_DIR,
    stream: bool = False,
    timeout: float | None = None,
    cpus_per_client: int = 1,
    gpus_per_client: float = 0.0,
    ray_address: str | None = None,
) -> dict[str, Any]:
    """Run one simulation to completion and return its metrics.json as a dict.

    `run_config` overrides the app's defaults (pyproject.toml). `workdir` receives the
    session's files (FLWR_HOME, process logs) and, unless
    `run_config` names an `output-dir`, the outputs in `<workdir>/output`. Without `workdir`
    the session's files go to a temporary directory that is removed afterwards (kept, and
    named in the error, when the run failed) and the outputs go where `output-dir` says (the
    app's default: `outputs` under the current directory). `timeout` (seconds) gives up on a
    run that takes longer; None waits as long as it takes. `ray_address` (host:port of a running
    Ray cluster's head, as `ray start --head` prints it) runs the simulation's ClientApp actors on
    that cluster instead of a Ray instance of its own (Flower's Ray backend connects through
    RAY_ADDRESS; each actor asks for `cpus_per_client` CPUs and `gpus_per_client` GPUs there).
    Raises ConfigError (naming the key) for a bad run-config value of concatfl's own app before
    anything starts (another app's keys are its own), and SimulationError (with the log tail)
    unless the run ends `finished:completed`.
    """
    if Path(app_dir).resolve() == PROJECT_DIR.resolve():
        RunConfig.from_mapping(run_config)  # the ServerApp would refuse it only after a simulation's start-up
    scratch = workdir is None
    workdir = Path(workdir or tempfile.mkdtemp(prefix="concatfl-run-")).resolve()
    default_output = app_config(app_dir).get("output-dir", "outputs") if scratch else workdir / "output"
    output_dir = Path(run_config.get("output-dir", default_output)).resolve()
    overrides = {**run_config, "output-dir": str(output_dir)}
    try:
        cluster = {"RAY_ADDRESS": ray_address} if ray_address else {}
        with FlowerSession(workdir, simulation=True, env=cluster) as session:
            run_id = session.submit(
                overrides,
                app_dir,
                f"num-supernodes={num_supernodes} client-resources-num-cpus={cpus_per_client} "
                f"client-resources-num-gpus={gpus_per_client}",
            )
            session.wait(run_id, stream=stream, timeout=timeout)
    except SimulationError as error:
        if scratch:
            error.add_note(f"The session's files (SuperLink database and logs) are kept in {workdir}")
        raise
    except BaseException:
        if scratch:
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    if scratch:
        shutil.rmtree(workdir, ignore_errors=True)
    return read_metrics(output_dir)


def app_config(app_dir: str | os.PathLike = PROJECT_DIR) -> dict[str, Any]:
    """The run-config defaults an app declares (`[tool.flwr.app.config]` of its pyproject.toml)."""
    with (Path(app_dir) / "pyproject.toml").open("rb") as handle:
        return dict(tomllib.load(handle)["tool"]["flwr"]["app"].get("config", {}))


_OVERRIDE = re.compile(r"""([^\s=]+)=('[^']*'|"[^"]*"|[^\s'"]+)""")
_OVERRIDES = re.compile(rf"\s*(?:{_OVERRIDE.pattern}\s*)*")


def parse_overrides(text: str) -> dict[str, Any]:
    """`"k=v k2='s t'"` (Flower's --run-config syntax) → dict, values parsed as TOML (a quoted
    value may hold spaces)."""
    if not _OVERRIDES.fullmatch(text):
        raise ValueError(f"--run-config must be key=value pairs separated by spaces, got {text!r}")
    overrides = {}
    for key, raw in _OVERRIDE.findall(text):
        try:
            overrides[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            raise ValueError(
                f"--run-config value of '{key}' is {raw}, which is not a number, true/false or a quoted "
                f"string; strings need quotes: {key}='{raw}'"
            ) from None
    return overrides


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (`main` reads its arguments with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-supernodes", type=int, default=10)
    parser.add_argument("--run-config", default="", help="overrides, e.g. \"num-server-rounds=5 lr=0.1\"")
    parser.add_argument(
        "--workdir",
        default=None,
        help="keep the run's files here (FLWR_HOME, logs; outputs in WORKDIR/output unless "
        "output-dir is set). Default: a temporary directory, removed afterwards; outputs go to output-dir",
    )
    parser.add_argument("--timeout", type=float, default=None, help="give up after this many seconds (default: none)")
    parser.add_argument("--cpus-per-client", type=int, default=1)
    parser.add_argument("--gpus-per-client", type=float, default=0.0)
    parser.add_argument(
        "--ray-address", default=None, metavar="HOST:PORT",
        help="run on this running Ray cluster (its head's address) instead of a Ray instance of the run's own",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command line: check the run config, run one simulation, stream its log, say where metrics.json is.

    Returns 2 for a bad argument or run-config value (found before anything starts), 1 when
    the run did not complete.
    """
    exit_on_signals()
    plain_flower_logs()
    args = build_parser().parse_args(argv)
    try:
        overrides = parse_overrides(args.run_config)
        config = RunConfig.from_mapping(overrides)
        if args.num_supernodes < config.min_available_nodes:
            raise ValueError(
                f"--num-supernodes {args.num_supernodes} is below run-config key 'min-available-nodes' "
                f"({config.min_available_nodes}): the ServerApp would wait for nodes forever"
            )
    except ValueError as error:  # ConfigError is a ValueError
        print(f"concatfl.launch: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        metrics = run_simulation(
            overrides,
            args.num_supernodes,
            workdir=args.workdir,
            stream=True,
            timeout=args.timeout,
            cpus_per_client=args.cpus_per_client,
            gpus_per_client=args.gpus_per_client,
            ray_address=args.ray_address,
        )
    except SimulationError as error:
        print(f"concatfl.launch: {error}", *getattr(error, "__notes__", []), sep="\n", file=sys.stderr)
        return 1
    print(
        f"finished in {time.perf_counter() - started:.1f} s: {metrics['strategy']}, {len(metrics['rounds'])} rounds, "
        f"final accuracy {metrics['final_accuracy']:.4f}; metrics: {metrics['run_config']['output-dir']}/metrics.json"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
