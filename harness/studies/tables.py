"""The study tables: one runner for every table spec of conf/table/ (docs/extending.md, "A study table").

A spec names its sweep (conf/sweep/), the fields a seed row takes from each finished (run, replica), the keys a cell
groups the seeds by and the cells' order, the statistics over seeds, the Markdown tables and their columns, and the
figure (studies/table_spec.py, table_text.py, table_figures.py). The runner reads the sweep's results and writes
table.md and the figure under --out (default: the spec's `out`):

    python -m fedharness.studies.tables compression results/sweeps/compression --out docs/compression
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedharness.config.compose import group_options
from fedharness.errors import ConfigError
from fedharness.studies.reports.analysis import parse_target
from fedharness.studies.reports.data import load_results
from fedharness.studies.table_figures import draw
from fedharness.studies.table_spec import read_spec, seed_rows, summary
from fedharness.studies.table_text import markdown


def parse_targets(items: list[str]) -> dict[str, str]:
    """`--target DATASET=METRIC>=V` items as {dataset: text}; each text is parsed once here so that a malformed
    one fails at the command line, naming --target, rather than deep inside the table."""
    out = {}
    for item in items:
        dataset, _, text_ = item.partition("=")
        parse_target(text_)
        out[dataset] = text_
    return out


def main(argv: list[str] | None = None) -> int:
    """Read a spec and the results of its sweep; write table.md and the figure under --out; print the table. Bad
    input (a spec, results or target): one line on stderr, exit status 2, nothing written."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", help=f"a spec of conf/table/ ({', '.join(group_options('table'))}) or a YAML file")
    parser.add_argument("results_dir")
    parser.add_argument("--out", default=None, help="the folder written (default: the spec's out)")
    parser.add_argument("--target", action="append", default=[], metavar="DATASET=METRIC>=V",
                        help="a problem's target (defaults: the spec's targets)")
    args = parser.parse_args(argv)
    try:
        spec, targets = read_spec(args.table), parse_targets(args.target)
        results = load_results(args.results_dir)
        seeds = seed_rows(spec, results, targets)
        table = summary(spec, seeds)
        text = markdown(spec, table)
    except ConfigError as err:
        print(f"fedharness.studies.tables: error: {err}", file=sys.stderr)
        return 2
    folder = Path(args.out or spec["out"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "table.md").write_text(text)
    written = [folder / "table.md"]
    if "figure" in spec:
        written.append(folder / spec["figure"]["file"])
        draw(spec, results, seeds, table, written[-1])
    print(text)
    print(f"{len(seeds)} (run, seed) results; written: {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
