"""Processes that concatfl starts, and how it stops them: on success, failure, SIGTERM, SIGINT
and timeout alike (the SuperLink starts the simulation runtime in a session of its own, so a
process is stopped with every descendant it has)."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil


class SimulationError(RuntimeError):
    """The run did not finish as completed; the message carries the tail of its log."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def in_namespace(command: list[str], netns: str | None) -> list[str]:
    """`command` run inside network namespace `netns` (`ip netns exec` keeps the PID)."""
    return ["ip", "netns", "exec", netns, *command] if netns else command


def stop_process_tree(process: subprocess.Popen[bytes]) -> None:
    """Stop a process and all its descendants (`stop_process_trees`)."""
    stop_process_trees([process])


def stop_process_trees(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    """Stop processes and all their descendants, all at once.

    The SuperLink starts the simulation runtime in a session of its own, so killing the
    process group is not enough: every descendant is collected first, then terminated. Every
    process is terminated before any is waited for, so stopping takes at most ~30 s however
    many there are (one after another, a capacity sweep's sixteen SuperNodes with their
    executors could take minutes: longer than `timeout -k` waits before its SIGKILL, which left
    them all running).
    """
    roots, family = [], []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(process.pid)
            roots.append(process)
            family += [root, *root.children(recursive=True)]
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.terminate()
    _, alive = psutil.wait_procs(family, timeout=20)
    for member in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    psutil.wait_procs(alive, timeout=10)
    for process in roots:
        process.wait(timeout=10)


def kill_process_tree(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL a process and everything it started (a crashed host: nothing gets to clean up)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        family = [psutil.Process(process.pid)]
        family += family[0].children(recursive=True)
        for member in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                member.kill()
        psutil.wait_procs(family, timeout=10)
    process.wait(timeout=10)


def wait_for_port(
    host: str,
    port: int,
    process: subprocess.Popen[bytes],
    log_file: Path,
    netns: str | None,
    what: str = "flower-superlink",
    limit: float = 60,
) -> None:
    """Wait until `process` (`what`, logging to `log_file`) listens on host:port in `netns`;
    SimulationError, with the log's tail, when it exits first or does not listen within `limit` s."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SimulationError(f"{what} exited early:\n{log_file.read_text()[-3000:]}")
        if port_open(host, port, netns):
            return
        time.sleep(0.2)
    raise SimulationError(f"{what} did not listen on {host}:{port} within {limit} s")


def port_open(host: str, port: int, netns: str | None) -> bool:
    """Whether something listens on host:port, seen from inside `netns` when given."""
    if netns is None:
        with socket.socket() as sock:
            return sock.connect_ex((host, port)) == 0
    probe = f"import socket,sys; sys.exit(socket.socket().connect_ex(({host!r}, {port})))"
    return subprocess.run(in_namespace([sys.executable, "-c", probe], netns), check=False).returncode == 0


def exit_on_signals() -> None:
    """Turn SIGTERM into SystemExit and SIGINT into KeyboardInterrupt, so FlowerSession stops
    what it started. SIGINT too, because a command started in the background by a shell (`… &`,
    nohup) inherits it ignored, and so would every process it starts: Ctrl-C would do nothing
    and Flower's parent-process monitors (SIGINT when the parent is gone) would be ignored."""
    signal.signal(signal.SIGTERM, _exit_once)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _exit_once(signum: int, _frame: object) -> None:
    # `timeout` signals the command and then its whole process group: a second SIGTERM landing
    # in the cleanup would cut it short and leave the SuperLink and SuperNodes running.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(128 + signum)


def leftover_processes(workdir: Path) -> list[str]:
    """Processes left running by whatever ran in `workdir`: this process's descendants, or any
    process naming `workdir` in its command line (scoped so that runs in other shells do not
    count as leaks; zombies are not counted)."""
    suspects = psutil.Process().children(recursive=True)
    for process in psutil.process_iter(["cmdline"]):
        if str(workdir) in " ".join(process.info["cmdline"] or []):
            suspects.append(process)
    leaked = []
    for process in suspects:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                leaked.append(" ".join(process.cmdline()))
        except psutil.NoSuchProcess:
            continue
    return leaked
