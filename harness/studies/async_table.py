"""The asynchronous table: simulated seconds and server steps to a target for synchronous FedAvg (without and with
a round deadline), FedBuff and FedAsync, with clients of unequal speed (docs/async.md, "The table").

Per problem of `conf/sweep/async.yaml` and per speed profile, one row per mode: synchronous FedAvg, FedAvg with a
deadline, FedBuff with its concurrency C and buffer M, FedAsync with its C and alpha; the mean and spread over the
replicas (seeds), as Markdown and a figure of accuracy against simulated time.

    python -m fedharness.studies.async_table results/sweeps/async --out docs/async_table

One rounds/ row is one server version (docs/async.md), so server steps to the target are the `round` of
`fedharness report --target` (studies/reports/analysis.py's time_to_target: the first evaluated step meeting it),
and seconds to it the rounds/ column sim_s there (the replica's simulated clock). Both are read at evaluated steps
only: a row evaluated every e steps resolves them to e steps. MB to the target is that function's `mb` (bytes up
and down by then, as `fedharness report` counts them). A seed that never meets the target (censored) is counted in
the `reached` column and left out of those means; a cell none of whose seeds met it reads "not reached (> R)", R
the run's last step. "x sync" is synchronous FedAvg's mean seconds to the target (the row without a deadline, same
problem and profile) over the row's. Updates per step is the rounds/ column `participants` (the updates the step
aggregated) averaged over the evaluated steps 1..R of each seed; seconds per step is the seed's sim_s at step R
over R. Those two and the final accuracy are over every seed; a run that diverged reads "diverged after step R".
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from fedharness.studies import study_tables as st
from fedharness.studies.reports.data import Results
from fedharness.studies.systems import PROBLEMS, SPEEDS, TARGETS, _availability_label, _speed_label, problem_label

MODES = ("sync", "fedbuff", "fedasync")


def _float(value) -> float:
    return math.nan if value is None else float(value)


def _row(cfg: dict) -> dict:
    """The table row a flattened config is: mode, C, M, alpha, staleness weight and limit, deadline, late work."""
    mode = str(cfg.get("cadence.name") or "sync")
    deadline = _float(cfg.get("cadence.deadline_s"))
    K = int(cfg.get("algorithm.clients_per_round"))
    concurrency = int(cfg.get("cadence.concurrency") or K) if mode != "sync" else K
    buffer = cfg.get("cadence.buffer")
    buffer = K if mode == "sync" else (1 if mode == "fedasync" else int(buffer or K))
    staleness = str(cfg.get("staleness.name") or "poly")
    slope = cfg.get("staleness.slope" if staleness == "hinge" else "staleness.exponent")
    weight = "constant" if staleness == "constant" else f"{staleness} {float(slope):g}"
    if staleness == "hinge":
        weight += f", cutoff {int(cfg.get('staleness.cutoff'))}"
    return {"mode": mode, "C": concurrency, "M": buffer,
            "alpha": float(cfg.get("cadence.alpha")) if mode == "fedasync" else math.nan,
            "staleness": weight if mode != "sync" else "–",
            "max_staleness": _float(cfg.get("cadence.max_staleness")) if mode != "sync" else math.nan,
            "algorithm": "FedNova" if cfg.get("algorithm.aggregator") == "fednova" else "FedAvg",
            "model": str(cfg.get("model.name")), "deadline_s": deadline,
            "late_work": str(cfg.get("cadence.late_work") or "drop") if not np.isnan(deadline) else "–",
            "speed": str(cfg.get("speed.name") or "equal"), "speed_label": _speed_label(cfg),
            "availability": _availability_label(cfg), "K": K,
            "step_s": float(cfg.get("network.compute_s_per_step") or 0.0),
            "bandwidth": float(cfg.get("network.bandwidth_MB_per_s"))}


def seed_rows(results: Results, targets: dict[str, str] | None = None) -> pd.DataFrame:
    """One row per (finished run, replica): problem, speed, mode, C, M, alpha, deadline, reached, server step,
    simulated seconds and MB to the problem's target (NaN when censored), the run's last step and sim_s there,
    the mean updates per evaluated step 1..last, and the final test accuracy."""
    rounds = st.iterate_rounds(results)
    trained = rounds[rounds["round"] >= 1]  # step 0 is the initial model's evaluation: nothing aggregated
    participants = trained.groupby(["run_id", "replica"])["participants"].mean()
    frames = []
    for rep in st.replicas(results, {**TARGETS, **(targets or {})}):
        frames.append({**rep.cells("sim_s"), **_row(rep.run.cfg), "last_sim_s": float(rep.last["sim_s"]),
                       "mb": float(rep.hit["mb"]) if rep.hit is not None else math.nan,
                       "participants": float(participants.get((rep.run.run_id, rep.replica), math.nan))})
    return pd.DataFrame(frames)


_KEYS = ["problem", "model", "speed", "mode", "C", "M", "alpha", "staleness", "max_staleness", "algorithm",
         "deadline_s", "late_work"]


def _order(df: pd.DataFrame) -> pd.DataFrame:
    """Problems as in PROBLEMS, speeds as in SPEEDS; within them sync (no deadline first), FedBuff, FedAsync, each
    by C then M."""
    first = {p: i for i, p in enumerate(PROBLEMS)}
    speed = {s: i for i, s in enumerate(SPEEDS)}
    mode = {m: i for i, m in enumerate(MODES)}
    return df.assign(_p=[first.get(p, len(first)) for p in zip(df["problem"], df["model"])],
                     _s=df["speed"].map(lambda s: speed.get(s, len(speed))),
                     _m=df["mode"].map(lambda m: mode.get(m, len(mode))),
                     _a=(df["algorithm"] == "FedNova").astype(int), _d=df["deadline_s"].fillna(-1.0),
                     _x=df["max_staleness"].fillna(-1.0)).sort_values(
        ["_p", "problem", "model", "_s", "speed", "_m", "_a", "_d", "C", "M", "alpha", "staleness", "_x"],
        kind="stable").drop(columns=["_p", "_s", "_m", "_a", "_d", "_x"])


def summary(seeds: pd.DataFrame) -> pd.DataFrame:
    """One row per (problem, speed, mode, C, M, alpha, staleness, deadline): seeds, reached, mean and std (ddof 1,
    over the seeds that reached the target) of simulated seconds, server steps and MB to it; synchronous FedAvg's
    mean seconds to it over the row's (`x_sync`); mean updates per step, mean seconds per step and mean and std of
    the final test accuracy (%) over every seed."""
    rows = []
    for key, g in seeds.groupby(_KEYS, sort=False, dropna=False):
        first = g.iloc[0]
        rows.append({**dict(zip(_KEYS, key)), "target": first["target"], "speed_label": first["speed_label"],
                     "availability": first["availability"], "K": int(first["K"]), "step_s": first["step_s"],
                     "bandwidth": first["bandwidth"],
                     **st.seed_stats(g, sim_s="sim_s", steps="round", mb="mb"),
                     "participants": g["participants"].mean(),
                     "s_per_step": (g["last_sim_s"] / g["last_round"]).mean()})
    table = _order(pd.DataFrame(rows)).reset_index(drop=True)
    sync = table[(table["mode"] == "sync") & (table["algorithm"] == "FedAvg") & table["deadline_s"].isna()]
    base = sync.set_index(["problem", "model", "speed"])["sim_s_mean"]
    base = base[~base.index.duplicated()]
    table["x_sync"] = [base.get((r.problem, r.model, r.speed), math.nan) / r.sim_s_mean
                       for r in table.itertuples()]
    return table


def label(mode: str, C: int, M: int, alpha: float, deadline_s: float, late_work: str, staleness: str = "poly 0.5",
          max_staleness: float = math.nan, algorithm: str = "FedAvg") -> str:
    """A row's name: 'FedAvg (synchronous)', 'FedAvg, deadline 2.1 s (drop)', 'FedBuff C = 20, M = 10',
    'FedAsync C = 10, alpha 0.6'; a staleness weight other than FedBuff's (1 + tau)^-0.5 and a staleness limit
    are added."""
    if mode == "sync":
        if np.isnan(deadline_s):
            return f"{algorithm} (synchronous)"
        return f"{algorithm}, deadline {deadline_s:g} s ({late_work})"
    parts = [f"FedBuff C = {C}, M = {M}" if mode == "fedbuff" else f"FedAsync C = {C}, alpha {alpha:g}"]
    if staleness != "poly 0.5":
        parts.append(f"s = {staleness}")
    if not np.isnan(max_staleness):
        parts.append(f"max_staleness {max_staleness:g}")
    return ", ".join(parts)


def row_label(r) -> str:
    return label(r.mode, r.C, r.M, r.alpha, r.deadline_s, r.late_work, r.staleness, r.max_staleness, r.algorithm)


def _times(r) -> str:
    return "–" if np.isnan(r.x_sync) else f"{r.x_sync:.1f}x"


def markdown(table: pd.DataFrame) -> str:
    """One table per problem, its speed profiles one after the other: 'mean ± std' over the seeds (seconds, steps
    and MB over those that reached the target)."""
    out = []
    for (problem, model), part in table.groupby(["problem", "model"], sort=False):
        first = part.iloc[0]
        out += [f"**{problem_label(problem, model)}**: target {first['target']}, {int(part['seeds'].max())} seeds, "
                f"K = {int(first['K'])} (synchronous); median client: {first['step_s']:g} s a step, "
                f"{first['bandwidth']:g} MB/s; availability {', '.join(dict.fromkeys(part['availability']))}", "",
                "| speeds | row | steps run | reached | simulated s to target | x sync | server steps to target | "
                "MB to target | updates per step | s per step | final test accuracy (%) |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in part.itertuples():
            accuracy = f"diverged after step {r.last_round}" if r.diverged else st.pm(r.acc_mean, r.acc_std, 1)
            out.append(f"| {r.speed_label} | {row_label(r)} | {r.last_round} | {r.reached}/{r.seeds} | "
                       f"{st.to_target_cell(r, 'sim_s', 1)} | {_times(r)} | {st.to_target_cell(r, 'steps', 1)} | "
                       f"{st.to_target_cell(r, 'mb', 2)} | {r.participants:.2f} | {r.s_per_step:.2f} | "
                       f"{accuracy} |")
        out.append("")
    return "\n".join(out)


STYLES = {"sync": "-", "fedbuff": "--", "fedasync": ":"}


def accuracy_vs_time(results: Results, seeds: pd.DataFrame, path: Path, metric: str = "test_acc") -> None:
    """One panel per (problem, speed profile): the mean over seeds of `metric` against the mean over seeds of
    sim_s at each evaluated step, one line per row of the table (solid: synchronous, dashed: FedBuff, dotted:
    FedAsync), the target as a grey dotted line. The x axis stops at twice the latest mean time to the target
    in the panel (or at the latest step where no row reached it), so that the rows' approach to it shows."""
    table = summary(seeds)

    def xmax(problem: tuple[str, str], speed: str) -> float | None:
        reached = table[(table["problem"] == problem[0]) & (table["model"] == problem[1])
                        & (table["speed"] == speed)]["sim_s_mean"].dropna()
        return 2 * reached.max() if len(reached) else None

    st.accuracy_vs_time(results, _order(seeds.drop_duplicates("run_id")).reset_index(drop=True), path, metric,
                        problem_label=problem_label, style=lambda run: STYLES.get(run.mode, "-"), label=row_label,
                        xmax=xmax)


def main(argv: list[str] | None = None) -> int:
    return st.main(argv, doc=__doc__, out="docs/async_table", targets=TARGETS, seed_rows=seed_rows,
                   table=lambda seeds: markdown(summary(seeds)), figure=accuracy_vs_time,
                   figure_name="accuracy_vs_time.png")


if __name__ == "__main__":
    raise SystemExit(main())
