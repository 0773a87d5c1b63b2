"""Checkpoint and resume: the checkpoint file, and runs stopped after a round and resumed.

The resume tests run concatfl's real ServerApp `main` in-process against a FakeGrid whose nodes
are concatfl's real ClientApp (real Messages and Contexts, digits). Each "run" gives the nodes
new Flower node ids and fresh client state, as a new simulation does; the stopped-and-resumed
run must end with exactly the model of the uninterrupted one (in one process on one thread the
client side is deterministic, so the comparison is exact).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

from concatfl.checkpoint import (
    CHECKPOINT_FILE,
    Checkpoint,
    check_resumable,
    load_checkpoint,
    save_checkpoint,
)
from concatfl.client_app import app as client_app
from concatfl.metrics import read_metrics
from concatfl import server_app
from concatfl.server_app import main as server_main

from .e2e import run_in_process, run_simulation
from .fakes import BIG_IDS, FakeGrid

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
with PYPROJECT.open("rb") as _handle:
    DEFAULTS = tomllib.load(_handle)["tool"]["flwr"]["app"]["config"]
NUM_NODES = 6


# ---------------------------------------------------------------------------- checkpoint file
def _checkpoint(server_round: int = 3) -> Checkpoint:
    return Checkpoint(
        server_round=server_round,
        arrays={"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "n": torch.tensor(4)},
        strategy_state={"rng": {"state": 7}, "history": [{"round": 1}], "copies": [np.ones(3)]},
        initial={"accuracy": 0.1, "loss": 2.3},
        torch_rng=torch.get_rng_state(),
        run_config={"strategy": "fedcat", "num-server-rounds": 3},
        wall_seconds=12.5,
    )


def test_checkpoint_round_trip_is_exact_and_leaves_no_temporary_file(tmp_path):
    saved = _checkpoint()
    path = save_checkpoint(tmp_path / "out", saved)
    assert path == tmp_path / "out" / CHECKPOINT_FILE
    assert [p.name for p in (tmp_path / "out").iterdir()] == [CHECKPOINT_FILE]
    loaded = load_checkpoint(tmp_path / "out")
    assert loaded.server_round == 3 and loaded.wall_seconds == 12.5 and loaded.initial == saved.initial
    assert torch.equal(loaded.arrays["w"], saved.arrays["w"]) and loaded.arrays["n"].dtype == torch.int64
    assert np.array_equal(loaded.strategy_state["copies"][0], np.ones(3))
    assert torch.equal(loaded.torch_rng, saved.torch_rng)


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path, _checkpoint(server_round=2))
    broken = _checkpoint(server_round=3)
    broken.strategy_state["unpicklable"] = lambda: None
    with pytest.raises(Exception):
        save_checkpoint(tmp_path, broken)
    assert load_checkpoint(tmp_path).server_round == 2
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_FILE]


def test_resume_without_a_checkpoint_names_the_path_and_the_keys(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"resume=true.*checkpoint.*'output-dir'"):
        load_checkpoint(tmp_path)


def test_resume_allows_more_rounds_but_not_another_algorithm():
    saved = {"strategy": "fedcat", "seed": 0, "num-server-rounds": 4, "resume": False}
    check_resumable(saved, {**saved, "num-server-rounds": 8, "resume": True})
    with pytest.raises(ValueError, match=r"'seed' 0 -> 1.*'strategy' 'fedcat' -> 'fedavg'"):
        check_resumable(saved, {**saved, "strategy": "fedavg", "seed": 1})


# ---------------------------------------------------------------------------- resume through the ServerApp
class Stopped(Exception):
    """The ServerApp 'died' right after writing a checkpoint."""


def _serve(run_config: dict, output: Path, first_id: int) -> None:
    """concatfl's ServerApp against NUM_NODES nodes running concatfl's ClientApp on partitions
    0..N-1, under Flower ids that differ per run (like a new simulation), with fresh client state."""
    config = {**DEFAULTS, **run_config, "output-dir": str(output), "device": "cpu", "min-available-nodes": NUM_NODES}

    def node(partition: int):
        context = Context(
            run_id=1,
            node_id=BIG_IDS[first_id + partition],
            node_config={"partition-id": partition, "num-partitions": NUM_NODES},
            state=RecordDict(),
            run_config=config,
        )
        return lambda message: client_app(message, context)

    grid = FakeGrid({BIG_IDS[first_id + partition]: node(partition) for partition in range(NUM_NODES)})
    server_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config))


def _stop_after(monkeypatch, server_round: int) -> None:
    """Make the ServerApp stop (raise) right after it wrote the checkpoint of `server_round`."""

    def save_then_stop(output_dir, checkpoint):
        path = save_checkpoint(output_dir, checkpoint)
        if checkpoint.server_round == server_round:
            raise Stopped
        return path

    monkeypatch.setattr(server_app, "save_checkpoint", save_then_stop)


CASES = {
    # 7 rounds of K = 3: stopped in the middle of the second cycle.
    "fedcat": ({"strategy": "fedcat", "fedcat-k": 3, "fedcat-lambda": 1, "partition": "dirichlet", "alpha": 0.3}, 7, 4),
    # 3 superclients of 2 clients, 2 of them trained per round.
    "fedseq": (
        {"strategy": "fedseq", "fedseq-pretrain-epochs": 1, "fedseq-min-samples": 350, "fraction-train": 0.5},
        4,
        2,
    ),
    # The same superclients, 2 slots averaged every 3 rounds: stopped between two averagings.
    "fedseq-inter": (
        {"strategy": "fedseq-inter", "fedseq-pretrain-epochs": 1, "fedseq-min-samples": 350, "fraction-train": 0.5},
        5,
        2,
    ),
    # 2 encoder + 2 classifier rounds: stopped inside the classifier stage, so the resumed
    # clients have lost their feature caches and the server must send the encoders again.
    "fedconcat": (
        {
            "strategy": "fedconcat",
            "partition": "classes",
            "fedconcat-clusters": "2",
            "fedconcat-encoder-rounds": 2,
            "fedconcat-classifier-rounds": 2,
        },
        4,
        3,
    ),
    # FedDyn inside the clusters (real clients run its objective). Stopped in the classifier
    # stage: the clients' g_k lives in their state, which a new simulation starts afresh, so
    # only a stop after the encoder stage can end with exactly the uninterrupted model.
    "fedconcat+feddyn": (
        {
            "strategy": "fedconcat",
            "local-objective": "feddyn",
            "feddyn-alpha": 0.1,
            "partition": "classes",
            "fedconcat-clusters": "2",
            "fedconcat-encoder-rounds": 2,
            "fedconcat-classifier-rounds": 2,
        },
        4,
        3,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_stopped_and_resumed_run_ends_with_the_uninterrupted_model(tmp_path, monkeypatch, name):
    run_config, rounds, stop_after = CASES[name]
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    run_config = {**run_config, "num-server-rounds": rounds}
    _serve(run_config, straight, first_id=0)
    with monkeypatch.context() as patch:
        _stop_after(patch, stop_after)
        with pytest.raises(Stopped):
            _serve(run_config, interrupted, first_id=10)
    assert load_checkpoint(interrupted).server_round == stop_after
    _serve({**run_config, "resume": True}, interrupted, first_id=20)

    final, resumed = load_checkpoint(straight), load_checkpoint(interrupted)
    assert resumed.server_round == final.server_round == rounds
    assert resumed.arrays.keys() == final.arrays.keys()
    for key in final.arrays:
        assert torch.equal(resumed.arrays[key], final.arrays[key]), key
    straight_metrics, resumed_metrics = read_metrics(straight), read_metrics(interrupted)
    assert [r.get("accuracy") for r in resumed_metrics["rounds"]] == [r.get("accuracy") for r in straight_metrics["rounds"]]
    assert resumed_metrics["initial"] == straight_metrics["initial"]
    assert resumed_metrics["final_accuracy"] == straight_metrics["final_accuracy"]
    assert _without_timings(resumed_metrics["setup"]) == _without_timings(straight_metrics["setup"])
    assert resumed_metrics["node_identity"]["unanswered"] == resumed_metrics["node_identity"]["flower_ids"] == []


def _without_timings(record):
    """A metrics record without its wall-time entries (the one thing two runs never share)."""
    if isinstance(record, dict):
        return {k: _without_timings(v) for k, v in record.items() if "seconds" not in k}
    if isinstance(record, list):
        return [_without_timings(v) for v in record]
    return record


@pytest.mark.e2e
def test_simulation_resumes_from_its_checkpoint(tmp_path):
    """Through `flwr run`: each simulation gives its nodes new random Flower ids, so only stable
    ids let the resumed run pick the clients the uninterrupted one picked. The uninterrupted run
    is the same ServerApp and ClientApps in one process (`run_in_process`: the same partitions,
    seeds and stable ids, without a third simulation's start-up)."""
    fedcat = {"strategy": "fedcat", "fedcat-k": 2, "partition": "dirichlet", "alpha": 0.3, "num-server-rounds": 4}
    straight = run_in_process(tmp_path / "straight", fedcat, 4)
    first = run_simulation(tmp_path / "first", {**fedcat, "num-server-rounds": 2, "output-dir": str(tmp_path / "b")}, 4)
    resumed = run_simulation(tmp_path / "resumed", {**fedcat, "resume": True, "output-dir": str(tmp_path / "b")}, 4)

    assert len(first["rounds"]) == 2 and len(resumed["rounds"]) == 4
    assert [r["copy_to_device"] for r in resumed["rounds"]] == [r["copy_to_device"] for r in straight["rounds"]]
    assert set(straight["rounds"][0]["copy_to_device"]) <= {0, 1, 2, 3}  # partition ids
    final, continued = load_checkpoint(tmp_path / "straight" / "output"), load_checkpoint(tmp_path / "b")
    for key in final.arrays:  # other processes: equal up to float nondeterminism
        assert torch.allclose(continued.arrays[key], final.arrays[key], atol=1e-5), key
    assert abs(resumed["final_accuracy"] - straight["final_accuracy"]) <= 0.01

