"""concatfl's warm ClientApp executor (concatfl/deployment/warm_executor.py) with real Flower processes.

Each deployment runs a real SuperLink and SuperNodes through concatfl's launcher with the warm
executor in their process (`--warm-executor`); tests/apps/stateful scripts the messages (count in
`context.state`, raise, crash) and reports the ClientApp's process id with every reply.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import psutil
import pytest

from concatfl import PROJECT_DIR
from concatfl.deployment.commands import supernode_command
from concatfl.deployment.session import FlowerSession
import concatfl.deployment.supernode as supernode
import concatfl.deployment.warm_executor as warm_executor
from concatfl.deployment.warm_executor import (
    AppRef,
    Supervisor,
    TaskReport,
    main,
    parse_args,
    stop_with_parent,
    task_records,
)
from concatfl.deployment.fleet import log_count, online_node_ids, wait_for
from concatfl.deployment.processes import kill_process_tree

from .deploy import FAST_POLLING
from .e2e import leftover_processes

STATEFUL_APP = PROJECT_DIR / "tests/apps/stateful"
# Flower's reply for a task whose process stopped sending heartbeats.
CRASHED = "ClientApp stopped responding."


def test_a_flower_of_another_shape_runs_flowers_own_superexec_with_the_same_connection(monkeypatch):
    import concatfl.deployment.compat as compat
    import concatfl.deployment.warm_executor as warm_executor

    monkeypatch.setattr(compat, "clientapp_steps_problem", lambda: "flwr.cli.install.install_from_fab is gone")
    executed = []

    def execvp(program, arguments):
        executed.append((program, arguments))
        raise SystemExit(0)  # exec never returns

    monkeypatch.setattr(warm_executor.os, "execvp", execvp)
    with pytest.raises(SystemExit):
        main(["--runtime-api-address", "127.0.0.1:9094", "--root-certificates", "/certs/ca.crt", "--parent-pid", "42"])
    assert executed == [("flower-superexec", [
        "flower-superexec", "--runtime-api-address", "127.0.0.1:9094", "--root-certificates", "/certs/ca.crt",
        "--parent-pid", "42",
    ])]


def test_an_executor_started_with_sigint_ignored_still_exits_with_its_parent(tmp_path):
    # As from a shell's background job (`… &`, nohup): SIGINT ignored, inherited by every child.
    parent = subprocess.Popen(["sleep", "1"], preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    stderr = tmp_path / "executor.err"
    with stderr.open("w") as err:
        executor = subprocess.Popen(
            [sys.executable, "-m", "concatfl.deployment.warm_executor", "--runtime-api-address", "127.0.0.1:1",
             "--insecure", "--parent-pid", str(parent.pid)],
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        parent.wait()
        try:
            executor.wait(timeout=60)  # it retries its connection to nothing until the parent is gone
        except subprocess.TimeoutExpired:
            executor.send_signal(signal.SIGUSR1)  # its threads' stacks, for the failure message
            time.sleep(2)
            pytest.fail(f"the executor outlived its parent by 60 s; its stderr and stacks:\n{stderr.read_text()[-6000:]}")
    finally:
        kill_process_tree(executor)

    def its_worker() -> list[psutil.Process]:
        flag = f"--parent-pid {executor.pid}"
        return [p for p in psutil.process_iter(["cmdline"]) if flag in " ".join(p.info["cmdline"] or [])]

    wait_for(lambda: not its_worker(), 30, "the executor's worker to exit with it")


def test_the_parent_monitor_interrupts_a_main_thread_waiting_out_a_retry_back_off():
    # Flower's retry back-off waits on an Event; a SIGINT raised in the monitor's own thread
    # would reach the main thread only when that wait ends (up to a minute).
    # The parent ends while the main thread already waits: a signal sent before the wait has begun
    # is one the wait never sees, whoever sends it.
    parent = subprocess.Popen(["sleep", "1"])
    monitor = threading.Thread(target=stop_with_parent, args=(parent.pid, types.SimpleNamespace(worker=None), None),
                               daemon=True)
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):  # entered first: the SIGINT comes a second in
            monitor.start()
            threading.Event().wait(30)
    finally:
        parent.wait()
    assert time.monotonic() - started < 5


def test_bad_arguments_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--runtime-api-address", "127.0.0.1:9094"])
    assert "--root-certificates is required unless --insecure" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--runtime-api-address", "127.0.0.1:9094", "--insecure", "--poll-interval", "0"])
    assert "--poll-interval must be between 0.01 and 60 seconds, got 0.0" in capsys.readouterr().err


def test_task_reports_and_records_survive_their_text_form():
    report = TaskReport("completed", AppRef("concatfl/app", "0.1.0", "ab12"), {"pull": 0.01, "app": 1.5})
    assert TaskReport.from_json(report.to_json()) == report
    assert TaskReport.from_json(TaskReport("failed", None, {}).to_json()).app is None
    log_text = "\x1b[92mINFO \x1b[0m:      [warm-executor] task record {\"task\": 7, \"status\": \"completed\"}\nother line\n"
    assert task_records(log_text) == [{"task": 7, "status": "completed"}]


class OrphanedTaskRuntime:
    """A SuperNode's Runtime API holding a task whose message is listed but whose objects never
    arrive (what Flower 1.42's SuperNode leaves behind for a message of a run that is no longer
    running)."""

    def PullTaskInput(self, request):  # pylint: disable=invalid-name
        from flwr.app import Context, RecordDict
        from flwr.common.serde import context_to_proto, fab_to_proto, run_to_proto
        from flwr.proto.runtime_pb2 import PullTaskInputResponse
        from flwr.supercore.fab import Fab
        from flwr.supercore.run import Run

        context = Context(run_id=7, node_id=3, node_config={}, state=RecordDict(), run_config={})
        return PullTaskInputResponse(task_id=11, context=context_to_proto(context), run=run_to_proto(Run.create_empty(7)),
                                     fab=fab_to_proto(Fab("0" * 64, b"", {})))

    def PullMessages(self, request):  # pylint: disable=invalid-name
        from flwr.proto.message_pb2 import Message, ObjectTree
        from flwr.proto.runtime_pb2 import PullAppMessagesResponse

        return PullAppMessagesResponse(messages_list=[Message()], message_object_trees=[ObjectTree(object_id="a" * 64)])

    def PullObject(self, request):  # pylint: disable=invalid-name
        from flwr.proto.message_pb2 import PullObjectResponse

        return PullObjectResponse(object_found=True, object_available=False)

    def ConfirmMessageReceived(self, request):  # pylint: disable=invalid-name
        raise AssertionError("no object arrived: nothing to confirm")


def test_a_message_whose_objects_never_arrive_fails_its_task_instead_of_holding_the_worker(monkeypatch):
    from flwr.supercore.inflatable.inflatable_utils import ObjectPullError

    monkeypatch.setattr(warm_executor, "OBJECTS_WAIT_SECONDS", 0.3)
    started = time.monotonic()
    with pytest.raises(ObjectPullError, match="a" * 64):
        warm_executor.pull_task_input(OrphanedTaskRuntime())
    assert time.monotonic() - started < 5  # not Flower's PULL_MAX_TIME (2 h)


def test_a_warm_supernode_runs_the_executor_in_the_launchers_process():
    command = supernode_command("127.0.0.1:8000", 9095, 0, 2, executor="warm")
    assert command[1:4] == ["-m", "concatfl.deployment.supernode", "--warm-executor"]
    connection, flags = supernode.runtime_connection(command[4:])
    assert connection.address == "127.0.0.1:9095" and connection.insecure and "--isolation=process" in flags
    with pytest.raises(ValueError, match="use --isolation=process or leave it out, not --isolation=subprocess"):
        supernode.runtime_connection(["--isolation=subprocess"])
    with pytest.raises(ValueError, match="executor must be one of stock, warm, got 'hot'"):
        FlowerSession(Path("/tmp"), simulation=False, executor="hot")


def test_the_in_process_executor_claims_a_task_as_soon_as_it_is_woken():
    # No task at first; the SuperNode stores a message and wakes it: it claims at once, not
    # after its 60 s poll.
    claims = []

    class Client:
        def AcquireTask(self, request):  # noqa: N802 (Flower's name)
            claims.append(time.monotonic())
            if len(claims) == 1:
                return types.SimpleNamespace(HasField=lambda field: False, token="")
            raise SystemExit  # ends the loop after the second claim

        def close(self):
            pass

    wake = threading.Event()
    supervisor = Supervisor(types.SimpleNamespace(client=lambda component: Client()), poll_interval=60.0, wake=wake)

    def serve():
        with contextlib.suppress(SystemExit):
            supervisor.serve()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(warm_executor, "Worker", lambda *args: types.SimpleNamespace(stop=lambda *args: None))
        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        wait_for(lambda: claims, 10, "the first claim", interval=0.01)
        woken = time.monotonic()
        wake.set()
        thread.join(timeout=10)
    assert len(claims) == 2 and claims[1] - woken < 1.0


def run_plan(session: FlowerSession, plan: str, output: Path, app_dir: Path = STATEFUL_APP) -> list[dict]:
    """Submit the stateful app with `plan` and return partition 0's replies."""
    run_id = session.submit({"plan": plan, "reply-timeout": 120.0, "output-dir": str(output)}, app_dir=app_dir)
    session.wait(run_id, timeout=600)
    return json.loads((output / "replies.json").read_text())["0"]


def one_node_session(workdir: Path, executor: str) -> FlowerSession:
    """A SuperLink and partition 0 of 1 (started on entering), with `executor`."""
    return FlowerSession(workdir, simulation=False, executor=executor, env=FAST_POLLING)


def start_node(session: FlowerSession) -> None:
    session.start_supernode(0, 1)
    wait_for(lambda: len(online_node_ids(session)) == 1, 90, "the SuperNode online")


def without_process_facts(replies: list[dict]) -> list[dict]:
    return [{key: value for key, value in reply.items() if key not in ("pid", "rss")} for reply in replies]


@pytest.mark.e2e
def test_state_and_error_replies_are_those_of_the_stock_executor(tmp_path):
    plan = "count,raise,count,count"
    results = {}
    for executor in ("stock", "warm"):
        with one_node_session(tmp_path / executor, executor) as session:
            start_node(session)
            results[executor] = run_plan(session, plan, tmp_path / executor / "output")
    # As with flwr-clientapp, the Context is pushed back after a ClientApp exception too: the
    # counter went on to 2 before the raise, and the run went on.
    expected = [
        {"action": "count", "count": 1, "version": 1},
        {"action": "raise", "error": "<class 'RuntimeError'>:<'raised on purpose at message 2'>"},
        {"action": "count", "count": 3, "version": 1},
        {"action": "count", "count": 4, "version": 1},
    ]
    assert without_process_facts(results["stock"]) == expected
    assert without_process_facts(results["warm"]) == expected
    # Stock: a new process per message. Warm: one process served them all.
    stock_pids = [reply["pid"] for reply in results["stock"] if "pid" in reply]
    warm_pids = {reply["pid"] for reply in results["warm"] if "pid" in reply}
    assert len(set(stock_pids)) == len(stock_pids) == 3 and len(warm_pids) == 1
    assert leftover_processes(tmp_path) == []


@pytest.mark.e2e
def test_a_crashed_worker_is_replaced_and_a_new_app_version_gets_a_fresh_worker(tmp_path):
    new_version = tmp_path / "stateful-v2"
    shutil.copytree(STATEFUL_APP, new_version)
    module = new_version / "stateful_app.py"
    module.write_text(module.read_text().replace("VERSION = 1", "VERSION = 2"))
    with one_node_session(tmp_path, "warm") as session:
        start_node(session)
        first = run_plan(session, "count,count,exit,count,count", tmp_path / "v1")
        second = run_plan(session, "count", tmp_path / "v2", app_dir=new_version)
        executor_log = tmp_path / "supernode-0.log"  # the executor runs in the SuperNode's process
        assert [task["status"] for task in task_records(executor_log.read_text())].count("worker died") == 1
        assert log_count(executor_log, "New app version") == 1
    # The crashed task gets Flower's own error reply; the counter lives in the SuperNode, so it
    # goes on in the new worker (the crashed task pushed no Context: 3 is not counted).
    assert without_process_facts(first) == [
        {"action": "count", "count": 1, "version": 1},
        {"action": "count", "count": 2, "version": 1},
        {"action": "exit", "error": CRASHED},
        {"action": "count", "count": 3, "version": 1},
        {"action": "count", "count": 4, "version": 1},
    ]
    before, after = {r["pid"] for r in first[:2]}, {r["pid"] for r in first[3:]}
    assert len(before) == len(after) == 1 and before != after
    # A new run of a changed app: the new code runs, in another process.
    assert without_process_facts(second) == [{"action": "count", "count": 1, "version": 2}]
    assert second[0]["pid"] not in after
    assert leftover_processes(tmp_path) == []


@pytest.mark.e2e
def test_a_supernode_killed_mid_task_takes_its_worker_with_it(tmp_path):
    with one_node_session(tmp_path, "warm") as session:
        start_node(session)
        session.submit({"plan": "sleep", "reply-timeout": 120.0, "output-dir": str(tmp_path / "output")}, app_dir=STATEFUL_APP)
        (supernode_process,) = [p for p in session.processes if p.args and "concatfl.deployment.supernode" in " ".join(p.args)]
        wait_for(lambda: psutil.Process(supernode_process.pid).children(), 60, "the executor's worker")
        (worker,) = psutil.Process(supernode_process.pid).children()
        wait_for(lambda: log_count(tmp_path / "supernode-0.log", "Receiving: train message"), 120, "the task")
        time.sleep(2)  # the worker has claimed it and sleeps in the ClientApp
        # The SuperNode alone, not its process tree: the worker would reply after 60 s to a
        # SuperNode that is gone and retry for ever; it sees its parent gone and exits.
        os.kill(supernode_process.pid, signal.SIGKILL)
        wait_for(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, 30, "the worker to exit")
    assert leftover_processes(tmp_path) == []
