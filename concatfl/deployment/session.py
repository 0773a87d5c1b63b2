"""`FlowerSession`: a private SuperLink (simulation or deployment), the SuperNodes (with their warm
executors) started for it, and the `flwr` CLI pointed at it; everything it started is stopped when
the session ends, however it ends."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from .. import PROJECT_DIR
from .cli import FlowerCli
from .commands import (
    Certificates,
    check_executor,
    fleet_door_command,
    fleet_door_env,
    superlink_command,
    supernode_command,
)
from .processes import free_port, in_namespace, kill_process_tree, stop_process_trees, wait_for_port

LOOPBACK = "127.0.0.1"


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
        Address SuperNodes connect to: the SuperLink's, or with `fleet_door` the door's (the
        SuperLink then listens on 127.0.0.1 only).
    superlink_args : tuple[str, ...] (default: ("--insecure",))
        Security flags of the SuperLink (`superlink_security`: TLS, SuperNode authentication).
    root_certificates, cli_netns, env :
        As for `FlowerCli` (`env` also reaches the SuperLink and SuperNodes, e.g.
        FLWR_SUPEREXEC_TASK_POLL_INTERVAL). With `fleet_door`, the CLI is the operator's, on the
        SuperLink's host: it runs in `superlink_netns` and `cli_netns` must be None.
    superlink_netns : str | None (default: None)
        Network namespace the SuperLink runs in (multi-host tests); None is the caller's own.
    fleet_door : Certificates | None (default: None)
        The SuperLink's certificates (as in `superlink_args`, which must turn TLS on): run the
        fleet door (HAProxy with deploy/haproxy.cfg, `fleet_door_command`) on `host`, in
        `superlink_netns`, in front of a SuperLink bound to 127.0.0.1, as in the documented
        deployment. SuperNodes reach only the door (Fleet API calls of registered nodes); the CLI
        reaches the SuperLink itself. None: SuperNodes and CLI reach the SuperLink on `host`.
    database : str | os.PathLike | None (default: None)
        The SuperLink's state database (`superlink_command`); None keeps it in memory.
    executor : str (default: "stock")
        How SuperNodes run ClientApp tasks (one of EXECUTORS): "stock" is Flower's SuperNode and
        SuperExec, "warm" is concatfl's SuperNode launcher with short waits that runs the warm
        executor in its own process (concatfl/deployment/supernode.py).
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
        fleet_door: Certificates | None = None,
    ) -> None:
        check_executor(executor)
        if fleet_door is not None and (cli_netns is not None or "--insecure" in superlink_args):
            raise ValueError("a fleet door needs a TLS SuperLink, and the CLI beside the SuperLink (cli_netns=None)")
        self.database = database
        self.port = free_port()
        self.fleet_door = fleet_door
        self.door_port = free_port() if fleet_door is not None else None
        self.superlink_host = LOOPBACK if fleet_door is not None else host
        self.ray_tmpdir = Path(tempfile.mkdtemp(prefix="cfl-ray-", dir="/tmp"))
        super().__init__(
            workdir,
            f"{self.superlink_host}:{self.port}",
            root_certificates=root_certificates,
            cli_netns=superlink_netns if fleet_door is not None else cli_netns,
            env={"RAY_TMPDIR": str(self.ray_tmpdir), **(env or {})},
        )
        self.executor = executor
        self.simulation = simulation
        self.host = host
        self.superlink_netns = superlink_netns
        self.superlink_args = superlink_args
        self.processes: list[subprocess.Popen[bytes]] = []
        self.superlink: subprocess.Popen[bytes] | None = None
        self.door: subprocess.Popen[bytes] | None = None
        self.closed = False  # once stopping, no process may start (a restart racing the exit)

    @property
    def address(self) -> str:
        """host:port where SuperNodes reach the SuperLink (the fleet door's, when there is one)."""
        return f"{self.host}:{self.door_port or self.port}"

    @property
    def superlink_address(self) -> str:
        """host:port of the SuperLink itself (the CLI's; with a fleet door, on loopback only)."""
        return f"{self.superlink_host}:{self.port}"

    def __enter__(self) -> FlowerSession:
        try:
            self.start_superlink()
            if self.fleet_door is not None:
                self.start_fleet_door()
        except BaseException:
            self.__exit__()
            raise
        return self

    def start_superlink(self) -> subprocess.Popen[bytes]:
        """Start the SuperLink (again, after `kill_superlink`: same address, same database) and
        wait until it listens."""
        command = superlink_command(
            self.superlink_host, self.port, self.database, simulation=self.simulation, security=self.superlink_args
        )
        self.superlink = self.spawn(command, "superlink.log", netns=self.superlink_netns, own_cpu_share=True)
        wait_for_port(
            self.superlink_host, self.port, self.superlink, self.workdir / "superlink.log", self.superlink_netns
        )
        return self.superlink

    def start_fleet_door(self) -> subprocess.Popen[bytes]:
        """Start the fleet door on `address` in front of the SuperLink (log `fleet-door.log`) and
        wait until it listens; it keeps running across SuperLink restarts."""
        assert self.fleet_door is not None and self.door_port is not None
        # "localhost": the name in the SuperLink's certificate for its loopback address
        settings = fleet_door_env(
            self.address, self.superlink_address, "localhost", self.fleet_door, f"{LOOPBACK}:{free_port()}"
        )
        command = fleet_door_command(PROJECT_DIR / "deploy/haproxy.cfg")
        self.door = self.spawn(command, "fleet-door.log", netns=self.superlink_netns, env=settings, own_cpu_share=True)
        wait_for_port(self.host, self.door_port, self.door, self.workdir / "fleet-door.log", self.superlink_netns, "haproxy")
        return self.door

    def kill_superlink(self) -> None:
        """SIGKILL the SuperLink and what it started (a crashed host: the runs it held die with it)."""
        assert self.superlink is not None
        kill_process_tree(self.superlink)

    def __exit__(self, *exc: object) -> None:
        self.closed = True
        try:
            stop_process_trees(list(reversed(self.processes)))
        except BaseException:  # interrupted (a second Ctrl-C, …): no more waiting, kill what is left
            for process in self.processes:
                with contextlib.suppress(Exception):
                    kill_process_tree(process)
            raise
        finally:
            shutil.rmtree(self.ray_tmpdir, ignore_errors=True)

    def spawn(
        self,
        command: list[str],
        log_name: str,
        netns: str | None = None,
        env: Mapping[str, str] | None = None,
        own_cpu_share: bool = False,
    ) -> subprocess.Popen[bytes]:
        """Start a process (in `netns`, logging to `workdir/log_name`, with `env` added to the
        session's environment) that the session will stop; RuntimeError once the session is stopping.

        Every process gets a process group of its own (a Ctrl-C at the terminal reaches only the
        caller, which stops them in order). `own_cpu_share` (the SuperLink's host: the SuperLink
        and the fleet door) also gives it a session of its own. Linux's autogroup scheduling
        shares the CPU equally among sessions, whatever the number of processes in each: the
        SuperNodes stay in the caller's session and share one slice, as nodes on other hosts
        would not take the SuperLink's CPU. With a session per SuperNode, 48 nodes left the
        SuperLink and its ServerApp ~1/49 of this machine (docs/results.md, `soak --capacity`).
        """
        if self.closed:
            raise RuntimeError("the session is stopping: no new process")
        process = subprocess.Popen(
            in_namespace(command, netns),
            env={**self.env, **(env or {})},
            stdout=(self.workdir / log_name).open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=own_cpu_share,
            process_group=None if own_cpu_share else 0,
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
        With the warm executor, the executor's records (`warm_executor.task_records`) are in
        that log too, and its worker is a child of the SuperNode.
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
        return self.spawn(command, log_name or f"supernode-{partition_id}.log", netns=netns)
