"""PNG figures: convergence curves with std bands, collapse plots (metric against n K T), speedup, cost to target.

Drawn on `matplotlib.figure.Figure` objects, never through pyplot: the process's backend (a notebook's inline
one, a user's GUI) is left as it is, and no figure is held open by pyplot.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from fedharness.studies.reports.analysis import Target


def _grid(count: int, width: float = 4.2, height: float = 3.3):
    cols = min(3, max(1, count))
    rows = math.ceil(count / cols)
    fig = Figure(figsize=(width * cols, height * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:count])


def _colors(values) -> dict:
    values = sorted(values)
    cmap = matplotlib.colormaps["viridis"]
    return {v: cmap(i / max(1, len(values) - 1) * 0.9) for i, v in enumerate(values)}


def _positive(values: pd.Series) -> bool:
    return bool(len(values)) and bool((values > 0).all())


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)  # png through matplotlib's Agg canvas, for this figure only
    return path


def _panels(curves: pd.DataFrame):
    """One axis per group with that group's curves, and one colour per n shared by all panels."""
    groups = list(dict.fromkeys(curves["group"]))
    fig, axes = _grid(len(groups))
    colors = _colors(curves["n"].unique())
    panels = [(ax, group, curves[curves["group"] == group]) for ax, group in zip(axes, groups)]
    return fig, panels, colors


X_AXES = {"round": "round", "mb": "MB communicated (up + down, all clients)"}


def convergence(curves: pd.DataFrame, metric: str, scale_key: str, target: Target | None, path: Path,
                x: str = "round") -> Path:
    """Mean over replicas with a +-1 std band, one panel per group, one line per n; against the round, or with
    x="mb" against the MB communicated by then (where compressed updates pay off: the same accuracy for fewer
    bytes)."""
    fig, panels, colors = _panels(curves)
    for ax, group, g in panels:
        for n, c in g.groupby("n"):
            ax.plot(c[x], c["mean"], color=colors[n], label=f"n={n:g}")
            std = c["std"].fillna(0)
            lo = c["mean"] - std
            if _positive(curves["mean"]):
                lo = lo.clip(lower=c["mean"] * 1e-3)
            ax.fill_between(c[x], lo, c["mean"] + std, color=colors[n], alpha=0.2, linewidth=0)
        if target is not None and target.metric == metric:
            ax.axhline(target.value, color="k", linestyle="--", linewidth=0.8, label=target.label)
        if _positive(curves["mean"]):
            ax.set_yscale("log")
        if x == "mb" and (g["mb"] > 0).any():
            ax.set_xscale("log")
        ax.set_title(group, fontsize=9)
        ax.set_xlabel(X_AXES[x])
        ax.set_ylabel(metric)
        ax.legend(fontsize=7, title=scale_key, title_fontsize=7)
    return _save(fig, path)


def collapse(curves: pd.DataFrame, metric: str, target: Target | None, path: Path) -> Path:
    """Metric against n x (local steps so far) = n K T: under linear speedup the curves of all n coincide."""
    fig, panels, colors = _panels(curves)
    for ax, group, g in panels:
        drawn = False
        for n, c in g.groupby("n"):
            x = n * c["local_steps"]
            keep = x > 0
            ax.plot(x[keep], c["mean"][keep], color=colors[n], label=f"n={n:g}")
            drawn = drawn or bool(keep.any())
        ax.set_title(group, fontsize=9)
        if not drawn:  # every run of the group stopped (diverged, failed) before its first evaluation
            _nothing(ax, "no evaluation after round 0 (diverged or failed)")
            continue
        if target is not None and target.metric == metric:
            ax.axhline(target.value, color="k", linestyle="--", linewidth=0.8)
        ax.set_xscale("log")
        if _positive(curves["mean"]):
            ax.set_yscale("log")
        ax.set_xlabel("n K T (clients x local steps so far)")
        ax.set_ylabel(metric)
        ax.legend(fontsize=7)
    return _save(fig, path)


TIME_LABELS = {"rounds": "rounds", "sim_s": "simulated seconds"}


def speedup(cells: pd.DataFrame, fits: pd.DataFrame, target: Target, scale_key: str, path: Path,
            time: str = "rounds") -> Path:
    """Left: T(n) on log-log axes with the fit and the ideal slope -1; right: S(n) against ideal n / n0. T in
    rounds or simulated seconds (`time`, a cells column)."""
    cells = cells.assign(rounds=cells[time])  # the column drawn, whichever time it is
    fig = Figure(figsize=(10, 4))
    ax1, ax2 = fig.subplots(1, 2)
    markers = "osD^v<>p*h"
    for i, (group, g) in enumerate(cells.groupby("group", sort=False)):
        g = g.sort_values("n")
        ok = g[np.isfinite(g["rounds"]) & (g["rounds"] > 0)]
        line = ax1.plot(ok["n"], ok["rounds"], markers[i % len(markers)], label=group if len(ok) else "_nolegend_")[0]
        color = line.get_color()
        cens = g[~np.isfinite(g["rounds"])]
        if len(cens):
            _censored(ax1, cens["n"], color, f"{group}: censored (median replica never reached {target.label})")
        fit = fits[fits["group"] == group]
        if len(fit) and np.isfinite(fit["b"].iloc[0]):
            a, b = fit["a"].iloc[0], fit["b"].iloc[0]
            xs = np.geomspace(ok["n"].min(), ok["n"].max(), 50)
            ax1.plot(xs, a * xs ** (-b), "-", color=color, linewidth=1,
                     label=f"fit b={b:.2f} [{fit['b_lo'].iloc[0]:.2f}, {fit['b_hi'].iloc[0]:.2f}]")
        if len(ok):
            n0, t0 = ok["n"].iloc[0], ok["rounds"].iloc[0]
            ax2.plot(ok["n"], t0 / ok["rounds"], markers[i % len(markers)] + "-", color=color, label=group)
    usable = cells[np.isfinite(cells["rounds"]) & (cells["rounds"] > 0)]
    if len(usable):
        xs = np.geomspace(usable["n"].min(), usable["n"].max(), 20)
        ax2.plot(xs, xs / usable["n"].min(), "k--", linewidth=0.8, label="linear speedup")
        first = usable.sort_values("n").iloc[0]
        ax1.plot(xs, first["rounds"] * first["n"] / xs, "k:", linewidth=0.8, label="slope -1")
    censored = bool((~np.isfinite(cells["rounds"])).any())
    for ax in (ax1, ax2):
        if len(usable):
            ax.set_xscale("log")
            ax.set_yscale("log")
        else:
            _nothing(ax)
        if len(usable) or (censored and ax is ax1):
            ax.set_xscale("log")
            ax.legend(fontsize=7)
        if not len(usable):
            ax.set_yticks([])  # no cell has a number of rounds: no scale to read one from
        ax.set_xlabel(f"n ({scale_key})")
    ax1.set_ylabel(f"{TIME_LABELS[time]} to {target.label} (median)")
    ax2.set_ylabel("speedup S(n) = T(n0) / T(n)")
    return _save(fig, path)


def cost_to_target(cells: pd.DataFrame, target: Target, scale_key: str, path: Path) -> Path:
    """Rounds, MB communicated and simulated seconds to the target, per group, against n."""
    fig = Figure(figsize=(13, 3.8))
    axes = fig.subplots(1, 3)
    for ax, col, name in zip(axes, ("rounds", "MB", "sim_s"),
                             ("rounds", "MB (up + down, all clients)", "simulated seconds")):
        drawn = False
        for group, g in cells.groupby("group", sort=False):
            g = g.sort_values("n")
            ok = g[np.isfinite(g[col]) & (g[col] > 0)]
            ax.plot(ok["n"], ok[col], "o-", label=group)
            drawn = drawn or len(ok) > 0
        if drawn:
            ax.set_xscale("log")
            ax.set_yscale("log")
        else:
            _nothing(ax)
        ax.set_xlabel(f"n ({scale_key})")
        ax.set_ylabel(f"{name} to {target.label}")
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def client_spread(spread: pd.DataFrame, scale_key: str, path: Path) -> Path:
    """Per-client accuracy over rounds (eval.per_client): the median client (line), the 10th to 90th percentile
    band and the mean (dashed), one panel per group, one colour per n; each averaged over replicas."""
    fig, panels, colors = _panels(spread)
    for ax, group, g in panels:
        for n, c in g.groupby("n"):
            ax.plot(c["round"], c["client_acc_p50"], color=colors[n], label=f"n={n:g}: median client")
            ax.fill_between(c["round"], c["client_acc_p10"], c["client_acc_p90"], color=colors[n], alpha=0.2,
                            linewidth=0)
            ax.plot(c["round"], c["client_acc_mean"], color=colors[n], linestyle="--", linewidth=0.8)
        ax.set_title(group, fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel("client accuracy (p10-p90 band, mean dashed)")
        ax.legend(fontsize=7, title=scale_key, title_fontsize=7)
    return _save(fig, path)


def _censored(ax, ns, color, label: str) -> None:
    """Cells that never reached the target, drawn as censored: a marker on the top edge of the axis (x: n, y: the
    axis' top, whatever its scale), labelled in the legend, never at a made-up number of rounds."""
    ax.plot(ns, [1.0] * len(ns), "^", color=color, markersize=8, clip_on=False, transform=ax.get_xaxis_transform(),
            label=label)


def _nothing(ax, why: str = "no cell reached the target after round 0") -> None:
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, fontsize=8)
