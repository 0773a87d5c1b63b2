"""A simulation on an existing Ray cluster: the way `concatfl.launch --ray-address` runs one.

A two-node Ray cluster is started as a user starts one (`ray start --head`, then `ray start
--address` on the worker machine), here both on this machine inside a network namespace of
their own that has only a loopback interface: Ray replaces `--node-ip-address=127.0.0.1` by the
machine's outgoing address (`resolve_ip_for_localhost`), so only there does the cluster talk
over loopback alone. The head offers no CPU, the worker two, each a custom resource that names
it; the worker's `ray start` runs with CONCATFL_RAY_NODE=worker in its environment, which every
process its raylet starts inherits. A short FedSeq simulation goes through Flower's normal path
(a simulation SuperLink, `flwr run`) with RAY_ADDRESS pointing at the head; while it runs every
ClientAppActor process is found and asked which node started it. The cluster and the namespace
are removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import psutil
import pytest

from concatfl.deployment.processes import free_port
from concatfl.deployment.session import FlowerSession
from concatfl.metrics import read_metrics

RAY = str(Path(sys.executable).parent / "ray")
NODE_MARK = "CONCATFL_RAY_NODE"


def in_namespace(namespace: str, *command: str, env: dict[str, str] | None = None) -> None:
    subprocess.run(["ip", "netns", "exec", namespace, *command], check=True, capture_output=True, timeout=120,
                   env={**os.environ, **(env or {})})


def stop_cluster(temp_dir: str) -> None:
    """Stop every process of the cluster started with `temp_dir` (not `ray stop`, which stops every
    Ray on the machine)."""
    roots = [p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])]
    family = set()
    for root in roots:
        try:
            family.update([root, *root.children(recursive=True)])
        except psutil.Error:
            continue
    for process in family:
        try:
            process.terminate()
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(list(family), timeout=20)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            continue


class ActorWatch:
    """Which node (the NODE_MARK in its environment) each ClientAppActor process of the cluster in
    network namespace `namespace` came from (other simulations may run beside it: their actors
    are in another namespace)."""

    def __init__(self, namespace: str) -> None:
        self.network = f"net:[{os.stat(f'/run/netns/{namespace}').st_ino}]"
        self.nodes: dict[int, str] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.wait(0.5):
            for process in psutil.process_iter(["cmdline"]):
                try:
                    if (
                        "ClientAppActor" in " ".join(process.info["cmdline"] or [])
                        and process.pid not in self.nodes
                        and os.readlink(f"/proc/{process.pid}/ns/net") == self.network
                    ):
                        self.nodes[process.pid] = process.environ().get(NODE_MARK, "head")
                except (psutil.Error, OSError):  # it ended meanwhile
                    continue

    def stop(self) -> dict[int, str]:
        self._done.set()
        self._thread.join()
        return self.nodes


@pytest.mark.e2e
def test_clientapp_actors_run_on_the_worker_of_an_existing_ray_cluster(tmp_path):
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.fail("this test makes a network namespace: it needs `ip` and root (CI has both)")
    namespace = f"cfl-ray-{os.getpid()}"
    temp_dir = tempfile.mkdtemp(prefix="cfl-rc-", dir="/tmp")  # Ray's socket paths must stay short
    port = free_port()
    subprocess.run(["ip", "netns", "add", namespace], check=True)
    try:
        in_namespace(namespace, "ip", "link", "set", "lo", "up")
        in_namespace(namespace, RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                     "--num-cpus=0", '--resources={"concatfl-head": 1}', f"--temp-dir={temp_dir}",
                     "--include-dashboard=false", "--disable-usage-stats")
        in_namespace(namespace, RAY, "start", f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1",
                     "--num-cpus=2", '--resources={"concatfl-worker": 1}', "--disable-usage-stats",
                     env={NODE_MARK: "worker"})
        watch = ActorWatch(namespace)
        output = tmp_path / "output"
        session = FlowerSession(tmp_path, simulation=True, superlink_netns=namespace, cli_netns=namespace,
                                env={"RAY_ADDRESS": f"127.0.0.1:{port}"})
        with session:
            run_id = session.submit(
                {"strategy": "fedseq", "num-server-rounds": 2, "fedseq-pretrain-epochs": 1,
                 "fedseq-min-samples": 100, "output-dir": str(output)},
                federation_config="num-supernodes=4 client-resources-num-cpus=1",
            )
            session.wait(run_id, timeout=600)
        nodes = watch.stop()
    finally:
        stop_cluster(temp_dir)
        subprocess.run(["ip", "netns", "del", namespace], check=False)
        shutil.rmtree(temp_dir, ignore_errors=True)
    # Two CPUs on the worker, one per client: two actors, both there; the head runs none.
    assert sorted(nodes.values()) == ["worker", "worker"], nodes
    metrics = read_metrics(output)
    assert len(metrics["rounds"]) == 2 and metrics["final_accuracy"] > metrics["initial"]["accuracy"]
    assert not [p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])]
