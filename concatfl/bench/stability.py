"""The `sequential-stability` suite: where the papers' sequential algorithms collapse, and what
concatfl's hop rules change.

FedAvg (with FedCat's K devices per round: equal participation; and with every node), FedCat and
FedSeq (the paper's algorithm; the fixed damped step η = 0.5 with the hop bound; the adaptive
step `hop_step='auto'`, which reads no server data) at equal rounds on digits, over a grid of the
quantities that decide whether a chain of label-skewed clients keeps what it learned:

* the local step: lr and momentum (an effective step lr/(1 − momentum)) and local epochs, and
  the optimizer users ordinarily run (SGD lr 0.1 momentum 0.9 for 1 and 5 epochs, Adam at
  lr 1e-3 and 1e-2);
* the label skew: two classes per client (#C=2) or Dirichlet α = 0.1;
* the chain length and federation size: K = 4 devices per round for FedCat of 10 clients, K = 8
  of 20, K = 6 of 30; FedSeq's superclients of about 5 or 8 clients;
* the client: concatfl's ClientApp (an MLP of 2×200), or the user-style app of
  tests/apps/quickstart (its own 64-64-32 network, SGD momentum 0.9, batch 16, one epoch, at lr
  0.01 / 0.05 / 0.1) with its strategies' defaults (FedCat: K = 2 of 10; FedSeq: every
  superclient each round).

Besides accuracy, each cell reports the measurements that explain it, from the strategies'
`divergence` records: how much longer later hops were than first hops (`hop_length_ratio`),
the spread of the averaged models relative to how far they moved, and the smallest step the
bound applied. The runs go through `concatfl.bench.inprocess` (the ServerApp and ClientApp in
one process: ~200 runs fit about an hour on 2 cores). `map.png` plots each method's accuracy
over the settings, FedAvg as the reference line.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .columns import FINAL_ACCURACY, TOTAL_MEGABYTES, WALL_SECONDS, Column, Metrics
from .data import Subsample
from .inprocess import PROJECT_DIR
from .suites import PAPER_EXACT, Cell, Setting, Suite

SUITE = "sequential-stability"
MNIST_SUITE = "sequential-stability-mnist"
MAP_PLOT = "map.png"

CLIENTS = 10
DEVICES_PER_ROUND = 4  # K; FedAvg trains the same number of clients per round
SAMPLES_PER_CLIENT = 1437 // CLIENTS  # digits' 1,437 training images, no local test split
BASE = {
    "dataset": "digits",
    "partition": "classes",
    "classes-per-client": 2,
    "num-server-rounds": 30,
    "batch-size": 16,
    "local-test-fraction": 0.0,
    "fedseq-pretrain-epochs": 5,
    "device": "cpu",
}
# (lr, momentum): effective steps lr/(1 − momentum) of 0.05, 0.1, 0.5 and 1.0.
STEPS = ((0.05, 0.0), (0.01, 0.9), (0.05, 0.9), (0.1, 0.9))
ADAM_LRS = (0.001, 0.01)


def _setting(name: str, label: str, clients: int, k: int, chain_clients: int, **overrides: Any) -> tuple:
    """A setting: its clients, FedCat's K (FedAvg's fraction K/N), FedSeq's superclient size."""
    config = {
        **BASE,
        **overrides,
        "min-available-nodes": clients,
        "fraction-train": k / clients,
        "fedcat-k": k,
        # A superclient grows until it holds this many samples: about `chain_clients` clients.
        "fedseq-min-samples": (chain_clients - 1) * (1437 // clients) + 1,
        "fedseq-max-clients": chain_clients,
    }
    return Setting(name, label), clients, config


def _label(lr: float, momentum: float, epochs: int) -> str:
    return f"lr {lr:g}, mom {momentum:g} (step {lr / (1 - momentum):g}), {epochs} ep"


SETTINGS = [
    *(
        _setting(f"c2-lr{lr:g}-m{m:g}-e{e}", f"#C=2, {_label(lr, m, e)}", CLIENTS, DEVICES_PER_ROUND, 5,
                 lr=lr, momentum=m, **{"local-epochs": e})
        for lr, m, e in (*((lr, m, 1) for lr, m in STEPS), (0.01, 0.9, 5), (0.05, 0.9, 5), (0.1, 0.9, 5))
    ),
    *(
        _setting(f"c2-adam{lr:g}-e1", f"#C=2, Adam lr {lr:g}, 1 ep", CLIENTS, DEVICES_PER_ROUND, 5,
                 lr=lr, optimizer="adam", **{"local-epochs": 1})
        for lr in ADAM_LRS
    ),
    _setting("dir0.1-lr0.05-m0.9-e1", f"Dir(0.1), {_label(0.05, 0.9, 1)}", CLIENTS, DEVICES_PER_ROUND, 5,
             partition="dirichlet", alpha=0.1, lr=0.05, momentum=0.9, **{"local-epochs": 1}),
    _setting("chain8-lr0.05-m0.9-e1", f"#C=2, 20 clients, K=8 / superclients of ~8, {_label(0.05, 0.9, 1)}",
             20, 8, 8, lr=0.05, momentum=0.9, **{"local-epochs": 1}),
    _setting("n30-lr0.05-m0.9-e1", f"#C=2, 30 clients, K=6 / superclients of ~5, {_label(0.05, 0.9, 1)}",
             30, 6, 5, lr=0.05, momentum=0.9, **{"local-epochs": 1}),
]
QUICKSTART_APP = PROJECT_DIR / "tests" / "apps" / "quickstart"
QUICKSTART_LRS = (0.01, 0.05, 0.1)
QUICKSTART = {"num-server-rounds": 30, "momentum": 0.9, "batch-size": 16, "local-epochs": 1}
# The user-style app's optimizer cells beyond SGD at one epoch: (label, name, run-config keys).
QUICKSTART_OPTIMIZERS = (
    ("quickstart-lr0.1-e5", "lr 0.1, mom 0.9 (step 1), 5 ep", {"lr": 0.1, "local-epochs": 5}),
    *((f"quickstart-adam{lr:g}", f"Adam lr {lr:g}, 1 ep", {"lr": lr, "optimizer": "adam"}) for lr in ADAM_LRS),
)
QUICKSTART_K = 2  # FedCat's default on 10 nodes: 10 % of them, at least 2

BOUNDED = {"fedcat-hop-clip": 1.5, "fedseq-hop-clip": 1.5}
# The hop rules the map compares (concatfl.strategies.sequential): fixed steps, FedSeq's sized
# step, the even share (each hop weighs what its client's data weighs in the chain) and the running mean.
RULES = {
    "fixed": ("hop-step 0.5", "0.5"),
    "fixed 0.25": ("hop-step 0.25", "0.25"),
    "fixed 1": ("hop-step 1", "1"),
    "sized": ("hop-step sized", "sized"),
    "even": ("hop-step even", "even"),
    "mean": ("hop-step mean", "mean"),
}
FEDAVG_ALL = "FedAvg (every node)"


def rule_label(strategy: str, rule: str) -> str:
    """A method's row label: the strategy and its hop rule, with the bound on later hops."""
    return f"{strategy} ({rule}: {RULES[rule][0]}, hop-clip 1.5)"


FEDCAT_FIXED = rule_label("FedCat", "fixed")
FEDSEQ_FIXED = rule_label("FedSeq", "fixed")
METHODS: dict[str, dict[str, Any]] = {
    "FedAvg": {"strategy": "fedavg"},
    FEDAVG_ALL: {"strategy": "fedavg", "fraction-train": 1.0},
    "FedCat (paper-exact)": {"strategy": "fedcat", **PAPER_EXACT},
    **{rule_label("FedCat", rule): {"strategy": "fedcat", **BOUNDED, "fedcat-hop-step": RULES[rule][1]}
       for rule in ("fixed", "even", "mean")},
    "FedSeq (paper-exact)": {"strategy": "fedseq", **PAPER_EXACT},
    **{rule_label("FedSeq", rule): {"strategy": "fedseq", **BOUNDED, "fedseq-hop-step": step}
       for rule, (_, step) in RULES.items()},
    **{rule_label("FedSeqInter", rule): {"strategy": "fedseq-inter", **BOUNDED, "fedseq-hop-step": RULES[rule][1]}
       for rule in ("fixed", "even")},
}


def _quickstart_cells() -> list[Cell]:
    """The user-style app's columns: its own keys for the same rows."""
    paper = {"hop-step": "1", "hop-clip": 0.0, "update-clip": 0.0, "weight-clip": 0.0}
    rows = {
        "FedAvg": {"variant": "fedavg", "fraction-train": QUICKSTART_K / CLIENTS},
        FEDAVG_ALL: {"variant": "fedavg", "fraction-train": 1.0},
        "FedCat (paper-exact)": {"variant": "fedcat", **paper},
        **{rule_label("FedCat", rule): {"variant": "fedcat", "hop-step": RULES[rule][1]} for rule in ("fixed", "even", "mean")},
        "FedSeq (paper-exact)": {"variant": "fedseq", **paper},
        **{rule_label("FedSeq", rule): {"variant": "fedseq", "hop-step": step} for rule, (_, step) in RULES.items()},
        **{rule_label("FedSeqInter", rule): {"variant": "fedseq-inter", "hop-step": RULES[rule][1]}
           for rule in ("fixed", "even")},
    }
    settings = [
        (Setting(f"quickstart-lr{lr:g}", f"quickstart app, #C=2, lr {lr:g}, mom 0.9 (step {lr / 0.1:g}), 1 ep, "
                 f"K={QUICKSTART_K}"), {"lr": lr})
        for lr in QUICKSTART_LRS
    ] + [
        (Setting(name, f"quickstart app, #C=2, {label}, K={QUICKSTART_K}"), keys)
        for name, label, keys in QUICKSTART_OPTIMIZERS
    ]
    return [
        Cell(setting, method, CLIENTS, {**QUICKSTART, **keys, **row}, QUICKSTART_APP)
        for setting, keys in settings
        for method, row in rows.items()
    ]


def _divergence_mean(key: str) -> Callable[[Metrics], float | None]:
    """Mean over the run's aggregations of one number of its `divergence` records."""

    def extract(metrics: Metrics) -> float | None:
        values = [r["divergence"][key] for r in metrics["rounds"] if key in r.get("divergence", {})]
        return statistics.fmean(values) if values else None

    return extract


def _smallest_step(metrics: Metrics) -> float | None:
    steps = [r["divergence"]["hop_steps"]["min"] for r in metrics["rounds"] if "hop_steps" in r.get("divergence", {})]
    return min(steps) if steps else None


COLUMNS = (
    FINAL_ACCURACY,
    Column("later/first hop length", _divergence_mean("hop_length_ratio"), 2),
    Column("spread/update of averaged models", _divergence_mean("ratio"), 2),
    Column("accuracy of the averaged models (mean)", _divergence_mean("average_accuracy"), 3),
    Column("smallest hop step taken", _smallest_step, 2),
    TOTAL_MEGABYTES,
    WALL_SECONDS,
)
IN_PROCESS_NOTE = "runs in one process (concatfl.bench.inprocess): the ServerApp and ClientApp of `flwr run`, no transport"


def suite() -> Suite:
    """The map's cells: every method in every setting."""
    cells = tuple(
        Cell(setting, method, clients, {**config, **overrides})
        for setting, clients, config in SETTINGS
        for method, overrides in METHODS.items()
    ) + tuple(_quickstart_cells())
    notes = (
        f"digits, ~{SAMPLES_PER_CLIENT} training images per client (~72 with 20 clients, ~48 with 30), no local "
        "test split; 30 rounds; batch 16; FedAvg: FedCat's K clients per round (fraction-train K/N: equal "
        "participation), FedAvg (every node): all of them; FedSeq trains the same fraction of its superclients "
        "per round (one superclient here)",
        "quickstart app columns: tests/apps/quickstart (its own model, ClientApp and ServerApp, 10 clients of two "
        "classes) with its strategies' defaults but the hop settings: FedCat K = 2, FedSeq every superclient each "
        "round (superclients of ≥ 800 samples), FedAvg with 2 clients a round or every client",
        "paper-exact = hop-step 1, hop-clip 0, update-clip 0 (every reply taken as it is); the other rows "
        "bound later hops at 1.5 first hops and every reply at update-clip 4; fixed = the damped step 0.5, "
        "even = each hop's share is its client's share of the chain's data, mean = the running mean of the "
        "chain's models, sized = FedSeq's default (0.25, then 1 where the hops before the first "
        "aggregation moved the model by at most 0.15 of its norm; concatfl.strategies.sequential); the "
        "rules read no server data, so their rows are the same with or without a server evaluation",
        IN_PROCESS_NOTE,
    )
    return Suite(
        SUITE, "digits", "where sequential training collapses", cells, COLUMNS, notes,
        in_process=True, extra_plot=plot_map,
    )


def mnist_suite() -> Suite:
    """The FedCat paper's MNIST regime at CPU size: 600 images per client, its model and optimizer."""
    setting = Setting("mnist-dir0.1", "MNIST Dir(0.1), 20 clients × 600 images, K=4, 5 ep, lr 0.01, mom 0.9")
    config = {
        "dataset": "mnist",
        "model": "mcmahan-cnn",
        "partition": "dirichlet",
        "alpha": 0.1,
        "num-server-rounds": 12,
        "fraction-train": 0.2,
        "fedcat-k": 4,
        "local-epochs": 5,
        "batch-size": 50,
        "lr": 0.01,
        "momentum": 0.9,
        "local-test-fraction": 0.0,
        "min-available-nodes": 20,
        "device": "cpu",
    }
    methods = ("FedAvg", "FedCat (paper-exact)", FEDCAT_FIXED, rule_label("FedCat", "even"))
    cells = tuple(Cell(setting, method, 20, {**config, **METHODS[method]}) for method in methods)
    notes = (
        "the FedCat paper's data per client (600 MNIST images: a stratified 12,000-image subsample; 1,000 test "
        "images), model and optimizer; 20 clients instead of 100, K = 4 instead of 10, 12 rounds instead of 200",
        IN_PROCESS_NOTE,
    )
    return Suite(
        MNIST_SUITE, "small", "the FedCat paper's MNIST regime", cells, COLUMNS, notes,
        subsample=Subsample(12_000, 1_000), in_process=True,
    )


SUITES = {SUITE: suite, MNIST_SUITE: mnist_suite}


def plot_map(the_suite: Suite, runs: dict[tuple[str, str], list[Metrics]], directory: Path) -> Path:
    """Final accuracy of each method (mean ± std over seeds) in each setting, FedAvg as a line."""
    settings = the_suite.settings
    figure = Figure(figsize=(13, 6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    positions = range(len(settings))
    methods = the_suite.methods
    width = 0.8 / len(methods)
    for index, method in enumerate(methods):
        means, stds = [], []
        for setting in settings:
            accuracies = [100 * m["final_accuracy"] for m in runs.get((setting.name, method), [])]
            means.append(statistics.fmean(accuracies) if accuracies else float("nan"))
            stds.append(statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0)
        if method.startswith("FedAvg"):
            style = "-" if method == "FedAvg" else ":"
            axes.plot(positions, means, color="black", marker="o", linestyle=style, linewidth=2, label=method, zorder=3)
            continue
        offsets = [p - 0.4 + width * (index + 0.5) for p in positions]
        axes.errorbar(offsets, means, yerr=stds, fmt="o", capsize=2, label=method)
    axes.set_xticks(list(positions), [s.label for s in settings], rotation=30, ha="right", fontsize="small")
    axes.set(ylabel="final accuracy (%), mean ± std over seeds", title=f"{SUITE}: accuracy after 30 rounds")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: no point hidden
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / MAP_PLOT
    figure.savefig(path, dpi=110)
    return path
