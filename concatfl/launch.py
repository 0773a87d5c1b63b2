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
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil
import tomli_w

from .config import RunConfig
from .metrics import read_metrics

PROJECT_DIR = Path(__file__).resolve().parents[1]
CONNECTION = "concatfl-sim"
# How a SuperNode runs its ClientApp tasks: Flower's SuperExec (a new process per message) or
# concatfl's warm executor (one long-lived process per SuperNode, concatfl/warm_executor.py) beside
# a SuperNode with short fixed waits (concatfl/supernode.py).
EXECUTORS = ("stock", "warm")


class SimulationError(RuntimeError):
    """The run did not finish as completed; the message carries the tail of its log."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def flower_env(flwr_home: Path, ray_tmpdir: Path | None = None) -> dict[str, str]:
    """Environment for Flower's CLI and SuperLink: isolated home, no telemetry or installs.

    Ray puts UNIX sockets under RAY_TMPDIR, whose paths may not exceed 107 bytes: a simulation
    gets a short directory of its own (`ray_tmpdir`) rather than one under a (possibly deep) work
    directory.
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
            "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
            "RAY_DEDUP_LOGS": "0",
        }
    )
    if ray_tmpdir is not None:
        env["RAY_TMPDIR"] = str(ray_tmpdir)
    return env


@dataclass(frozen=True)
class Certificates:
    """The files `scripts/make-certs.sh` writes into `directory` (paths as the processes see them:
    a host directory natively, `/certs` inside the docker-compose containers)."""

    directory: Path

    @property
    def ca_cert(self) -> Path:
        """The CA certificate every SuperNode and the `flwr` CLI trust."""
        return self.directory / "ca.crt"

    @property
    def superlink_cert(self) -> Path:
        """The SuperLink's server certificate (SANs: 127.0.0.1, localhost, 10.200.0.1, superlink)."""
        return self.directory / "superlink.crt"

    @property
    def superlink_key(self) -> Path:
        """The SuperLink's TLS private key."""
        return self.directory / "superlink.key"

    def supernode_key(self, index: int) -> Path:
        """Authentication private key (OpenSSH, ECDSA P-384) of SuperNode `index`."""
        return self.directory / f"supernode-{index}"

    def supernode_public_key(self, index: int) -> Path:
        """Public key of SuperNode `index`, to register with `flwr supernode register`."""
        return self.directory / f"supernode-{index}.pub"


def superlink_security(certificates: Certificates | None, *, supernode_auth: bool = False) -> tuple[str, ...]:
    """SuperLink flags for TLS (None: `--insecure`) and CLI-managed SuperNode authentication
    (only registered public keys may connect; Flower requires TLS for it)."""
    if certificates is None:
        if supernode_auth:
            raise ValueError("SuperNode authentication needs TLS certificates")
        return ("--insecure",)
    tls = (
        f"--ssl-ca-certfile={certificates.ca_cert}",
        f"--ssl-certfile={certificates.superlink_cert}",
        f"--ssl-keyfile={certificates.superlink_key}",
    )
    return tls + (("--enable-supernode-auth",) if supernode_auth else ())


def supernode_security(
    ca_cert: str | os.PathLike | None, private_key: str | os.PathLike | None = None
) -> tuple[str, ...]:
    """SuperNode flags: trust `ca_cert` for TLS (None: `--insecure`) and authenticate with
    `private_key` (an OpenSSH EC private key whose public key the SuperLink has registered)."""
    if ca_cert is None:
        if private_key is not None:
            raise ValueError("SuperNode authentication needs TLS (a CA certificate)")
        return ("--insecure",)
    flags: tuple[str, ...] = (f"--root-certificates={ca_cert}",)
    return flags + ((f"--auth-supernode-private-key={private_key}",) if private_key is not None else ())


def superlink_command(
    host: str,
    port: int,
    database: str | os.PathLike | None,
    *,
    simulation: bool,
    security: tuple[str, ...] = ("--insecure",),
    health_address: str | None = None,
) -> list[str]:
    """How concatfl starts a SuperLink (natively, in tests and in docker-compose.yml).

    `database` is an SQLite file that keeps the SuperLink's state (registered SuperNode keys,
    runs, messages and their objects) across restarts; None keeps it in memory (Flower's
    default), which is faster: every object a message carries is written to and read from it
    (measured: ~0.4 s of a FedSeq hop on loopback, docs/deployment.md). `security` comes from
    `superlink_security`; `health_address` (host:port) starts Flower's plain-gRPC health service
    there (docker-compose's healthcheck probes it).
    """
    command = [
        "flower-superlink",
        *security,
        f"--host={host}",
        f"--port={port}",
        *([f"--database={database}"] if database is not None else []),
        "--disable-runtime-dependency-installation",
    ]
    if health_address is not None:
        command.append(f"--health-server-address={health_address}")
    return command + (["--simulation", "--isolation=subprocess"] if simulation else [])


def supernode_command(
    superlink: str,
    port: int,
    partition_id: int,
    num_partitions: int,
    *,
    security: tuple[str, ...] = ("--insecure",),
    health_address: str | None = None,
    node_config: str = "",
    executor: str = "stock",
) -> list[str]:
    """How concatfl starts a SuperNode holding partition `partition_id` of `num_partitions`.

    `port` is the SuperNode's own Runtime API port (one per SuperNode on a host); `security`
    comes from `supernode_security`; `node_config` adds `key=value` pairs for the ClientApp.
    `executor` is "stock" (Flower's `flower-supernode`, which starts Flower's SuperExec: a new
    ClientApp process per message) or "warm" (concatfl's SuperNode launcher, Flower's SuperNode
    with short fixed waits (concatfl/supernode.py), with `--isolation process`:
    `warm_executor_command` runs its ClientApp tasks).
    """
    check_executor(executor)
    command = [
        *([sys.executable, "-m", "concatfl.supernode"] if executor == "warm" else ["flower-supernode"]),
        *security,
        f"--superlink={superlink}",
        f"--port={port}",
        f"--node-config=partition-id={partition_id} num-partitions={num_partitions}"
        + (f" {node_config}" if node_config else ""),
    ]
    if health_address is not None:
        command.append(f"--health-server-address={health_address}")
    if executor == "warm":
        command.append("--isolation=process")
    return command


def check_executor(executor: str) -> None:
    """Raise ValueError unless `executor` is one of EXECUTORS."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")


def warm_executor_command(runtime_api_port: int, supernode_pid: int) -> list[str]:
    """concatfl's warm ClientApp executor for the SuperNode whose Runtime API listens on
    127.0.0.1:`runtime_api_port` (it exits with the SuperNode `supernode_pid`); see
    concatfl/warm_executor.py."""
    return [
        sys.executable,
        "-m",
        "concatfl.warm_executor",
        f"--runtime-api-address=127.0.0.1:{runtime_api_port}",
        "--insecure",
        f"--parent-pid={supernode_pid}",
    ]


def in_namespace(command: list[str], netns: str | None) -> list[str]:
    """`command` run inside network namespace `netns` (`ip netns exec` keeps the PID)."""
    return ["ip", "netns", "exec", netns, *command] if netns else command


class FlowerCli:
    """The `flwr` CLI pointed at one SuperLink, with its own FLWR_HOME under `workdir`.

    Parameters
    ----------
    workdir : path
        Where the CLI's FLWR_HOME (and the files it writes: run configs, logs) go.
    address : str
        host:port of the SuperLink's Control API.
    root_certificates : path | None (default: None)
        CA certificate the CLI trusts; None talks to an `--insecure` SuperLink.
    cli_netns : str | None (default: None)
        Network namespace the CLI runs in (multi-host tests); None is the caller's own.
    env : Mapping[str, str] | None (default: None)
        Extra environment for every process this object starts.
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        address: str,
        *,
        root_certificates: str | os.PathLike | None = None,
        cli_netns: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        self.flwr_home = self.workdir / "flwr-home"
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        self.env = {**flower_env(self.flwr_home), **(env or {})}
        self.cli_netns = cli_netns
        tls = f'root-certificates = "{root_certificates}"' if root_certificates else "insecure = true"
        (self.flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "{address}"\n{tls}\n'
        )

    def register_supernode(self, public_key: str | os.PathLike) -> int:
        """Register a SuperNode's public key (SuperNode authentication); returns its node id."""
        registered = json.loads(self.flwr(["supernode", "register", str(public_key), CONNECTION, "--format", "json"]))
        if not registered.get("success"):  # the CLI exits 0 even when it failed
            raise SimulationError(f"registering {public_key} failed: {registered.get('error-message')}")
        return int(registered["node-id"])

    def supernodes(self) -> list[dict[str, Any]]:
        """The SuperLink's node list (`flwr supernode ls`): one dict per node, with its status."""
        return list(json.loads(self.flwr(["supernode", "ls", CONNECTION, "--format", "json"]))["nodes"])

    def flwr(self, args: list[str], timeout: float = 120) -> str:
        """Run the `flwr` CLI against this SuperLink; fail with its output on error."""
        done = subprocess.run(
            in_namespace(["flwr", *args], self.cli_netns), env=self.env, capture_output=True, text=True, timeout=timeout
        )
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

    def wait(self, run_id: str, *, stream: bool = False, timeout: float | None = None) -> None:
        """Wait for the run to finish (printing its log when `stream`); require completed.

        `timeout` (seconds) gives up on a run that has not finished by then; None waits as
        long as the run takes.
        """
        follower = (
            subprocess.Popen(
                in_namespace(["flwr", "log", run_id, CONNECTION, "--stream"], self.cli_netns),
                env=self.env,
                stdout=subprocess.PIPE,
                start_new_session=True,
            )
            if stream
            else None
        )
        printer = _print_log_in_background(follower.stdout) if follower is not None else None
        deadline = None if timeout is None else time.monotonic() + timeout
        # Each status check starts a `flwr` CLI process (~1 s of CPU): back off to one per 5 s.
        pause = 1.0
        try:
            while not (status := self.status(run_id)).startswith("finished"):
                if deadline is not None and time.monotonic() > deadline:
                    raise SimulationError(f"run {run_id} did not finish within {timeout} s")
                time.sleep(pause)
                pause = min(pause * 1.5, 5.0)
            if follower is not None:
                follower.wait(timeout=30)
        finally:
            if follower is not None:
                stop_process_tree(follower)
            if printer is not None:
                printer.join(timeout=10)
        if status != "finished:completed":
            if stream:  # the log, with the error, was just printed
                raise SimulationError(f"run {run_id} ended {status!r}; the error is in its log above")
            log_text = self.flwr(["log", run_id, CONNECTION], timeout=60)
            raise SimulationError(f"run {run_id} ended {status!r}; log tail:\n{log_text[-4000:]}")



class FlowerSession(FlowerCli):
    """A private SuperLink and the `flwr` CLI pointed at it; stops all it started on exit.

    Parameters
    ----------
    workdir : path
        Where the session's FLWR_HOME and process logs go.
    simulation : bool
        True: a simulation SuperLink (Ray simulates the SuperNodes). False: real SuperNodes
        connect to `address` (see `start_supernode`).
    host : str (default: "127.0.0.1")
        Address the SuperLink listens on and everyone connects to.
    superlink_args : tuple[str, ...] (default: ("--insecure",))
        Security flags of the SuperLink (`superlink_security`: TLS, SuperNode authentication).
    root_certificates, cli_netns, env :
        As for `FlowerCli` (`env` also reaches the SuperLink and SuperNodes, e.g.
        FLWR_SUPEREXEC_TASK_POLL_INTERVAL).
    superlink_netns : str | None (default: None)
        Network namespace the SuperLink runs in (multi-host tests); None is the caller's own.
    database : str | os.PathLike | None (default: None)
        The SuperLink's state database (`superlink_command`); None keeps it in memory.
    executor : str (default: "stock")
        How SuperNodes run ClientApp tasks (one of EXECUTORS): "stock" is Flower's SuperNode and
        SuperExec, "warm" is concatfl's warm executor started next to every SuperNode, which runs
        with short fixed waits (concatfl/supernode.py).
    """

    # pylint: disable=too-many-arguments
    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        simulation: bool,
        host: str = "127.0.0.1",
        superlink_args: tuple[str, ...] = ("--insecure",),
        root_certificates: str | os.PathLike | None = None,
        superlink_netns: str | None = None,
        cli_netns: str | None = None,
        env: Mapping[str, str] | None = None,
        database: str | os.PathLike | None = None,
        executor: str = "stock",
    ) -> None:
        check_executor(executor)
        self.database = database
        self.port = free_port()
        self.ray_tmpdir = Path(tempfile.mkdtemp(prefix="cfl-ray-", dir="/tmp"))
        super().__init__(
            workdir,
            f"{host}:{self.port}",
            root_certificates=root_certificates,
            cli_netns=cli_netns,
            env={"RAY_TMPDIR": str(self.ray_tmpdir), **(env or {})},
        )
        self.executor = executor
        self.executors: dict[int, subprocess.Popen[bytes]] = {}
        self.simulation = simulation
        self.host = host
        self.superlink_netns = superlink_netns
        self.superlink_args = superlink_args
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def address(self) -> str:
        """host:port where SuperNodes and the CLI reach the SuperLink."""
        return f"{self.host}:{self.port}"

    def __enter__(self) -> FlowerSession:
        command = superlink_command(
            self.host, self.port, self.database, simulation=self.simulation, security=self.superlink_args
        )
        superlink = self.spawn(command, "superlink.log", netns=self.superlink_netns)
        try:
            _wait_for_port(self.host, self.port, superlink, self.workdir / "superlink.log", self.superlink_netns)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for process in reversed(self.processes):
            stop_process_tree(process)
        shutil.rmtree(self.ray_tmpdir, ignore_errors=True)

    def spawn(self, command: list[str], log_name: str, netns: str | None = None) -> subprocess.Popen[bytes]:
        """Start a process (in `netns`, logging to `workdir/log_name`) that the session will stop."""
        process = subprocess.Popen(
            in_namespace(command, netns),
            env=self.env,
            stdout=(self.workdir / log_name).open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    # pylint: disable=too-many-arguments
    def start_supernode(
        self,
        partition_id: int,
        num_partitions: int,
        *,
        security: tuple[str, ...] = ("--insecure",),
        netns: str | None = None,
        node_config: str = "",
        log_name: str | None = None,
    ) -> subprocess.Popen[bytes]:
        """A real SuperNode holding partition `partition_id` of `num_partitions`.

        `security` comes from `supernode_security`; the SuperNode runs in `netns` when given
        and logs to `log_name` (default `supernode-<partition_id>.log`, appended to on restart).
        With the warm executor, its executor starts beside it (same namespace; log
        `warm-executor-<partition_id>.log`; in `self.executors[partition_id]`) and exits with it.
        """
        port = free_port()
        command = supernode_command(
            self.address,
            port,
            partition_id,
            num_partitions,
            security=security,
            node_config=node_config,
            executor=self.executor,
        )
        supernode = self.spawn(command, log_name or f"supernode-{partition_id}.log", netns=netns)
        if self.executor == "warm":
            self.executors[partition_id] = self.spawn(
                warm_executor_command(port, supernode.pid), f"warm-executor-{partition_id}.log", netns=netns
            )
        return supernode

# Lines of Flower's run log that say nothing about this run: Flower 1.42 warns about the changed
# default federation size on every simulation, even when the size is given (as the launcher always
# does), reports installing the app into the launcher's private FLWR_HOME, ends with an empty
# log line, and (depending on timing) reports Ray stopping its client actors after the run.
NOISE = re.compile(
    r"INFO[^:]*:\s*$"
    r"|Manually terminating ClientAppActor"
    r"|Since flwr 1\.32, default simulated SuperNodes changed"
    r"|To change federation size, use the following command"
    r"|flwr federation simulation-config"
    r"|Successfully installed concatfl to "
)


# The first line of a log record (Flower's, or a Ray worker's "(ClientAppActor pid=…)" relay of
# one); other lines continue the record before them (tracebacks).
RECORD = re.compile(r"^(?:\x1b\[[\d;]*m)?(?:\(\w+ pid=\d+\)|(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\b)")
# Flower logs a ClientApp that raised as three ERROR records of ~40 lines each: this notice, the
# exception and its traceback.
CLIENT_FAILURE = "An exception was raised when processing a message by"
CLIENT_FAILURE_RECORDS = 3


def readable_log(lines: Iterable[str]) -> Iterator[str]:
    """The lines of a run's log worth showing a user: `NOISE` left out, and each ClientApp
    failure's tracebacks shortened to one line with the error's message (the strategy then logs
    the missed reply, whose reason in metrics.json keeps the full traceback)."""
    failure: list[str] = []  # the lines of the ClientApp failure being read
    records_left = 0  # its records not yet started
    for line in lines:
        starts_record = bool(RECORD.match(line))
        if starts_record and CLIENT_FAILURE in line:
            if failure:
                yield _failure_line(failure)
            failure, records_left = [], CLIENT_FAILURE_RECORDS
        if failure or records_left:
            if not starts_record or records_left:
                records_left -= starts_record
                failure.append(line)
                continue
            yield _failure_line(failure)  # a record after the failure's last one
            failure = []
        if not NOISE.search(line):
            yield line
    if failure:
        yield _failure_line(failure)


def _failure_line(records: list[str]) -> str:
    """One line for a ClientApp failure: its level prefix and the last line of its traceback."""
    prefix = records[0][: records[0].index(CLIENT_FAILURE)]
    message = next(line.strip() for line in reversed(records) if line.strip())
    return f"{prefix}ClientApp error (traceback left out): " + message.removesuffix("'>") + "\n"


def _print_log_in_background(stream: IO[bytes] | None) -> threading.Thread:
    """Copy a streamed run log to stdout, without `NOISE`, as it arrives."""

    def copy() -> None:
        assert stream is not None
        with stream:
            for line in readable_log(io.TextIOWrapper(stream, errors="replace")):
                sys.stdout.write(line)
                sys.stdout.flush()

    printer = threading.Thread(target=copy, daemon=True)
    printer.start()
    return printer


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
    timeout: float | None = None,
    cpus_per_client: int = 1,
    gpus_per_client: float = 0.0,
) -> dict[str, Any]:
    """Run one simulation to completion and return its metrics.json as a dict.

    `run_config` overrides the app's defaults (pyproject.toml). `workdir` receives the
    session's files (FLWR_HOME, process logs) and, unless
    `run_config` names an `output-dir`, the outputs in `<workdir>/output`. Without `workdir`
    the session's files go to a temporary directory that is removed afterwards (kept, and
    named in the error, when the run failed) and the outputs go where `output-dir` says (the
    app's default: `outputs` under the current directory). `timeout` (seconds) gives up on a
    run that takes longer; None waits as long as it takes.
    Raises SimulationError (with the log tail) unless the run ends `finished:completed`.
    """
    scratch = workdir is None
    workdir = Path(workdir or tempfile.mkdtemp(prefix="concatfl-run-")).resolve()
    default_output = app_config(app_dir).get("output-dir", "outputs") if scratch else workdir / "output"
    output_dir = Path(run_config.get("output-dir", default_output)).resolve()
    overrides = {**run_config, "output-dir": str(output_dir)}
    try:
        with FlowerSession(workdir, simulation=True) as session:
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


def _wait_for_port(
    host: str, port: int, process: subprocess.Popen[bytes], log_file: Path, netns: str | None, limit: float = 60
) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SimulationError(f"flower-superlink exited early:\n{log_file.read_text()[-3000:]}")
        if _port_open(host, port, netns):
            return
        time.sleep(0.2)
    raise SimulationError(f"flower-superlink did not listen on {host}:{port} within {limit} s")


def _port_open(host: str, port: int, netns: str | None) -> bool:
    """Whether something listens on host:port, seen from inside `netns` when given."""
    if netns is None:
        with socket.socket() as sock:
            return sock.connect_ex((host, port)) == 0
    probe = f"import socket,sys; sys.exit(socket.socket().connect_ex(({host!r}, {port})))"
    return subprocess.run(in_namespace([sys.executable, "-c", probe], netns), check=False).returncode == 0


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


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so FlowerSession stops the SuperLink it started."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def main(argv: list[str] | None = None) -> int:
    """Command line: check the run config, run one simulation, stream its log, say where metrics.json is.

    Returns 2 for a bad argument or run-config value (found before anything starts), 1 when
    the run did not complete.
    """
    exit_on_sigterm()
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
    args = parser.parse_args(argv)
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
