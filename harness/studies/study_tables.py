"""What the study tables (studies/compression.py, studies/systems.py, studies/async_table.py) share: the command
line, the walk over each finished (run, replica) with its problem's target, the per-cell statistics over seeds, the
Markdown cells and the figure's axes and file, and the accuracy-against-simulated-time figure of the two tables with
clients of unequal speed (systems.py, async_table.py).

Each study keeps what is its own: the columns a run adds, the keys a cell is grouped by, the rows' order, the
table's columns and the figure's lines.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fedharness.studies.reports.analysis import Target, parse_target, time_to_target
from fedharness.studies.reports.data import Results, load_results

SeedRows = Callable[[Results, dict[str, str]], pd.DataFrame]
Figure = Callable[[Results, pd.DataFrame, Path], None]


def problem_name(cfg: dict) -> str:
    """A run's problem as the tables name it (and as --target DATASET=... keys it): its data set."""
    return str(cfg.get("dataset.name"))


def parse_targets(items: list[str]) -> dict[str, str]:
    """`--target DATASET=METRIC>=V` items as {dataset: text}; each text is parsed once here so that a malformed
    one fails at the command line, naming --target, rather than deep inside the table."""
    out = {}
    for item in items:
        dataset, _, text = item.partition("=")
        parse_target(text)
        out[dataset] = text
    return out


def iterate_rounds(results: Results) -> pd.DataFrame:
    """The rounds/ rows of the iterate series: the model the tables and figures describe."""
    return results.rounds[results.rounds["series"] == "iterate"]


@dataclass(frozen=True)
class Replica:
    """One finished (run, replica): its problem and target, the run's runs/ row, its last evaluated iterate round
    and, where the problem has a target, its time_to_target row."""

    problem: str
    target: Target | None
    run: Any  # the runs/ row, a namedtuple of DataFrame.itertuples
    replica: int
    last: pd.Series
    hit: pd.Series | None

    def cells(self, to_target: str) -> dict[str, Any]:
        """The columns every study's seed row has; `to_target` names time_to_target's cost column kept (mb,
        sim_s). Censored or target-less: reached False and NaN round and cost, left out of the means later."""
        hit = self.hit
        return {"problem": self.problem, "target": self.target.label if self.target else "",
                "run_id": self.run.run_id, "replica": self.replica, "status": self.run.status,
                "reached": bool(hit["reached"]) if hit is not None else False,
                "round": float(hit["round"]) if hit is not None else np.nan,
                to_target: float(hit[to_target]) if hit is not None else np.nan,
                "last_round": int(self.last["round"]), "test_acc": float(self.last["test_acc"])}


def replicas(results: Results, targets: dict[str, str]) -> Iterator[Replica]:
    """Each replica of each run that finished (ok, or diverged: its seeds stop early), problem by problem in the
    order the runs first name them; time_to_target runs once per problem, as its target is per problem."""
    runs = results.runs[results.runs["status"].isin(["ok", "diverged"])]
    rounds = iterate_rounds(results)
    last = rounds[rounds["round"] == rounds.groupby(["run_id", "replica"])["round"].transform("max")]
    for problem, group in runs.groupby(runs["cfg"].map(problem_name), sort=False):
        target = parse_target(targets[problem]) if problem in targets else None
        sub = Results(results.store, group, rounds[rounds["run_id"].isin(group["run_id"])])
        ttt = time_to_target(sub, target) if target is not None else None
        for run in group.itertuples():
            fin = last[last["run_id"] == run.run_id].set_index("replica")
            hit = ttt[ttt["run_id"] == run.run_id].set_index("replica") if ttt is not None else None
            for rep, row in fin.iterrows():
                yield Replica(problem, target, run, int(rep), row, hit.loc[rep] if hit is not None else None)


def seed_stats(g: pd.DataFrame, **to_target: str) -> dict[str, Any]:
    """A cell's statistics over its seeds `g`: counts, the last round, whether it diverged, the final test
    accuracy (%) over every seed, and for each `name=column` of `to_target` the mean and std (ddof 1) of the
    column over the seeds that reached the target only (a censored seed has no value to average)."""
    hit = g[g["reached"]]
    out: dict[str, Any] = {"seeds": len(g), "reached": len(hit), "last_round": int(g["last_round"].max()),
                           "diverged": bool((g["status"] == "diverged").any())}
    for name, column in to_target.items():
        out[f"{name}_mean"], out[f"{name}_std"] = hit[column].mean(), hit[column].std()
    return {**out, "acc_mean": 100 * g["test_acc"].mean(), "acc_std": 100 * g["test_acc"].std()}


def pm(mean: float, std: float, digits: int) -> str:
    """'mean ± std'; the mean alone where std is NaN (a single seed)."""
    if np.isnan(std):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def to_target_cell(row: Any, name: str, digits: int) -> str:
    """A summary row's `name` to the target, 'mean ± std', or "not reached (> R)" where no seed reached it."""
    if not row.reached:
        return f"not reached (> {row.last_round})"
    return pm(getattr(row, f"{name}_mean"), getattr(row, f"{name}_std"), digits)


def accuracy_cell(row: Any) -> str:
    """A summary row's final test accuracy (%), or "diverged after round R": a diverged run's accuracy is not
    the model's."""
    return f"diverged after round {row.last_round}" if row.diverged else pm(row.acc_mean, row.acc_std, 1)


def heading(name: str, part: pd.DataFrame) -> str:
    """The line above a problem's table: its name, target, seeds and rounds."""
    return (f"**{name}**: target {part['target'].iloc[0]}, {int(part['seeds'].max())} seeds, "
            f"{int(part['last_round'].max())} rounds")


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend: the figures are files, written where no display may be."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish_panel(ax: Any, xlabel: str, metric: str, title: str, legend_size: float, ncol: int = 1) -> None:
    """The labels, title, legend (`ncol` columns) and grid every panel has."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{metric} (mean over seeds)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=legend_size, ncol=ncol)
    ax.grid(alpha=0.3)


def save_figure(fig: Any, path: Path) -> None:
    """Write the figure and free it (pyplot keeps every open figure otherwise)."""
    fig.savefig(path, dpi=120, bbox_inches="tight")
    pyplot().close(fig)


def accuracy_vs_time(results: Results, runs: pd.DataFrame, path: Path, metric: str, *,
                     problem_label: Callable[[str, str], str], style: Callable[[Any], str],
                     label: Callable[[Any], str], xmax: Callable[[tuple[str, str], str], float | None] | None = None
                     ) -> None:
    """One panel per (problem, speed profile) of `runs` (one row per run, in the table's order, with its problem,
    model, speed, speed_label, target and run_id): the mean over seeds of `metric` against the mean over seeds of
    sim_s at each evaluated round, one line per run (`style(run)` its line style, `label(run)` its legend), the
    target as a grey dotted line. A panel's row is its (problem, model), its column its speed profile, in the order
    `runs` first names them; `xmax((problem, model), speed)`, where given and not None, stops its x axis there."""
    plt = pyplot()
    rounds = iterate_rounds(results)
    panels = list(dict.fromkeys(zip(zip(runs["problem"], runs["model"]), runs["speed"])))
    problems = list(dict.fromkeys(zip(runs["problem"], runs["model"])))
    speeds = list(dict.fromkeys(runs["speed"]))
    fig, axes = plt.subplots(len(problems), len(speeds), figsize=(6 * len(speeds), 4 * len(problems)),
                             squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax in axes.flat:
        ax.set_visible(False)
    for problem, speed in panels:
        ax = axes[problems.index(problem)][speeds.index(speed)]
        ax.set_visible(True)
        cells = runs[(runs["problem"] == problem[0]) & (runs["model"] == problem[1]) & (runs["speed"] == speed)]
        for i, run in enumerate(cells.itertuples()):
            r = rounds[rounds["run_id"] == run.run_id].groupby("round")[[metric, "sim_s"]].mean()
            ax.plot(r["sim_s"], r[metric], color=colors[i % len(colors)], lw=1.4, ls=style(run), label=label(run))
        right = xmax(problem, speed) if xmax is not None else None
        if right is not None:
            ax.set_xlim(0, right)
        target = parse_target(cells["target"].iloc[0]) if cells["target"].iloc[0] else None
        if target is not None and target.metric == metric:
            ax.axhline(target.value, color="grey", ls=":", lw=1)
        finish_panel(ax, "simulated time sim_s (s, mean over seeds)", metric,
                     f"{problem_label(*problem)}\n{cells['speed_label'].iloc[0]}", 7)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None, *, doc: str, out: str, targets: dict[str, str], seed_rows: SeedRows,
         table: Callable[[pd.DataFrame], str], figure: Figure, figure_name: str) -> int:
    """A study's command: read results_dir, write table.md (`table` of the seed rows) and `figure_name`
    (`figure`) under --out, and print the table."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("results_dir")
    parser.add_argument("--out", default=out)
    parser.add_argument("--target", action="append", default=[], metavar="DATASET=METRIC>=V",
                        help=f"a problem's target (defaults: {', '.join(f'{k}={v}' for k, v in targets.items())})")
    args = parser.parse_args(argv)
    results = load_results(args.results_dir)
    seeds = seed_rows(results, parse_targets(args.target))
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    text = table(seeds)
    (folder / "table.md").write_text(text)
    figure(results, seeds, folder / figure_name)
    print(text)
    print(f"{len(seeds)} (run, seed) results; written: {folder / 'table.md'}, {folder / figure_name}")
    return 0
