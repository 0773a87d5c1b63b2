"""Benchmarks: the papers' comparisons run as real Flower simulations, summarized as mean ± std.

    python -m concatfl.bench fedcat --scale small --data-dir /path/to/data --seeds 0,1,2 --out results
    python -m concatfl.bench fedcat-digits --seeds 0,1,2 --out results

Each (setting, method, seed) is one `flwr run` simulation through concatfl's own ServerApp and
ClientApp; its metrics.json lands in `<out>/<suite>/<setting>/<method>/seed-<s>/output/` (the
digits suites have no setting folder). Finished runs are skipped, so a suite resumes where it
stopped. `<out>/<suite>/` then holds table.md, table.csv and plots/*.png.

Modules: `suites` (what runs, per scale), `runner` (running and resuming), `report` (tables and
plots from metrics.json), `columns` (the figures taken from one run), `data` (real data and its
subsamples).
"""

from .report import write_report
from .runner import BenchError, run_suite
from .suites import SCALES, SUITE_NAMES, get_suite

__all__ = ["SCALES", "SUITE_NAMES", "BenchError", "get_suite", "run_suite", "write_report"]
