"""The `robustness` suite: every strategy against clients that send malformed or poisoned replies.

The fuzzing mod (`concatfl.fuzz`) replaces a share of the replies (0, 10 % or 30 %, every kind
drawn uniformly) with malformed ones (NaN, Inf, wrong shapes, missing or extra arrays,
num-examples ≤ 0, float64/int64, empty replies, bad label distributions) or poisoned ones
(weights × 10⁶, num-examples 10¹², sign-flipped updates, label-distribution lies), with the
reply bounds on (the default) and off (`update-clip=0 weight-clip=0`). The robust aggregations
are run against sign-flipped updates from 20 % of the replies, where the bounds cannot help.
Two apps: concatfl's own (digits, 10 clients of two classes, the `sequential-stability` map's
client optimizer: lr 0.05, momentum 0.9, batch 16, one epoch) and the user-style app of
tests/apps/quickstart (its own model and ClientApp with the mod, the same optimizer).

Each run's fuzz log (the ground truth: which node sent which kind in which round) is compared
with what the server recorded (rejected replies in the hops' misses, clipped and down-weighted
ones under ``guard``; a reply that came too late or as an error is missing, never used): the
table counts the malformed replies the server accepted (it must be 0) and the outsized ones
(× 10⁶, 10¹² examples) it took as they were sent. Runs are in-process
(`concatfl.bench.inprocess`).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..fuzz import MALFORMED
from .columns import FINAL_ACCURACY, WALL_SECONDS, Column, Metrics
from .inprocess import PROJECT_DIR
from .suites import Cell, Setting, Suite

SUITE = "robustness"
PLOT = "robustness.png"
QUICKSTART_APP = PROJECT_DIR / "tests" / "apps" / "quickstart"
CLIENTS = 10
ROUNDS = 20
CLIENT_OPTIMIZER = {"lr": 0.05, "momentum": 0.9, "batch-size": 16, "local-epochs": 1}
DIGITS = {
    **CLIENT_OPTIMIZER,
    "dataset": "digits",
    "partition": "classes",
    "classes-per-client": 2,
    "num-server-rounds": ROUNDS,
    "local-test-fraction": 0.0,
    "min-available-nodes": CLIENTS,
    "device": "cpu",
    "fedseq-pretrain-epochs": 5,
    "fedseq-min-samples": 4 * (1437 // CLIENTS) + 1,  # superclients of about five clients
    "fedseq-max-clients": 5,
    "fedconcat-encoder-rounds": ROUNDS // 2,
    "fedconcat-classifier-rounds": ROUNDS // 2,
}
QUICKSTART = {**CLIENT_OPTIMIZER, "num-server-rounds": ROUNDS, "encoder-rounds": ROUNDS // 2,
              "classifier-rounds": ROUNDS // 2, "classifier-steps": 30}
STRATEGIES: dict[str, dict[str, Any]] = {
    "FedAvg": {"strategy": "fedavg"},
    "FedProx": {"strategy": "fedprox", "proximal-mu": 0.01},
    "SCAFFOLD": {"strategy": "scaffold"},
    "FedAvg + FedDyn": {"strategy": "fedavg", "local-objective": "feddyn"},
    "FedCat": {"strategy": "fedcat"},
    "FedCat (K = 4)": {"strategy": "fedcat", "fedcat-k": 4},
    "FedSeq": {"strategy": "fedseq"},
    "FedSeqInter": {"strategy": "fedseq-inter"},
    "FedConcat": {"strategy": "fedconcat"},
    "FedConcat-ID": {"strategy": "fedconcat-id"},
}
QUICKSTART_VARIANTS = ("fedavg", "fedcat", "fedseq", "fedconcat")
AGGREGATIONS = ("median", "trimmed-mean", "krum", "multi-krum")
GUARD_OFF = {"update-clip": 0.0, "weight-clip": 0.0}
FUZZ_LOG = "{workdir}/fuzz.jsonl"


def _fuzzed(share: float, kinds: str = "all") -> dict[str, Any]:
    return {"fuzz-share": share, "fuzz-kinds": kinds, "fuzz-log": FUZZ_LOG} if share else {}


# (setting, run-config overrides): the columns of the accuracy table.
FUZZ_SETTINGS = [
    (Setting(f"fuzz{int(share * 100)}-guard-{state}", f"{label}, bounds {state}"), {**_fuzzed(share), **extra})
    for share, label in ((0.0, "clean"), (0.1, "10 % fuzzed"), (0.3, "30 % fuzzed"))
    for state, extra in (("on", {}), ("off", GUARD_OFF))
]
# Malformed replies only: 30 % of the replies lost to the server (what SCAFFOLD's control
# variates must survive), without poison.
DROPPED = (Setting("malformed30-guard-on", "30 % malformed (dropped), bounds on"), _fuzzed(0.3, "malformed"))
SIGN_FLIP = (Setting("signflip20", "20 % sign-flipped, bounds on"), {**_fuzzed(0.2, "sign-flip"), "aggregation-byzantine": 2})
CLEAN = FUZZ_SETTINGS[0]


def suite() -> Suite:
    """Every strategy × fuzz share × bounds on/off, and the aggregations under sign flips, for both apps."""
    cells: list[Cell] = []
    for method, strategy in STRATEGIES.items():
        cells += [Cell(setting, method, CLIENTS, {**DIGITS, **strategy, **extra}) for setting, extra in (*FUZZ_SETTINGS, DROPPED)]
    for variant in QUICKSTART_VARIANTS:
        method = f"quickstart app: {variant}"
        cells += [
            Cell(setting, method, CLIENTS, {**QUICKSTART, "variant": variant, **extra}, QUICKSTART_APP)
            for setting, extra in (*FUZZ_SETTINGS, DROPPED)
        ]
    for aggregation in ("mean", *AGGREGATIONS):
        for app, config, label in ((None, {**DIGITS, "strategy": "fedavg"}, "FedAvg"),
                                   (QUICKSTART_APP, {**QUICKSTART, "variant": "fedavg"}, "quickstart app: fedavg")):
            method = label if aggregation == "mean" else f"{label} ({aggregation})"
            for setting, extra in (CLEAN, SIGN_FLIP) if aggregation != "mean" else (SIGN_FLIP,):
                cells.append(Cell(setting, method, CLIENTS, {**config, "aggregation": aggregation, **extra}, app))
    notes = (
        f"digits, {CLIENTS} clients of two classes (#C=2), {ROUNDS} rounds, every client every round; client "
        "optimizer lr 0.05, momentum 0.9, batch 16, one epoch. FedConcat: 10 encoder + 10 classifier rounds; "
        "FedSeq: 5 pre-training epochs, superclients of ~5 clients; FedCat: its default K (2 of 10), and K = 4",
        "fuzzed: that share of the eligible replies replaced by concatfl.fuzz, every kind drawn uniformly; "
        "malformed (dropped): only the malformed kinds, which the server rejects; "
        "bounds off: update-clip=0 weight-clip=0 (validation still rejects malformed replies)",
        "sign-flipped: 20 % of the replies carry the reversed update (Krum and multi-Krum told f = 2)",
        "runs in one process (concatfl.bench.inprocess): the apps' ServerApp and ClientApp, no transport",
    )
    return Suite(SUITE, "digits", "strategies against malformed and poisoned replies", tuple(cells), COLUMNS,
                 notes, in_process=True, extra_plot=plot)


# ------------------------------------------------------------------ the server's records vs the fuzz log


def fuzz_entries(metrics: Metrics) -> list[dict[str, Any]] | None:
    """What the fuzzing mod did in this run (None: the mod was off). A resumed run shares its
    log with the run it continues: that run's entries count up to the round it was resumed
    after (the rounds after it were lost and done again)."""
    path = metrics["run_config"].get("fuzz-log", "")
    if not path or not float(metrics["run_config"].get("fuzz-share", 0)):
        return None
    log_file = Path(path)
    entries = [json.loads(line) for line in log_file.read_text().splitlines()] if log_file.exists() else []
    resumed = metrics.get("resumed")
    if resumed is None:
        return entries
    return [e for e in entries if e["run_id"] == metrics["run_id"] or (e["server_round"] or 0) <= resumed["after_round"]]


# The tags of the requests that carry round 0 (stage 1's, and the same for a node placed later).
STAGE1_TAGS = ("pretrain", "labels", "label-inference")


def hop_records(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The hops of a round's record, or of the setup record (whose hops sit under their own
    names: FedSeq's `pretraining`, FedConcat's list `stage1`)."""
    if "hops" in record:
        return list(record["hops"])
    found = []
    for value in record.values():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict) and "misses" in item:
                found.append(item)
    return found


def server_view(metrics: Metrics, entry: dict[str, Any]) -> str:
    """How the server treated one fuzzed reply: "rejected", "bounded", "missing" (it never used
    it: the reply came too late, or as an error) or "accepted".

    The records name nodes by partition id where concatfl's ServerApp identifies them
    (`node_identity` in metrics.json), else by Flower node id. A reply without a round (a label
    query) or of round 0 (pre-training, label inference) answers stage 1: in the setup record,
    or, for a node placed after the start, in the round that placed it (found by the stage-1
    request tags).
    """
    node = entry["partition_id"] if "node_identity" in metrics else entry["node_id"]
    server_round = entry["server_round"] or 0
    if server_round == 0:
        records, tags = [metrics["setup"], *metrics["rounds"]], STAGE1_TAGS
    else:
        records, tags = [metrics["rounds"][server_round - 1]], None
    mine = lambda item: int(item["node"]) == node and (tags is None or item.get("tag") in tags)  # noqa: E731
    reasons = [miss["reason"] for record in records for hop in hop_records(record) for miss in hop["misses"] if mine(miss)]
    if any(reason.startswith("rejected") for reason in reasons):
        return "rejected"
    events = [e for record in records for kind in ("clipped", "down-weighted") for e in record.get("guard", {}).get(kind, [])]
    if any(mine(event) for event in events):
        return "bounded"
    return "missing" if reasons else "accepted"


def malformed_accepted(metrics: Metrics) -> float | None:
    """Fuzzed malformed replies the server did not reject (must be 0)."""
    entries = fuzz_entries(metrics)
    if entries is None:
        return None
    return float(sum(server_view(metrics, e) == "accepted" for e in entries if e["kind"] in MALFORMED))


def outsized_taken(metrics: Metrics) -> float | None:
    """Replies × 10⁶ or of 10¹² examples that the server took as they were sent."""
    entries = fuzz_entries(metrics)
    if entries is None:
        return None
    outsized = [e for e in entries if e["kind"] in ("scaled", "huge-examples")]
    return float(sum(server_view(metrics, e) == "accepted" for e in outsized))


def replaced(metrics: Metrics) -> float | None:
    """Replies the mod replaced."""
    entries = fuzz_entries(metrics)
    return None if entries is None else float(len(entries))


def longest_clean_update(metrics: Metrics) -> float | None:
    """In a clean run: the largest update length over its reference seen in any round (the
    bound is update-clip times the reference)."""
    if float(metrics["run_config"].get("fuzz-share", 0)):
        return None
    ratios = [
        figures["max_length_ratio"]
        for record in [metrics["setup"], *metrics["rounds"]]
        for stream, figures in record.get("guard", {}).get("streams", {}).items()
        if figures.get("max_length_ratio") is not None and not stream.endswith("/later")
    ]
    return max(ratios) if ratios else None


COLUMNS = (
    FINAL_ACCURACY,
    Column("malformed replies accepted", malformed_accepted, 1),
    Column("replies ×10⁶ or of 10¹² examples taken as sent", outsized_taken, 1),
    Column("replies replaced by the mod", replaced, 1),
    Column("largest update / reference (clean runs)", longest_clean_update, 2),
    WALL_SECONDS,
)


def plot(the_suite: Suite, runs: dict[tuple[str, str], list[Metrics]], directory: Path) -> Path:
    """Final accuracy of each strategy per fuzz share, bounds on (filled) and off (hollow)."""
    methods = [m for m in the_suite.methods if "(" not in m]
    figure = Figure(figsize=(13, 5.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    width = 0.8 / 6
    for index, (setting, _) in enumerate(FUZZ_SETTINGS):
        means, stds = [], []
        for method in methods:
            accuracies = [100 * m["final_accuracy"] for m in runs.get((setting.name, method), [])]
            means.append(statistics.fmean(accuracies) if accuracies else float("nan"))
            stds.append(statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0)
        offsets = [p - 0.4 + width * (index + 0.5) for p in range(len(methods))]
        bound = setting.name.endswith("-on")
        axes.bar(offsets, means, width, yerr=stds, capsize=2, label=setting.label,
                 color=f"C{index // 2}", alpha=0.9 if bound else 0.35, edgecolor=f"C{index // 2}")
    axes.set_xticks(range(len(methods)), methods, rotation=30, ha="right", fontsize="small")
    axes.set(ylabel="final accuracy (%), mean ± std over seeds", title=f"{SUITE}: accuracy after {ROUNDS} rounds")
    axes.grid(axis="y", alpha=0.3)
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / PLOT
    figure.savefig(path, dpi=110)
    return path
