"""A node's own earlier updates as witnesses for its update's direction (`concatfl.core.witness`)."""

from __future__ import annotations

import numpy as np
import pytest

from concatfl.core.witness import SKETCH_SIZE, believed, cosine, sketch, update_believed


def test_believed_unless_every_witness_disagrees():
    assert believed({}) and believed({"taken": -0.9, "seen": 0.0}) and believed({"taken": 0.3})
    assert not believed({"taken": -0.9, "seen": -0.01}) and not believed({"taken": 0.3}, bound=0.5)


def test_update_believed_counts_one_witness_when_the_last_taken_is_the_last_seen():
    honest = np.float32([0.2, 0.1])
    assert update_believed(honest, honest, honest) == (True, {"taken": pytest.approx(1.0)})
    assert update_believed(-honest, honest, -honest) == (True, {"taken": pytest.approx(-1.0), "seen": pytest.approx(1.0)})
    assert update_believed(-honest, honest, honest.copy()) == (False, {"taken": pytest.approx(-1.0), "seen": pytest.approx(-1.0)})
    assert update_believed(honest, None, None) == (True, {})
    assert cosine(honest, np.zeros(2)) == 0.0


def test_a_small_update_is_kept_whole_and_a_large_one_as_a_sketch_that_keeps_its_cosines():
    small = np.arange(SKETCH_SIZE, dtype=np.float64)
    np.testing.assert_allclose(sketch(small), small / np.linalg.norm(small), atol=1e-4)  # its direction
    assert sketch(small).dtype == np.float16 and not sketch(np.zeros(3)).any()
    rng = np.random.default_rng(0)
    a, noise = rng.normal(size=100_000), rng.normal(size=100_000)
    kept = sketch(a * 1e-6)  # an update's scale does not matter, however small
    assert kept.shape == (SKETCH_SIZE,) and kept.dtype == np.float16
    assert float(np.linalg.norm(kept.astype(np.float64))) == pytest.approx(1.0, abs=1e-3)
    # Linear: a reversed update's sketch is the reversed sketch, the same hash for every node.
    np.testing.assert_array_equal(sketch(-a * 1e-6), -kept)
    for true in (-0.5, -0.1, 0.1, 0.5, 0.9):
        b = true * a + np.sqrt(1 - true**2) * noise
        assert cosine(sketch(b), kept) == pytest.approx(cosine(b, a), abs=0.05)
