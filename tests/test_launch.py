"""concatfl.launch without Flower: run-config errors before anything starts, the optional
timeout, and where a run's files go (the session is replaced by a stand-in; the e2e test in
test_e2e_foundation.py runs the real thing)."""

from __future__ import annotations

import json
import shutil
import time
import types
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk

from concatfl import PROJECT_DIR, launch
from concatfl.config import ConfigError
from concatfl.deployment.cli import STATUS_QUERY_TRIES, FlowerCli, stage_app
from concatfl.deployment.processes import SimulationError
from concatfl.deployment.session import FlowerSession
from concatfl.launch import main, parse_overrides


@pytest.fixture
def nothing_may_start(monkeypatch):
    """Fail the test if the launcher gets as far as starting a SuperLink."""

    def refuse(self):
        raise AssertionError("a SuperLink was started")

    monkeypatch.setattr(FlowerSession, "__enter__", refuse)


@pytest.mark.parametrize(
    ("run_config", "message"),
    [
        ("strategy='nope'", "run-config key 'strategy' is 'nope'; allowed values: fedavg,"),
        ("alpha=-1", "run-config key 'alpha' must be >= 0.0, got -1.0"),
        ("num-server-rounds=0", "run-config key 'num-server-rounds' must be >= 1, got 0"),
        ("lr=abc", "--run-config value of 'lr' is abc, which is not a number, true/false or a quoted string; "
                   "strings need quotes: lr='abc'"),
        ("no-such-key=1", "unknown run-config key 'no-such-key'"),
    ],
)
def test_bad_run_config_fails_at_once_with_one_message(run_config, message, tmp_path, capsys, nothing_may_start):
    started = time.perf_counter()
    code = main(["--run-config", run_config, "--workdir", str(tmp_path / "work")])
    elapsed = time.perf_counter() - started

    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"concatfl.launch: {message}")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert elapsed < 1.0
    assert not (tmp_path / "work").exists()


def test_run_simulation_refuses_a_bad_run_config_naming_the_key_before_anything_starts(tmp_path, nothing_may_start):
    with pytest.raises(ConfigError, match="fedcat-epsilon"):
        launch.run_simulation({"fedcat-epsilon": 1.5}, 2, workdir=tmp_path / "work")
    assert not (tmp_path / "work").exists()


def test_fewer_supernodes_than_the_server_waits_for_fail_at_once(capsys, nothing_may_start):
    assert main(["--num-supernodes", "1"]) == 2
    assert "--num-supernodes 1 is below run-config key 'min-available-nodes' (2)" in capsys.readouterr().err
    assert main(["--num-supernodes", "3", "--run-config", "min-available-nodes=4"]) == 2


def test_unquoted_string_error_names_the_key():
    with pytest.raises(ValueError, match=r"'strategy' is fedcat.*strategy='fedcat'"):
        parse_overrides("lr=0.1 strategy=fedcat")


class ClockedSession(FlowerSession):
    """A session whose run reports `running` for `polls` status checks, while a fake clock
    advances 1000 s per pause between checks."""

    def __init__(self, workdir: Path, polls: int, clock: list[float]) -> None:
        super().__init__(workdir, simulation=True)
        self.polls, self.checks, self.clock = polls, 0, clock

    def status(self, run_id: str) -> str:
        self.checks += 1
        return "running" if self.checks <= self.polls else "finished:completed"


@pytest.fixture
def fake_clock(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(launch.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(launch.time, "sleep", lambda seconds: clock.__setitem__(0, clock[0] + 1000.0))
    return clock


def test_wait_has_no_time_limit_by_default(tmp_path, fake_clock):
    session = ClockedSession(tmp_path, polls=10, clock=fake_clock)
    try:
        session.wait("1")  # 10,000 s of "running": far beyond any fixed limit
    finally:
        session.__exit__()
    assert session.checks == 11 and fake_clock[0] == 10_000.0


def test_wait_gives_up_after_the_timeout(tmp_path, fake_clock):
    session = ClockedSession(tmp_path, polls=10, clock=fake_clock)
    try:
        with pytest.raises(SimulationError, match="did not finish within 2500.0 s"):
            session.wait("1", timeout=2500.0)
    finally:
        session.__exit__()
    assert session.checks == 4  # at 0, 1000, 2000 and 3000 s


@pytest.mark.parametrize(("argv", "timeout"), [([], None), (["--timeout", "7200"], 7200.0)])
def test_command_line_passes_the_timeout(argv, timeout, monkeypatch, capsys):
    seen = {}

    def run_simulation(overrides, num_supernodes, **options):
        seen.update(options)
        return {"strategy": "fedavg", "rounds": [], "final_accuracy": 0.5, "run_config": {"output-dir": "out"}}

    monkeypatch.setattr(launch, "run_simulation", run_simulation)
    assert main(argv) == 0
    assert seen["timeout"] == timeout
    assert capsys.readouterr().out.startswith("finished in ")


class StandInSession:
    """Replaces FlowerSession: records its workdir, then completes (writing metrics.json where
    the run config says) or fails."""

    workdirs: list[Path] = []
    fail = False

    def __init__(self, workdir, simulation, env=None):
        self.workdir = Path(workdir)
        (self.workdir / "flwr-home").mkdir(parents=True)
        StandInSession.workdirs.append(self.workdir)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def submit(self, run_config, app_dir, federation_config):
        if StandInSession.fail:
            raise SimulationError("run 1 ended 'finished:failed'")
        output = Path(run_config["output-dir"])
        output.mkdir(parents=True)
        (output / "metrics.json").write_text(json.dumps({"run_config": run_config, "final_accuracy": 0.9}))
        return "1"

    def wait(self, run_id, stream, timeout):
        return None


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    StandInSession.workdirs, StandInSession.fail = [], False
    monkeypatch.setattr(launch, "FlowerSession", StandInSession)
    monkeypatch.setattr(launch.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.chdir(tmp_path)
    return StandInSession


def test_without_workdir_session_files_are_removed_and_outputs_go_to_output_dir(tmp_path, stand_in):
    metrics = launch.run_simulation({"num-server-rounds": 1}, 2)

    assert list((tmp_path / "tmp").iterdir()) == []  # no concatfl-run-* left behind
    assert stand_in.workdirs[0].name.startswith("concatfl-run-") and not stand_in.workdirs[0].exists()
    # pyproject's output-dir ('outputs'), made absolute against the current directory
    assert metrics["run_config"]["output-dir"] == str(tmp_path / "outputs")
    assert (tmp_path / "outputs" / "metrics.json").exists()


def test_without_workdir_an_explicit_output_dir_is_used(tmp_path, stand_in):
    metrics = launch.run_simulation({"output-dir": "results/run1"}, 2)
    assert metrics["run_config"]["output-dir"] == str(tmp_path / "results" / "run1")
    assert list((tmp_path / "tmp").iterdir()) == []


def test_without_workdir_a_failed_run_keeps_its_files_and_says_where(tmp_path, stand_in):
    stand_in.fail = True
    with pytest.raises(SimulationError) as caught:
        launch.run_simulation({}, 2)
    kept = stand_in.workdirs[0]
    assert kept.exists() and str(kept) in "".join(caught.value.__notes__)


def test_another_apps_run_config_keys_are_left_to_its_serverapp(tmp_path, stand_in):
    metrics = launch.run_simulation({"variant": "mine"}, 2, workdir=tmp_path / "work", app_dir=tmp_path)
    assert metrics["run_config"]["variant"] == "mine"


def test_with_workdir_everything_stays_there(tmp_path, stand_in):
    metrics = launch.run_simulation({}, 2, workdir=tmp_path / "work")
    assert metrics["run_config"]["output-dir"] == str(tmp_path / "work" / "output")
    assert (tmp_path / "work" / "flwr-home").is_dir()


# ----------------------------------------------------------------------------- waiting for a run


def _cli_answering(tmp_path, monkeypatch, answers: list[dict | str]) -> FlowerCli:
    """A FlowerCli whose SuperLink answers the status queries with `answers` in turn (a run's
    record, or the reason a query failed); `flwr log` prints "(empty run log)"."""
    cli = FlowerCli(tmp_path, "127.0.0.1:9093")
    replies = iter(answers)

    def listing(run_id):
        reply = next(replies)
        if isinstance(reply, str):
            raise SimulationError(f"querying run {run_id} failed: {reply}")
        return reply

    monkeypatch.setattr(cli, "_listing", listing)
    monkeypatch.setattr(cli, "flwr", lambda args, timeout=120: "(empty run log)")
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    return cli


def _listing(status: str, details: str = "") -> dict:
    return {"status": status, "status-details": details}


FAILED_QUERY = "Deadline Exceeded"


def test_waiting_for_a_run_outlasts_a_failed_status_query(tmp_path, monkeypatch):
    cli = _cli_answering(tmp_path, monkeypatch, [_listing("running"), FAILED_QUERY, _listing("finished:completed")])
    cli.wait("7")


def test_a_run_the_superlink_ended_fails_with_the_superlinks_reason(tmp_path, monkeypatch):
    expired = _listing("finished:failed", "No heartbeat received from the task")
    cli = _cli_answering(tmp_path, monkeypatch, [_listing("running"), expired, expired])
    with pytest.raises(SimulationError, match=r"ended 'finished:failed \(No heartbeat received from the task\)'"):
        cli.wait("7")


def test_waiting_for_a_run_gives_up_after_consecutive_failed_queries_and_says_why(tmp_path, monkeypatch):
    cli = _cli_answering(tmp_path, monkeypatch, [_listing("running")] + [FAILED_QUERY] * STATUS_QUERY_TRIES)
    with pytest.raises(SimulationError, match="querying run 7 failed: Deadline Exceeded"):
        cli.wait("7")


def test_a_stop_the_superlink_refuses_fails_with_its_reason(tmp_path, monkeypatch):
    # In this process (the Control API's answer) and through the CLI in another network
    # namespace, which exits 0 when the SuperLink refused.
    cli = FlowerCli(tmp_path, "127.0.0.1:9093")
    monkeypatch.setattr(cli, "_ask", lambda what, call: types.SimpleNamespace(success=False))
    with pytest.raises(SimulationError, match="stopping run 7 failed: the SuperLink refused"):
        cli.stop("7")
    netns = FlowerCli(tmp_path, "127.0.0.1:9093", cli_netns="host-b")
    answers = {"ok": '{"success": true}', "refused": '{"success": false, "error-message": "Run 7 not found"}'}
    monkeypatch.setattr(netns, "flwr", lambda args, timeout=120: answers[args[1]])
    netns.stop("ok")
    with pytest.raises(SimulationError, match="stopping run refused failed: Run 7 not found"):
        netns.stop("refused")


def test_the_staged_app_builds_the_fab_flower_builds_from_the_app_folder(tmp_path):
    # An app folder with what Flower's rules leave out: a .venv, a .gitignore'd folder, tests.
    app = tmp_path / "app"
    shutil.copytree(PROJECT_DIR / "tests/apps/stateful", app)
    (app / "pkg").mkdir()
    (app / "pkg/__init__.py").write_text("VALUE = 1\n")
    (app / "pkg/test_value.py").write_text("def test(): pass\n")
    for folder in (".venv/lib/python3.11/site-packages/dep", "outputs"):
        (app / folder).mkdir(parents=True)
        (app / folder / "module.py").write_text("x = 1\n")
    (app / ".gitignore").write_text("outputs/\n")

    staged = stage_app(app, tmp_path / "staged")

    assert build_fab_from_disk(staged) == build_fab_from_disk(app)
    assert (staged / "pkg/__init__.py").is_file() and not (staged / ".venv").exists()
    assert stage_app(app, tmp_path / "staged") == staged  # staged again over the last one

