"""A soak run with a SuperNode that connects after stage 1 (`concatfl.bench.soak`, `late_nodes`).

Its own file: `make test` distributes the tests file by file over two workers, and this soak and
the short soak (tests/test_soak.py) are the two longest tests; in one file they ran one after
the other on one worker."""

from __future__ import annotations

import pytest

from concatfl.bench.soak import Settings, soak
from concatfl.metrics import read_metrics


@pytest.mark.e2e
def test_a_node_that_connects_after_stage_1_trains(tmp_path):
    # Six authenticated SuperNodes; the run starts with the five that are up and has the sixth join
    # once its checkpoint has passed round 1 (FedSeq's stage 1 is long over; rounds 2-5 leave a
    # loaded machine time to start it: a round here takes 10-18 s, a SuperNode up to ~30 s). Placement is one
    # mechanism for every strategy (`RelayStrategy._admit`); FedSeq is the strategy that used to
    # leave such a node out (FedConcat's and FedCat's placements: their strategy tests).
    settings = Settings(nodes=6, rounds=5, strategies=("fedseq",), fuzz_share=0.0, max_kills=0,
                        superlink_restart="", hang=False, late_nodes=1, late_delay=0.0, late_after_round=1,
                        time_limit=900.0, seed=0, baseline=False)
    report = soak(settings, tmp_path)
    assert report["processes_left"] == []
    (run,) = report["runs"]
    assert run["completed"], run
    assert run["late_nodes"] == [5] and run["joined"] == [5]
    metrics = read_metrics(tmp_path / "fedseq")
    assert metrics["setup"]["start_nodes"] == 5
    (joined,) = [record for record in metrics["rounds"] if 5 in record["membership"].get("joined", [])]
    (placed,) = joined["placements"]
    assert placed["node"] == 5 and placed["why"] == "joined after the start"
    assert joined["round"] >= 2  # after round 1's checkpoint
    # Its data trained the model: it was placed where it trains and never sat out the run.
    assert 5 not in metrics["membership"]["never_trained"]
