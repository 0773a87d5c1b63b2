"""FedCat and FedSeq with default arguments over a user's ordinary ClientApp (tests/apps/quickstart).

The app's client trains the way Flower's quickstart does: its own `Net`, SGD with momentum 0.9,
lr 0.05, batch 16, one local epoch, on 10 clients holding two classes each. That is where the
papers' algorithms (`hop_clip=0`) collapse to chance: a regression guard against the collapse
coming back, not a benchmark (the figures are in docs/results.md).
"""

from __future__ import annotations

import pytest

from .e2e import leftover_processes
from .user_app import APP_DIR, NUM_NODES, RUN_CONFIG, federation, fixture_app, serve  # noqa: F401  (fixture)

QUICKSTART_CLIENT = {"momentum": 0.9, "lr": 0.05, "batch-size": 16, "local-epochs": 1}
CHANCE = 0.1  # ten balanced classes
# Measured with the defaults: FedCat ≈ 0.47 after 30 rounds (K = 2 devices per round), FedSeq ≈ 0.85
# after 12; the papers' algorithms end at 0.23 and 0.10. "Clearly above chance": 3× chance.
ABOVE_CHANCE = 3 * CHANCE
ROUNDS = {"fedcat": 30, "fedseq": 12}


@pytest.mark.parametrize("variant", ["fedcat", "fedseq"])
def test_default_sequential_strategies_learn_with_a_quickstart_client(app, variant):
    _, client, server = app
    run_config = {**RUN_CONFIG, **QUICKSTART_CLIENT, "variant": variant, "num-server-rounds": ROUNDS[variant]}
    strategy, result = serve(server, federation(client.app, run_config), run_config)
    final = float(result.evaluate_metrics_serverapp[max(result.evaluate_metrics_serverapp)]["accuracy"])
    assert final > ABOVE_CHANCE, f"{variant} with default arguments ended at {final:.3f}"
    divergence = [record["divergence"] for record in strategy.history if "divergence" in record]
    assert divergence and all(not record["diverged"] for record in divergence[-3:])


@pytest.mark.e2e
def test_default_fedseq_learns_with_a_quickstart_client_through_flwr_run(tmp_path):
    """The same FedSeq run through `flwr run` (Ray simulation, NUM_NODES SuperNodes)."""
    from concatfl.launch import run_simulation

    summary = run_simulation(
        {**QUICKSTART_CLIENT, "variant": "fedseq", "num-server-rounds": ROUNDS["fedseq"]},
        NUM_NODES,
        workdir=tmp_path,
        app_dir=APP_DIR,
        timeout=900,
    )
    assert len(summary["rounds"]) == ROUNDS["fedseq"] and summary["final_accuracy"] > ABOVE_CHANCE
    assert leftover_processes(tmp_path) == []
