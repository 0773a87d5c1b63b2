"""The update memory (`core.memory`): exact expectations on small models."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from concatfl.core.memory import UpdateMemory, applied, update_of


def model(w: list[float], b: float, steps: int = 0) -> dict[str, np.ndarray]:
    return {"w": np.array(w, dtype=np.float32), "b": np.array([b], dtype=np.float32), "steps": np.array(steps)}


def test_an_update_is_the_float_difference_and_applies_back():
    sent, returned = model([1.0, 2.0], 0.5, steps=3), model([1.5, 1.0], 0.25, steps=7)
    update = update_of(sent, returned)
    assert set(update) == {"w", "b"}  # the integer counter has no update
    np.testing.assert_array_equal(update["w"], [0.5, -1.0])
    assert update["w"].dtype == np.float32
    moved = applied(model([0.0, 0.0], 1.0, steps=9), update)
    np.testing.assert_array_equal(moved["w"], [0.5, -1.0])
    np.testing.assert_array_equal(moved["b"], [0.75])
    assert moved["steps"] == 9 and moved["w"].dtype == np.float32


def test_models_differing_in_keys_have_no_update():
    with pytest.raises(ValueError, match="differ in keys"):
        update_of({"w": np.zeros(2)}, {"v": np.zeros(2)})


def test_every_remembered_client_counts_with_its_latest_update():
    memory = UpdateMemory()
    memory.remember(7, model([0.0, 0.0], 0.0), model([1.0, 0.0], 0.0), weight=10, server_round=1)
    memory.remember(3, model([0.0, 0.0], 0.0), model([0.0, 2.0], 1.0), weight=30, server_round=1)
    # Round 2 starts from another model; node 7 replies again, node 3's reply is lost.
    memory.remember(7, model([5.0, 5.0], 0.0), model([5.0, 4.0], 0.0), weight=20, server_round=2)
    models, weights = memory.models(model([5.0, 5.0], 0.0))
    assert weights == [30.0, 20.0]  # node order: 3, then 7
    np.testing.assert_array_equal(models[0]["w"], [5.0, 7.0])  # node 3's round-1 update replayed
    np.testing.assert_array_equal(models[0]["b"], [1.0])
    np.testing.assert_array_equal(models[1]["w"], [5.0, 4.0])  # node 7's fresh one
    assert memory.summary(2) == {"fresh": 1, "replayed": [3], "oldest_round": 1}


def test_the_memory_survives_a_checkpoint():
    memory = UpdateMemory()
    memory.remember(2**63 + 5, model([0.0, 0.0], 0.0), model([1.0, 2.0], 3.0), weight=4, server_round=6)
    restored = UpdateMemory()
    restored.load_state_dict(pickle.loads(pickle.dumps(memory.state_dict())))
    assert set(restored.entries) == {2**63 + 5}
    models, weights = restored.models(model([1.0, 1.0], 1.0))
    np.testing.assert_array_equal(models[0]["w"], [2.0, 3.0])
    np.testing.assert_array_equal(models[0]["b"], [4.0])
    assert weights == [4.0] and restored.summary(6) == {"fresh": 1, "replayed": [], "oldest_round": 6}
