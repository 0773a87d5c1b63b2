"""The user-style app's image mode (the swap suite's app) on tiny files in CIFAR-10's own python
format: its data loading, flwr-datasets' partitioners and quickstart-pytorch's CNN, end to end."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from .user_app import NUM_NODES, RUN_CONFIG, federation, fixture_app, serve  # noqa: F401  (fixture)

CLASSES = 10


@pytest.fixture(name="cifar_dir")
def fixture_cifar_dir(tmp_path):
    """cifar-10-batches-py with 40 random 3×32×32 images per class (test: 10 per class)."""
    rng = np.random.default_rng(0)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    labels = np.repeat(np.arange(CLASSES), 40)
    batches = zip(np.array_split(labels, 5), [f"data_batch_{i}" for i in range(1, 6)])
    for batch_labels, name in [*batches, (np.repeat(np.arange(CLASSES), 10), "test_batch")]:
        images = rng.integers(0, 256, (len(batch_labels), 3 * 32 * 32), dtype=np.uint8)
        with open(folder / name, "wb") as handle:
            pickle.dump({b"data": images, b"labels": batch_labels.tolist()}, handle)
    return tmp_path


@pytest.mark.parametrize(("partition", "keys"), [("classes", {"classes-per-client": 2}), ("dirichlet", {"alpha": 0.5})])
def test_the_image_mode_partitions_with_flwr_datasets_and_trains_quickstarts_cnn(app, cifar_dir, partition, keys):
    task, client, server = app
    run_config = {**RUN_CONFIG, "dataset": "cifar10", "data-dir": str(cifar_dir), "partition": partition, **keys,
                  "variant": "fedavg", "num-server-rounds": 1, "local-epochs": 1, "lr": 0.01}
    parts = [task.load_image_data(run_config, i, NUM_NODES)[1] for i in range(NUM_NODES)]
    assert sum(len(labels) for labels in parts) == 400
    if partition == "classes":
        assert all(len(set(labels.tolist())) == 2 for labels in parts)
    strategy, result = serve(server, federation(client.app, run_config), run_config)
    assert type(strategy.global_module(result.arrays, task.model_of(run_config)[0])).__name__ == "ImageNet"
    assert 0.0 <= result.evaluate_metrics_serverapp[1]["accuracy"] <= 1.0
    assert strategy.history[0]["hops"][0]["replies"] == NUM_NODES
