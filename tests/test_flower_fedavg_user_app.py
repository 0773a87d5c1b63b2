"""concatfl's FedAvg against Flower's own, on a user's app (tests/apps/quickstart): the swap map's
baseline row is only fair if, with every node and nothing to reject, the two are the same FedAvg."""

from __future__ import annotations

import numpy as np
from flwr.app import Context, RecordDict

from concatfl.metrics import read_metrics

from .user_app import NUM_NODES, RUN_CONFIG, federation, fixture_app, serve  # noqa: F401  (fixture)

ROUNDS = 3


def test_concatfls_fedavg_with_every_node_trains_the_model_flowers_fedavg_trains(app):
    _, client, server = app
    strategies, results = {}, {}
    for variant in ("fedavg", "flower-fedavg"):
        run_config = {**RUN_CONFIG, "variant": variant, "num-server-rounds": ROUNDS, "local-epochs": 1}
        strategies[variant], results[variant] = serve(server, federation(client.app, run_config), run_config)
    # concatfl's bounds rejected nothing: every node's reply of every round was averaged
    hops = [record["hops"] for record in strategies["fedavg"].history]
    assert [[(hop["replies"], hop["misses"]) for hop in round_hops] for round_hops in hops] == [[(NUM_NODES, [])]] * ROUNDS
    ours, flowers = (results[variant].arrays.to_numpy_ndarrays() for variant in ("fedavg", "flower-fedavg"))
    assert len(ours) == len(flowers)
    for mine, theirs in zip(ours, flowers):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-6)


def test_flowers_fedavg_run_writes_the_metrics_document_of_concatfls_strategies(app, tmp_path):
    task, client, server = app
    run_config = {**RUN_CONFIG, "variant": "flower-fedavg", "num-server-rounds": ROUNDS, "local-epochs": 1,
                  "output-dir": str(tmp_path)}
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    server.main(federation(client.app, run_config), context)
    document = read_metrics(tmp_path)
    assert [record["round"] for record in document["rounds"]] == [1, 2, 3]
    assert document["final_accuracy"] == document["rounds"][-1]["accuracy"]
    # Each round ships the model (float32) to every node and gets one back from each, plus a few kB
    # of headers and metadata.
    model_bytes = 4 * sum(tensor.numel() for tensor in task.model_of(run_config)[0]().state_dict().values())
    for record in document["rounds"]:
        for direction in ("bytes_sent", "bytes_received"):
            assert NUM_NODES * model_bytes < record[direction] < NUM_NODES * (model_bytes + 4096)
