"""Run concatfl as a real Flower simulation (`flwr run`) and return its metrics.json.

`flwr run` submits the app to a SuperLink and returns at once; it even exits 0 when the run
later fails. This launcher therefore owns the whole life cycle: it starts a private simulation
SuperLink (own ports, own FLWR_HOME, no runtime dependency installation), submits the run,
streams the run's log if asked, waits until the SuperLink reports the run finished, requires
`finished:completed`, and stops every process it started.

    python -m concatfl.launch --num-supernodes 10 --run-config "num-server-rounds=20"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
import tomli_w

from .metrics import read_metrics

PROJECT_DIR = Path(__file__).resolve().parents[1]
CONNECTION = "concatfl-sim"


class SimulationError(RuntimeError):
    """The run did not finish as completed; the message carries the tail of its log."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def flower_env(flwr_home: Path, ray_tmpdir: Path) -> dict[str, str]:
    """Environment for Flower's CLI and SuperLink: isolated home, no telemetry or installs.

    Ray puts UNIX sockets under RAY_TMPDIR, whose paths may not exceed 107 bytes: it gets a
    short directory of its own rather than one under a (possibly deep) work directory.
    """
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)
    env.update(
        {
            "PATH": bin_dir + os.pathsep + env.get("PATH", ""),
            "FLWR_HOME": str(flwr_home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "RAY_TMPDIR": str(ray_tmpdir),
            "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
            "RAY_DEDUP_LOGS": "0",
        }
    )
    return env


def superlink_command(
    host: str, port: int, database: str | os.PathLike, *, simulation: bool, security: tuple[str, ...] = ("--insecure",)
) -> list[str]:
    """How concatfl starts a SuperLink (natively, in tests and in docker-compose.yml)."""
    command = [
        "flower-superlink",
        *security,
        f"--host={host}",
        f"--port={port}",
        f"--database={database}",
        "--disable-runtime-dependency-installation",
    ]
    return command + (["--simulation", "--isolation=subprocess"] if simulation else [])


def supernode_command(
    superlink: str, port: int, partition_id: int, num_partitions: int, *, security: tuple[str, ...] = ("--insecure",)
) -> list[str]:
    """How concatfl starts a SuperNode holding partition `partition_id` of `num_partitions`."""
    return [
        "flower-supernode",
        *security,
        f"--superlink={superlink}",
        f"--port={port}",
        f"--node-config=partition-id={partition_id} num-partitions={num_partitions}",
    ]


class FlowerSession:
    """A private SuperLink and the `flwr` CLI pointed at it; stops all it started on exit.

    `simulation=True` gives a simulation SuperLink (SuperNodes are simulated by Ray);
    otherwise real SuperNodes connect to `address` (see `start_supernode`). `superlink_args`
    adds flags (TLS, authentication, …); `insecure=False` expects them to configure TLS and
    `root_certificates` to be the CA the CLI trusts.
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        simulation: bool,
        host: str = "127.0.0.1",
        superlink_args: tuple[str, ...] = ("--insecure",),
        root_certificates: str | None = None,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        self.flwr_home = self.workdir / "flwr-home"
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        self.ray_tmpdir = Path(tempfile.mkdtemp(prefix="cfl-ray-", dir="/tmp"))
        self.env = flower_env(self.flwr_home, self.ray_tmpdir)
        self.simulation = simulation
        self.host = host
        self.port = free_port()
        self.superlink_args = superlink_args
        self.processes: list[subprocess.Popen[bytes]] = []
        tls = f'root-certificates = "{root_certificates}"' if root_certificates else "insecure = true"
        (self.flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f'[superlink.{CONNECTION}]\naddress = "{host}:{self.port}"\n{tls}\n'
        )

    @property
    def address(self) -> str:
        """host:port where SuperNodes and the CLI reach the SuperLink."""
        return f"{self.host}:{self.port}"

    def __enter__(self) -> FlowerSession:
        command = superlink_command(
            self.host, self.port, self.flwr_home / "state.db", simulation=self.simulation, security=self.superlink_args
        )
        superlink = self.spawn(command, "superlink.log")
        _wait_for_port(self.host, self.port, superlink, self.workdir / "superlink.log")
        return self

    def __exit__(self, *exc: object) -> None:
        for process in reversed(self.processes):
            stop_process_tree(process)
        shutil.rmtree(self.ray_tmpdir, ignore_errors=True)

    def spawn(self, command: list[str], log_name: str) -> subprocess.Popen[bytes]:
        """Start a process (logging to `workdir/log_name`) that the session will stop."""
        process = subprocess.Popen(
            command,
            env=self.env,
            stdout=(self.workdir / log_name).open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def start_supernode(self, partition_id: int, num_partitions: int, *extra: str) -> subprocess.Popen[bytes]:
        """A real SuperNode holding partition `partition_id` of `num_partitions`."""
        command = supernode_command(
            self.address, free_port(), partition_id, num_partitions, security=extra or ("--insecure",)
        )
        return self.spawn(command, f"supernode-{partition_id}.log")

    def flwr(self, args: list[str], timeout: float = 120) -> str:
        """Run the `flwr` CLI against this SuperLink; fail with its output on error."""
        done = subprocess.run(["flwr", *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise SimulationError(f"`flwr {' '.join(args)}` failed:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def submit(
        self, run_config: Mapping[str, Any], app_dir: str | os.PathLike = PROJECT_DIR, federation_config: str = ""
    ) -> str:
        """`flwr run` with these overrides (written to a TOML file); returns the run id."""
        config_file = self.workdir / "run-config.toml"
        config_file.write_text(tomli_w.dumps(dict(run_config)))
        args = ["run", str(app_dir), CONNECTION, "--run-config", str(config_file), "--format", "json"]
        if federation_config:
            args += ["--federation-config", federation_config]
        submitted = json.loads(self.flwr(args))
        if not submitted.get("success"):
            raise SimulationError(f"run submission failed: {submitted.get('error-message')}")
        return str(submitted["run-id"])

    def status(self, run_id: str) -> str:
        """The SuperLink's status of a run, e.g. `running` or `finished:completed`."""
        listing = json.loads(self.flwr(["ls", CONNECTION, "--run-id", run_id, "--format", "json"]))
        return str(listing["runs"][0]["status"])

    def wait(self, run_id: str, *, stream: bool = False, timeout: float = 1800) -> None:
        """Wait for the run to finish (printing its log when `stream`); require completed."""
        follower = (
            subprocess.Popen(["flwr", "log", run_id, CONNECTION, "--stream"], env=self.env, start_new_session=True)
            if stream
            else None
        )
        deadline = time.monotonic() + timeout
        try:
            while not (status := self.status(run_id)).startswith("finished"):
                if time.monotonic() > deadline:
                    raise SimulationError(f"run {run_id} did not finish within {timeout} s")
                time.sleep(1.0)
            if follower is not None:
                follower.wait(timeout=30)
        finally:
            if follower is not None:
                stop_process_tree(follower)
        if status != "finished:completed":
            log_text = self.flwr(["log", run_id, CONNECTION], timeout=60)
            raise SimulationError(f"run {run_id} ended {status!r}; log tail:\n{log_text[-4000:]}")


def stop_process_tree(process: subprocess.Popen[bytes]) -> None:
    """Stop a process and all its descendants.

    The SuperLink starts the simulation runtime in a session of its own, so killing the
    process group is not enough: every descendant is collected first, then terminated.
    """
    try:
        root = psutil.Process(process.pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.terminate()
    _, alive = psutil.wait_procs(family, timeout=20)
    for member in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    psutil.wait_procs(alive, timeout=10)
    process.wait(timeout=10)


def run_simulation(
    run_config: Mapping[str, Any],
    num_supernodes: int,
    *,
    workdir: str | os.PathLike | None = None,
    app_dir: str | os.PathLike = PROJECT_DIR,
    stream: bool = False,
    timeout: float = 1800,
    cpus_per_client: int = 1,
    gpus_per_client: float = 0.0,
) -> dict[str, Any]:
    """Run one simulation to completion and return its metrics.json as a dict.

    `run_config` overrides pyproject's defaults; `output-dir` defaults to `<workdir>/output`.
    Raises SimulationError (with the log tail) unless the run ends `finished:completed`.
    """
    workdir = Path(workdir or tempfile.mkdtemp(prefix="concatfl-run-")).resolve()
    overrides = {"output-dir": str(workdir / "output"), **run_config}
    with FlowerSession(workdir, simulation=True) as session:
        run_id = session.submit(
            overrides,
            app_dir,
            f"num-supernodes={num_supernodes} client-resources-num-cpus={cpus_per_client} "
            f"client-resources-num-gpus={gpus_per_client}",
        )
        session.wait(run_id, stream=stream, timeout=timeout)
    return read_metrics(overrides["output-dir"])


def _wait_for_port(host: str, port: int, process: subprocess.Popen[bytes], log_file: Path, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SimulationError(f"flower-superlink exited early:\n{log_file.read_text()[-3000:]}")
        with socket.socket() as sock:
            if sock.connect_ex((host, port)) == 0:
                return
        time.sleep(0.2)
    raise SimulationError(f"flower-superlink did not listen on {host}:{port} within {limit} s")


def parse_overrides(text: str) -> dict[str, Any]:
    """`"k=v k2='s'"` (Flower's --run-config syntax) → dict, values parsed as TOML."""
    values: dict[str, Any] = {}
    for item in text.split():
        key, _, raw = item.partition("=")
        values[key] = tomllib.loads(f"v = {raw}")["v"]
    return values


def main(argv: list[str] | None = None) -> int:
    """Command line: run one simulation, stream its log, print where metrics.json is."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-supernodes", type=int, default=10)
    parser.add_argument("--run-config", default="", help="overrides, e.g. \"num-server-rounds=5 lr=0.1\"")
    parser.add_argument("--workdir", default=None, help="where the run's files go (default: a temp dir)")
    parser.add_argument("--cpus-per-client", type=int, default=1)
    parser.add_argument("--gpus-per-client", type=float, default=0.0)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    metrics = run_simulation(
        parse_overrides(args.run_config),
        args.num_supernodes,
        workdir=args.workdir,
        stream=True,
        cpus_per_client=args.cpus_per_client,
        gpus_per_client=args.gpus_per_client,
    )
    print(
        f"\nfinished: strategy={metrics['strategy']} final_accuracy={metrics['final_accuracy']:.4f} "
        f"rounds={len(metrics['rounds'])} wall={time.perf_counter() - started:.1f}s\n"
        f"metrics: {metrics['run_config']['output-dir']}/metrics.json"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
