"""metrics.py: the summary document and the atomic metrics.json writer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from concatfl.metrics import METRICS_FILE, read_metrics, summarize, write_metrics

INITIAL = {"accuracy": 0.1, "loss": 2.3}


def _round(number: int, sent: int, received: int, accuracy: float | None = None) -> dict:
    record = {"round": number, "bytes_sent": sent, "bytes_received": received, "seconds": 0.5,
              "hops": [], "aggregated": accuracy is not None}
    if accuracy is not None:
        record.update({"accuracy": accuracy, "loss": 1.0 - accuracy})
    return record


def _summary(rounds, setup=None, wall=12.34567):
    return summarize({"strategy": "fedavg"}, "FedAvg", 4, setup or {}, INITIAL, rounds, wall)


def test_summarize_takes_the_last_evaluated_round_not_the_last_round():
    rounds = [_round(1, 100, 50, 0.4), _round(2, 100, 50, 0.6), _round(3, 100, 50)]
    document = _summary(rounds)
    assert document["final_accuracy"] == 0.6
    assert document["final_loss"] == pytest.approx(0.4)


def test_summarize_falls_back_to_the_initial_evaluation():
    document = _summary([_round(1, 10, 5), _round(2, 10, 5)])
    assert document["final_accuracy"] == 0.1 and document["final_loss"] == 2.3


def test_summarize_sums_bytes_including_setup():
    rounds = [_round(1, 100, 40, 0.5), _round(2, 250, 60), _round(3, 7, 3, 0.7)]
    assert _summary(rounds)["total_bytes_sent"] == 357
    assert _summary(rounds)["total_bytes_received"] == 103
    with_setup = _summary(rounds, setup={"bytes_sent": 1000, "bytes_received": 11})
    assert with_setup["total_bytes_sent"] == 1357
    assert with_setup["total_bytes_received"] == 114


def test_summarize_carries_every_field_of_the_schema():
    rounds = [_round(1, 1, 1, 0.5)]
    document = _summary(rounds, setup={"groups": [[1, 2]]})
    assert document == {
        "run_config": {"strategy": "fedavg"},
        "strategy": "FedAvg",
        "num_nodes": 4,
        "setup": {"groups": [[1, 2]]},
        "initial": INITIAL,
        "rounds": rounds,
        "final_accuracy": 0.5,
        "final_loss": 0.5,
        "total_bytes_sent": 1,
        "total_bytes_received": 1,
        "wall_seconds": 12.346,
    }


def test_write_metrics_round_trips_and_leaves_no_temp_file(tmp_path):
    document = _summary([_round(1, 100, 50, 0.4)])
    target = write_metrics(tmp_path / "run" / "nested", document)
    assert target == tmp_path / "run" / "nested" / METRICS_FILE
    assert sorted(p.name for p in target.parent.iterdir()) == [METRICS_FILE]
    assert read_metrics(target.parent) == document
    assert json.loads(target.read_text()) == document


def test_write_metrics_converts_numpy_values(tmp_path):
    document = {"accuracy": np.float32(0.5), "counts": np.array([1, 2, 3]), "n": np.int64(7)}
    write_metrics(tmp_path, document)
    assert read_metrics(tmp_path) == {"accuracy": 0.5, "counts": [1, 2, 3], "n": 7}


def test_write_metrics_replaces_an_existing_file(tmp_path):
    write_metrics(tmp_path, {"final_accuracy": 0.1})
    write_metrics(tmp_path, {"final_accuracy": 0.9})
    assert read_metrics(tmp_path) == {"final_accuracy": 0.9}
    assert [p.name for p in tmp_path.iterdir()] == [METRICS_FILE]


def test_failed_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path):
    write_metrics(tmp_path, {"final_accuracy": 0.1})
    with pytest.raises(TypeError, match="cannot write object"):
        write_metrics(tmp_path, {"bad": object()})
    assert read_metrics(tmp_path) == {"final_accuracy": 0.1}
    # NamedTemporaryFile(delete=False) is never removed when json.dump raises.
    assert [p.name for p in tmp_path.iterdir()] == [METRICS_FILE]


def test_the_node_identity_report_is_kept_when_given():
    assert "node_identity" not in _summary([_round(1, 10, 5, 0.5)])
    report = {"identified": 3, "late": [2], "flower_ids": [], "unanswered": [2**63 + 1]}
    document = summarize({}, "FedAvg", 4, {}, INITIAL, [_round(1, 10, 5, 0.5)], 1.0, report)
    assert document["node_identity"] == report
