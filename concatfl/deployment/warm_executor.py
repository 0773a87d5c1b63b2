"""A warm ClientApp executor: one long-lived process per SuperNode runs all its ClientApp tasks.

Flower 1.42 starts a new `flwr-clientapp` process for every message a SuperNode receives: each
pays interpreter start, imports (torch, flwr, the app), data loading and a cold first step,
seconds per message. This executor takes the SuperExec's place. concatfl's SuperNode launcher
runs it in the SuperNode's own process (`python -m concatfl.deployment.supernode --warm-executor
...`: the loop wakes it for every message it stores, so it never polls while idle); beside any
SuperNode started with `--isolation process` it runs as a process of its own, polling every
`--poll-interval` seconds:

    flower-supernode --isolation process --port 9094 --superlink ... --node-config ...
    python -m concatfl.deployment.warm_executor --runtime-api-address 127.0.0.1:9094 --insecure

A light supervisor claims the SuperNode's ClientApp tasks through the Runtime API
(`AcquireTask`, exactly as `flower-superexec` does) and hands each task's token to one worker
process, which runs the task in-process with Flower's own steps (`pull_task_input`'s calls,
`ClientApp.__call__`, `push_message`, `push_task_output`). The worker keeps the app's modules,
and with them what the app caches per process (concatfl: dataset and partitions), from one
message to the next.

Flower's guarantees, kept:
- an exception in the ClientApp becomes an error reply (`CLIENT_APP_RAISED_EXCEPTION`, the same
  reason text as `flwr-clientapp`) and the worker goes on with the next task;
- the task's Context, `context.state` included, is pushed back after every task as
  `flwr-clientapp` pushes it; the SuperNode stores it and hands it to the next task;
- a worker that dies is restarted by the supervisor (with the last app already imported); the
  task it was running gets Flower's own "ClientApp stopped responding" error reply once its
  heartbeat expires, and later tasks run in the new worker;
- a task of another app version (a different FAB hash) gets a fresh worker: Python caches the
  imported modules, so a worker never runs two FABs;
- a worker whose supervisor's process ended (its SuperNode killed) exits (`exit_with_parent`);
- on a Flower whose ClientApp steps changed shape (`concatfl.deployment.compat`), the executor
  runs Flower's own `flower-superexec` instead, with a warning.

Only the standard library and `flwr` are imported at module level: the worker runs this file as
a script (`python -P`), so the ClientApp's own modules (concatfl's included) are imported from
the installed FAB, exactly as in `flwr-clientapp`. Flower's runtime dependency installation
(`--allow-runtime-dependency-installation`) is not offered: the app's dependencies must be
installed in the executor's environment.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import IO, TYPE_CHECKING


if TYPE_CHECKING:
    from flwr.app import Context, Message
    from flwr.supercore.fab import Fab
    from flwr.supercore.run import Run
    from flwr.supercore.runtime import RuntimeHttpClient

# Object-pull backoff while the sender is still uploading a message's objects (a message is listed
# before its objects arrive): retry after 0.05 s, doubling up to 0.1 s. Flower's default
# (supercore/constant.py) starts at 1 s and doubles up to 10 s, tuned for a new process per
# message; a warm worker, concatfl's SuperNode launcher and ServerApp ask right away. Tries are
# not counted, so a pull is bounded by its total time instead of 500 short tries: Flower's
# PULL_MAX_TIME (2 h), in the worker OBJECTS_WAIT_SECONDS.
SHORT_PULL_BACKOFF = {"initial_backoff": 0.05, "backoff_cap": 0.1, "max_tries_per_object": None}
# How long a task's message may take to appear after the task was claimed.
MESSAGE_WAIT_SECONDS = 30.0
# How long a listed message's objects may take to arrive. Flower 1.42's SuperNode creates the task
# and lists the message before pulling its objects from the SuperLink, and when the SuperLink
# answers that the run is no longer running (a run that ended, or one the SuperLink lost in a
# restart) it drops the pull but leaves task and message behind: without a bound the worker
# would wait Flower's PULL_MAX_TIME (2 h) for objects that never come, and every later task of
# the node (a new run's included) would wait behind it. concatfl's SuperNode launcher drops such a
# message and fails its task at once (`supernode.MessageStep`); this bound is for an executor beside
# Flower's own SuperNode. A SuperNode holds a whole message before any of its objects become
# available, so this bounds the download of one message (LeNet-5's 2.3 MB, a ResNet's tens of MB).
OBJECTS_WAIT_SECONDS = 60.0
# Default seconds between two `AcquireTask` calls when idle (stock SuperExec: 1 s).
DEFAULT_POLL_INTERVAL = 0.1
# A worker that dies within this many seconds of its start is restarted only after this pause,
# so that an app which kills its process at import does not turn into a busy restart loop.
RESTART_PAUSE = 2.0


# Every finished task is logged as this prefix and one JSON object (task id, status, claimed_at
# (Unix time), seconds from claim to report, steps, worker_pid, worker_rss_mib): see `task_records`.
TASK_LOG_PREFIX = "task record"


@dataclass(frozen=True)
class RuntimeConnection:
    """How to reach a SuperNode's Runtime API (the SuperExec's flags)."""

    address: str
    insecure: bool
    root_certificates_path: str | None = None
    superexec_auth_secret: bytes | None = None

    def client(self, component: str, token: str | None = None) -> RuntimeHttpClient:
        """A Runtime API client; with `token`, acting as that task's ClientApp."""
        # pylint: disable=import-outside-toplevel
        from flwr.supercore.interceptors import (
            RuntimeTokenHttpInterceptor,
            RuntimeVersionHttpInterceptor,
            SuperExecAuthHttpInterceptor,
        )
        from flwr.supercore.retry import make_simple_http_retry_invoker
        from flwr.supercore.runtime import RuntimeHttpClient
        from flwr.supercore.runtime.tracing import RuntimeTracingInterceptor
        from flwr.supercore.tls import validate_and_resolve_root_certificates

        interceptors = [RuntimeTracingInterceptor(), RuntimeVersionHttpInterceptor(component_name=component)]
        if token is not None:
            interceptors.append(RuntimeTokenHttpInterceptor(token))
        elif self.superexec_auth_secret:
            interceptors.append(
                SuperExecAuthHttpInterceptor(
                    master_secret=self.superexec_auth_secret,
                    protected_methods=frozenset({"/flwr.proto.Runtime/AcquireTask"}),
                )
            )
        return RuntimeHttpClient.from_server_address(
            server_address=self.address,
            insecure=self.insecure,
            root_certificates=validate_and_resolve_root_certificates(self.root_certificates_path, self.insecure),
            interceptors=interceptors,
            retry_invoker=make_simple_http_retry_invoker(),
        )

    def arguments(self) -> list[str]:
        """Command-line flags that recreate this connection (except the auth secret)."""
        flags = ["--runtime-api-address", self.address]
        if self.insecure:
            flags.append("--insecure")
        elif self.root_certificates_path is not None:
            flags += ["--root-certificates", self.root_certificates_path]
        return flags


@dataclass(frozen=True)
class AppRef:
    """The app a task ran: FAB id, version and hash (what a restarted worker preloads)."""

    fab_id: str
    fab_version: str
    fab_hash: str


@dataclass
class TaskReport:
    """What a worker tells the supervisor after a task.

    `status` is Flower's sub-status (completed/failed); `app` the app the task ran (None when
    its input could not be pulled); `steps` the seconds each step took (connect: Runtime API
    client and heartbeat; pull: task input and message; load: FAB install and ClientApp import;
    app: the ClientApp call; push: reply message and task output).
    """

    status: str
    app: AppRef | None
    steps: dict[str, float]

    def to_json(self) -> str:
        """One JSON line."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, line: str) -> TaskReport:
        """Inverse of `to_json`."""
        fields = json.loads(line)
        return cls(fields["status"], AppRef(**fields["app"]) if fields["app"] else None, fields["steps"])


# --------------------------------------------------------------------------------------------
# Worker: runs tasks in-process


class TaskRunner:
    """Runs ClientApp tasks one after the other in this process, keeping the app loaded."""

    def __init__(self, connection: RuntimeConnection) -> None:
        self.connection = connection
        self.installed_fab_hashes: set[str] = set()

    def preload(self, app: AppRef) -> None:
        """Import an already installed app (after a restart) so its first task starts warm."""
        # pylint: disable=import-outside-toplevel
        from flwr.clientapp.utils import get_load_client_app_fn

        try:
            get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)(
                app.fab_id, app.fab_version, app.fab_hash
            )
        except Exception as error:  # pylint: disable=broad-exception-caught
            # The task that needs the app loads it again and replies with the error.
            log(WARNING, "preloading ClientApp %s %s failed: %s", app.fab_id, app.fab_version, error)

    def run(self, token: str) -> TaskReport:
        """Run one task (`flwr-clientapp --token`'s steps, in this process)."""
        # pylint: disable=import-outside-toplevel,too-many-locals
        from flwr.app import Message
        from flwr.app.error import Error
        from flwr.cli.install import install_from_fab
        from flwr.clientapp.client_app import LoadClientAppError
        from flwr.clientapp.utils import get_load_client_app_fn
        from flwr.common.constant import ErrorCode, SubStatus
        from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
        from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

        clock = StepClock()
        client = self.connection.client("flwr-clientapp", token)
        heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
        message = context = reply = app = None
        sub_status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        try:
            heartbeat.start()
            clock.lap("connect")
            message, context, run, fab = pull_task_input(client)
            app = AppRef(run.fab_id, run.fab_version, fab.hash_str)
            clock.lap("pull")
            if fab.hash_str not in self.installed_fab_hashes:
                install_from_fab(fab.content, skip_prompt=True)
                self.installed_fab_hashes.add(fab.hash_str)
            load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
            client_app = load(run.fab_id, run.fab_version, fab.hash_str)
            clock.lap("load")
            reply = client_app(message=message, context=context)
            sub_status, details = SubStatus.COMPLETED, ""
        except Exception as error:  # pylint: disable=broad-exception-caught
            # As flwr-clientapp: the reason names the exception's type and text.
            code, reason = ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(error)}:<'{error}'>"
            if isinstance(error, LoadClientAppError):
                code, reason = ErrorCode.LOAD_CLIENT_APP_EXCEPTION, "An exception was raised when attempting to load `ClientApp`"
            log(ERROR, "ClientApp raised an exception", exc_info=error)
            details = reason
            if message is not None:
                reply = Message(Error(code=code, reason=reason), reply_to=message)
        finally:
            clock.lap("app")
            if reply is not None and context is not None:
                try:
                    push_message(client, reply, context)
                except Exception as error:  # pylint: disable=broad-exception-caught
                    log(ERROR, "Failed to push reply message", exc_info=error)
            # Stopped before the task is finished: a heartbeat for a finished task is refused,
            # and Flower's sender answers a refusal with SIGINT to its process.
            if heartbeat.is_running:
                heartbeat.stop()
            push_task_output(client=client, context=context, sub_status=sub_status, details=details)
            client.close()
            clock.lap("push")
        return TaskReport(str(sub_status), app, clock.steps)


class StepClock:
    """Seconds spent in consecutive named steps."""

    def __init__(self) -> None:
        self.steps: dict[str, float] = {}
        self.last = time.perf_counter()

    def lap(self, step: str) -> None:
        """Close `step` (it lasted since the previous lap)."""
        now = time.perf_counter()
        self.steps[step] = round(now - self.last, 4)
        self.last = now


def pull_task_input(client: RuntimeHttpClient) -> tuple[Message, Context, Run, Fab]:
    """Flower's `run_clientapp.pull_task_input` with a short object-pull backoff.

    Same calls in the same order (PullTaskInput, PullMessages, object pulls, confirmation); a
    warm worker may ask before the SuperNode has stored the message and its objects, so it waits
    for the message and retries object pulls with SHORT_PULL_BACKOFF instead of Flower's 1 s
    (up to 10 s), for at most OBJECTS_WAIT_SECONDS.
    """
    # pylint: disable=import-outside-toplevel
    from flwr.app import Message
    from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node  # pylint: disable=no-name-in-module
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest  # pylint: disable=no-name-in-module
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf,
        make_pull_object_fn_protobuf,
    )
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
    from flwr.supercore.task_identity import TaskIdentity

    task_input = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id = task_input.task_id
    TaskIdentity.run_id = task_input.run.run_id
    TaskIdentity.node_id = task_input.context.node_id
    context = context_from_proto(task_input.context)
    run = run_from_proto(task_input.run)
    fab = fab_from_proto(task_input.fab)

    deadline = time.monotonic() + MESSAGE_WAIT_SECONDS
    while not (pulled := client.PullMessages(PullAppMessagesRequest())).messages_list:
        if time.monotonic() > deadline:
            raise RuntimeError(f"No messages received from Runtime API within {MESSAGE_WAIT_SECONDS:.0f} s")
        time.sleep(SHORT_PULL_BACKOFF["initial_backoff"])
    node = Node(node_id=context.node_id)
    object_tree = pulled.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        object_tree,
        make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message,
        max_time=OBJECTS_WAIT_SECONDS,
        **SHORT_PULL_BACKOFF,
    )
    # The deflated message does not carry its own id (its object id): set it as Flower does.
    message.metadata.__dict__["_message_id"] = object_tree.object_id
    return message, context, run, fab


def worker_main(connection: RuntimeConnection, reply_fd: int, preload: str | None) -> None:
    """Worker loop: a task token per stdin line; its TaskReport as a JSON line on `reply_fd`."""
    runner = TaskRunner(connection)
    if preload:
        runner.preload(AppRef(**json.loads(preload)))
    with os.fdopen(reply_fd, "w", buffering=1) as replies:
        for line in sys.stdin:
            if token := line.strip():
                replies.write(runner.run(token).to_json() + "\n")
                # The task's objects (message, reply, models) are garbage now; a full collection
                # takes 0.2-0.5 s with torch loaded, so it runs after the task was reported.
                gc.collect()


# --------------------------------------------------------------------------------------------
# Supervisor: claims tasks, keeps one worker per app version


class Worker:
    """A worker process (this file run as a script) and the pipes to talk to it.

    `fab_hash` is the app version the worker has run or preloaded (None: none yet).
    """

    def __init__(self, connection: RuntimeConnection, preload: AppRef | None) -> None:
        self.fab_hash = preload.fab_hash if preload else None
        self.started = time.monotonic()
        read_end, write_end = os.pipe()
        command = [sys.executable, "-P", str(Path(__file__).resolve()), "--worker", "--reply-fd", str(write_end)]
        command += connection.arguments() + ["--parent-pid", str(os.getpid())]
        if preload is not None:
            command += ["--preload", json.dumps(dataclasses.asdict(preload))]
        self.process = subprocess.Popen(  # pylint: disable=consider-using-with
            command, stdin=subprocess.PIPE, pass_fds=(write_end,), text=True
        )
        os.close(write_end)  # the worker holds the only write end: EOF here means it is gone
        self.replies: IO[str] = os.fdopen(read_end, "r")

    def run(self, token: str, fab_hash: str) -> TaskReport | None:
        """Hand the worker a task; its report, or None when the worker died meanwhile."""
        self.fab_hash = fab_hash
        try:
            assert self.process.stdin is not None
            self.process.stdin.write(token + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            return None
        line = self.replies.readline()
        return TaskReport.from_json(line) if line else None

    def rss(self) -> int:
        """The worker's resident memory in bytes (0 once it is gone)."""
        import psutil  # pylint: disable=import-outside-toplevel

        try:
            return int(psutil.Process(self.process.pid).memory_info().rss)
        except psutil.NoSuchProcess:
            return 0

    def alive(self) -> bool:
        """Whether the worker process still runs."""
        return self.process.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        """End the worker: closing its stdin ends its loop; terminate it if it has not ended
        within `grace` seconds, kill it if it has not within as many again."""
        with contextlib.suppress(BrokenPipeError):
            if self.process.stdin is not None:
                self.process.stdin.close()
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.replies.close()


class Supervisor:
    """Claims ClientApp tasks and runs each in a live worker of the task's app version.

    Parameters
    ----------
    connection : RuntimeConnection
        The SuperNode's Runtime API.
    poll_interval : float
        Seconds between two `AcquireTask` calls while no task is pending.
    wake : threading.Event | None (default: None)
        Set by the SuperNode when it has stored a message (concatfl's SuperNode launcher, which
        runs this supervisor in its own process): the supervisor claims the task at once, and
        polls only every `poll_interval` seconds while it is not set. None: poll.
    """

    def __init__(self, connection: RuntimeConnection, poll_interval: float, wake: threading.Event | None = None) -> None:
        self.connection = connection
        self.poll_interval = poll_interval
        self.wake = wake or threading.Event()
        self.worker: Worker | None = None
        self.last_app: AppRef | None = None

    def serve(self) -> None:
        """Claim and run tasks until stopped (SIGTERM/SIGINT)."""
        # pylint: disable=import-outside-toplevel
        from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=no-name-in-module
        from flwr.supercore.constant import TaskType

        client = self.connection.client("SuperExec")
        request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
        self.worker = Worker(self.connection, None)  # imports flwr while no task waits
        try:
            while True:
                claimed = client.AcquireTask(request)
                if claimed.HasField("task") and claimed.token:
                    self.dispatch(claimed.token, claimed.task.fab_hash, claimed.task.task_id)
                else:
                    # Cleared after waking and before the next claim: a wake that comes later is kept.
                    self.wake.wait(self.poll_interval)
                    self.wake.clear()
        finally:
            client.close()
            self.worker.stop()

    def stop(self, grace: float = 2.0) -> None:
        """End the worker (within `grace` seconds, then by force): its SuperNode is exiting."""
        if self.worker is not None:
            self.worker.stop(grace)

    def dispatch(self, token: str, fab_hash: str, task_id: int) -> None:
        """Run one claimed task in a fitting, live worker; replace the worker if it dies."""
        assert self.worker is not None
        if not self.worker.alive():
            log(ERROR, "The ClientApp worker exited (code %s); starting a new one", self.worker.process.returncode)
            self.restart(self.last_app)
        elif self.worker.fab_hash not in (None, fab_hash):
            log(INFO, "New app version (FAB %s): starting a fresh ClientApp worker", fab_hash[:12])
            self.restart(None)
        assert self.worker is not None
        claimed_at, started = time.time(), time.perf_counter()
        report = self.worker.run(token, fab_hash)
        record = {
            "task": task_id,
            "status": report.status if report else "worker died",
            "claimed_at": round(claimed_at, 3),
            "seconds": round(time.perf_counter() - started, 4),
            "steps": report.steps if report else {},
            "worker_pid": self.worker.process.pid,
            "worker_rss_mib": round(self.worker.rss() / 2**20, 1),
        }
        log(INFO, "%s %s", TASK_LOG_PREFIX, json.dumps(record))
        if report is None:
            log(ERROR, "The ClientApp worker died running task %d; starting a new one", task_id)
            self.restart(self.last_app)
        elif report.app is not None:
            self.last_app = report.app

    def restart(self, preload: AppRef | None) -> None:
        """Replace the worker by a new one (importing `preload`'s app before its first task)."""
        assert self.worker is not None
        if time.monotonic() - self.worker.started < RESTART_PAUSE:
            time.sleep(RESTART_PAUSE)
        self.worker.stop()
        self.worker = Worker(self.connection, preload)


def task_records(log_text: str) -> list[dict]:
    """The task records (one dict per finished or lost task) in an executor's log."""
    marker = f"[warm-executor] {TASK_LOG_PREFIX} "
    return [json.loads(line.split(marker, 1)[1]) for line in log_text.splitlines() if marker in line]


def log(level: int, message: str, *args: object, **kwargs: object) -> None:
    """Log through Flower's logger (same format as the SuperNode's)."""
    from flwr.supercore import log as flower_log  # pylint: disable=import-outside-toplevel

    flower_log(level, "[warm-executor] " + message, *args, **kwargs)


def stock_superexec_command(args: argparse.Namespace) -> list[str]:
    """`flower-superexec` with this executor's connection flags (what Flower runs without it)."""
    command = ["flower-superexec", "--runtime-api-address", args.runtime_api_address]
    command += ["--insecure"] if args.insecure else ["--root-certificates", args.root_certificates]
    if args.superexec_auth_secret_file:
        command += ["--superexec-auth-secret-file", args.superexec_auth_secret_file]
    if args.parent_pid is not None:
        command += ["--parent-pid", str(args.parent_pid)]
    return command


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The SuperExec's flags, plus the idle poll interval (and the worker's private flags)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--runtime-api-address", required=True, help="the SuperNode's Runtime API, host:port")
    parser.add_argument("--insecure", action="store_true", help="talk to the Runtime API without TLS")
    parser.add_argument("--root-certificates", default=None, help="CA certificate of a TLS Runtime API")
    parser.add_argument("--superexec-auth-secret-file", default=None, help="as flower-superexec's")
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=DEFAULT_POLL_INTERVAL,
        help=f"seconds between task polls when idle (default {DEFAULT_POLL_INTERVAL}; 0.01-60)",
    )
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process exits")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reply-fd", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--preload", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.insecure and args.root_certificates is None:
        parser.error("--root-certificates is required unless --insecure is given")
    if not 0.01 <= args.poll_interval <= 60:
        parser.error(f"--poll-interval must be between 0.01 and 60 seconds, got {args.poll_interval}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Command line: the supervisor (default) or, with --worker, one worker.

    The supervisor first checks that the installed Flower still has the task steps a worker runs
    (`concatfl.deployment.compat`); where it does not, it becomes Flower's own `flower-superexec`
    with the same connection (one process per task, Flower's behaviour), with a warning.
    """
    args = parse_args(argv)
    # The parent monitor stops this process with SIGINT, but a process started in the background
    # by a shell (`… &`, nohup) inherits SIGINT ignored: the executors of SuperNodes that had
    # exited then kept retrying their connection for ever. Take SIGINT back (an exec into
    # flower-superexec starts it with the default disposition too).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # SIGUSR1 writes every thread's Python stack to stderr: where a process that should have
    # ended is waiting (`kill -USR1 PID`).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if not args.worker:
        from concatfl.deployment.compat import clientapp_steps_problem  # pylint: disable=import-outside-toplevel

        if (problem := clientapp_steps_problem()) is not None:
            log(WARNING, "this Flower's ClientApp steps differ from those the warm executor runs (%s); "
                "running Flower's own flower-superexec instead", problem)
            os.execvp("flower-superexec", stock_superexec_command(args))
    from flwr.supercore.auth.superexec_secret import load_superexec_auth_secret  # pylint: disable=import-outside-toplevel

    connection = RuntimeConnection(
        args.runtime_api_address,
        args.insecure,
        args.root_certificates,
        load_superexec_auth_secret(args.superexec_auth_secret_file),
    )
    if args.worker:
        if args.parent_pid is not None:
            threading.Thread(target=exit_with_parent, args=(args.parent_pid,), daemon=True).start()
        worker_main(connection, args.reply_fd, args.preload)
        return 0
    supervisor = Supervisor(connection, args.poll_interval)
    if args.parent_pid is not None:
        threading.Thread(target=stop_with_parent, args=(args.parent_pid, supervisor), daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # run `finally`: stop the worker
    try:
        supervisor.serve()
    except KeyboardInterrupt:
        pass
    return 0


def exit_with_parent(parent_pid: int, interval: float = 0.2, grace: float = 2.0) -> None:
    """End this process (a worker) once its parent `parent_pid` (its supervisor: the warm
    executor, or the SuperNode that runs one) has ended: SIGINT, and after `grace` seconds an
    immediate exit. A task cut short by the SIGINT would otherwise try to push its reply to the
    gone SuperNode, retrying for minutes in its `finally`.

    A process whose parent ends is given another parent at once, so the check is one
    `getppid()` per `interval`, and a parent that has ended but was not yet reaped (a zombie,
    which still "exists" for `kill(pid, 0)`, Flower's own check) counts as ended.
    """
    while os.getppid() == parent_pid:
        time.sleep(interval)
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # see `stop_with_parent`
    time.sleep(grace)
    os._exit(128 + signal.SIGINT)


def stop_with_parent(parent_pid: int, supervisor: Supervisor, grace: float | None = 5.0) -> None:
    """Once the SuperNode `parent_pid` is gone: SIGINT to this process, kill the worker, and
    after `grace` seconds an immediate exit (None: no exit, for a caller that is not the process
    to end).

    Flower's parent monitor only raises SIGINT; its handler runs in the main thread, which may be
    blocked reading the reply of a task whose worker keeps retrying to push to the dead SuperNode
    (the soak found such pairs still running minutes later). Killing the worker ends that read.
    A KeyboardInterrupt raised while the main thread is inside an import's lock callback is
    swallowed by Python ("Exception ignored in ... _get_module_lock"), and the process then
    retried its connection for ever: hence the exit after `grace`.
    """
    import psutil  # pylint: disable=import-outside-toplevel

    def parent_alive() -> bool:
        try:
            return psutil.Process(parent_pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    while parent_alive():
        time.sleep(0.2)
    # To the main thread itself: raised in this thread, the SIGINT waits until the main thread
    # next runs Python code, and one waiting out Flower's retry back-off (an Event.wait of up to a
    # minute) went on retrying its connection that long after its SuperNode was gone.
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    if supervisor.worker is not None:
        with contextlib.suppress(ProcessLookupError):
            supervisor.worker.process.kill()
    if grace is None:
        return
    time.sleep(grace)
    if supervisor.worker is not None:  # one started since
        with contextlib.suppress(ProcessLookupError):
            supervisor.worker.process.kill()
    os._exit(128 + signal.SIGINT)


if __name__ == "__main__":
    sys.exit(main())
