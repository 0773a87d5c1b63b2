"""Run a suite's missing cells as real Flower simulations, then write its report.

Each (cell, seed) is one `flwr run` simulation through concatfl's own ServerApp and ClientApp
(`concatfl.launch.run_simulation`) in `<out>/<suite>/<setting>/<method>/seed-<s>/`. A seed whose
metrics.json exists is not run again, so an interrupted suite resumes where it stopped; its
recorded run config must match the cell's, so results of another scale are never mixed in.
"""

from __future__ import annotations

import shlex
import shutil
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..data.datasets import DatasetNotFoundError
from ..deployment.processes import SimulationError
from ..launch import run_simulation
from ..metrics import METRICS_FILE, read_metrics
from .data import ensure_available, write_subsample
from .report import write_report
from .suites import Cell, Suite, slug


def suite_command(suite: str, argv: Sequence[str]) -> str:
    """The command line a report prints for `python -m concatfl.bench <suite> <argv>` (without
    the measuring machine's interpreter path)."""
    return shlex.join(["python", "-m", "concatfl.bench", suite, *argv])


def measure_and_print(
    suite: str, argv: Sequence[str], parse: Callable[[Sequence[str]], Any], measure: Callable[[Any, str], Path]
) -> int:
    """`python -m concatfl.bench <suite> <argv>` for a suite with options of its own: parse them,
    `measure(options, command)` (which writes and returns the table), print the table and the wall time."""
    options = parse(argv)
    started = time.perf_counter()
    table = measure(options, suite_command(suite, argv))
    print(table.read_text())
    print(f"{suite} wall time: {time.perf_counter() - started:.0f} s; table: {table}")
    return 0

DATA_CACHE = "data"  # under --out: the subsamples of the scaled-down suites
PATH_KEYS = ("data-dir", "fuzz-log")  # folders and files: the same run may have them elsewhere
# (run config, clients, workdir, app_dir=…) → metrics; app_dir is passed only for a cell of another app
Simulate = Callable[..., dict[str, Any]]


class BenchError(RuntimeError):
    """The suite cannot run as asked (bad filter, missing data, mismatched results) or cells failed."""


def simulate_with_flower(timeout: float = 6 * 3600, cpus_per_client: int = 1, gpus_per_client: float = 0.0) -> Simulate:
    """Run a cell as a real `flwr run` simulation with these per-run limits and client resources."""

    def simulate(run_config: dict[str, Any], num_supernodes: int, workdir: Path, **app: Path) -> dict[str, Any]:
        return run_simulation(
            run_config,
            num_supernodes,
            workdir=workdir,
            timeout=timeout,
            cpus_per_client=cpus_per_client,
            gpus_per_client=gpus_per_client,
            **app,
        )

    return simulate


def select_cells(suite: Suite, methods: Sequence[str] = (), settings: Sequence[str] = ()) -> list[Cell]:
    """The cells whose method (label or folder name) and setting (name or label) are asked for;
    an empty filter keeps all."""
    known_methods = {name for m in suite.methods for name in (m, slug(m))}
    known_settings = {name for s in suite.settings for name in (s.name, s.label)}
    for asked, known, kind in ((methods, known_methods, "method"), (settings, known_settings, "setting")):
        unknown = [name for name in asked if name not in known]
        if unknown:
            raise BenchError(f"unknown {kind}(s) {unknown} in {suite.name}; known: {sorted(known - {''})}")
    return [
        cell
        for cell in suite.cells
        if (not methods or {cell.method, slug(cell.method)} & set(methods))
        and (not settings or {cell.setting.name, cell.setting.label} & set(settings))
    ]


def prepare_data(suite: Suite, cells: Sequence[Cell], data_dirs: Mapping[str, Path], out: Path) -> dict[str, Path]:
    """dataset → the data-dir its runs read: the user's folder, or (scaled-down suites) a
    subsample written under `<out>/data/`. Fails before any run when a dataset is missing.

    `data_dirs` maps a dataset to its folder, `"*"` to the folder for every other dataset.
    """
    prepared = {}
    for dataset in dict.fromkeys(cell.dataset for cell in cells if cell.dataset != "digits"):
        source = data_dirs.get(dataset, data_dirs.get("*"))
        if source is None:
            raise BenchError(f"{suite.name} needs {dataset}: pass --data-dir DIR (or --data-dir {dataset}=DIR)")
        source = source.expanduser().resolve()
        try:
            if suite.subsample is not None:
                prepared[dataset] = write_subsample(dataset, source, suite.subsample, out / DATA_CACHE)
            else:
                ensure_available(dataset, source)
                prepared[dataset] = source
        except DatasetNotFoundError as error:
            raise BenchError(f"{error}\n(--data-dir {dataset}=DIR gives {dataset} a folder of its own)") from error
    return prepared


def cell_config(
    cell: Cell,
    seed: int,
    data: Mapping[str, Path],
    overrides: Mapping[str, Any] | None = None,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """The run config of one seed of a cell (`data-dir` set for real datasets), with `overrides`
    (the command line's --set) on top and ``{workdir}`` in string values replaced by `workdir`.
    A fuzzed cell draws its faults with the seed too (`fuzz-seed`, unless set): each seed meets
    other faults, as it meets other data and another initial model."""
    config = {**cell.run_config, **(overrides or {}), "seed": seed}
    if config.get("fuzz-share"):
        config.setdefault("fuzz-seed", seed)
    if workdir is not None:
        folder = str(workdir.resolve())
        config = {k: v.replace("{workdir}", folder) if isinstance(v, str) else v for k, v in config.items()}
    if cell.dataset in data:
        config["data-dir"] = str(data[cell.dataset])
    return config


def is_finished(workdir: Path, config: Mapping[str, Any]) -> bool:
    """Whether the run in `workdir` finished with `config`; raises BenchError if it used another.

    Paths (`PATH_KEYS`) are not compared: the same data may live elsewhere on another machine.
    """
    if not (workdir / "output" / METRICS_FILE).exists():
        return False
    recorded = read_metrics(workdir / "output")["run_config"]
    # A value the run config stores as text (a hop step of 1.0 is recorded as "1.0") matches its text.
    differing = {
        k: (recorded.get(k), v)
        for k, v in config.items()
        if k not in PATH_KEYS and recorded.get(k) != v and str(recorded.get(k)) != str(v)
    }
    if differing:
        details = ", ".join(f"{k}: {old!r} there, {new!r} now" for k, (old, new) in differing.items())
        raise BenchError(
            f"{workdir} holds a run with another configuration ({details}); another scale or an earlier "
            "version of the suite? Use another --out, or remove that folder to run it again."
        )
    return True


def run_suite(
    suite: Suite,
    seeds: Sequence[int],
    out: Path,
    *,
    data_dirs: Mapping[str, Path] | None = None,
    methods: Sequence[str] = (),
    settings: Sequence[str] = (),
    simulate: Simulate | None = None,
    overrides: Mapping[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Run every missing (selected cell, seed), then write the report; returns table.md's path.

    `overrides` (run-config keys) apply to every cell, over the suite's own settings.

    A failed run is reported and the suite goes on; after the report is written, BenchError
    names the failed runs (a re-run retries them).
    """
    simulate = simulate or simulate_with_flower()
    suite_dir = out / suite.name
    cells = select_cells(suite, methods, settings)
    data = prepare_data(suite, cells, data_dirs or {}, out)
    jobs = [
        (cell, seed, cell.workdir(suite_dir, seed), cell_config(cell, seed, data, overrides, cell.workdir(suite_dir, seed)))
        for cell in cells
        for seed in seeds
    ]
    # Checked before anything runs, so results of another configuration stop the suite at once.
    finished = [is_finished(workdir, config) for _, _, workdir, config in jobs]
    pending = finished.count(False)
    durations: list[float] = []
    failures: list[str] = []
    for done, ((cell, seed, workdir, config), earlier) in enumerate(zip(jobs, finished), start=1):
        name = " · ".join(filter(None, [cell.setting.label, cell.method, f"seed {seed}"]))
        if earlier:
            log(f"[{done}/{len(jobs)}] {name}: done earlier")
            continue
        started = time.perf_counter()
        shutil.rmtree(workdir, ignore_errors=True)  # what an earlier, unfinished try left
        try:
            app = {} if cell.app_dir is None else {"app_dir": cell.app_dir}
            metrics = simulate(config, cell.num_supernodes, workdir, **app)
        except SimulationError as error:
            failures.append(f"{name}: {str(error).splitlines()[0]}")
            log(f"[{done}/{len(jobs)}] {name}: FAILED ({error}); see {workdir}")
            continue
        finally:
            pending -= 1
        durations.append(time.perf_counter() - started)
        eta = f"; about {pending * statistics.fmean(durations) / 60:.0f} min left" if pending else ""
        log(
            f"[{done}/{len(jobs)}] {name}: accuracy {metrics['final_accuracy']:.4f} "
            f"({durations[-1]:.0f} s{eta})"
        )
    table = write_report(suite, seeds, suite_dir)
    if failures:
        raise BenchError(f"{len(failures)} run(s) failed (table written without them):\n" + "\n".join(failures))
    return table
