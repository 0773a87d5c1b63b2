"""Every entry point that starts processes stops all of them when it is stopped itself.

Each command runs in its own folder; while it runs, every process it started (its whole tree,
sampled twice a second: the SuperLink and SuperNodes run in process groups of their own, so once
the command is gone they would no longer be its descendants) is noted. Once it has started its
processes it gets SIGTERM (or SIGINT, as a terminal's Ctrl-C); it must exit, and none of the
noted processes may be left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from concatfl import PROJECT_DIR
from concatfl.deployment.processes import stop_process_trees
from concatfl.deployment.session import FlowerSession

# (name, command, a process name that shows the command has started its deployment, signals sent)
ENTRY_POINTS = [
    ("launch", [sys.executable, "-m", "concatfl.launch", "--num-supernodes", "2", "--run-config", "num-server-rounds=50"],
     "flwr-simulation", (signal.SIGTERM,)),
    ("launch-ctrl-c", [sys.executable, "-m", "concatfl.launch", "--num-supernodes", "2", "--run-config",
                       "num-server-rounds=50"], "flwr-simulation", (signal.SIGINT,)),
    ("deploy-latency", [sys.executable, str(PROJECT_DIR / "scripts/deploy_latency.py"), "--nodes", "2",
                        "--rounds", "20", "--variants", "warm-executor", "--idle-seconds", "1", "--out",
                        "{workdir}/latency.json"],
     "warm_executor", (signal.SIGTERM, signal.SIGTERM)),  # as `timeout` does: the command, then its group
    ("soak", [sys.executable, "-m", "concatfl.bench", "soak", "--nodes", "4", "--strategies", "fedavg",
              "--rounds", "50", "--no-hang", "--out", "{workdir}"], "warm_executor", (signal.SIGTERM,)),
]


def tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def command_line(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.e2e
@pytest.mark.parametrize(("name", "command", "started", "stop"), ENTRY_POINTS, ids=[e[0] for e in ENTRY_POINTS])
def test_a_stopped_entry_point_leaves_no_process(tmp_path: Path, name, command, started, stop):
    command = [part.replace("{workdir}", str(tmp_path)) for part in command]
    entry = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    root = psutil.Process(entry.pid)
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 300
    while not any(started in command_line(p) for p in seen.values() if alive(p)):
        assert entry.poll() is None, f"{name} exited ({entry.returncode}) before starting {started}"
        assert time.monotonic() < deadline, f"{name} did not start {started} within 300 s"
        seen.update({p.pid: p for p in tree(root)})
        time.sleep(0.5)
    time.sleep(3)  # let it get on with its work
    seen.update({p.pid: p for p in tree(root)})
    for signal_number in stop:
        entry.send_signal(signal_number)
    entry.wait(timeout=120)
    time.sleep(1)
    left = [command_line(p) for p in seen.values() if p.pid != entry.pid and alive(p)]
    assert left == [], f"{name} left {len(left)} processes"


def test_stopping_signals_every_process_before_waiting_for_any(tmp_path: Path):
    # Each process takes a second to stop once signalled: stopped one after another, a session's
    # dozens of SuperNodes took minutes to stop, past the `timeout -k` that then killed the
    # command mid-cleanup. All are signalled at once, within the first one's second.
    log = tmp_path / "log"
    program = (
        "import signal, sys, time\n"
        "def stop(*_):\n"
        "    open(sys.argv[1], 'a').write(f'stopping {time.time()}\\n'); time.sleep(1); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "open(sys.argv[1], 'a').write('ready\\n')\n"
        "time.sleep(600)\n"
    )
    processes = [subprocess.Popen([sys.executable, "-c", program, str(log)]) for _ in range(6)]
    try:
        deadline = time.monotonic() + 60
        while (log.read_text().count("ready") if log.exists() else 0) < len(processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        stop_process_trees(processes)
    finally:
        for process in processes:
            process.kill()
            process.wait()
    stops = [float(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("stopping")]
    assert len(stops) == len(processes) and max(stops) - min(stops) < 1.0
    assert all(process.returncode == 0 for process in processes)


def test_supernodes_share_the_callers_cpu_slice_and_the_superlink_has_its_own(tmp_path: Path):
    # Why: FlowerSession.spawn's docstring (autogroup scheduling shares the CPU by session).
    with FlowerSession(tmp_path, simulation=False) as session:
        node = session.spawn(["sleep", "60"], "node.log")
        superlink = session.superlink
        assert superlink is not None
        assert os.getsid(node.pid) == os.getsid(0) and os.getpgid(node.pid) == node.pid
        assert os.getsid(superlink.pid) == superlink.pid != os.getsid(0)
