"""The benchmark suites: which runs make up each table, at which scale, and what was scaled down.

A suite is a list of cells, one per (setting, method); a setting is a column group of the
paper's table (dataset × partition), a method a row. Each cell is one run config (without the
seed) and a number of simulated clients.

* `fedcat`, `fedconcat`, `fedseq` follow the three papers' settings and come in three scales:
  `paper` (the papers' settings, meant for a GPU), `small` (a slice of the paper's experiment:
  each client holds the paper's amount of real data, but there are fewer clients, settings,
  methods and rounds; 18–27 min per suite and seed on 2 CPU cores, in process) and `smoke`
  (scikit-learn's digits, a few rounds; minutes). Each scale is a table of named knobs; every
  knob that differs from the paper scale is listed in the table's header, from → to. Every
  setting has a "Centralized" row: the same model and optimizer trained on the setting's whole
  training set by one client, the yardstick for the federated rows.
* `fedcat-digits`, `fedseq-digits`, `fedconcat-digits`, `baselines-digits` are the earlier
  single-setting digits comparisons, unchanged (same labels, same output paths).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import RunConfig
from .columns import (
    FINAL_ACCURACY,
    FINAL_ACCURACY_PERCENT,
    TOTAL_MEGABYTES,
    WALL_SECONDS,
    Column,
    label_stage_megabytes,
    mean_covered_classes,
    setup_value,
    stage_megabytes,
)
from .data import LABELS, Subsample

SCALES = ("smoke", "small", "paper")
Knobs = dict[str, Any]
# What a suite's builder gives for one dataset: its partitions (folder, label, run-config
# overrides), the settings every row shares (model, optimizer, rounds) and its methods (label →
# run-config overrides).
Rows = tuple[list[tuple[str, str, dict[str, Any]]], dict[str, Any], dict[str, dict[str, Any]]]


@dataclass(frozen=True)
class Setting:
    """A column group of the table: one dataset × partition. `name` is its folder ("" when a
    suite has a single, unnamed setting), `label` its column title."""

    name: str
    label: str


@dataclass(frozen=True)
class Cell:
    """One (setting, method) of a suite: the run config of each of its seeds, minus the seed.

    `app_dir` is the Flower app the cell runs (None: concatfl's own). A string value of the run
    config may hold ``{workdir}``, replaced by the run's folder (a file the run writes beside
    its outputs, e.g. the fuzzing mod's log).
    """

    setting: Setting
    method: str
    num_supernodes: int
    run_config: Mapping[str, Any]
    app_dir: Path | None = None

    @property
    def dataset(self) -> str:
        """The dataset the cell trains on."""
        return str(self.run_config.get("dataset", "digits"))

    def workdir(self, suite_dir: Path, seed: int) -> Path:
        """Where seed `seed` of this cell runs; its metrics.json is `<workdir>/output/metrics.json`."""
        return suite_dir / self.setting.name / slug(self.method) / f"seed-{seed}"


@dataclass(frozen=True)
class Suite:
    """A benchmark table: its cells, the columns it reports and the notes its header carries.

    `columns[0]` is the accuracy the `paper` figures sit next to; `paper` is None for suites
    without a paper column, else (method, setting name) → the paper's figure (None: unknown).
    `targets` adds "rounds to reach t × the reference accuracy" columns. `subsample` is the real
    data the scale trains on (None: the whole dataset). `in_process` runs the cells with
    `concatfl.bench.inprocess` instead of `flwr run` simulations; `extra_plot(suite, runs,
    plots_dir)` draws a suite-specific figure beside the standard ones.
    """

    name: str
    scale: str
    description: str
    cells: tuple[Cell, ...]
    columns: tuple[Column, ...]
    notes: tuple[str, ...] = ()
    targets: tuple[float, ...] = ()
    paper: Mapping[tuple[str, str], float | None] | None = None
    subsample: Subsample | None = None
    in_process: bool = False
    extra_plot: Callable[[Suite, dict[tuple[str, str], list[dict[str, Any]]], Path], Path] | None = None

    @property
    def settings(self) -> list[Setting]:
        """The settings in table order."""
        return list(dict.fromkeys(cell.setting for cell in self.cells))

    @property
    def methods(self) -> list[str]:
        """The method labels in table order."""
        return list(dict.fromkeys(cell.method for cell in self.cells))

    def cell(self, setting: Setting, method: str) -> Cell | None:
        """The cell of (setting, method), if the suite runs that combination."""
        return next((c for c in self.cells if c.setting == setting and c.method == method), None)


# The papers' sequential algorithms: every reply taken as it is (no damped step, no bound).
PAPER_EXACT = {
    "fedcat-hop-step": 1.0,
    "fedcat-hop-clip": 0.0,
    "fedseq-hop-step": 1.0,
    "fedseq-hop-clip": 0.0,
    "fedseq-witness": False,
    "update-clip": 0.0,
    "weight-clip": 0.0,
}
SEQUENTIAL = ("fedcat", "fedseq", "fedseq-inter")


def paper_exact(config: Mapping[str, Any]) -> dict[str, Any]:
    """`config`, with the papers' exact algorithm for FedCat and FedSeq rows (others unchanged)."""
    return {**PAPER_EXACT, **config} if config.get("strategy") in SEQUENTIAL else dict(config)


def slug(label: str) -> str:
    """A method label as a folder name (the earlier harness's rule: output paths stay put)."""
    return "".join(ch if ch.isalnum() else "-" for ch in label.lower()).strip("-")


# --------------------------------------------------------------------------- the papers' suites



def _paper_table(methods: dict[str, tuple[float | None, ...]], settings: tuple[str, ...]) -> dict[tuple[str, str], float | None]:
    """(method label, setting name) → figure, from one row of figures per method (None: not reported)."""
    return {
        (method, setting): figure
        for method, figures in methods.items()
        for setting, figure in zip(settings, figures, strict=True)
        if figure is not None
    }


# The row of every setting that trains on all of the setting's data in one client.
CENTRALIZED = "Centralized"

# The papers' own figures (test accuracy, %, at the papers' scale), keyed by (method label, setting
# name), as the papers' tables report them. FedCat: Tables 1/3 (final accuracy after 200 rounds);
# FedConcat: Table 1 (3 seeds; Fashion-MNIST read at classifier round 173); FedSeq: accuracy
# averaged over the last 100 rounds.
PAPER: dict[str, dict[tuple[str, str], float | None]] = {
    "fedcat": _paper_table(
        {
            "FedAvg": (99.04, 99.31, 99.37, 51.01, 54.32, 55.69),
            "FedProx": (99.02, 99.27, 99.30, 51.85, 54.99, 55.58),
            "SCAFFOLD": (98.92, 99.28, 99.32, 52.81, 56.09, 58.13),
            "FedCat": (99.21, 99.42, 99.40, 56.16, 57.89, 61.45),
            "FedCat w/ GC (no concatenation)": (None, None, None, 51.02, 57.20, 57.54),
            "FedCat w/ DC (random selection)": (None, None, None, 55.06, 57.51, 59.12),
        },
        ("mnist-dir0.1", "mnist-dir0.5", "mnist-dir1", "cifar10-dir0.1", "cifar10-dir0.5", "cifar10-dir1"),
    ),
    "fedconcat": _paper_table(
        {
            "FedAvg": (79.0, 84.7, 85.1, 87.5, 53.6, 57.6, 53.0, 59.9),
            "FedProx": (81.8, None, None, None, 53.1, None, None, None),
            "MOON": (81.4, None, None, None, 53.4, None, None, None),
            "FedRS": (78.3, None, None, None, 53.8, None, None, None),
            "FedLC": (77.7, None, None, None, 49.8, None, None, None),
            "FedConcat": (84.4, 87.1, 84.5, 87.7, 56.9, 62.0, 57.7, 64.2),
            "FedConcat-ID": (83.0, 86.6, 85.0, None, 56.5, 61.8, 56.9, 63.7),
            CENTRALIZED: (88.4, 88.4, 88.4, 88.4, 70.2, 70.2, 70.2, 70.2),
        },
        ("fmnist-c2", "fmnist-c3", "fmnist-dir0.1", "fmnist-dir0.5", "cifar10-c2", "cifar10-c3", "cifar10-dir0.1", "cifar10-dir0.5"),
    ),
    "fedseq": _paper_table(
        {
            "FedAvg": (71.41, 76.82, 77.98),
            "SCAFFOLD": (79.02, 76.47, 78.25),
            "FedDyn": (83.26, 81.74, 82.41),
            "FedSeq (greedy+KL)": (82.21, 82.20, 82.23),
            "FedSeqInter": (82.65, 82.79, 83.32),
            "FedSeq + FedDyn": (82.90, 83.55, 83.95),
            CENTRALIZED: (85.72, 85.72, 85.72),
        },
        ("cifar10-dir0", "cifar10-dir0.2", "cifar10-dir0.5"),
    ),
}

# Knobs set the same way in every suite at a scale: which rows run, what differs on CIFAR-10
# (knob → value, applied to its settings only), how long the centralized row trains.
_EVERY_ROW = {"methods": None, "on CIFAR-10": {}, "centralized epochs": 10}
_SMOKE_DATA = {"datasets": ("digits",), "train images": None, "test images": None, "centralized epochs": 3}
_SMALL_TEST_IMAGES = 2000
_CLIENTS_TRAIN_ON_ALL = {"local-test-fraction": 0.0}  # clients train on their whole partition, as in the papers


@dataclass(frozen=True)
class Blueprint:
    """A papers' suite at any scale: `rows` gives, per dataset and its knobs, the partitions,
    shared settings and methods that `cells` turns into the table's cells."""

    name: str
    description: str
    rows: Callable[[str, Knobs], Rows]
    paper_knobs: Knobs
    scale_knobs: dict[str, Knobs]  # per scale: the knobs that differ from the paper's
    columns: tuple[Column, ...]
    choices: tuple[str, ...]  # settings the harness chose where the brief gives no paper value
    targets: tuple[float, ...] = ()
    knob_notes: dict[str, str] = field(default_factory=dict)  # knob → why/what, shown with a change
    scale_notes: dict[str, str] = field(default_factory=dict)  # scale → what its header must also say

    def knobs(self, scale: str) -> Knobs:
        """Every knob at `scale`."""
        return {**self.paper_knobs, **self.scale_knobs.get(scale, {})}

    def cells(self, knobs: Knobs) -> list[Cell]:
        """The suite's cells under `knobs`."""
        return _cells(knobs, self.rows)

    def suite(self, scale: str) -> Suite:
        """The suite at `scale`, its header listing every knob changed from the paper scale."""
        knobs = self.knobs(scale)
        changed = [
            f"{knob}: {_show(self.paper_knobs[knob])} → {_show(value)}"
            + (f" ({self.knob_notes[knob]})" if knob in self.knob_notes else "")
            for knob, value in knobs.items()
            if value != self.paper_knobs[knob]
        ]
        scaled = (
            "Scaled down from the paper (paper → here): " + "; ".join(changed) + "."
            if changed
            else "Paper scale: the papers' settings as the harness knows them (see the harness's choices)."
        )
        subsample = (
            Subsample(knobs["train images"], knobs["test images"]) if knobs["train images"] is not None else None
        )
        return Suite(
            name=self.name,
            scale=scale,
            description=self.description,
            cells=tuple(self.cells(knobs)),
            columns=self.columns,
            notes=(
                scaled,
                "Harness choices (no paper value given to the harness): " + "; ".join(self.choices) + ".",
                "FedCat and FedSeq rows run the papers' algorithms exactly (hop-step 1, hop-clip 0, update-clip 0), "
                "except a row marked 'default', which runs concatfl's default hop rules and reply bounds.",
                *([self.scale_notes[scale]] if scale in self.scale_notes else []),
            ),
            targets=self.targets,
            paper=PAPER[self.name],
            subsample=subsample,
        )


def _show(value: Any) -> str:
    if value is None:
        return "all"
    if isinstance(value, tuple):
        return ", ".join(_show(v) for v in value)
    if isinstance(value, dict):
        return "[" + "; ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "]" if value else "no change"
    if isinstance(value, str):
        return LABELS.get(value, value)
    return f"{value:,}" if isinstance(value, int) else str(value)


def _cells(knobs: Knobs, rows: Callable[[str, Knobs], Rows]) -> list[Cell]:
    """Cells for every dataset × partition × method the knobs keep, then a centralized row per
    setting (it keeps only the model and optimizer of the shared settings). A dataset's rows are
    built from its own knobs: CIFAR-10's take the scale's "on CIFAR-10" overrides."""
    cells = []
    for dataset in knobs["datasets"]:
        local = _knobs_on(dataset, knobs)
        partitions, shared, every = rows(dataset, local)
        kept = _kept_methods(local, every)
        for name, label, partition in partitions:
            setting = Setting(f"{dataset}-{name}", f"{LABELS[dataset]} {label}")
            base = {"dataset": dataset, **partition, **_CLIENTS_TRAIN_ON_ALL, **shared}
            base["min-available-nodes"] = local["clients"]
            for method in kept:
                cells.append(Cell(setting, method, local["clients"], paper_exact({**base, **every[method]})))
            cells.append(Cell(setting, CENTRALIZED, 1, _centralized(dataset, shared, local["centralized epochs"])))
    return cells


def _knobs_on(dataset: str, knobs: Knobs) -> Knobs:
    """The knobs `dataset`'s settings run with: the scale's, and on CIFAR-10 its "on CIFAR-10" ones."""
    if dataset != "cifar10":
        return knobs
    unknown = sorted(set(knobs["on CIFAR-10"]) - set(knobs))
    if unknown:
        raise ValueError(f"unknown knob(s) {unknown} in the scale's 'on CIFAR-10'; known: {sorted(knobs)}")
    return {**knobs, **knobs["on CIFAR-10"]}


def _kept_methods(knobs: Knobs, every: Mapping[str, Any]) -> list[str]:
    """The method labels the knobs run, in the table's order (None: all of them)."""
    wanted = knobs["methods"]
    if wanted is None:
        return list(every)
    unknown = [method for method in wanted if method not in every]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown} in the scale's knobs; known: {list(every)}")
    return [method for method in every if method in wanted]


# Run-config keys of a suite's `shared` settings that describe the model and its local training.
_TRAINING_KEYS = ("model", "batch-size", "lr", "momentum", "weight-decay")


def _centralized(dataset: str, shared: Mapping[str, Any], epochs: int) -> dict[str, Any]:
    """One client holding the setting's whole training set, one local epoch per round, `epochs`
    rounds: the same model and optimizer as the federated rows (FedAvg over a single client)."""
    training = {key: shared[key] for key in _TRAINING_KEYS if key in shared}
    return {
        "dataset": dataset,
        "strategy": "fedavg",
        "partition": "iid",
        **_CLIENTS_TRAIN_ON_ALL,
        **training,
        "min-available-nodes": 1,
        "fraction-train": 1.0,
        "local-epochs": 1,
        "num-server-rounds": epochs,
    }


def _dirichlet(alphas: tuple[float, ...], label: Callable[[float], str]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(f"dir{alpha:g}", label(alpha), {"partition": "dirichlet", "alpha": alpha}) for alpha in alphas]


# FedProx μ of the FedCat paper (MNIST 0.1, CIFAR-10 0.01); Fashion-MNIST and digits: harness's choice.
FEDCAT_PROX_MU = {"mnist": 0.1, "fmnist": 0.1, "cifar10": 0.01, "digits": 0.1}


# FedCat as concatfl runs it by default: damped, bounded hops (docs/strategies.md), not the paper's rule.
DEFAULT_FEDCAT_LABEL = f"FedCat (hop-clip {RunConfig.fedcat_hop_clip:g}, hop-step {RunConfig.fedcat_hop_step}: default)"
# concatfl's default FedCat: its hop rules and the bounds on every reply (the papers' rows have neither).
DEFAULT_FEDCAT_HOPS = {
    "fedcat-hop-step": RunConfig.fedcat_hop_step,
    "fedcat-hop-clip": RunConfig.fedcat_hop_clip,
    "update-clip": RunConfig.update_clip,
    "weight-clip": RunConfig.weight_clip,
}


def _fedcat(dataset: str, knobs: Knobs) -> Rows:
    methods = {
        "FedAvg": {"strategy": "fedavg"},
        "FedProx": {"strategy": "fedavg", "local-objective": "fedprox", "proximal-mu": FEDCAT_PROX_MU[dataset]},
        "SCAFFOLD": {"strategy": "scaffold"},
        "FedCat": {"strategy": "fedcat"},
        "FedCat w/ GC (no concatenation)": {"strategy": "fedcat", "fedcat-concat": False},
        "FedCat w/ DC (random selection)": {"strategy": "fedcat", "fedcat-selection": "random"},
        DEFAULT_FEDCAT_LABEL: {"strategy": "fedcat", **DEFAULT_FEDCAT_HOPS},
    }
    shared = {
        "model": knobs["model"],
        "num-server-rounds": knobs["rounds"],
        # FedCat's K devices per round is round(fraction-train × N); FedAvg & co. train K clients too.
        "fraction-train": knobs["devices per round (K)"] / knobs["clients"],
        "local-epochs": knobs["local epochs"],
        "batch-size": 50,
        "lr": 0.01,
        "momentum": 0.9,
    }
    return _dirichlet(knobs["Dirichlet α"], lambda a: f"Dir({a:.1f})"), shared, methods


# The FedConcat paper's label skews: table column → (setting folder, label, run-config overrides).
FEDCONCAT_PARTITIONS = {
    label: (name, label, overrides)
    for name, label, overrides in [
        ("c2", "#C=2", {"partition": "classes", "classes-per-client": 2}),
        ("c3", "#C=3", {"partition": "classes", "classes-per-client": 3}),
        *_dirichlet((0.1, 0.5), lambda a: f"Dir({a:g})"),
    ]
}


def _fedconcat(_: str, knobs: Knobs) -> Rows:
    baseline_rounds = {"num-server-rounds": knobs["baseline rounds"]}
    concat_rounds = {
        "fedconcat-encoder-rounds": knobs["encoder rounds"],
        "fedconcat-classifier-rounds": knobs["classifier rounds"],
    }
    methods = {
        "FedAvg": {"strategy": "fedavg", **baseline_rounds},
        "FedProx": {"strategy": "fedavg", "local-objective": "fedprox", "proximal-mu": 0.01, **baseline_rounds},
        "MOON": {"strategy": "fedavg", "local-objective": "moon", **baseline_rounds},
        "FedRS": {"strategy": "fedavg", "local-objective": "fedrs", **baseline_rounds},
        "FedLC": {"strategy": "fedavg", "local-objective": "fedlc", **baseline_rounds},
        "FedConcat": {"strategy": "fedconcat", **concat_rounds},
        "FedConcat-ID": {"strategy": "fedconcat-id", **concat_rounds},
    }

    shared = {
        "model": knobs["model"],
        "local-epochs": knobs["local epochs"],
        "batch-size": 64,
        "lr": 0.01,
        "momentum": 0.9,
        "weight-decay": 1e-5,
        "fedconcat-clusters": str(knobs["clusters (K)"]),
        "fedconcat-classifier-steps": 3,
    }
    return [FEDCONCAT_PARTITIONS[label] for label in knobs["partitions"]], shared, methods


def _fedseq(_: str, knobs: Knobs) -> Rows:
    fedseq = {"strategy": "fedseq", "report-label-counts": True}
    prox = {"local-objective": "fedprox", "proximal-mu": 0.01}
    dyn = {"local-objective": "feddyn", "feddyn-alpha": 0.1}
    methods = {
        "FedAvg": {"strategy": "fedavg"},
        "FedProx": {"strategy": "fedavg", **prox},
        "SCAFFOLD": {"strategy": "scaffold"},
        "FedDyn": {"strategy": "fedavg", **dyn},
        "FedSeq (greedy+KL)": fedseq,
        "FedSeq (random grouping)": {**fedseq, "fedseq-grouping": "random"},
        "FedSeqInter": {**fedseq, "strategy": "fedseq-inter"},
        "FedSeq + FedProx": {**fedseq, **prox},
        "FedSeq + FedDyn": {**fedseq, **dyn},
    }

    shared = {
        "model": knobs["model"],
        "num-server-rounds": knobs["rounds"],
        "fraction-train": 0.2,
        "local-epochs": 1,
        "batch-size": 64,
        "lr": 0.01,
        "momentum": 0.0,
        "weight-decay": 4e-4,
        "fedseq-min-samples": knobs["superclient min samples"],
        "fedseq-max-clients": 11,
        "fedseq-pretrain-epochs": knobs["pre-training epochs"],
    }
    alphas = _dirichlet(knobs["α"], lambda a: "α=0 (1 class/client)" if a == 0 else f"α={a:g}")
    return alphas, shared, methods


BLUEPRINTS: dict[str, Blueprint] = {
    "fedcat": Blueprint(
        "fedcat",
        "FedCat paper, Tables 1/3: McMahan CNN, SGD lr 0.01, momentum 0.9, batch 50; K devices per "
        "round (FedAvg, FedProx, SCAFFOLD: K clients per round); FedProx μ: MNIST 0.1, CIFAR-10 0.01",
        _fedcat,
        {
            "datasets": ("mnist", "fmnist", "cifar10"),
            "Dirichlet α": (0.1, 0.5, 1.0),
            "model": "mcmahan-cnn",
            "clients": 100,
            "devices per round (K)": 10,
            "rounds": 200,
            "local epochs": 5,
            "train images": None,
            "test images": None,
            **_EVERY_ROW,
        },
        {
            "small": {
                "datasets": ("mnist", "cifar10"),
                "Dirichlet α": (0.1,),
                "clients": 20,
                "devices per round (K)": 4,
                "rounds": 16,
                "train images": 20 * 600,
                "test images": _SMALL_TEST_IMAGES,
                "methods": ("FedAvg", "SCAFFOLD", "FedCat", DEFAULT_FEDCAT_LABEL),
                "on CIFAR-10": {"Dirichlet α": (0.1, 1.0), "methods": ("FedAvg", "FedCat", DEFAULT_FEDCAT_LABEL)},
            },
            "smoke": {**_SMOKE_DATA, "clients": 10, "devices per round (K)": 2, "rounds": 4},
        },
        (FINAL_ACCURACY_PERCENT, TOTAL_MEGABYTES, WALL_SECONDS),
        (
            "200 rounds at paper scale (the brief gives no round count)",
            "FedProx μ 0.1 for Fashion-MNIST and digits",
            "FedCat λ = 2, ε = 0.5 (concatfl's defaults)",
            "accuracy = the global model's on the whole test set after the last round",
        ),
        knob_notes={
            "devices per round (K)": "fraction-train K/clients",
            "datasets": "Fashion-MNIST is not in the paper's tables",
            "rounds": "4 aggregations of the K copies; the McMahan CNN trains ~1,700 images/s here",
            "train images": "600 per client, the paper's MNIST (its CIFAR-10: 500)",
            "methods": "the rows the time allows: FedProx changed little in the paper, the ablations "
            "are CIFAR-10-only rows there; concatfl's default FedCat beside the paper's",
            "on CIFAR-10": "Dir(1.0) beside Dir(0.1): the paper's mildest skew, to see whether FedAvg and FedCat "
            "learn there in the same 16 rounds",
        },
        scale_notes={
            "small": "Why FedAvg stays under the bar on CIFAR-10 Dir(0.1) here: 16 rounds of 4 devices holding one "
            "or two classes each, against the paper's 200 rounds of 10 (its FedAvg: 51 %); MNIST's FedAvg, and "
            "CIFAR-10's at Dir(1.0), learn in the same budget"
        },
    ),
    "fedconcat": Blueprint(
        "fedconcat",
        "FedConcat paper, Table 1: simple CNN, SGD lr 0.01, momentum 0.9, weight decay 1e-5, batch 64; "
        "K clusters; FedConcat's head trains 3 local steps per classifier round; the baselines "
        "(FedAvg + local objectives) get a round budget of about the same total communication — "
        "compare the MB table",
        _fedconcat,
        {
            "datasets": ("fmnist", "cifar10"),
            "partitions": tuple(FEDCONCAT_PARTITIONS),
            "model": "simple-cnn",
            "clients": 40,
            "clusters (K)": 5,
            "local epochs": 10,
            "baseline rounds": 50,
            "encoder rounds": 31,
            "classifier rounds": 200,
            "train images": None,
            "test images": None,
            **_EVERY_ROW,
        },
        {
            "small": {
                "partitions": ("#C=2",),
                "clients": 20,
                "local epochs": 2,
                "baseline rounds": 15,
                "encoder rounds": 9,
                "classifier rounds": 60,
                "train images": 20 * 1500,
                "test images": _SMALL_TEST_IMAGES,
                "on CIFAR-10": {"partitions": ("#C=2", "Dir(0.5)"), "methods": ("FedAvg", "FedConcat", "FedConcat-ID")},
            },
            "smoke": {
                **_SMOKE_DATA,
                "model": "mlp",
                "clients": 10,
                "baseline rounds": 3,
                "encoder rounds": 2,
                "classifier rounds": 12,
            },
        },
        (
            FINAL_ACCURACY_PERCENT,
            TOTAL_MEGABYTES,
            Column("stage 1 MB (labels)", label_stage_megabytes),
            Column("encoder-training MB", stage_megabytes("encoder-training")),
            Column("encoder-broadcast MB", stage_megabytes("encoder-broadcast")),
            Column("classifier MB", stage_megabytes("classifier")),
            WALL_SECONDS,
        ),
        (
            "Fashion-MNIST gets CIFAR-10's round budget (50 FedAvg rounds ≙ 31 encoder + 200 classifier rounds)",
            "all clients train every round (fraction-train 1.0)",
            "FedProx μ 0.01, MOON μ 1 and τ 0.5, FedRS α 0.5, FedLC τ 1 (concatfl's defaults)",
            "accuracy = the global model's on the whole test set after the last round",
        ),
        knob_notes={
            "model": "simple-cnn needs ≥ 16×16 inputs",
            "partitions": "the paper's headline column; each partition adds 10 runs per seed",
            "local epochs": "a round of 10 epochs is ~15 s (Fashion-MNIST) to ~25 s (CIFAR-10) of training here",
            "baseline rounds": "encoder/classifier rounds in the same ratio",
            "train images": "1,500 per client, the paper's Fashion-MNIST (its CIFAR-10: 1,250)",
            "on CIFAR-10": "the paper's question (FedConcat against FedAvg) in the time left, on #C=2 and on "
            "Dir(0.5), a skew where FedAvg learns in 15 rounds",
        },
        scale_notes={
            "small": "Why FedAvg stays under the bar on CIFAR-10 #C=2 here: 15 rounds of 2 local epochs on clients "
            "of two classes, against the paper's 50 rounds of 10 epochs (its FedAvg: 53.6 %); at Dir(0.5) it learns "
            "in the same budget"
        },
    ),
    "fedseq": Blueprint(
        "fedseq",
        "FedSeq paper, Tables I–III: LeNet-5, SGD lr 0.01, weight decay 4e-4, no momentum, batch 64, "
        "1 local epoch, 20 % of the clients (FedSeq: of the superclients) per round; superclients of "
        "at most 11 clients; FedDyn α 0.1",
        _fedseq,
        {
            "datasets": ("cifar10", "fmnist"),
            "α": (0.0, 0.2, 0.5),
            "model": "lenet5",
            "clients": 500,
            "rounds": 500,
            "superclient min samples": 800,
            "pre-training epochs": 10,
            "train images": None,
            "test images": None,
            **_EVERY_ROW,
        },
        {
            "small": {
                "datasets": ("cifar10",),
                "α": (0.0,),
                "clients": 100,
                "rounds": 40,
                "pre-training epochs": 5,
                "train images": 100 * 100,
                "test images": _SMALL_TEST_IMAGES,
                "methods": (
                    "FedAvg",
                    "SCAFFOLD",
                    "FedDyn",
                    "FedSeq (greedy+KL)",
                    "FedSeq (random grouping)",
                    "FedSeqInter",
                    "FedSeq + FedDyn",
                ),
            },
            "smoke": {
                **_SMOKE_DATA,
                "model": "mlp",
                "clients": 10,
                "rounds": 3,
                "superclient min samples": 230,
                "pre-training epochs": 1,
            },
        },
        (
            FINAL_ACCURACY_PERCENT,
            TOTAL_MEGABYTES,
            WALL_SECONDS,
            Column("balance ratio (true labels)", setup_value("mean_balance_ratio_true")),
            Column("balance ratio (estimated)", setup_value("mean_balance_ratio_estimated")),
            Column("covered classes per superclient (true labels)", mean_covered_classes("true")),
        ),
        (
            "500 rounds at paper scale (the brief gives no round count)",
            "FedProx μ 0.01",
            "pre-training 10 epochs (concatfl's default)",
            "FedSeq runs ask the clients for their true label counts (report-label-counts) only to "
            "report the true balance ratio; that query is part of their MB (a few hundred bytes per client)",
            "accuracy = the global model's on the whole test set after the last round",
        ),
        targets=(0.7, 0.8),
        knob_notes={
            "train images": "100 per client, the paper's; a superclient of ≥ 800 images has ≥ 8 one-class "
            "clients, so it can cover every class",
            "model": "LeNet-5 needs ≥ 16×16 inputs",
            "datasets": "the paper's dataset; Fashion-MNIST is not in its tables",
            "α": "FedSeq's hardest skew only; each α adds 8 runs per seed",
            "rounds": "LeNet-5 trains ~1,260 CIFAR-10 images/s here",
            "pre-training epochs": "each FedSeq run pre-trains every client's model",
            "methods": "the paper's rows and random grouping; FedProx rows are not in its tables",
        },
        scale_notes={
            "small": "Why no row clears the bar here: a client's 100 images are 2 SGD steps (batch 64, no "
            "momentum) a round, and 40 rounds are a sliver of the paper's budget: at α=0 its FedAvg needs 4,036 "
            "rounds, FedSeq 594, to reach 70 % of centralized accuracy"
        },
    ),
}


# --------------------------------------------------------------------------- the digits suites


def _single_setting(
    name: str,
    description: str,
    num_supernodes: int,
    shared: dict[str, Any],
    methods: list[tuple[str, dict[str, Any]]],
    extra_columns: tuple[Column, ...] = (),
) -> Suite:
    """A one-setting digits comparison; its cells live directly under `<out>/<name>/`."""
    setting = Setting("", "")
    cells = tuple(
        Cell(setting, label, num_supernodes, paper_exact({**shared, **overrides})) for label, overrides in methods
    )
    columns = (FINAL_ACCURACY, TOTAL_MEGABYTES, WALL_SECONDS, *extra_columns)
    return Suite(name, "digits", description, cells, columns)


DIGITS_DIRICHLET = {"dataset": "digits", "partition": "dirichlet", "alpha": 0.1, "num-server-rounds": 40}
DIGITS_SUITES: dict[str, Suite] = {
    "fedcat-digits": _single_setting(
        "fedcat-digits",
        "digits, 20 clients, Dirichlet α=0.1, 40 rounds, K=4 devices per round (FedAvg: fraction 0.2)",
        20,
        {**DIGITS_DIRICHLET, "fraction-train": 0.2, "min-available-nodes": 20},
        [
            ("FedAvg", {"strategy": "fedavg"}),
            ("FedCat", {"strategy": "fedcat", "fedcat-k": 4}),
            ("FedCat w/ GC (no concatenation)", {"strategy": "fedcat", "fedcat-k": 4, "fedcat-concat": False}),
            ("FedCat w/ DC (random selection)", {"strategy": "fedcat", "fedcat-k": 4, "fedcat-selection": "random"}),
        ],
    ),
    "fedseq-digits": _single_setting(
        "fedseq-digits",
        "digits, 50 clients, α=0 (one class per client), 30 rounds, fraction-train 0.2 (rows marked "
        "0.4: 0.4), no local test split, min-samples 270 (10 clients per superclient, 5 superclients: "
        "at 0.2 FedSeqInter has one slot and equals FedSeq, at 0.4 it has two)",
        50,
        {
            "dataset": "digits",
            "partition": "dirichlet",
            "alpha": 0.0,
            "num-server-rounds": 30,
            "fraction-train": 0.2,
            "local-test-fraction": 0.0,
            "min-available-nodes": 50,
            "fedseq-min-samples": 270,
            "fedseq-pretrain-epochs": 10,
            "report-label-counts": True,
        },
        [
            ("FedAvg", {"strategy": "fedavg"}),
            ("FedSeq (greedy+KL, paper's ½/½ merge)", {"strategy": "fedseq"}),
            ("FedSeq (greedy+KL, weighted merge)", {"strategy": "fedseq", "fedseq-greedy-merge": "weighted"}),
            ("FedSeqInter (greedy+KL, paper's merge)", {"strategy": "fedseq-inter"}),
            ("FedSeq (random grouping)", {"strategy": "fedseq", "fedseq-grouping": "random"}),
            ("FedAvg, 0.4", {"strategy": "fedavg", "fraction-train": 0.4}),
            ("FedSeq (greedy+KL, paper's merge), 0.4", {"strategy": "fedseq", "fraction-train": 0.4}),
            ("FedSeqInter (greedy+KL, paper's merge), 0.4", {"strategy": "fedseq-inter", "fraction-train": 0.4}),
        ],
        (
            Column("balance ratio (true labels)", setup_value("mean_balance_ratio_true")),
            Column("balance ratio (estimated)", setup_value("mean_balance_ratio_estimated")),
        ),
    ),
    "fedconcat-digits": _single_setting(
        "fedconcat-digits",
        "digits, 20 clients, #C=2 (two classes per client); FedConcat: K=5 clusters, 10 encoder + "
        "20 classifier rounds; FedAvg: 16 rounds ≈ the same total bytes (see the MB column)",
        20,
        {"dataset": "digits", "partition": "classes", "classes-per-client": 2, "min-available-nodes": 20},
        [
            ("FedAvg", {"strategy": "fedavg", "num-server-rounds": 16}),
            ("FedConcat", {"strategy": "fedconcat"}),
            ("FedConcat-ID", {"strategy": "fedconcat-id"}),
        ],
        (
            Column("stage 1 MB (labels)", label_stage_megabytes),
            Column("encoder-training MB", stage_megabytes("encoder-training")),
            Column("encoder-broadcast MB", stage_megabytes("encoder-broadcast")),
            Column("classifier MB", stage_megabytes("classifier")),
        ),
    ),
    "baselines-digits": _single_setting(
        "baselines-digits",
        "digits, 20 clients, Dirichlet α=0.1, 40 rounds for every method (FedConcat: 20 encoder + 20 "
        "classifier rounds), fraction-train 0.2 (FedAvg/SCAFFOLD: 4 clients per round, FedCat: K=4, "
        "FedSeq: 1 of ~5 superclients of ≥230 samples); FedProx μ=0.01, FedDyn α=0.1 (the FedSeq paper's), "
        "MOON μ=1 τ=0.5, FedRS α=0.5, FedLC τ=1",
        20,
        {
            **DIGITS_DIRICHLET,
            "fraction-train": 0.2,
            "min-available-nodes": 20,
            "fedcat-k": 4,
            "fedseq-min-samples": 230,
            "fedconcat-encoder-rounds": 20,
            "fedconcat-classifier-rounds": 20,
        },
        [
            ("FedAvg", {"strategy": "fedavg"}),
            ("FedProx", {"strategy": "fedprox", "proximal-mu": 0.01}),
            ("SCAFFOLD", {"strategy": "scaffold"}),
            ("FedCat", {"strategy": "fedcat"}),
            ("FedSeq", {"strategy": "fedseq"}),
            ("FedSeqInter", {"strategy": "fedseq-inter"}),
            ("FedConcat", {"strategy": "fedconcat"}),
            ("FedConcat-ID", {"strategy": "fedconcat-id"}),
            ("FedSeq + FedDyn", {"strategy": "fedseq", "local-objective": "feddyn", "feddyn-alpha": 0.1}),
            ("FedCat + FedProx", {"strategy": "fedcat", "local-objective": "fedprox", "proximal-mu": 0.01}),
            ("FedAvg + FedDyn", {"strategy": "fedavg", "local-objective": "feddyn", "feddyn-alpha": 0.1}),
            ("FedAvg + MOON", {"strategy": "fedavg", "local-objective": "moon"}),
            ("FedAvg + FedRS", {"strategy": "fedavg", "local-objective": "fedrs"}),
            ("FedAvg + FedLC", {"strategy": "fedavg", "local-objective": "fedlc"}),
        ],
    ),
}

SUITE_NAMES = (*BLUEPRINTS, *DIGITS_SUITES)


def get_suite(name: str, scale: str | None = None) -> Suite:
    """Suite `name` at `scale` (papers' suites: default `smoke`; digits suites: fixed, no scale)."""
    if name in DIGITS_SUITES:
        if scale is not None:
            raise ValueError(f"{name} has a fixed scale; --scale applies to {', '.join(BLUEPRINTS)}")
        return DIGITS_SUITES[name]
    if name not in BLUEPRINTS:
        raise ValueError(f"unknown suite {name!r}; known: {', '.join(SUITE_NAMES)}")
    scale = scale or "smoke"
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; known: {', '.join(SCALES)}")
    return BLUEPRINTS[name].suite(scale)
