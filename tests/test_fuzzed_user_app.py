"""A user's app (tests/apps/quickstart, its ClientApp with `concatfl.fuzz.fuzz_mod`) under bad
replies: concatfl's FedAvg rejects the malformed ones and those × 10⁶ (no update is that long),
bounds the weight of those of 10¹² examples (to the node's own previous report where it made
one), and still learns.

The in-process test shows what the bounds are worth (the same run without them ends at chance);
the e2e test runs it through `flwr run` and reads the records in metrics.json.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from concatfl.bench.inprocess import simulate_in_process
from concatfl.bench.robustness import malformed_accepted, outsized_taken, replaced

from .e2e import leftover_processes
from .user_app import APP_DIR, NUM_NODES

# 30 % of the replies: NaN, a wrong shape, 10¹² examples or every weight × 10⁶ (seeded: with
# fuzz-seed 0 that is 14 replaced replies over 6 rounds, 5 of them outsized).
FUZZED = {"variant": "fedavg", "num-server-rounds": 6, "fuzz-share": 0.3,
          "fuzz-kinds": "nan,wrong-shape,huge-examples,scaled"}
# Measured in-process: 0.50 and 0.55 (seeds 0, 1) with the bounds, 0.64 clean, 0.10 without bounds.
LEARNS = 0.35


def fuzzed_run(tmp_path: Path, **overrides) -> dict:
    config = {**FUZZED, "fuzz-log": str(tmp_path / "fuzz.jsonl"), **overrides}
    return simulate_in_process(config, NUM_NODES, tmp_path, app_dir=APP_DIR)


def test_without_the_bounds_the_same_replies_wreck_the_model(tmp_path):
    bounded = fuzzed_run(tmp_path / "bounded")
    unbounded = fuzzed_run(tmp_path / "unbounded", **{"update-clip": 0.0, "weight-clip": 0.0})
    assert bounded["final_accuracy"] > LEARNS and unbounded["final_accuracy"] < 0.15
    assert outsized_taken(bounded) == 0 and outsized_taken(unbounded) > 0
    assert malformed_accepted(bounded) == malformed_accepted(unbounded) == 0


@pytest.mark.e2e
def test_fedavg_through_flwr_run_with_fuzzed_clients(tmp_path):
    from concatfl.launch import run_simulation

    metrics = run_simulation(
        {**FUZZED, "fuzz-log": str(tmp_path / "fuzz.jsonl")}, NUM_NODES, workdir=tmp_path, app_dir=APP_DIR, timeout=900
    )
    assert metrics["final_accuracy"] > LEARNS
    rejected = [m for r in metrics["rounds"] for h in r["hops"] for m in h["misses"] if m["reason"].startswith("rejected")]
    down_weighted = [event for r in metrics["rounds"] for event in r.get("guard", {}).get("down-weighted", [])]
    assert any("not an update" in m["reason"] for m in rejected) and down_weighted
    # Every replaced reply (the mod's log) is found rejected or bounded in the records.
    assert replaced(metrics) == 14 and malformed_accepted(metrics) == 0 and outsized_taken(metrics) == 0
    assert leftover_processes(tmp_path) == []
