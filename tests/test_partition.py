"""partition_indices / local_split on sklearn digits labels and small synthetic label arrays."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from sklearn.datasets import load_digits

from concatfl.data.partition import PartitionError, local_split, partition_indices

DIGITS = load_digits().target  # 1797 labels, 10 classes
C = 10
N = 10
SYNTH = np.repeat(np.arange(4), 5)  # 20 labels, 4 classes

SCHEMES = {
    "iid": {},
    "dirichlet-0.1": {"alpha": 0.1},
    "dirichlet-0.5": {"alpha": 0.5},
    "dirichlet-0": {"alpha": 0.0},
    "classes-2": {"classes_per_client": 2},
}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Every test computes its partitions (a cached one would not log its warnings again)."""
    monkeypatch.setenv("CONCATFL_CACHE", str(tmp_path / "cache"))


def _scheme(name: str) -> str:
    return name.split("-")[0]


@functools.lru_cache(maxsize=None)
def _digits_parts(name: str, seed: int = 0, n: int = N) -> tuple[np.ndarray, ...]:
    return tuple(partition_indices(DIGITS, n, _scheme(name), seed=seed, **SCHEMES[name]))


def _classes(parts, labels=DIGITS) -> list[set[int]]:
    return [set(np.unique(labels[p]).tolist()) for p in parts]


def _assert_exact_cover(parts, size):
    joined = np.concatenate(parts)
    assert len(joined) == size
    assert np.array_equal(np.sort(joined), np.arange(size))


@pytest.mark.parametrize("name", list(SCHEMES))
def test_every_digits_index_used_exactly_once_and_every_client_non_empty(name):
    parts = _digits_parts(name)
    assert len(parts) == N
    assert all(len(p) > 0 for p in parts)
    assert all(np.array_equal(p, np.sort(p)) for p in parts)
    _assert_exact_cover(parts, len(DIGITS))


@pytest.mark.parametrize("name", list(SCHEMES))
def test_same_seed_gives_identical_partition(name):
    again = partition_indices(DIGITS, N, _scheme(name), seed=0, **SCHEMES[name])
    assert all(np.array_equal(a, b) for a, b in zip(_digits_parts(name), again))


@pytest.mark.parametrize("name", ["iid", "dirichlet-0.5"])
def test_different_seed_gives_different_partition(name):
    other = _digits_parts(name, seed=1)
    assert any(not np.array_equal(a, b) for a, b in zip(_digits_parts(name), other))


def test_iid_sizes_differ_by_at_most_one():
    sizes = [len(p) for p in _digits_parts("iid")]
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == len(DIGITS)


def test_iid_on_synthetic_sizes_within_one_and_exact_cover():
    parts = partition_indices(SYNTH, 8, "iid", seed=3)
    assert sorted(len(p) for p in parts) == [2, 2, 2, 2, 3, 3, 3, 3]
    _assert_exact_cover(parts, len(SYNTH))


def test_iid_is_not_label_skewed():
    parts = _digits_parts("iid")
    assert all(len(c) == C for c in _classes(parts))
    max_share = np.mean([np.bincount(DIGITS[p]).max() / len(p) for p in parts])
    assert max_share < 0.2


def test_dirichlet_alpha_0_1_is_strongly_label_skewed():
    parts = _digits_parts("dirichlet-0.1")
    mean_classes = np.mean([len(c) for c in _classes(parts)])
    max_share = np.mean([np.bincount(DIGITS[p]).max() / len(p) for p in parts])
    assert mean_classes < 7
    assert max_share > 0.5


def test_dirichlet_alpha_0_gives_exactly_one_class_per_client_class_i_mod_c():
    parts = _digits_parts("dirichlet-0")
    assert _classes(parts) == [{i % C} for i in range(N)]


def test_dirichlet_alpha_0_with_more_clients_than_classes_on_synthetic():
    parts = partition_indices(SYNTH, 8, "dirichlet", alpha=0.0, seed=0)
    assert _classes(parts, SYNTH) == [{i % 4} for i in range(8)]
    _assert_exact_cover(parts, len(SYNTH))


def test_classes_k2_gives_every_client_exactly_two_classes_including_i_mod_c():
    parts = _digits_parts("classes-2")
    for i, classes in enumerate(_classes(parts)):
        assert len(classes) == 2
        assert i % C in classes


def test_classes_k2_with_more_clients_than_classes():
    parts = partition_indices(DIGITS, 13, "classes", classes_per_client=2, seed=0)
    for i, classes in enumerate(_classes(parts)):
        assert len(classes) == 2 and i % C in classes
    _assert_exact_cover(parts, len(DIGITS))


def test_classes_k_equal_to_num_classes_on_synthetic_gives_all_classes_each():
    parts = partition_indices(SYNTH, 2, "classes", classes_per_client=4, seed=0)
    assert _classes(parts, SYNTH) == [{0, 1, 2, 3}, {0, 1, 2, 3}]
    _assert_exact_cover(parts, len(SYNTH))


def test_classes_per_client_above_num_classes_raises():
    with pytest.raises(PartitionError, match="classes-per-client=5"):
        partition_indices(SYNTH, 2, "classes", classes_per_client=5)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "classes"])
def test_more_clients_than_samples_raises(scheme):
    with pytest.raises(PartitionError, match="21 clients but only 20"):
        partition_indices(SYNTH, 21, scheme, alpha=0.5)


def test_zero_clients_and_unknown_scheme_raise():
    with pytest.raises(PartitionError):
        partition_indices(SYNTH, 0, "iid")
    with pytest.raises(PartitionError, match="unknown partition scheme"):
        partition_indices(SYNTH, 2, "shards")


def test_dirichlet_on_small_dataset_with_default_min_size_builds_a_partition():
    # 40 samples / 4 clients: min-partition-size 10 is clamped to len // N = 10, i.e. every
    # client must get exactly the mean size; flwr-datasets gives up after 10 tries with a bare
    # ValueError ("update the values of alpha"). A Dirichlet(1.0) split is easily buildable here.
    labels = np.repeat(np.arange(4), 10)
    parts = partition_indices(labels, 4, "dirichlet", alpha=1.0, seed=0)
    assert all(len(p) > 0 for p in parts)
    _assert_exact_cover(parts, len(labels))


def test_dirichlet_on_small_dataset_with_min_size_one_covers():
    parts = partition_indices(SYNTH, 4, "dirichlet", alpha=1.0, min_partition_size=1, seed=0)
    assert all(len(p) > 0 for p in parts)
    _assert_exact_cover(parts, len(SYNTH))


# ----------------------------------------------------------------------------- natural

WRITER_IDS = [f"f{w:04d}_{w % 7:02d}" for w in range(11)]
# 11 writers, 2..6 samples each, rows shuffled so writers are interleaved in the array.
_RAW_WRITERS = np.concatenate([[wid] * (2 + k % 5) for k, wid in enumerate(WRITER_IDS)])
_ORDER = np.random.default_rng(0).permutation(len(_RAW_WRITERS))
WRITERS = _RAW_WRITERS[_ORDER]
WRITER_LABELS = np.arange(len(WRITERS)) % 10


def _natural(n: int) -> list[np.ndarray]:
    return partition_indices(WRITER_LABELS, n, "natural", writers=WRITERS)


@pytest.mark.parametrize("n", [1, 3, 4, 11])
def test_natural_never_splits_a_writer_and_covers_every_sample(n):
    parts = _natural(n)
    owners = [set(WRITERS[p].tolist()) for p in parts]
    for a in range(n):
        for b in range(a + 1, n):
            assert not owners[a] & owners[b]
    _assert_exact_cover(parts, len(WRITERS))


def test_natural_client_i_gets_writers_i_i_plus_n_of_the_sorted_list():
    n = 4
    parts = _natural(n)
    ordered = sorted(WRITER_IDS)
    for i, part in enumerate(parts):
        assert set(WRITERS[part].tolist()) == set(ordered[i::n])
        # and it holds every sample of those writers
        assert len(part) == int(np.isin(WRITERS, ordered[i::n]).sum())


def test_natural_with_more_clients_than_writers_raises():
    with pytest.raises(PartitionError, match="12 clients but only 11"):
        _natural(12)


def test_natural_without_writers_raises():
    with pytest.raises(PartitionError, match="writer"):
        partition_indices(WRITER_LABELS, 2, "natural")


# ----------------------------------------------------------------------------- local_split


@pytest.mark.parametrize(("size", "fraction"), [(100, 0.2), (7, 0.5), (10, 0.0), (1, 0.9), (2, 0.99)])
def test_local_split_disjoint_covering_train_non_empty(size, fraction):
    indices = np.arange(1000, 1000 + 3 * size, 3)
    train, test = local_split(indices, fraction, seed=0, partition_id=5)
    assert len(train) > 0
    assert not set(train.tolist()) & set(test.tolist())
    assert np.array_equal(np.sort(np.concatenate([train, test])), indices)
    assert len(test) == min(int(round(fraction * size)), size - 1)


def test_local_split_deterministic_and_depends_on_seed_and_partition():
    indices = np.arange(200)
    first = local_split(indices, 0.2, seed=0, partition_id=1)
    again = local_split(indices, 0.2, seed=0, partition_id=1)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not np.array_equal(first[1], local_split(indices, 0.2, seed=1, partition_id=1)[1])
    assert not np.array_equal(first[1], local_split(indices, 0.2, seed=0, partition_id=2)[1])


def test_dirichlet_minimum_above_half_the_mean_is_lowered_with_a_warning(caplog):
    # 4 clients of the synthetic labels: a minimum of half of all samples can never be met.
    parts = partition_indices(SYNTH, 4, "dirichlet", alpha=1.0, min_partition_size=len(SYNTH) // 2, seed=0)
    assert min(len(p) for p in parts) >= len(SYNTH) // 8
    assert f"min-partition-size={len(SYNTH) // 2} lowered to {len(SYNTH) // 8}" in caplog.text


def test_partitions_are_computed_once_per_machine_and_read_back_identical(tmp_path, monkeypatch):
    import concatfl.data.partition as partition

    first = partition_indices(DIGITS, 7, "dirichlet", alpha=0.3, seed=4)
    assert len(list((tmp_path / "cache").glob("partition-*.npz"))) == 1

    def not_again(*args, **kwargs):
        raise AssertionError("partitions computed again despite the cache")

    monkeypatch.setattr(partition, "_compute_partitions", not_again)
    again = partition_indices(DIGITS, 7, "dirichlet", alpha=0.3, seed=4)
    assert all(np.array_equal(a, b) for a, b in zip(first, again)) and len(again) == 7
    # Another setting, or other labels, is another file.
    with pytest.raises(AssertionError, match="computed again"):
        partition_indices(DIGITS, 7, "dirichlet", alpha=0.3, seed=5)
    with pytest.raises(AssertionError, match="computed again"):
        partition_indices(DIGITS[::-1].copy(), 7, "dirichlet", alpha=0.3, seed=4)
