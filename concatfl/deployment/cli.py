"""The `flwr` CLI pointed at one SuperLink (`FlowerCli`): submit a run, follow its log, wait for
it to end and require `finished:completed` (`flwr run` returns at once and exits 0 even when a
run later fails), register SuperNode keys; and the run log as a person wants to read it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import httpx
import tomli_w
from flwr.cli.build import build_fab_from_files
from flwr.proto.control_pb2 import ListNodesRequest, ListRunsRequest, StopRunRequest  # pylint: disable=no-name-in-module
from flwr.supercore.control.control_http_client import ControlHttpClient
from flwr.supercore.interceptors.http.runtime_version import RuntimeVersionHttpInterceptor
from flwr.supercore.logger import update_console_handler

from .. import PROJECT_DIR
from .commands import flower_env
from .processes import SimulationError, in_namespace, stop_process_tree

CONNECTION = "concatfl-sim"
# Consecutive failed status queries after which waiting for a run gives up (the SuperLink is gone).
STATUS_QUERY_TRIES = 5


class FlowerCli:
    """The `flwr` CLI pointed at one SuperLink, with its own FLWR_HOME under `workdir`.

    Status queries (a run's status, the node list), asked every second or two while waiting, go
    through Flower's Control API client in this process, the client the CLI itself uses: a CLI
    process per query cost ~1.5 s of CPU. In another network namespace (`cli_netns`) they go
    through the CLI there.

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
        self.control_address = address
        self.root_certificates = Path(root_certificates) if root_certificates else None
        tls = f'root-certificates = "{root_certificates}"' if root_certificates else "insecure = true"
        (self.flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "{address}"\n{tls}\n'
        )

    def register_supernode(self, public_key: str | os.PathLike) -> int:
        """Register a SuperNode's public key (SuperNode authentication); returns its node id."""
        registered = self.flwr_json(["supernode", "register", str(public_key), CONNECTION], f"registering {public_key}")
        return int(registered["node-id"])

    def supernodes(self) -> list[dict[str, Any]]:
        """The SuperLink's node list (as `flwr supernode ls` has it): a dict per node with its
        `node-id` and `status`."""
        if self.cli_netns is None:
            listing = self._ask("listing the SuperNodes", lambda client: client.ListNodes(ListNodesRequest()))
            return [{"node-id": node.node_id, "status": node.status} for node in listing.nodes_info]
        listing = self.flwr_json(["supernode", "ls", CONNECTION], "listing the SuperNodes",
                                 lambda answer: "nodes" in answer)
        return list(listing["nodes"])

    def _ask(self, what: str, call: Callable[[ControlHttpClient], Any]) -> Any:
        """One Control API request from this process (Flower's client, as the CLI makes it)."""
        client = ControlHttpClient.from_server_address(
            server_address=self.control_address,
            insecure=self.root_certificates is None,
            root_certificates=self.root_certificates.read_bytes() if self.root_certificates else None,
            interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr CLI")],
        )
        try:
            return call(client)
        except (httpx.HTTPError, ValueError) as error:  # refused, timed out, restarting
            raise SimulationError(f"{what} failed: {error}") from None
        finally:
            client.close()

    def flwr(self, args: list[str], timeout: float = 120) -> str:
        """Run the `flwr` CLI against this SuperLink; fail with its output on error."""
        done = subprocess.run(
            in_namespace(["flwr", *args], self.cli_netns), env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise SimulationError(f"`flwr {' '.join(args)}` failed:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def flwr_json(
        self,
        args: list[str],
        what: str,
        answered: Callable[[dict[str, Any]], Any] = lambda answer: answer.get("success"),
    ) -> dict[str, Any]:
        """`flwr <args> --format json`'s answer; SimulationError naming `what` with Flower's error
        message unless `answered(answer)` (the CLI exits 0 when the SuperLink refused or its
        request timed out)."""
        answer = json.loads(self.flwr([*args, "--format", "json"]))
        if not answered(answer):
            raise SimulationError(f"{what} failed: {answer.get('error-message', answer)}")
        return answer

    def submit(
        self, run_config: Mapping[str, Any], app_dir: str | os.PathLike = PROJECT_DIR, federation_config: str = ""
    ) -> str:
        """`flwr run` of the app (its FAB's files, `stage_app`) with these overrides (written to a
        TOML file); returns the run id."""
        config_file = self.workdir / "run-config.toml"
        config_file.write_text(tomli_w.dumps(dict(run_config)))
        app = stage_app(Path(app_dir), self.workdir / "app")
        args = ["run", str(app), CONNECTION, "--run-config", str(config_file)]
        if federation_config:
            args += ["--federation-config", federation_config]
        return str(self.flwr_json(args, "run submission")["run-id"])

    def status(self, run_id: str) -> str:
        """The SuperLink's status of a run, e.g. `running` or `finished:completed`."""
        return str(self._listing(run_id)["status"])

    def _listing(self, run_id: str) -> dict[str, Any]:
        """The SuperLink's record of a run: `status` (as the CLI shows it, e.g.
        `finished:completed`) and `status-details`."""
        if self.cli_netns is None:
            runs = self._ask(f"querying run {run_id}", lambda client: client.ListRuns(ListRunsRequest(run_id=int(run_id))))
            if int(run_id) not in runs.run_dict:
                raise SimulationError(f"querying run {run_id} failed: the SuperLink does not list it")
            status = runs.run_dict[int(run_id)].status
            return {"status": ":".join(filter(None, (status.status, status.sub_status))), "status-details": status.details}
        listing = self.flwr_json(["ls", CONNECTION, "--run-id", run_id], f"querying run {run_id}",
                                 lambda answer: answer.get("runs"))
        return dict(listing["runs"][0])

    def stop(self, run_id: str) -> None:
        """Stop a run (`flwr stop`): the SuperLink marks it finished and refuses its messages."""
        if self.cli_netns is not None:
            self.flwr_json(["stop", run_id, CONNECTION], f"stopping run {run_id}")
        else:
            stopped = self._ask(f"stopping run {run_id}", lambda client: client.StopRun(StopRunRequest(run_id=int(run_id))))
            if not stopped.success:
                raise SimulationError(f"stopping run {run_id} failed: the SuperLink refused")

    def run_log(self, run_id: str) -> str:
        """The run's log as the SuperLink keeps it (`flwr log`)."""
        return self.flwr(["log", run_id, CONNECTION], timeout=60)

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
                stderr=subprocess.STDOUT,  # the CLI's own lines go through the same filter
                start_new_session=True,
            )
            if stream
            else None
        )
        printer = _print_log_in_background(follower.stdout) if follower is not None else None
        deadline = None if timeout is None else time.monotonic() + timeout
        # A status query costs milliseconds here, a CLI process (~1.5 s of CPU) in another namespace.
        pause, longest_pause = (0.5, 1.0) if self.cli_netns is None else (1.0, 5.0)
        failed_queries = 0
        try:
            while True:
                try:
                    status = self.status(run_id)
                    failed_queries = 0
                except SimulationError:  # a loaded SuperLink may miss one query; it must not end the wait
                    failed_queries += 1
                    if failed_queries >= STATUS_QUERY_TRIES:
                        raise
                    status = "unknown"
                if status.startswith("finished"):
                    break
                if deadline is not None and time.monotonic() > deadline:
                    raise SimulationError(f"run {run_id} did not finish within {timeout} s")
                time.sleep(pause)
                pause = min(pause * 1.5, longest_pause)
            if follower is not None:
                follower.wait(timeout=30)
        finally:
            if follower is not None:
                stop_process_tree(follower)
            if printer is not None:
                printer.join(timeout=10)
        if status != "finished:completed":
            # The SuperLink's reason, e.g. "No heartbeat received from the task": a run it ended
            # has nothing about it in the run's own log.
            with contextlib.suppress(SimulationError):
                status += f" ({self._listing(run_id).get('status-details', '')})"
            if stream:  # the log, with the error, was just printed
                raise SimulationError(f"run {run_id} ended {status!r}; the error is in its log above")
            log_text = self.run_log(run_id)
            raise SimulationError(f"run {run_id} ended {status!r}; log tail:\n{log_text[-4000:]}")


def stage_app(app_dir: Path, into: Path) -> Path:
    """The files of `app_dir` that Flower puts in its FAB, copied to `into` (replaced), for `flwr
    run`: the FAB built from there is the one `flwr run app_dir` builds, byte for byte.

    `flwr run` lists every file under the app's folder before its rules leave most out, the
    ~47,000 files of a `.venv` there included (Flower's own rule drops `.venv/**`): 5 s of CPU
    for each run submitted. This walk skips the `.venv` and leaves every rule to Flower.
    """
    app_dir = app_dir.resolve()
    files: dict[str, bytes | Path] = {}
    for folder, subfolders, names in os.walk(app_dir):
        here = Path(folder)
        if here == app_dir and ".venv" in subfolders:
            subfolders.remove(".venv")
        for name in names:
            if not (here / name).is_symlink():  # as Flower's `collect_files`
                files[(here / name).relative_to(app_dir).as_posix()] = here / name
    fab, _ = build_fab_from_files(files)
    shutil.rmtree(into, ignore_errors=True)
    with zipfile.ZipFile(io.BytesIO(fab)) as archive:
        archive.extractall(into, members=[name for name in archive.namelist() if not name.startswith(".info/")])
    return into


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
ANSI_CODE = re.compile(r"\x1b\[[\d;]*m")
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


def colors_wanted(stream: IO[str]) -> bool:
    """Colour codes only for a terminal, and not where NO_COLOR is set (no-color.org)."""
    return stream.isatty() and not os.environ.get("NO_COLOR")


def plain(line: str) -> str:
    """`line` without ANSI colour codes (Flower colours its level names even in a file)."""
    return ANSI_CODE.sub("", line)


def plain_flower_logs() -> None:
    """Turn off the colours of this process's Flower log lines when they do not go to a terminal."""
    if not colors_wanted(sys.stderr):
        update_console_handler(colored=False)


def _print_log_in_background(stream: IO[bytes] | None) -> threading.Thread:
    """Copy a streamed run log to stdout, without `NOISE`, as it arrives (without colour codes
    when stdout is not a terminal)."""
    colored = colors_wanted(sys.stdout)

    def copy() -> None:
        assert stream is not None
        with stream:
            for line in readable_log(io.TextIOWrapper(stream, errors="replace")):
                sys.stdout.write(line if colored else plain(line))
                sys.stdout.flush()

    printer = threading.Thread(target=copy, daemon=True)
    printer.start()
    return printer
