"""A suite's table (markdown and CSV) and plots, built only from its runs' metrics.json files.

Every figure is the mean ± sample standard deviation over the seeds that finished; a cell where
fewer seeds contributed than were asked for shows "(k/n)". Layout: a one-setting suite is one
table, methods × columns; a suite with several settings (the papers' tables) gets one table per
column, methods × settings, with the paper's figure and the gain over FedAvg (ours / the
paper's) next to each setting's accuracy.
"""

from __future__ import annotations

import csv
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..metrics import METRICS_FILE, read_metrics
from .columns import Column, Metrics, best_accuracy, curve, rounds_to
from .data import describe
from .suites import CENTRALIZED, Setting, Suite

TABLE_MD = "table.md"
TABLE_CSV = "table.csv"
PLOTS_DIR = "plots"
MISSING = "–"
# The row every gain is measured against, and the gain column's title.
BASELINE = "FedAvg"
# A baseline "learns" when its final accuracy reaches this share of the centralized row's.
LEARNING_SHARE = 2 / 3
GAIN_TITLE = "gain over FedAvg (points): ours / paper"

Runs = dict[tuple[str, str], list[Metrics]]  # (setting name, method) → the finished runs' metrics


@dataclass(frozen=True)
class Summary:
    """A cell's figure over seeds: mean, sample standard deviation, how many seeds had it."""

    mean: float
    std: float
    n: int


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(values: Iterable[float | None]) -> Summary | None:
    """Mean ± std of the values that exist (None: no run had the figure)."""
    present = [value for value in values if value is not None]
    return Summary(*mean_std(present), len(present)) if present else None


def load_runs(suite: Suite, seeds: Sequence[int], suite_dir: Path) -> Runs:
    """The metrics of every finished (cell, seed); unfinished seeds are left out."""
    runs: Runs = {}
    for cell in suite.cells:
        outputs = [cell.workdir(suite_dir, seed) / "output" for seed in seeds]
        runs[(cell.setting.name, cell.method)] = [read_metrics(o) for o in outputs if (o / METRICS_FILE).exists()]
    return runs


def mean_final_accuracy(runs: Runs, setting: Setting, method: str) -> float | None:
    """The mean final accuracy of the finished runs of (setting, method); None if there are none."""
    metrics = runs.get((setting.name, method), [])
    return mean_std([m["final_accuracy"] for m in metrics])[0] if metrics else None


def reference_accuracy(runs: Runs, setting: Setting) -> tuple[float | None, bool]:
    """The setting's reference accuracy and whether it is centralized: the mean final accuracy of
    its centralized runs, or else the best accuracy any finished run reached (any method, seed and
    round)."""
    centralized = mean_final_accuracy(runs, setting, CENTRALIZED)
    if centralized is not None:
        return centralized, True
    reached = [best_accuracy(m) for (name, _), metrics in runs.items() if name == setting.name for m in metrics]
    return (max(reached) if reached else None), False


def baseline_against_centralized(runs: Runs, setting: Setting) -> str | None:
    """How far the setting's FedAvg got against its centralized row and the bar of
    LEARNING_SHARE of it; None if either has no finished run."""
    reference = mean_final_accuracy(runs, setting, CENTRALIZED)
    reached = mean_final_accuracy(runs, setting, BASELINE)
    if reference is None or reached is None:
        return None
    verdict = "learns" if reached >= LEARNING_SHARE * reference else "below the bar"
    return (
        f"{setting.label}: {BASELINE} {100 * reached:.1f} % = {reached / reference:.0%} of centralized "
        f"{100 * reference:.1f} % ({verdict})"
    )


def columns_for(suite: Suite, runs: Runs, setting: Setting) -> list[Column]:
    """The suite's columns, plus its rounds-to-target columns measured against this setting's reference."""
    reference, _ = reference_accuracy(runs, setting)
    targets = [
        Column(f"rounds to {t:.0%} of reference", _none if reference is None else rounds_to(t * reference), 1)
        for t in suite.targets
    ]
    return [*suite.columns, *targets]


def _none(_: Metrics) -> None:
    return None


def summaries(suite: Suite, runs: Runs) -> dict[tuple[str, str, str], Summary | None]:
    """(setting name, method, column title) → that cell's summary over seeds."""
    table = {}
    for setting in suite.settings:
        for column in columns_for(suite, runs, setting):
            for method in suite.methods:
                metrics = runs.get((setting.name, method), [])
                table[(setting.name, method, column.title)] = summarize(column.extract(m) for m in metrics)
    return table


def format_summary(summary: Summary | None, seeds: int, decimals: int | None = None) -> str:
    """The cell's text: mean ± std, then "(k/n)" when only k of the n seeds contributed; "–" if none did.

    `decimals` None picks them by magnitude: 4 below 10, 1 below 10,000, else none.
    """
    if summary is None:
        return MISSING
    mean, std = summary.mean, summary.std
    if decimals is None:
        decimals = 4 if abs(mean) < 10 else 1 if abs(mean) < 1e4 else 0
    grouping = "," if abs(mean) >= 1e4 else ""
    text = f"{mean:{grouping}.{decimals}f} ± {std:{grouping}.{decimals}f}"
    return text if summary.n == seeds else f"{text} ({summary.n}/{seeds})"


def _paper(suite: Suite, method: str, setting: Setting) -> float | None:
    return suite.paper.get((method, setting.name)) if suite.paper is not None else None


def gain_over_baseline(
    suite: Suite, cells: dict[tuple[str, str, str], Summary | None], setting: Setting, method: str, title: str
) -> str:
    """"ours / paper": the method's accuracy minus the baseline's (FedAvg), in points, here and in
    the paper. Ours is marked "(noise)" when smaller than 2 standard deviations (the larger of the
    two rows'); "–" where a figure is missing, and for the baseline itself."""
    if method == BASELINE:
        return MISSING
    ours, base = cells.get((setting.name, method, title)), cells.get((setting.name, BASELINE, title))
    ours_text = MISSING
    if ours is not None and base is not None:
        gain = ours.mean - base.mean
        ours_text = f"{gain:+.1f}" + (" (noise)" if abs(gain) < 2 * max(ours.std, base.std) else "")
    paper, paper_base = _paper(suite, method, setting), _paper(suite, BASELINE, setting)
    paper_text = MISSING if paper is None or paper_base is None else f"{paper - paper_base:+.1f}"
    return f"{ours_text} / {paper_text}"


def render_markdown(suite: Suite, seeds: Sequence[int], runs: Runs) -> str:
    """The suite's table.md: header (scale, scale-downs, choices, data, paper), then the tables."""
    cells = summaries(suite, runs)
    settings = suite.settings
    columns = columns_for(suite, runs, settings[0])  # titles and formats are the same in every setting
    titles = [column.title for column in columns]
    with_paper = suite.paper is not None
    paper_titles = ["paper", GAIN_TITLE] if with_paper else []

    def paper_cells(method: str, setting: Setting) -> list[str]:
        if not with_paper:
            return []
        return [_format_paper(_paper(suite, method, setting)), gain_over_baseline(suite, cells, setting, method, titles[0])]

    lines = _header(suite, seeds, runs)
    if len(settings) == 1:
        setting = settings[0]
        lines += _table_head(["method", titles[0], *paper_titles, *titles[1:]])
        for method in suite.methods:
            row = [format_summary(cells[(setting.name, method, c.title)], len(seeds), c.decimals) for c in columns]
            lines.append(_row([method, row[0], *paper_cells(method, setting), *row[1:]]))
        return "\n".join(lines) + "\n"
    for index, column in enumerate(columns):
        first = index == 0
        head = [item for s in settings for item in ([s.label, *paper_titles] if first else [s.label])]
        lines += [f"### {column.title}", "", *_table_head(["method", *head])]
        for method in suite.methods:
            row = [method]
            for setting in settings:
                row.append(format_summary(cells[(setting.name, method, column.title)], len(seeds), column.decimals))
                if first:
                    row += paper_cells(method, setting)
            lines.append(_row(row))
        lines.append("")
    return "\n".join(lines)


def _header(suite: Suite, seeds: Sequence[int], runs: Runs) -> list[str]:
    if suite.scale == "digits":  # the digits suites keep their earlier one-line header
        return [f"## {suite.name}", "", f"{suite.description}; {len(seeds)} seeds, mean ± std.", ""]
    notes = list(suite.notes)
    data = dict.fromkeys(
        note
        for metrics in runs.values()
        for m in metrics
        if (note := describe(m["run_config"]["dataset"], m["run_config"]["data-dir"])) is not None
    )
    notes += [f"Data: {note}." for note in data]
    if suite.paper is not None:
        known = any(value is not None for value in suite.paper.values())
        notes.append(
            f"Paper column: the paper's figure (accuracy, %, at the paper's scale, not ours); {MISSING} where the "
            f"paper reports none. Gain column: accuracy minus {BASELINE}'s, in points, at our scale / in the "
            f"paper; ours is marked (noise) when under 2 standard deviations."
            if known
            else f"Paper column: the papers' figures were not available to the harness, so every one shows "
            f"{MISSING} (known figures go into PAPER in concatfl/bench/suites.py)."
        )
    learned = [text for s in suite.settings if (text := baseline_against_centralized(runs, s)) is not None]
    if learned:
        notes.append(
            f"Does the baseline learn? (bar: {LEARNING_SHARE:.0%} of the centralized row's final accuracy) "
            + "; ".join(learned)
            + "."
        )
    if suite.targets:
        references = []
        for s in suite.settings:
            reference, centralized = reference_accuracy(runs, s)
            kind = "centralized" if centralized else "best run (no centralized run)"
            references.append(f"{s.label} {MISSING if reference is None else f'{100 * reference:.1f} %'} ({kind})")
        notes.append(
            "Rounds to reach a share of the reference accuracy: the reference is the centralized row's "
            "mean final accuracy, or where that row has no run the best accuracy any run of the setting "
            "reached (any method, seed, round): " + "; ".join(references) + ". Mean over the seeds that reached it."
        )
    return [
        f"## {suite.name} — scale `{suite.scale}`",
        "",
        f"{suite.description}.",
        "",
        f"{len(seeds)} seed{'s' if len(seeds) > 1 else ''} ({', '.join(map(str, seeds))}): mean ± sample std "
        f"over seeds; \"(k/n)\": only k of the n seeds finished (or reached the target); {MISSING}: no figure.",
        "",
        *[f"- {note}" for note in notes],
        "",
    ]


def _table_head(head: list[str]) -> list[str]:
    return [_row(head), "|---" * len(head) + "|"]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _format_paper(value: float | None) -> str:
    return MISSING if value is None else f"{value:.1f}"


def write_csv(suite: Suite, seeds: Sequence[int], runs: Runs, path: Path) -> None:
    """table.csv: one row per method; per setting, each column's mean, std and seed count (and
    the paper's figure after the accuracy). Empty fields: no figure."""
    cells = summaries(suite, runs)
    titles = [column.title for column in columns_for(suite, runs, suite.settings[0])]
    header, keys = ["method"], []
    for setting in suite.settings:
        prefix = f"{setting.label} | " if setting.label else ""
        for index, title in enumerate(titles):
            header += [f"{prefix}{title} mean", f"{prefix}{title} std", f"{prefix}{title} n"]
            keys.append((setting, title))
            if index == 0 and suite.paper is not None:
                header.append(f"{prefix}paper")
                keys.append((setting, None))
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for method in suite.methods:
            row = [method]
            for setting, title in keys:
                if title is None:
                    row.append(_number(_paper(suite, method, setting)))
                    continue
                summary = cells[(setting.name, method, title)]
                row += [_number(summary.mean), _number(summary.std), str(summary.n)] if summary else ["", "", "0"]
            writer.writerow(row)


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.10g}"


@dataclass(frozen=True)
class CurvePoint:
    """One point of a method's curve over seeds: round, mean cumulative MB, accuracy mean ± std."""

    round: int
    megabytes: float
    accuracy: float
    accuracy_std: float


def mean_curve(metrics: Sequence[Metrics]) -> list[CurvePoint]:
    """The runs' accuracy (mean and sample std) and MB (mean) at the rounds every run evaluated."""
    curves = [{r: (mb, acc) for r, mb, acc in curve(m)} for m in metrics]
    common = sorted(set.intersection(*(set(c) for c in curves)))
    points = []
    for r in common:
        accuracy, std = mean_std([c[r][1] for c in curves])
        points.append(CurvePoint(r, statistics.fmean(c[r][0] for c in curves), accuracy, std))
    return points


# Each method gets its own hollow marker, line style and (shrinking) marker size, and in the
# accuracy-vs-round view a small sideways offset, so curves that coincide (e.g. two methods that
# both stall at one accuracy) stay visible side by side.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINE_STYLES = ("-", "--", "-.", ":")
ROUND_OFFSET = 0.06  # rounds between neighbouring methods' points


def curve_figure(lines: dict[str, list[CurvePoint]], seeds: dict[str, int], by_megabytes: bool, title: str) -> Figure:
    """Accuracy vs round (or vs MB): per method the mean over its seeds, with a band of ±1 std."""
    figure = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(figure)  # Agg, without pyplot's global state
    axes = figure.add_subplot()
    for index, (method, points) in enumerate(lines.items()):
        offset = 0.0 if by_megabytes else (index - (len(lines) - 1) / 2) * ROUND_OFFSET
        x = [p.megabytes if by_megabytes else p.round + offset for p in points]
        mean = [100 * p.accuracy for p in points]
        std = [100 * p.accuracy_std for p in points]
        (line,) = axes.plot(
            x,
            mean,
            linestyle=LINE_STYLES[index % len(LINE_STYLES)],
            marker=MARKERS[index % len(MARKERS)],
            markersize=max(3.0, 9.0 - 1.5 * index),
            markerfacecolor="none",
            label=f"{method} (n={seeds[method]})",
        )
        if seeds[method] > 1:
            lower = [m - s for m, s in zip(mean, std)]
            upper = [m + s for m, s in zip(mean, std)]
            axes.fill_between(x, lower, upper, color=line.get_color(), alpha=0.15, linewidth=0)
    x_label = "measured MB (down+up, cumulative; mean over seeds)" if by_megabytes else "round"
    axes.set(xlabel=x_label, ylabel="accuracy (%)", title=title)
    if not by_megabytes:
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.text(0.01, 0.99, "lines: mean over seeds (n); bands: ±1 std", transform=axes.transAxes,
              fontsize="small", va="top")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small", loc="lower right")
    return figure


def plot_curves(suite: Suite, runs: Runs, directory: Path) -> list[Path]:
    """Per setting: accuracy vs round and accuracy vs measured MB, one line per method (mean
    over seeds, a shaded band of ±1 sample std)."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for setting in suite.settings:
        finished = {m: runs[(setting.name, m)] for m in suite.methods if runs.get((setting.name, m))}
        if not finished:
            continue
        lines = {method: mean_curve(metrics) for method, metrics in finished.items()}
        seeds = {method: len(metrics) for method, metrics in finished.items()}
        suffix = f"-{setting.name}" if setting.name else ""
        title = f"{suite.name} ({suite.scale})" + (f", {setting.label}" if setting.label else "")
        for by_megabytes, stem in ((False, "accuracy-vs-round"), (True, "accuracy-vs-mb")):
            path = directory / f"{stem}{suffix}.png"
            curve_figure(lines, seeds, by_megabytes, title).savefig(path, dpi=110)
            written.append(path)
    return written


def write_report(suite: Suite, seeds: Sequence[int], suite_dir: Path) -> Path:
    """Write table.md, table.csv and the plots of every finished cell; return table.md's path."""
    runs = load_runs(suite, seeds, suite_dir)
    suite_dir.mkdir(parents=True, exist_ok=True)
    table = suite_dir / TABLE_MD
    table.write_text(render_markdown(suite, seeds, runs))
    write_csv(suite, seeds, runs, suite_dir / TABLE_CSV)
    plot_curves(suite, runs, suite_dir / PLOTS_DIR)
    if suite.extra_plot is not None:
        suite.extra_plot(suite, runs, suite_dir / PLOTS_DIR)
    return table
