"""A short soak: a real deployment of 6 authenticated SuperNodes running FedCat while one at a
time is SIGKILLed and restarted, the SuperLink is killed once and the run resumed from its
checkpoint, and 10 % of the replies are malformed or poisoned (`concatfl.bench.soak`; the full
soak is `python -m concatfl.bench soak`)."""

from __future__ import annotations

import pytest

from concatfl.bench.soak import Settings, soak
from concatfl.metrics import read_metrics


@pytest.mark.e2e
def test_a_short_soak_completes_resumes_exactly_accepts_no_bad_reply_and_leaves_nothing(tmp_path):
    settings = Settings(nodes=6, rounds=4, strategies=("fedcat",), fuzz_share=0.1, kill_every=20.0, max_kills=1,
                        round_timeout=30.0, superlink_restart="fedcat", superlink_restart_after=1, hang=False,
                        time_limit=900.0, seed=1)
    report = soak(settings, tmp_path)
    (run,) = report["runs"]
    assert run["completed"], run
    assert run["rounds"] == settings.rounds
    restart = run["superlink_restart"]
    # The resumed run started from the very model of the checkpoint the crash left.
    assert run["resumed"] == {"after_round": restart["checkpoint"]["round"], "model": restart["checkpoint"]["model"]}
    assert run["malformed_accepted"] == 0 and run["outsized_taken_as_sent"] == 0
    assert report["faults"].get("supernode-killed") == 1 and report["faults"].get("superlink-killed") == 1
    assert report["processes_left"] == []
    # FedCat loses no copy to a dead, restarted or fuzzed node: every round dispatches K copies; a
    # copy whose reply is missing or rejected keeps its model and d_i, one that replied grows.
    previous: list[int] = []
    for record in read_metrics(tmp_path / "fedcat")["rounds"]:
        assert len(record["copy_to_device"]) == len(record["data_sizes"]) == record["k"]
        if record["offset"] == 0:
            previous = [0] * record["k"]
        missed = {miss["tag"] for miss in record["hops"][0]["misses"]}
        for copy, (before, after) in enumerate(zip(previous, record["data_sizes"])):
            assert (after == before) if copy in missed else (after > before), record
        previous = record["data_sizes"]
