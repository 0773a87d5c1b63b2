"""Partitions of a training set across clients, built with flwr-datasets partitioners.

Every scheme is deterministic given `seed`, and every client gets at least one sample:
- `iid`: uniform random split (`IidPartitioner`);
- `dirichlet`: per-class Dirichlet(α) proportions as in NIID-Bench, with a minimum partition
  size and self-balancing (`DirichletPartitioner`); α = 0 means one class per client
  (`PathologicalPartitioner` with one class each, class `i % C` to client i);
- `classes`: #C=k, each client holds k classes (`PathologicalPartitioner`, NIID-Bench's
  deterministic assignment: client i gets class `i % C` first);
- `natural`: FEMNIST writers (`NaturalIdPartitioner`); client i gets writers i, i+N, i+2N, … of
  the sorted writer list, so any number of clients up to the number of writers works.
Each client's partition is then split into a local train and a local test part.

The partitions of a training set are computed once per machine and kept in concatfl's cache
(`concatfl.data.cache`, keyed by the labels' digest and every setting): a ClientApp that finds
them never imports flwr-datasets (with HF datasets, pandas, pyarrow and matplotlib, ~0.2 GB).
"""

from __future__ import annotations

import hashlib
import warnings
from importlib.metadata import version
from logging import WARNING

import numpy as np
from flwr.supercore import log

from .cache import cache_path, computed_once


class PartitionError(ValueError):
    """The requested partition cannot be built (e.g. more clients than samples)."""


def partition_indices(
    labels: np.ndarray,
    num_partitions: int,
    scheme: str,
    *,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    min_partition_size: int = 10,
    seed: int = 0,
    writers: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Indices into `labels` for each of `num_partitions` clients (sorted, non-empty)."""
    labels = np.asarray(labels)
    if num_partitions < 1:
        raise PartitionError(f"num-partitions must be >= 1, got {num_partitions}")
    if num_partitions > len(labels):
        raise PartitionError(f"{num_partitions} clients but only {len(labels)} training samples")
    if scheme == "dirichlet" and alpha > 0:
        # flwr-datasets gives up when the minimum nears the mean size: cap it at half the mean.
        minimum = max(1, min(min_partition_size, len(labels) // (2 * num_partitions)))
        if minimum < min_partition_size:
            log(
                WARNING,
                "min-partition-size=%d lowered to %d (half the mean partition size of %d clients)",
                min_partition_size, minimum, num_partitions,
            )
        min_partition_size = minimum
    settings = (scheme, alpha, classes_per_client, min_partition_size, seed, num_partitions)
    inputs = [labels] if writers is None else [labels, np.asarray(writers).astype(str)]
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(x).tobytes() for x in inputs)).hexdigest()
    signature = f"partition\0{digest}\0{settings}\0flwr-datasets {version('flwr-datasets')}"

    def compute() -> dict[str, np.ndarray]:
        parts = _compute_partitions(labels, num_partitions, scheme, alpha=alpha, classes_per_client=classes_per_client,
                                    min_partition_size=min_partition_size, seed=seed, writers=writers)
        return {"indices": np.concatenate(parts), "offsets": np.cumsum([0] + [len(part) for part in parts])}

    stored = computed_once(cache_path("partition", signature), compute)
    indices, offsets = stored["indices"], stored["offsets"]
    return [indices[offsets[i] : offsets[i + 1]] for i in range(num_partitions)]


# pylint: disable=import-outside-toplevel
def _compute_partitions(
    labels: np.ndarray,
    num_partitions: int,
    scheme: str,
    *,
    alpha: float,
    classes_per_client: int,
    min_partition_size: int,
    seed: int,
    writers: np.ndarray | None,
) -> list[np.ndarray]:
    """`partition_indices` without the cache: flwr-datasets' partitioners (`min_partition_size`
    already capped for Dirichlet)."""
    from datasets import Dataset
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        Partitioner,
        PathologicalPartitioner,
    )

    table = {"label": labels.tolist(), "index": np.arange(len(labels)).tolist()}
    if scheme == "natural":
        if writers is None:
            raise PartitionError("partition='natural' needs writer ids (dataset='femnist')")
        return _natural(labels, np.asarray(writers), num_partitions)
    num_classes = len(np.unique(labels))
    partitioner: Partitioner
    if scheme == "iid":
        partitioner = IidPartitioner(num_partitions=num_partitions)
    elif scheme == "dirichlet" and alpha > 0:
        partitioner = DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            alpha=alpha,
            min_partition_size=min_partition_size,
            self_balancing=True,
            shuffle=True,
            seed=seed,
        )
    elif scheme in ("dirichlet", "classes"):
        per_client = 1 if scheme == "dirichlet" else classes_per_client
        if per_client > num_classes:
            raise PartitionError(
                f"classes-per-client={per_client} but the dataset has only {num_classes} classes"
            )
        partitioner = PathologicalPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            num_classes_per_partition=per_client,
            class_assignment_mode="first-deterministic",
            shuffle=True,
            seed=seed,
        )
    else:
        raise PartitionError(f"unknown partition scheme {scheme!r}")
    if scheme == "iid":
        # IidPartitioner takes contiguous shards: shuffle the rows so the split depends on seed.
        order = np.random.default_rng(seed).permutation(len(labels))
        table = {"label": labels[order].tolist(), "index": order.tolist()}
    partitioner.dataset = Dataset.from_dict(table)
    with warnings.catch_warnings():
        # DirichletPartitioner warns on every resample while the minimum size is not met.
        warnings.simplefilter("ignore")
        try:
            parts = [np.sort(np.asarray(partitioner.load_partition(i)["index"])) for i in range(num_partitions)]
        except ValueError as failure:
            raise PartitionError(
                f"partition '{scheme}' (alpha={alpha}, min-partition-size={min_partition_size}) cannot be "
                f"built for {num_partitions} clients and {len(labels)} samples: {failure}"
            ) from failure
    empty = [i for i, part in enumerate(parts) if len(part) == 0]
    if empty:
        raise PartitionError(
            f"partition '{scheme}' left clients {empty} without data; use fewer clients "
            "or more classes-per-client"
        )
    return parts


def _natural(labels: np.ndarray, writers: np.ndarray, num_partitions: int) -> list[np.ndarray]:
    from datasets import Dataset
    from flwr_datasets.partitioner import NaturalIdPartitioner

    partitioner = NaturalIdPartitioner(partition_by="writer")
    partitioner.dataset = Dataset.from_dict(
        {"writer": writers.astype(str).tolist(), "index": np.arange(len(labels)).tolist()}
    )
    num_writers = partitioner.num_partitions
    if num_partitions > num_writers:
        raise PartitionError(f"{num_partitions} clients but only {num_writers} FEMNIST writers")
    order = sorted(range(num_writers), key=lambda w: partitioner.partition_id_to_natural_id[w])
    groups = [order[i::num_partitions] for i in range(num_partitions)]
    return [
        np.sort(np.concatenate([np.asarray(partitioner.load_partition(w)["index"]) for w in group]))
        for group in groups
    ]


def local_split(
    indices: np.ndarray, test_fraction: float, seed: int, partition_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Split a client's indices into (train, test); the train part is never empty."""
    rng = np.random.default_rng([seed, partition_id])
    shuffled = rng.permutation(indices)
    num_test = min(int(round(test_fraction * len(indices))), len(indices) - 1)
    return np.sort(shuffled[num_test:]), np.sort(shuffled[:num_test])
