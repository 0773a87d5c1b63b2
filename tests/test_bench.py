"""The benchmark harness: tables from hand-written metrics.json files, resuming, suite
definitions, data subsamples, and (e2e) the smoke scale run as real Flower simulations."""

from __future__ import annotations

import csv
import pickle
import struct
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from concatfl.bench import BenchError, get_suite, robustness, run_suite, write_report
from concatfl.bench.__main__ import main
from concatfl.bench.columns import FINAL_ACCURACY_PERCENT, TOTAL_MEGABYTES
from concatfl.bench.data import Subsample, describe, shown_path, write_subsample
from concatfl.bench.report import Summary, curve_figure, gain_over_baseline, load_runs, mean_curve, plot_curves
from concatfl.bench.runner import cell_config, suite_command
from concatfl.bench.suites import BLUEPRINTS, PAPER, SCALES, SUITE_NAMES, Cell, Setting, Suite
from concatfl.config import RunConfig
from concatfl.data.datasets import load_dataset
from concatfl import PROJECT_DIR
from concatfl.deployment.processes import SimulationError
from concatfl.metrics import write_metrics

from .e2e import leftover_processes

A, B = Setting("a", "Set A"), Setting("b", "Set B")


def tiny_suite() -> Suite:
    """Two settings × two methods, a paper figure for one cell, rounds-to-70 %/80 % columns."""
    cells = tuple(
        Cell(setting, method, 2, {"strategy": strategy, "alpha": alpha})
        for setting, alpha in ((A, 0.1), (B, 0.5))
        for method, strategy in (("FedAvg", "fedavg"), ("FedCat", "fedcat"))
    )
    return Suite(
        "tiny", "small", "a hand-made suite", cells, (FINAL_ACCURACY_PERCENT, TOTAL_MEGABYTES),
        notes=("Scaled down: clients: 100 → 2.",), targets=(0.7, 0.8), paper={("FedAvg", "a"): 71.5},
    )


def fake_metrics(config: dict[str, Any], accuracies: list[float], mb_per_round: float = 2.0) -> dict[str, Any]:
    """A metrics.json document: one evaluated round per accuracy, half the bytes each way."""
    half = int(mb_per_round * 1e6 / 2)
    rounds = [
        {"round": r, "bytes_sent": half, "bytes_received": half, "seconds": 1.0, "accuracy": acc, "loss": 1.0}
        for r, acc in enumerate(accuracies, start=1)
    ]
    return {
        "run_config": {"dataset": "digits", "data-dir": "", **config},
        "strategy": config.get("strategy", "fedavg"),
        "num_nodes": 2,
        "setup": {},
        "initial": {"accuracy": 0.1, "loss": 2.3},
        "rounds": rounds,
        "final_accuracy": accuracies[-1],
        "final_loss": 1.0,
        "total_bytes_sent": half * len(rounds),
        "total_bytes_received": half * len(rounds),
        "wall_seconds": 10.0,
    }


def write_run(suite_dir: Path, cell: Cell, seed: int, accuracies: list[float]) -> None:
    write_metrics(cell.workdir(suite_dir, seed) / "output", fake_metrics(cell_config(cell, seed, {}), accuracies))


def table_rows(markdown: str, section: str) -> dict[str, list[str]]:
    """method → cells of the table under `### section`."""
    block = markdown.split(f"### {section}\n", 1)[1].split("\n\n###", 1)[0]
    rows = [line.strip("| ").split(" | ") for line in block.strip().splitlines()[2:]]
    return {row[0]: row[1:] for row in rows}


def test_table_is_mean_and_sample_std_over_seeds_with_partial_cells_marked(tmp_path):
    suite = tiny_suite()
    fedavg_a, fedcat_a = suite.cell(A, "FedAvg"), suite.cell(A, "FedCat")
    for seed, accuracies in enumerate([[0.3, 0.5], [0.4, 0.6], [0.65, 0.7]]):
        write_run(tmp_path, fedavg_a, seed, accuracies)
    write_run(tmp_path, fedcat_a, 0, [0.7, 0.8])
    write_run(tmp_path, fedcat_a, 1, [0.75, 0.9])  # seed 2 of FedCat never finished

    table = write_report(suite, [0, 1, 2], tmp_path)
    markdown = table.read_text()

    assert "## tiny — scale `small`" in markdown and "- Scaled down: clients: 100 → 2." in markdown
    # reference = best accuracy of any run in the setting (FedCat seed 1: 0.9)
    assert "Set A 90.0 % (best run (no centralized run))" in markdown
    accuracy = table_rows(markdown, "final accuracy (%)")
    # per setting: accuracy, paper, gain over FedAvg (ours / paper); FedAvg 50, 60, 70 %, the paper's 71.5
    assert accuracy["FedAvg"] == ["60.0 ± 10.0", "71.5", "–", "–", "–", "–"]
    # 85 − 60 = +25 points, more than 2 std (2 × 10): a gain; the paper has no FedCat figure
    assert accuracy["FedCat"] == ["85.0 ± 7.1 (2/3)", "–", "+25.0 / –", "–", "–", "– / –"]
    assert table_rows(markdown, "total MB (down+up)")["FedAvg"] == ["4.0000 ± 0.0000", "–"]
    # 70 % of 0.9 = 0.63: only seed 2 got there (round 1); 80 % = 0.72: FedCat at rounds 2 and 1
    assert table_rows(markdown, "rounds to 70% of reference")["FedAvg"] == ["1.0 ± 0.0 (1/3)", "–"]
    assert table_rows(markdown, "rounds to 80% of reference")["FedCat"] == ["1.5 ± 0.7 (2/3)", "–"]

    with open(tmp_path / "table.csv", newline="") as handle:
        rows = {row["method"]: row for row in csv.DictReader(handle)}
    fedavg = rows["FedAvg"]
    assert float(fedavg["Set A | final accuracy (%) mean"]) == pytest.approx(60.0)
    assert float(fedavg["Set A | final accuracy (%) std"]) == pytest.approx(10.0)
    assert fedavg["Set A | final accuracy (%) n"] == "3" and fedavg["Set A | paper"] == "71.5"
    assert rows["FedCat"]["Set A | final accuracy (%) n"] == "2" and rows["FedCat"]["Set A | paper"] == ""
    assert fedavg["Set B | final accuracy (%) mean"] == "" and fedavg["Set B | final accuracy (%) n"] == "0"

    plots = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert plots == ["accuracy-vs-mb-a.png", "accuracy-vs-round-a.png"]  # setting b has no runs
    assert (tmp_path / "plots" / "accuracy-vs-mb-a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_show_the_mean_over_seeds_with_a_std_band_and_keep_coinciding_curves_apart(tmp_path):
    suite = tiny_suite()
    for seed, accuracies in enumerate([[0.3, 0.5], [0.5, 0.7]]):
        write_run(tmp_path, suite.cell(A, "FedAvg"), seed, accuracies)
        write_run(tmp_path, suite.cell(A, "FedCat"), seed, accuracies)  # the very same curve
    runs = load_runs(suite, [0, 1], tmp_path)
    curve = mean_curve(runs[("a", "FedAvg")])
    assert [(p.round, p.megabytes) for p in curve] == [(0, 0.0), (1, 2.0), (2, 4.0)]
    assert [p.accuracy for p in curve] == pytest.approx([0.1, 0.4, 0.6])
    assert [p.accuracy_std for p in curve] == pytest.approx([0.0, 0.1414214, 0.1414214])

    written = plot_curves(suite, runs, tmp_path / "plots")
    assert sorted(p.name for p in written) == ["accuracy-vs-mb-a.png", "accuracy-vs-round-a.png"]
    assert all(path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for path in written)
    lines = {method: mean_curve(runs[("a", method)]) for method in ("FedAvg", "FedCat")}
    axes = curve_figure(lines, {"FedAvg": 2, "FedCat": 2}, False, "tiny").axes[0]
    drawn = axes.get_lines()
    assert [line.get_label() for line in drawn] == ["FedAvg (n=2)", "FedCat (n=2)"]
    assert len({(line.get_marker(), line.get_linestyle(), line.get_markersize()) for line in drawn}) == 2
    assert len(axes.collections) == 2  # one ±1 std band per method
    band = axes.collections[0].get_paths()[0].vertices
    assert band[:, 1].min() == pytest.approx(10.0)  # round 0: both seeds start at 10 %, no spread
    assert band[:, 1].max() == pytest.approx(100 * (0.6 + 0.1414214))


class FakeSimulation:
    """Stands in for `flwr run`: records each call and writes a metrics.json like a real run."""

    def __init__(self, fail_method: str | None = None) -> None:
        self.calls: list[Path] = []
        self.fail_method = fail_method

    def __call__(self, run_config: dict[str, Any], num_supernodes: int, workdir: Path) -> dict[str, Any]:
        self.calls.append(workdir)
        if self.fail_method and self.fail_method in str(workdir):
            raise SimulationError("run 1 ended 'finished:failed'; log tail: ...")
        metrics = fake_metrics(run_config, [0.5, 0.6])
        write_metrics(workdir / "output", metrics)
        return metrics


def test_finished_runs_are_not_run_again_and_digits_paths_stay_put(tmp_path):
    suite = get_suite("fedcat-digits")
    write_run(tmp_path / "fedcat-digits", suite.cells[0], 0, [0.5, 0.6])  # FedAvg, seed 0: done earlier
    simulate = FakeSimulation()

    table = run_suite(suite, [0, 1], tmp_path, simulate=simulate, log=lambda _: None)

    assert len(simulate.calls) == 4 * 2 - 1
    assert tmp_path / "fedcat-digits" / "fedavg" / "seed-0" not in simulate.calls
    assert tmp_path / "fedcat-digits" / "fedcat-w--gc--no-concatenation" / "seed-1" in simulate.calls
    assert table == tmp_path / "fedcat-digits" / "table.md"
    assert table.read_text().startswith("## fedcat-digits\n\n")
    assert "| method | final accuracy | total MB (down+up) | wall s |" in table.read_text()

    again = FakeSimulation()
    run_suite(suite, [0, 1], tmp_path, simulate=again, log=lambda _: None)
    assert again.calls == []


def test_a_finished_run_with_another_config_is_refused(tmp_path):
    suite = get_suite("fedcat", "smoke")
    cell = suite.cells[0]
    write_metrics(
        cell.workdir(tmp_path / "fedcat", 0) / "output",
        fake_metrics({**cell_config(cell, 0, {}), "num-server-rounds": 99}, [0.5]),
    )
    with pytest.raises(BenchError, match="num-server-rounds: 99 there, 4 now"):
        run_suite(suite, [0], tmp_path, simulate=FakeSimulation(), log=lambda _: None)


def test_a_failed_run_is_reported_after_the_others_ran(tmp_path):
    simulate = FakeSimulation(fail_method="fedcat-w--dc")
    with pytest.raises(BenchError, match="(?s)1 run\\(s\\) failed.*FedCat w/ DC"):
        run_suite(get_suite("fedcat-digits"), [0], tmp_path, simulate=simulate, log=lambda _: None)
    assert len(simulate.calls) == 4
    table = (tmp_path / "fedcat-digits" / "table.md").read_text()
    assert "| FedCat w/ DC (random selection) | – | – | – |" in table


def test_each_seed_of_a_fuzzed_cell_meets_other_faults():
    cells = robustness.suite().cells
    fuzzed = [cell for cell in cells if cell.run_config.get("fuzz-share")]
    clean = [cell for cell in cells if not cell.run_config.get("fuzz-share")]
    assert fuzzed and clean
    assert [cell_config(fuzzed[0], seed, {})["fuzz-seed"] for seed in (0, 1, 2)] == [0, 1, 2]
    assert cell_config(fuzzed[0], 2, {}, {"fuzz-seed": 7})["fuzz-seed"] == 7  # --set wins
    assert "fuzz-seed" not in cell_config(clean[0], 2, {})


def test_every_cell_of_every_suite_is_a_valid_run_config():
    declared = set(tomllib.loads((PROJECT_DIR / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"])
    for name in SUITE_NAMES:
        for scale in SCALES if name in BLUEPRINTS else [None]:
            suite = get_suite(name, scale)
            for cell in suite.cells:
                config = cell_config(cell, 0, {cell.dataset: Path("/data")} if cell.dataset != "digits" else {})
                assert set(config) <= declared, (name, scale, cell.method, set(config) - declared)
                assert RunConfig.from_mapping(config).min_available_nodes <= cell.num_supernodes
    sizes = {(name, scale): len(BLUEPRINTS[name].suite(scale).cells) for name in BLUEPRINTS for scale in SCALES}
    assert sizes == {
        # per setting: the methods, then the centralized row
        ("fedcat", "smoke"): 3 * 8, ("fedcat", "small"): (4 + 1) + 2 * (3 + 1), ("fedcat", "paper"): 9 * 8,
        ("fedconcat", "smoke"): 4 * 8, ("fedconcat", "small"): (7 + 1) + 2 * (3 + 1), ("fedconcat", "paper"): 8 * 8,
        ("fedseq", "smoke"): 3 * 10, ("fedseq", "small"): 7 + 1, ("fedseq", "paper"): 6 * 10,
    }  # fmt: skip
    assert all(c.dataset == "digits" for name in BLUEPRINTS for c in BLUEPRINTS[name].suite("smoke").cells)


def test_gains_below_two_standard_deviations_are_called_noise_and_paper_gains_use_the_papers_figures():
    suite = tiny_suite()
    suite = Suite(suite.name, suite.scale, suite.description, suite.cells, suite.columns,
                  paper={("FedAvg", "a"): 71.5, ("FedCat", "a"): 74.0})
    cells = {
        ("a", "FedAvg", "final accuracy (%)"): Summary(60.0, 2.0, 3),
        ("a", "FedCat", "final accuracy (%)"): Summary(63.0, 1.0, 3),
    }
    assert gain_over_baseline(suite, cells, A, "FedCat", "final accuracy (%)") == "+3.0 (noise) / +2.5"
    cells[("a", "FedCat", "final accuracy (%)")] = Summary(55.0, 0.5, 3)
    assert gain_over_baseline(suite, cells, A, "FedCat", "final accuracy (%)") == "-5.0 / +2.5"
    assert gain_over_baseline(suite, cells, A, "FedAvg", "final accuracy (%)") == "–"
    assert gain_over_baseline(suite, cells, B, "FedCat", "final accuracy (%)") == "– / –"


def test_every_paper_figure_names_a_method_and_setting_of_its_paper_scale_suite():
    for name, figures in PAPER.items():
        suite = get_suite(name, "paper")
        assert figures and {method for method, _ in figures} <= set(suite.methods)
        assert {setting for _, setting in figures} <= {s.name for s in suite.settings}
    assert PAPER["fedcat"][("FedCat", "cifar10-dir0.1")] == 56.16
    assert PAPER["fedconcat"][("FedConcat", "fmnist-c2")] == 84.4
    assert PAPER["fedseq"][("FedSeq (greedy+KL)", "cifar10-dir0")] == 82.21


def test_the_header_lists_every_change_from_the_paper_scale():
    small, paper = get_suite("fedcat", "small"), get_suite("fedcat", "paper")
    assert "clients: 100 → 20" in small.notes[0] and "local epochs" not in small.notes[0]
    assert "train images: all → 12,000 (600 per client" in small.notes[0] and small.subsample == Subsample(12000, 2000)
    assert "datasets: MNIST, Fashion-MNIST, CIFAR-10 → MNIST, CIFAR-10" in small.notes[0]
    default = "FedCat (hop-clip 1.5, hop-step 0.5: default)"
    assert f"on CIFAR-10: no change → [Dirichlet α: 0.1, 1.0; methods: FedAvg, FedCat, {default}] (" in small.notes[0]
    cifar10 = [(c.setting.label, c.method) for c in small.cells if c.dataset == "cifar10"]
    methods = ("FedAvg", "FedCat", default, "Centralized")
    assert cifar10 == [(f"CIFAR-10 Dir({a})", m) for a in ("0.1", "1.0") for m in methods]
    hops = small.cell(small.settings[0], default).run_config
    assert (hops["strategy"], hops["fedcat-hop-step"], hops["fedcat-hop-clip"]) == ("fedcat", "0.5", 1.5)
    assert small.cell(small.settings[0], "FedCat").run_config["fedcat-hop-clip"] == 0.0
    concat_paper = get_suite("fedconcat", "paper")
    assert [s.name for s in concat_paper.settings][:4] == ["fmnist-c2", "fmnist-c3", "fmnist-dir0.1", "fmnist-dir0.5"]
    assert "partitions: #C=2, #C=3, Dir(0.1), Dir(0.5) → #C=2 (" in get_suite("fedconcat", "small").notes[0]
    assert paper.notes[0].startswith("Paper scale") and paper.subsample is None
    assert "datasets: MNIST, Fashion-MNIST, CIFAR-10 → digits" in get_suite("fedcat", "smoke").notes[0]
    fedavg = paper.cell(paper.settings[0], "FedAvg")
    assert fedavg.num_supernodes == 100 and fedavg.run_config["fraction-train"] == 0.1


def test_every_setting_has_a_centralized_row_with_the_suites_model_and_optimizer():
    suite = get_suite("fedseq", "small")
    (setting,) = suite.settings
    centralized = suite.cell(setting, "Centralized")
    assert centralized.num_supernodes == 1
    assert centralized.run_config == {
        "dataset": "cifar10", "strategy": "fedavg", "partition": "iid", "local-test-fraction": 0.0,
        "model": "lenet5", "batch-size": 64, "lr": 0.01, "momentum": 0.0, "weight-decay": 4e-4,
        "min-available-nodes": 1, "fraction-train": 1.0, "local-epochs": 1, "num-server-rounds": 10,
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"unknown method\(s\) \['FedNope'\]"):
        BLUEPRINTS["fedseq"].cells({**BLUEPRINTS["fedseq"].knobs("small"), "methods": ("FedAvg", "FedNope")})


def test_cifar10_settings_take_the_scales_cifar10_knobs_and_only_they_do():
    suite = get_suite("fedconcat", "small")
    rows = [(c.setting.name, c.method) for c in suite.cells if c.method in ("FedAvg", "MOON", "FedConcat-ID")]
    assert rows == [
        ("fmnist-c2", "FedAvg"), ("fmnist-c2", "MOON"), ("fmnist-c2", "FedConcat-ID"),
        ("cifar10-c2", "FedAvg"), ("cifar10-c2", "FedConcat-ID"),
        ("cifar10-dir0.5", "FedAvg"), ("cifar10-dir0.5", "FedConcat-ID"),
    ]  # fmt: skip
    dirichlet = suite.cell(suite.settings[-1], "FedAvg").run_config
    assert (dirichlet["partition"], dirichlet["alpha"], dirichlet["num-server-rounds"]) == ("dirichlet", 0.5, 15)
    assert "[partitions: #C=2, Dir(0.5); methods: FedAvg, FedConcat, FedConcat-ID]" in suite.notes[0]
    knobs = BLUEPRINTS["fedconcat"].knobs("small")
    with pytest.raises(ValueError, match=r"unknown knob\(s\) \['base rounds'\] in the scale's 'on CIFAR-10'"):
        BLUEPRINTS["fedconcat"].cells({**knobs, "on CIFAR-10": {"base rounds": 50}})


def test_the_centralized_row_is_the_reference_and_the_yardstick_of_the_baseline(tmp_path):
    suite = tiny_suite()
    cells = (*suite.cells, Cell(A, "Centralized", 1, {"strategy": "fedavg", "partition": "iid"}))
    suite = Suite(suite.name, suite.scale, suite.description, cells, suite.columns, targets=suite.targets)
    write_run(tmp_path, suite.cell(A, "Centralized"), 0, [0.6, 0.8])
    write_run(tmp_path, suite.cell(A, "Centralized"), 1, [0.7, 0.9])
    write_run(tmp_path, suite.cell(A, "FedAvg"), 0, [0.5, 0.5])
    write_run(tmp_path, suite.cell(A, "FedCat"), 0, [0.55, 0.6])
    write_run(tmp_path, suite.cell(B, "FedAvg"), 0, [0.4, 0.3])

    markdown = write_report(suite, [0, 1], tmp_path).read_text()

    # centralized: (0.8 + 0.9) / 2 = 85 %; FedAvg's 50 % is 59 % of it, under the 2/3 bar
    assert "Set A: FedAvg 50.0 % = 59% of centralized 85.0 % (below the bar)" in markdown
    assert "Set A 85.0 % (centralized); Set B 40.0 % (best run (no centralized run))" in markdown
    # 70 % of 0.85 = 0.595: FedCat at round 2, FedAvg never; 80 % = 0.68: neither
    rounds = table_rows(markdown, "rounds to 70% of reference")
    assert rounds["FedCat"] == ["2.0 ± 0.0 (1/2)", "–"] and rounds["FedAvg"] == ["–", "1.0 ± 0.0 (1/2)"]


def test_report_only_writes_the_table_from_finished_runs(tmp_path, capsys):
    suite = get_suite("fedcat", "smoke")
    write_run(tmp_path / "fedcat", suite.cells[0], 0, [0.4, 0.5])
    assert main(["fedcat", "--seeds", "0,1", "--report-only", "--out", str(tmp_path)]) == 0
    assert "| FedAvg | 50.0 ± 0.0 (1/2) |" in capsys.readouterr().out
    assert not (tmp_path / "data").exists() and (tmp_path / "fedcat" / "table.csv").exists()


def test_report_only_with_a_setting_tables_just_that_setting(tmp_path, capsys):
    suite = get_suite("fedcat", "smoke")
    write_run(tmp_path / "fedcat", suite.cell(suite.settings[2], "FedAvg"), 0, [0.4, 0.5])
    args = ["fedcat", "--seeds", "0", "--report-only", "--out", str(tmp_path), "--setting", "digits-dir1"]
    assert main([*args, "--method", "FedAvg", "--method", "FedCat"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[0] == "| method | final accuracy (%) | paper | gain over FedAvg (points): ours / paper | total MB (down+up) | wall s |"
    assert rows[1].startswith("| FedAvg | 50.0 ± 0.0 | – | – |") and rows[2] == "| FedCat | – | – | – / – | – | – |"
    assert len(rows) == 3


def test_dry_run_lists_the_runs_and_digits_suites_take_no_scale(capsys):
    assert main(["fedseq", "--scale", "small", "--seeds", "0,1", "--dry-run"]) == 0
    assert "fedseq (scale small): 8 cells × 2 seed(s) = 16 runs" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["fedcat-digits", "--scale", "small", "--dry-run"])


def write_idx(path: Path, array: np.ndarray) -> None:
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_mnist_subsample_is_stratified_idx_with_the_original_pixels(tmp_path):
    rng = np.random.default_rng(0)
    source = tmp_path / "src" / "MNIST" / "raw"
    source.mkdir(parents=True)
    x_train, y_train = rng.integers(0, 256, (200, 28, 28)), np.repeat(np.arange(10), 20)
    x_test, y_test = rng.integers(0, 256, (40, 28, 28)), np.repeat(np.arange(10), 4)
    for name, array in (("train-images-idx3-ubyte", x_train), ("train-labels-idx1-ubyte", y_train),
                        ("t10k-images-idx3-ubyte", x_test), ("t10k-labels-idx1-ubyte", y_test)):  # fmt: skip
        write_idx(source / name, array)

    folder = write_subsample("mnist", tmp_path / "src", Subsample(50, 20), tmp_path / "cache")
    data = load_dataset("mnist", folder)

    assert np.bincount(data.y_train.numpy()).tolist() == [5] * 10
    assert np.bincount(data.y_test.numpy()).tolist() == [2] * 10
    pixels = np.rint(data.x_train[:, 0].numpy() * 255).astype(int)
    assert all(any((row == x).all() for x in x_train[y_train == y]) for row, y in zip(pixels, data.y_train.numpy()))
    assert "subsample (seed 0) of 50 of its 200 train and 20 of its 40 test images" in describe("mnist", folder)
    assert write_subsample("mnist", tmp_path / "src", Subsample(50, 20), tmp_path / "cache") == folder  # reused


def test_cifar10_subsample_is_pickles_and_a_jpeg_copy_is_called_lossy(tmp_path):
    rng = np.random.default_rng(0)
    pickles = tmp_path / "src" / "cifar-10-batches-py"
    pickles.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (20, 3072), dtype=np.uint8), b"labels": list(range(10)) * 2}
        (pickles / name).write_bytes(pickle.dumps(batch))

    folder = write_subsample("cifar10", tmp_path / "src", Subsample(30, 10), tmp_path / "cache")
    data = load_dataset("cifar10", folder)

    assert (len(data.y_train), len(data.y_test)) == (30, 10) and data.input_shape == (3, 32, 32)
    assert "the original python pickles" in describe("cifar10", folder)
    jpeg_tree = tmp_path / "jpeg" / "train" / "airplane"
    jpeg_tree.mkdir(parents=True)
    (jpeg_tree / "0001.jpg").write_bytes(b"\xff\xd8")
    assert "LOSSY JPEG copy" in describe("cifar10", tmp_path / "jpeg")


def test_reports_name_paths_relative_to_the_repository_and_no_interpreter_path():
    assert shown_path(PROJECT_DIR / "results" / "overhead" / "deploy-latency.json") == "results/overhead/deploy-latency.json"
    assert shown_path(PROJECT_DIR.parent / "shared" / "data") == "../shared/data"
    assert shown_path("/usr/share/datasets/fashion-mnist") == "/usr/share/datasets/fashion-mnist"
    assert suite_command("scale", ["--data-dir", "../shared/data"]) == "python -m concatfl.bench scale --data-dir ../shared/data"


@pytest.mark.e2e
def test_smoke_scale_runs_through_flower_and_writes_table_csv_and_plots(tmp_path, capsys):
    # One real `flwr run` simulation (FedCat at Dir(1.0)); the other cells stay empty (the gain
    # over FedAvg, which needs both rows: test_gains_below_two_standard_deviations_…).
    args = ["fedcat", "--scale", "smoke", "--seeds", "0", "--out", str(tmp_path), "--cell-timeout", "900"]
    args += ["--method", "FedCat", "--setting", "digits-dir1"]

    assert main(args) == 0

    suite_dir = tmp_path / "fedcat"
    markdown = (suite_dir / "table.md").read_text()
    assert "## fedcat — scale `smoke`" in markdown
    assert "datasets: MNIST, Fashion-MNIST, CIFAR-10 → digits" in markdown
    accuracy = table_rows(markdown, "final accuracy (%)")
    assert list(accuracy) == get_suite("fedcat", "smoke").methods
    # columns: Dir(0.1), paper, gain, Dir(0.5), paper, gain, Dir(1.0), paper, gain
    fedcat = accuracy["FedCat"]
    assert fedcat[0] == "–" and fedcat[3] == "–" and fedcat[6] != "–"
    assert fedcat[7] == "–" and fedcat[8] == "– / –"  # the papers report no digits figures; no FedAvg row
    assert set(accuracy["FedAvg"]) == {"–"} and set(accuracy["SCAFFOLD"]) == {"–", "– / –"}  # not run
    with open(suite_dir / "table.csv", newline="") as handle:
        rows = {row["method"]: row for row in csv.DictReader(handle)}
    assert 0.0 <= float(rows["FedCat"]["digits Dir(1.0) | final accuracy (%) mean"]) <= 100.0
    assert float(rows["FedCat"]["digits Dir(1.0) | total MB (down+up) mean"]) > 0
    for name in ("accuracy-vs-round-digits-dir1.png", "accuracy-vs-mb-digits-dir1.png"):
        assert (suite_dir / "plots" / name).read_bytes()[:4] == b"\x89PNG"
    assert leftover_processes(tmp_path) == []

    capsys.readouterr()
    assert main(args) == 0  # everything finished: nothing runs again
    assert capsys.readouterr().out.count("done earlier") == 1


def test_a_scale_note_says_why_a_baseline_cannot_learn_at_that_scale():
    notes = get_suite("fedseq", "small").notes
    assert notes[-1].startswith("Why no row clears the bar here") and "4,036 rounds" in notes[-1]
    assert not any(note.startswith("Why") for note in get_suite("fedseq", "paper").notes)
