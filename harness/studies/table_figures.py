"""The figures of the study tables (studies/tables.py), one per spec, its `figure.kind`:

* heat_map: a pivot spec's `value` (a cell statistic) per part, the rows against the columns, 0 to 100;
* accuracy_vs_mb: per problem, test accuracy against the MB sent by each evaluated round (log x), a line per run
  (its `color` field's value picks the color from `colors`, `style` and `label` are texts of the run's seed row,
  the line thicker at larger values of `width` within a color);
* accuracy_vs_time: per (problem, speed profile), test accuracy against simulated time sim_s, a line per run
  (`style` and `label` texts of its seed row), the target as a grey dotted line; with `xmax: twice_to_target` the
  x axis stops at twice the panel's latest mean time to the target. Its seed rows need the fields model, speed,
  problem_label and speed_label (conf/table/_clients.yaml has them).
Every line is the mean over seeds at each evaluated round.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fedharness.studies.reports.analysis import parse_target
from fedharness.studies.reports.data import Results
from fedharness.studies.table_spec import iterate_rounds, order
from fedharness.studies.table_text import parts, pivot, text

METRIC = "test_acc"


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend: the figures are files, written where no display may be."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish_panel(ax: Any, xlabel: str, title: str, legend_size: float, ncol: int = 1) -> None:
    """The labels, title, legend (`ncol` columns) and grid every panel has."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{METRIC} (mean over seeds)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=legend_size, ncol=ncol)
    ax.grid(alpha=0.3)


def heat_map(spec: dict[str, Any], results: Results, seeds: pd.DataFrame, table: pd.DataFrame) -> Any:
    plt, fig_spec = pyplot(), spec["figure"]
    panels = list(parts(spec, table))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels) + 1.5, 4.2), squeeze=False, sharey=True)
    p = spec["pivot"]
    for ax, (names, part) in zip(axes[0], panels):
        rows, columns, cells = pivot(spec, table, part)
        mean = np.array([[cells[r + c][fig_spec["value"]] if r + c in cells else math.nan for c in columns]
                         for r in rows])
        image = ax.imshow(mean, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        labels = [text(p["columns"]["label"], dict(zip([k["field"] for k in p["columns"]["keys"]], c)))
                  for c in columns]
        ax.set_xticks(range(len(columns)), labels, rotation=60, ha="right", fontsize=8)
        ax.set_yticks(range(len(rows)), [" ".join(map(str, r)) for r in rows], fontsize=8)  # shared: the left's
        for (i, j), value in np.ndenumerate(mean):
            ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=7)
        ax.set_title(text(fig_spec["title"], names), fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
    return fig


def accuracy_vs_mb(spec: dict[str, Any], results: Results, seeds: pd.DataFrame,
                   table: pd.DataFrame) -> Any:
    plt, fig_spec = pyplot(), spec["figure"]
    rounds = iterate_rounds(results)
    rounds = rounds.assign(mb=(rounds["bytes_up"].astype(float) + rounds["bytes_down"].astype(float)) / 1e6)
    runs = order(spec, seeds.drop_duplicates("run_id"))
    problems = list(dict.fromkeys(runs["problem"]))
    colors = dict(zip(fig_spec["colors"], plt.get_cmap("tab10").colors))
    fig, axes = plt.subplots(1, len(problems), figsize=(6.5 * len(problems), 4.4), squeeze=False)
    for ax, problem in zip(axes[0], problems):
        cells = runs[runs["problem"] == problem]
        for run in cells.to_dict("records"):
            r = rounds[rounds["run_id"] == run["run_id"]].groupby("round")[[METRIC, "mb"]].mean()
            r = r[r["mb"] > 0]  # round 0, before anything is sent, has no place on a log axis
            color, value = run[fig_spec["color"]], run[fig_spec["width"]]
            widths = sorted(v for v in cells.loc[cells[fig_spec["color"]] == color, fig_spec["width"]].unique()
                            if not math.isnan(v))
            rank = widths.index(value) if not math.isnan(value) else 0
            ax.plot(r["mb"], r[METRIC], color=colors.get(color, "k"), ls=text(fig_spec["style"], run),
                    lw=0.8 + 1.4 * rank / max(1, len(widths) - 1), label=text(fig_spec["label"], run))
        ax.set_xscale("log")
        title = cells["problem_label"].iloc[0] if "problem_label" in cells else problem
        finish_panel(ax, "MB sent (up + down, all clients)", title, 6, ncol=2)
    return fig


def accuracy_vs_time(spec: dict[str, Any], results: Results, seeds: pd.DataFrame,
                     table: pd.DataFrame) -> Any:
    """A panel's row is its (problem, model), its column its speed profile, in the order the runs first name them."""
    plt, fig_spec = pyplot(), spec["figure"]
    rounds = iterate_rounds(results)
    runs = order(spec, seeds.drop_duplicates("run_id")).reset_index(drop=True)
    problems = list(dict.fromkeys(zip(runs["problem"], runs["model"])))
    speeds = list(dict.fromkeys(runs["speed"]))
    fig, axes = plt.subplots(len(problems), len(speeds), figsize=(6 * len(speeds), 4 * len(problems)),
                             squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax in axes.flat:
        ax.set_visible(False)
    for problem, speed in dict.fromkeys(zip(zip(runs["problem"], runs["model"]), runs["speed"])):
        ax = axes[problems.index(problem)][speeds.index(speed)]
        ax.set_visible(True)
        panel = (runs["problem"] == problem[0]) & (runs["model"] == problem[1]) & (runs["speed"] == speed)
        cells = runs[panel]
        for i, run in enumerate(cells.to_dict("records")):
            r = rounds[rounds["run_id"] == run["run_id"]].groupby("round")[[METRIC, "sim_s"]].mean()
            ax.plot(r["sim_s"], r[METRIC], color=colors[i % len(colors)], lw=1.4, ls=text(fig_spec["style"], run),
                    label=text(fig_spec["label"], run))
        if fig_spec.get("xmax") == "twice_to_target":  # so that the rows' approach to the target shows
            reached = table[(table["problem"] == problem[0]) & (table["model"] == problem[1])
                            & (table["speed"] == speed)]["sim_s_mean"].dropna()
            if len(reached):
                ax.set_xlim(0, 2 * reached.max())
        target = parse_target(cells["target"].iloc[0]) if cells["target"].iloc[0] else None
        if target is not None and target.metric == METRIC:
            ax.axhline(target.value, color="grey", ls=":", lw=1)
        finish_panel(ax, "simulated time sim_s (s, mean over seeds)",
                     f"{cells['problem_label'].iloc[0]}\n{cells['speed_label'].iloc[0]}", 7)
    fig.tight_layout()
    return fig


FIGURES: dict[str, Callable[..., Any]] = {"heat_map": heat_map, "accuracy_vs_mb": accuracy_vs_mb,
                                          "accuracy_vs_time": accuracy_vs_time}


def draw(spec: dict[str, Any], results: Results, seeds: pd.DataFrame, table: pd.DataFrame, path: Path) -> None:
    """Draw the spec's figure (its summary `table`, its `seeds`) into `path` and free it."""
    fig = FIGURES[spec["figure"]["kind"]](spec, results, seeds, table)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    pyplot().close(fig)
