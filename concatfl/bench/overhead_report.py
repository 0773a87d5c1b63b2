"""The `overhead` suite's table (table.md): one section per part, from overhead.json alone."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .data import LABELS

PARTS = ("1", "2", "3", "4")
MB = 1e6


def describe_data(config: Mapping[str, Any]) -> str:
    """"MNIST (6,000 train images), model mcmahan-cnn" for a part's section."""
    dataset = config.get("dataset", "digits")  # parts measured before the option existed were digits
    data = LABELS.get(dataset, dataset)
    subsample = re.search(r"-train(\d+)-", str(config.get("data-dir", "")))
    if subsample:
        data += f" ({int(subsample.group(1)):,} train images)"
    return f"{data}, model {config.get('model', 'default')}"


def _s(value: float | None, decimals: int = 2) -> str:
    return "–" if value is None else f"{value:.{decimals}f}"


def _run_line(run: Mapping[str, Any]) -> str:
    start, end = (" / ".join(f"{v:.2f}" for v in run[key]) for key in ("load_average_start", "load_average_end"))
    return (
        f"Command: `{run['command']}` — {run['cpu_model']}, {run['cores']} cores; load average (1/5/15 min) "
        f"{start} at the start, {end} at the end."
    )


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|---" * len(head) + "|", *("| " + " | ".join(r) + " |" for r in rows)]


def render_fedavg(part: Mapping[str, Any]) -> list[str]:
    """Part 1's section."""
    sim, bare, per = part["simulation"], part["bare"], part["per_round"]
    config = part["run_config"]
    ratio = part["ratio_rounds_to_bare"]
    verdict = "met" if ratio <= part["target"] else "missed"
    return [
        "### 1. FedAvg: `flwr run` simulation vs a bare PyTorch loop",
        "",
        f"{describe_data(config)}, {part['clients']} clients, all train every round, "
        f"{config['local-epochs']} local epoch(s), {config['num-server-rounds']} rounds. The simulation trains up to "
        f"{part['concurrent_clients']} clients at once; the bare loop trains them one after another in one "
        f"process ({bare['torch_threads']} torch threads), with the same data, mini-batches, averaging and "
        "central evaluation.",
        "",
        *_table(
            ["", "seconds"],
            [
                ["simulation, total wall (start of `flwr run` → every process stopped)", _s(sim["wall_seconds"])],
                ["· start-up until round 1 (SuperLink, runtime, ServerApp set-up, initial evaluation)",
                 _s(sim["startup_seconds"])],  # fmt: skip
                ["· of which before the ServerApp started", _s(sim["before_serverapp_seconds"])],
                ["· rounds (sum of metrics.json's per-round `seconds`)", _s(sim["rounds_seconds"])],
                ["· after the last round (completion poll, teardown)", _s(sim["after_serverapp_seconds"])],
                ["bare loop, rounds", _s(bare["rounds_seconds"])],
                ["bare loop, set-up (data, model, initial evaluation; not in its rounds)", _s(bare["setup_seconds"])],
                [f"**rounds / bare** (target ≤ {part['target']:g}: {verdict})", f"**{ratio:.2f}**"],
                ["rounds after the first / bare's (without round 1's warm-up)", _s(part["ratio_later_rounds_to_bare"])],
            ],
        ),
        "",
        "Per round (mean seconds):",
        "",
        *_table(
            ["", "simulation", "bare loop", "difference"],
            [
                ["training: hop (send → last reply) vs the clients' training", _s(per["simulation_hop"], 3),
                 _s(per["bare_train"], 3), _s(per["simulation_hop"] - per["bare_train"], 3)],
                ["server: validation, aggregation, evaluation vs averaging + evaluation",
                 _s(per["simulation_server_side"], 3), _s(per["bare_aggregate_and_evaluate"], 3),
                 _s(per["simulation_server_side"] - per["bare_aggregate_and_evaluate"], 3)],
                ["whole round", _s(per["simulation_round"], 3), _s(per["bare_round"], 3),
                 _s(per["simulation_round"] - per["bare_round"], 3)],
                ["first round", _s(sim["first_round_seconds"], 3), _s(bare["first_round_seconds"], 3),
                 _s(sim["first_round_seconds"] - bare["first_round_seconds"], 3)],
                ["later rounds", _s(sim["later_rounds_mean_seconds"], 3), _s(bare["later_rounds_mean_seconds"], 3),
                 "–" if sim["later_rounds_mean_seconds"] is None
                 else _s(sim["later_rounds_mean_seconds"] - bare["later_rounds_mean_seconds"], 3)],
            ],
        ),  # fmt: skip
        "",
        "The hop's excess over the training is Flower's messaging (serialization, the SuperLink, dispatch to "
        "the simulated clients, polling for replies) and the ClientApp's per-message work (config, rebuilding "
        "the model). metrics.json does not keep the clients' `train-seconds` (the ServerApp only aggregates "
        "them), so the training column is the bare loop's timing of the same training. Final accuracy: "
        f"simulation {sim['final_accuracy']:.4f}, bare loop {bare['final_accuracy']:.4f} (same training; "
        "averaging in another reply order may move the last digits). Peak RSS of the simulation's process "
        f"tree: {sim['peak_rss_bytes'] / MB:,.0f} MB (see part 3).",
        "",
    ]


def render_fedconcat(part: Mapping[str, Any]) -> list[str]:
    """Part 2's section."""
    config = part["run_config"]
    rows = [
        [kind, str(c["rounds"]), _s(c["mean_seconds"], 3), _s(c["mean_hop_seconds"], 3), _s(c["mean_bytes"] / MB, 4)]
        for kind, c in part["rounds"].items()
    ]
    ratios = part["encoder_over_classifier"]
    if ratios is not None:
        met = [name for name in ("seconds", "bytes") if ratios[name] >= part["target"]]
        rows.append(
            [f"**encoder / classifier** (target ≥ {part['target']:g}×; met for: {', '.join(met) or 'neither'})",
             "", f"**{ratios['seconds']:.2f}×**", "", f"**{ratios['bytes']:.2f}×**"]  # fmt: skip
        )
    return [
        "### 2. FedConcat: classifier round vs encoder round",
        "",
        f"{describe_data(config)}, {config.get('local-epochs', 'default')} local epoch(s), {part['clients']} "
        f"clients, #C={config['classes-per-client']}, K={part['clusters']} clusters, "
        f"{config['fedconcat-encoder-rounds']} encoder + {config['fedconcat-classifier-rounds']} classifier "
        f"rounds (simulation wall {part['wall_seconds']:.0f} s). A round's seconds include the server's "
        "evaluation of the global model; bytes are what Flower ships for the messages (`strategies.wire`), "
        "down + up.",
        "",
        *_table(["round kind", "rounds", "mean s", "mean hop s", "mean MB"], rows),
        "",
    ]


def render_scale(part: Mapping[str, Any]) -> list[str]:
    """Part 3's section."""
    rows = [
        [
            str(run["clients"]),
            str(run["per_round"]),
            f"{run['peak_rss_bytes'] / MB:,.0f}",
            _s(run["startup_seconds"], 1),
            _s(run["first_round_seconds"], 2),
            _s(run["later_rounds_mean_seconds"], 2),
            _s(run["hop_mean_seconds"], 2),
        ]
        for run in part["runs"]
    ]
    peaks = "; ".join(
        f"{run['clients']} clients: "
        + ", ".join(f"{label} {rss / MB:,.0f}" for label, rss in list(run["peak_rss_by_process"].items())[:4])
        for run in part["runs"]
    )
    return [
        "### 3. Many simulated clients, the same number per round",
        "",
        "FedAvg on digits, iid. Peak RSS is summed over the simulation's whole process tree (SuperLink, "
        "simulation runtime, Ray), sampled every 0.5 s; shared pages count once per process, so it is an "
        "upper bound.",
        "",
        *_table(
            ["clients", "train per round", "peak RSS (MB)", "start-up s", "first round s", "later rounds s",
             "hop s"],  # fmt: skip
            rows,
        ),
        "",
        f"Largest processes at the peak (MB): {peaks}.",
        "",
    ]


def render_latency(part: Mapping[str, Any]) -> list[str]:
    """Part 4's section."""
    rows = [
        [name, str(v["chain_hops"]), _s(v["mean_hop_seconds"]), _s(v["mean_train_seconds"]),
         _s(v["mean_overhead_seconds"])]  # fmt: skip
        for name, v in part["variants"].items()
    ]
    starts = ", ".join(f"{label} {seconds:.2f} s" for label, seconds in part["client_process_start_seconds"].items())
    return [
        "### 4. FedSeq through real processes (loopback)",
        "",
        f"`scripts/deploy_latency.py`: a SuperLink and {part['nodes']} SuperNodes, {part['rounds']} round(s); "
        f"FedSeq's chain of one-message hops (source: `{part['source']}`).",
        "",
        *_table(["settings", "chain hops", "mean hop s", "mean train-seconds", "mean overhead s"], rows),
        "",
        f"A fresh ClientApp process (one per message in deployment) needs: {starts}. "
        f"A train message of the digits model: {part['train_message']['bytes']:,} bytes.",
        "",
    ]


RENDERERS: dict[str, Callable[[Mapping[str, Any]], list[str]]] = {
    "1": render_fedavg,
    "2": render_fedconcat,
    "3": render_scale,
    "4": render_latency,
}


def render_table(document: Mapping[str, Any]) -> str:
    """table.md: one section per part measured so far, each with the run that measured it."""
    lines = [
        "## overhead — what the framework itself costs",
        "",
        "Wall-clock measurements: on a shared machine they move with its load (see each part's load average).",
        "",
    ]
    for part in PARTS:
        if part in document["parts"]:
            entry = document["parts"][part]
            section = RENDERERS[part](entry)
            lines += [section[0], "", _run_line(entry["run"]), *section[1:]]
    return "\n".join(lines)
