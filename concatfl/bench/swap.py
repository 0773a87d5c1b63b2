"""The `swap` suite: a user's Flower app with FedAvg swapped for a concatfl strategy, on real images.

The app is tests/apps/quickstart in its image mode: Flower's quickstart-pytorch CNN and training
loop (SGD, batch 32, one local epoch, lr from the train config), its own data loading (the
original CIFAR-10 pickles, Fashion-MNIST's IDX files) and flwr-datasets' partitioners; its
ClientApp's train handler knows nothing of concatfl. Only the ServerApp's strategy line changes
between rows: FedAvg with every node and with FedCat's K of N nodes a round (equal
participation), Flower's own FedAvg with every node, FedSeq, FedSeqInter, FedCat (its default
K, and K = N) with default arguments, FedConcat and FedConcat-ID (the app's handlers; 10 encoder
+ 10 classifier rounds), and the defaults again with 10 % of the replies fuzzed and with
Flower's LocalDpMod on the clients.

Federations: 10 clients of ~4,000 images, 100 of ~400 and 500 of 80 (FedSeq's own regime of many
small clients; a stratified 40,000 of the training set, the whole 10,000-image test set), each
label-skewed by #C=1 (100 and 500 clients), #C=2 or Dirichlet α = 0.1 / 0.5 (10 and 100 clients);
SGD momentum 0.9 at lr 0.01 (0.05 and Adam 1e-3 in their own settings). One process per run set
(`concatfl.bench.inprocess`).
"""

from __future__ import annotations

from typing import Any

from .columns import FINAL_ACCURACY, TOTAL_MEGABYTES, WALL_SECONDS
from .data import Subsample
from .inprocess import PROJECT_DIR
from .suites import Cell, Setting, Suite

SUITE = "swap"
APP = PROJECT_DIR / "tests" / "apps" / "quickstart"
TRAIN_IMAGES = 40_000
ROUNDS = 20
BASE = {
    "num-server-rounds": ROUNDS,
    "encoder-rounds": ROUNDS // 2,
    "classifier-rounds": ROUNDS // 2,
    "local-epochs": 1,
    "batch-size": 32,
    "optimizer": "sgd",
    "momentum": 0.9,
    "lr": 0.01,
}
FEDERATIONS = (10, 100, 500)
# (name, label, run-config keys, federation sizes it applies to). 500 clients of 80 images (the
# FedSeq paper's 500 clients) hold the pathological partitions only: its α = 0 is #C=1.
PARTITIONS = (
    ("c1", "#C=1", {"partition": "classes", "classes-per-client": 1}, (100, 500)),
    ("c2", "#C=2", {"partition": "classes", "classes-per-client": 2}, FEDERATIONS),
    ("dir0.1", "Dir(0.1)", {"partition": "dirichlet", "alpha": 0.1}, (10, 100)),
    ("dir0.5", "Dir(0.5)", {"partition": "dirichlet", "alpha": 0.5}, (10, 100)),
)
OPTIMIZERS = (
    ("", "SGD lr 0.01", {}),
    ("-lr0.05", "SGD lr 0.05", {"lr": 0.05}),
    ("-adam", "Adam lr 1e-3", {"optimizer": "adam", "lr": 0.001}),
)
DATASETS = (("cifar10", "CIFAR-10"), ("fmnist", "Fashion-MNIST"))
FUZZED = {"fuzz-share": 0.1, "fuzz-kinds": "all", "fuzz-log": "{workdir}/fuzz.jsonl"}
# Flower's LocalDpMod on every train reply (the app's `local_dp_mod`): C = 1, δ = 1e-5, noise std
# C·√(2·ln(1.25/δ))/ε per parameter. The update-direction check is off in these rows: it would
# reject updates drowned in that noise (docs/privacy.md).
LOCAL_DP_EPSILON = 100.0
LOCAL_DP = {"local-dp-epsilon": LOCAL_DP_EPSILON, "local-dp-delta": 1e-5, "local-dp-clip": 1.0, "history-check": False}


def fedcat_k(clients: int) -> int:
    """FedCat's default K: 10 % of the nodes, at least 2 (`concatfl.strategies.FedCat`)."""
    return max(2, round(0.1 * clients))


def methods(clients: int) -> dict[str, dict[str, Any]]:
    """The rows: the app's run-config keys of each strategy line."""
    rows: dict[str, dict[str, Any]] = {
        "FedAvg (every node)": {"variant": "fedavg", "fraction-train": 1.0},
        "FedAvg (K/N)": {"variant": "fedavg", "fraction-train": fedcat_k(clients) / clients},
        "Flower's FedAvg (every node)": {"variant": "flower-fedavg", "fraction-train": 1.0},
        "FedSeq": {"variant": "fedseq"},
        "FedSeqInter": {"variant": "fedseq-inter"},
        "FedCat": {"variant": "fedcat"},
        "FedCat (K = N)": {"variant": "fedcat", "fedcat-k": clients},
        "FedConcat": {"variant": "fedconcat"},
        "FedConcat-ID": {"variant": "fedconcat-id"},
    }
    defaults = ("FedAvg (every node)", "FedSeq", "FedCat")
    for suffix, keys in (("10 % fuzzed", FUZZED), (f"LocalDpMod ε={LOCAL_DP_EPSILON:g}", LOCAL_DP)):
        rows.update({f"{name}, {suffix}": {**rows[name], **keys} for name in defaults})
    return rows


def settings() -> list[tuple[Setting, int, dict[str, Any]]]:
    """(setting, clients, run-config keys), first tier first: CIFAR-10 at lr 0.01."""
    found = []
    for optimizer, optimizer_label, optimizer_keys in OPTIMIZERS:
        for dataset, dataset_label in DATASETS:
            for clients in FEDERATIONS:
                for name, label, keys, sizes in PARTITIONS:
                    if clients not in sizes or (optimizer and (clients, name) != (10, "c2")):
                        continue
                    setting = Setting(
                        f"{dataset}-n{clients}-{name}{optimizer}",
                        f"{dataset_label}, {clients} × {TRAIN_IMAGES // clients:,}, {label}, {optimizer_label}",
                    )
                    found.append((setting, clients, {"dataset": dataset, **keys, **optimizer_keys}))
    return found


def suite() -> Suite:
    """Every method in every setting (choose with --setting / --method)."""
    cells = tuple(
        Cell(setting, method, clients, {**BASE, **keys, **row}, APP)
        for setting, clients, keys in settings()
        for method, row in methods(clients).items()
    )
    notes = (
        f"tests/apps/quickstart in its image mode: Flower's quickstart-pytorch CNN, SGD momentum 0.9 (or Adam), "
        f"batch 32, one local epoch, {ROUNDS} rounds, central evaluation on the 10,000 test images; "
        f"{TRAIN_IMAGES:,} training images (stratified) split by flwr-datasets' partitioners",
        "FedAvg (K/N): FedCat's default K of N nodes a round (10 %, at least 2); FedConcat and FedConcat-ID: "
        f"{ROUNDS // 2} encoder + {ROUNDS // 2} classifier rounds; every other row its class's default arguments",
        "runs in one process (concatfl.bench.inprocess): the app's ServerApp and ClientApp, no transport",
    )
    return Suite(
        SUITE, "small", "a user's FedAvg swapped for concatfl's strategies on real images", cells,
        (FINAL_ACCURACY, TOTAL_MEGABYTES, WALL_SECONDS), notes,
        subsample=Subsample(TRAIN_IMAGES, 10_000), in_process=True,
    )
