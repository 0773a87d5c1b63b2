"""A short soak: a real deployment of 6 authenticated SuperNodes running FedCat while one at a
time is SIGKILLed and restarted, the SuperLink is killed once and the run resumed from its
checkpoint, and 10 % of the replies are malformed or poisoned (`concatfl.bench.soak`; the full
soak is `python -m concatfl.bench soak`)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from concatfl.bench.soak import Chaos, Settings, condition_settings, paired, paired_summary, render_paired, soak
from concatfl.deployment.fleet import Node
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
    # copy whose reply is missing or rejected goes on to a replacement device in a second hop, and
    # keeps its model and d_i only when that one fails too; a copy that trained grows.
    previous: list[int] = []
    for record in read_metrics(tmp_path / "fedcat")["rounds"]:
        assert len(record["copy_to_device"]) == len(record["data_sizes"]) == record["k"]
        if record["offset"] == 0:
            previous = [0] * record["k"]
        missed = {miss["tag"] for miss in record["hops"][0]["misses"]}
        if len(record["hops"]) > 1:
            missed -= {entry["copy"] for entry in record["replacements"]}
            missed |= {miss["tag"] for miss in record["hops"][1]["misses"]}
        for copy, (before, after) in enumerate(zip(previous, record["data_sizes"])):
            assert (after == before) if copy in missed else (after > before), record
        previous = record["data_sizes"]


def test_a_kill_due_during_a_pause_happens_when_the_pause_ends():
    # The short soak's one kill fell due while the SuperLink restarted and was dropped: its run
    # ended before the next period.
    nodes = {i: Node(i, i, subprocess.Popen(["sleep", "60"])) for i in range(2)}
    chaos = Chaos(None, None, nodes, Settings(kill_every=3.0, max_kills=1, seed=0), protected=set())
    chaos.pause(True)
    chaos.start()
    try:
        time.sleep(3.3)  # a kill fell due 0.3 s ago
        assert chaos.events == [] and all(node.process.poll() is None for node in nodes.values())
        chaos.pause(False)
        time.sleep(1.5)  # well before the next period (2.7 s from now)
        (kill,) = [event for event in chaos.events if event["kind"] == "supernode-killed"]
        assert nodes[kill["node"]].process.poll() is not None
    finally:
        chaos.stop(wait=5.0)
        for node in nodes.values():
            node.process.kill()
            node.process.wait()


def test_the_paired_measure_gives_each_condition_its_faults_and_the_cost_against_clean():
    base = Settings(nodes=10, rounds=30, strategies=("fedseq",))
    clean, faults, late = (condition_settings(base, "fedseq", 2, c) for c in ("clean", "faults", "late"))
    assert (clean.fuzz_share, clean.max_kills, clean.superlink_restart, clean.hang, clean.late_nodes) == (0.0, 0, "", False, 0)
    assert (faults.fuzz_share, faults.max_kills, faults.superlink_restart, faults.hang) == (0.1, None, "fedseq", True)
    assert faults.late_nodes == 2 and late.late_nodes == 5 and late.max_kills == 0 and late.fuzz_share == 0.0
    assert all(s.seed == 2 and s.run["classes-per-client"] == 4 and not s.baseline for s in (clean, faults, late))
    # Half the nodes start the late run: its late partitions are the last five.
    assert late.started_at_first == [0, 1, 2, 3, 4] and late.late_partitions(0) == [5, 6, 7, 8, 9]

    def run(condition, accuracy, **figures):
        return {"condition": condition, "completed": True, "final_accuracy": accuracy, "faults": figures.pop("faults", {}),
                **figures}

    runs = [
        run("clean", 0.90), run("clean", 0.92),
        run("faults", 0.88, replies_rejected=3, replies_missing=4, never_trained=[7], joined=[8, 9], rested=3, wall_seconds=600,
            superlink_restart={"round_redone": 3}, faults={"supernode-killed": 5}),
        run("faults", 0.86, replies_rejected=1, faults={"supernode-killed": 2}),
        run("late", 0.91, joined=[5, 6, 7, 8, 9]), {"condition": "late", "completed": False, "faults": {}},
    ]
    summary = paired_summary(runs)
    assert summary["clean"]["mean"] == 0.91 and summary["faults"]["mean"] == 0.87
    assert summary["faults"]["cost_points"] == 4.0 and summary["late"]["cost_points"] == 0.0
    assert summary["faults"]["replies_rejected"] == 4 and summary["faults"]["kills"] == 7
    assert summary["faults"]["rounds_redone"] == 1 and summary["faults"]["never_trained"] == [1, 0]
    assert summary["faults"]["rested"] == 3 and summary["faults"]["minutes"] == [10.0, 0.0]
    assert summary["late"]["completed"] == 1 and summary["late"]["runs"] == 2 and summary["late"]["joined_late"] == [5, 0]
    table = render_paired({"settings": {"nodes": 10, "rounds": 30, "seeds": [0, 1]}, "wall_seconds": 1.0, "machine": "m",
                           "load_average": {"start": 0, "end": 0}, "strategies": {"fedseq": summary}})
    assert "| fedseq | 0.910 ± 0.014 (2/2) | 0.870 ± 0.014 (2/2) | 4.0 | 0.910 ± 0.000 (1/2) | 0.0 |" in table
    assert "| fedseq, faults | 7 | 1 | [1, 0] | [2, 0] | 4 | 0 | 4 | 3 | 0 | [10.0, 0.0] |" in table


def test_the_paired_measure_runs_only_the_conditions_asked_for_and_reads_the_runs_already_made(tmp_path):
    # Both runs already made (their reports in place): nothing is started, and the faults
    # condition, not asked for, stays empty.
    for condition, accuracy in (("clean", 0.92), ("late", 0.90)):
        folder = tmp_path / "paired" / "seed-0" / "fedconcat" / condition
        folder.mkdir(parents=True)
        run = {"strategy": "fedconcat", "completed": True, "final_accuracy": accuracy, "joined": [5, 6] if condition == "late" else []}
        folder.joinpath("report.json").write_text(json.dumps(
            {"runs": [run], "faults": {}, "processes_left": [], "load_average": {"start": [0], "end": [0]}}))
    summary = paired(Settings(nodes=10, rounds=30, strategies=("fedconcat",)), (0,), tmp_path, ("clean", "late"))
    assert [(run["condition"], run["final_accuracy"]) for run in summary["runs"]] == [("clean", 0.92), ("late", 0.9)]
    figures = summary["strategies"]["fedconcat"]
    assert figures["late"]["cost_points"] == 2.0 and figures["faults"]["runs"] == 0 and "cost_points" not in figures["faults"]
    assert "| fedconcat | 0.920 ± 0.000 (1/1) | – | – | 0.900 ± 0.000 (1/1) | 2.0 |" in (tmp_path / "paired.md").read_text()
