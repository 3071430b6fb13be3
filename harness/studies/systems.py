"""The systems table: simulated seconds and rounds to a target, with clients of unequal speed (docs/systems.md).

Per problem of `conf/sweep/systems.yaml` and per speed profile: synchronous FedAvg without and with a round
deadline, with over-selection, and FedNova with deadline-limited (partial) local work; the mean and spread over
the replicas (seeds), as Markdown and a figure of accuracy against simulated time.

    python -m fedharness.studies.systems results/sweeps/systems --out docs/systems

Seconds and rounds to the target are those of `fedharness report --target` (studies/reports/analysis.py's
time_to_target: the first evaluated round meeting it, and the rounds/ column sim_s, the replica's simulated clock
at the end of that round). A seed that never meets the target (censored) is counted in the `reached` column and
left out of those two means; a cell none of whose seeds met it reads "not reached (> R)", R the run's last round.
Clients per round is the rounds/ column `participants` (the clients that took part in the round) averaged over
the evaluated rounds 1..R of each seed (every round where eval_every is 1, as in the sweep); seconds per round is
the seed's sim_s at round R over R. Those two and the final accuracy are over every seed; a run that diverged (a
non-finite loss: every seed of it stops) reads "diverged after round R" in the accuracy column.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from fedharness.studies import study_tables as st
from fedharness.studies.reports.data import Results

# The target of each problem, by data set (the synthetic W1 with logistic regression; digits with the 2NN);
# `--target DATASET=METRIC>=V` replaces one.
TARGETS = {"synthetic": "test_acc>=0.5", "digits": "test_acc>=0.9"}
PROBLEMS = {("synthetic", "auto"): "W1: Synthetic(1,1), 100 clients x 200 samples, logistic regression",
            ("digits", "2nn"): "digits, 2NN"}  # by (data set, model); any other reads "DATASET, model MODEL"
SPEEDS = ("equal", "lognormal", "slow_tail", "trace")


def problem_label(problem: str, model: str) -> str:
    return PROBLEMS.get((problem, model), f"{problem}, model {model}")


def _deadline(cfg: dict) -> float:
    value = cfg.get("cadence.deadline_s")
    return math.nan if value is None else float(value)


def _speed_label(cfg: dict) -> str:
    """The speed profile and its parameters, in words."""
    speed = cfg.get("speed.name") or "equal"
    if speed == "lognormal":
        return f"lognormal (speed_sigma {cfg.get('speed.step_sigma'):g}, " \
               f"bandwidth_sigma {cfg.get('speed.bandwidth_sigma'):g})"
    if speed == "slow_tail":
        return f"slow_tail ({100 * float(cfg.get('speed.fraction')):g}% of clients " \
               f"{float(cfg.get('speed.factor')):g}x slower per step)"
    if speed == "trace":
        return f"trace ({cfg.get('speed.file')})"
    return "equal"


def _availability_label(cfg: dict) -> str:
    availability = cfg.get("availability.name") or "always"
    if availability == "duty_cycle":
        return f"duty_cycle {float(cfg.get('availability.duty_cycle')):g} of {float(cfg.get('availability.period_s')):g} s"
    if availability == "trace":
        return f"trace ({cfg.get('availability.file')})"
    return availability


def _row(cfg: dict) -> dict:
    """The table row a flattened config is: algorithm, deadline, late work, over-selection."""
    deadline = _deadline(cfg)
    return {"algorithm": "FedNova" if cfg.get("algorithm.aggregator") == "fednova" else "FedAvg",
            "model": str(cfg.get("model.name")), "deadline_s": deadline,
            "late_work": str(cfg.get("cadence.late_work") or "drop") if not np.isnan(deadline) else "–",
            "over_selection": float(cfg.get("cadence.over_selection") or 1.0),
            "speed": str(cfg.get("speed.name") or "equal"), "speed_label": _speed_label(cfg),
            "availability": _availability_label(cfg), "K": int(cfg.get("algorithm.clients_per_round")),
            "step_s": float(cfg.get("network.compute_s_per_step") or 0.0),
            "bandwidth": float(cfg.get("network.bandwidth_MB_per_s"))}


def seed_rows(results: Results, targets: dict[str, str] | None = None) -> pd.DataFrame:
    """One row per (finished run, replica): problem, speed, algorithm, deadline, late work, over-selection,
    reached, round and simulated seconds to the problem's target (NaN when censored), the run's last round and
    sim_s there, the mean participants over rounds 1..last, and the final test accuracy."""
    rounds = st.iterate_rounds(results)
    trained = rounds[rounds["round"] >= 1]  # round 0 is the initial model's evaluation: no one took part
    participants = trained.groupby(["run_id", "replica"])["participants"].mean()
    frames = [{**rep.cells("sim_s"), **_row(rep.run.cfg), "last_sim_s": float(rep.last["sim_s"]),
               "participants": float(participants.get((rep.run.run_id, rep.replica), math.nan))}
              for rep in st.replicas(results, {**TARGETS, **(targets or {})})]
    return pd.DataFrame(frames)


_KEYS = ["problem", "model", "speed", "algorithm", "over_selection", "deadline_s", "late_work"]


def _order(df: pd.DataFrame) -> pd.DataFrame:
    """Problems as in PROBLEMS, speeds as in SPEEDS; within them FedAvg before FedNova, then over-selection, then
    no deadline before a deadline, drop before partial."""
    first = {p: i for i, p in enumerate(PROBLEMS)}
    speed = {s: i for i, s in enumerate(SPEEDS)}
    return df.assign(_p=[first.get(p, len(first)) for p in zip(df["problem"], df["model"])],
                     _s=df["speed"].map(lambda s: speed.get(s, len(speed))),
                     _a=(df["algorithm"] == "FedNova").astype(int),
                     _d=df["deadline_s"].fillna(-1.0), _l=(df["late_work"] == "partial").astype(int)).sort_values(
        ["_p", "problem", "model", "_s", "speed", "_a", "over_selection", "_d", "_l"], kind="stable").drop(
        columns=["_p", "_s", "_a", "_d", "_l"])


def summary(seeds: pd.DataFrame) -> pd.DataFrame:
    """One row per (problem, speed, algorithm, over-selection, deadline, late work): seeds, reached, mean and std
    (ddof 1, over the seeds that reached the target) of simulated seconds and rounds to it; mean participants per
    round, mean seconds per round and mean and std of the final test accuracy (%) over every seed."""
    rows = []
    for key, g in seeds.groupby(_KEYS, sort=False, dropna=False):
        first = g.iloc[0]
        rows.append({**dict(zip(_KEYS, key)), "target": first["target"], "speed_label": first["speed_label"],
                     "availability": first["availability"], "K": int(first["K"]), "step_s": first["step_s"],
                     "bandwidth": first["bandwidth"], **st.seed_stats(g, sim_s="sim_s", rounds="round"),
                     "participants": g["participants"].mean(),
                     "s_per_round": (g["last_sim_s"] / g["last_round"]).mean()})
    return _order(pd.DataFrame(rows)).reset_index(drop=True)


def label(algorithm: str, over_selection: float, deadline_s: float, late_work: str) -> str:
    """A row's name: 'FedAvg', 'FedAvg, deadline 2.1 s (drop)', 'FedAvg, over-selection 1.3', ..."""
    parts = [algorithm]
    if over_selection != 1:
        parts.append(f"over-selection {over_selection:g}")
    if not np.isnan(deadline_s):
        parts.append(f"deadline {deadline_s:g} s ({late_work})")
    return ", ".join(parts)


def markdown(table: pd.DataFrame) -> str:
    """One table per problem, its speed profiles one after the other: 'mean ± std' over the seeds (seconds and
    rounds over those that reached the target)."""
    out = []
    for (problem, model), part in table.groupby(["problem", "model"], sort=False):
        first = part.iloc[0]
        out += [f"{st.heading(problem_label(problem, model), part)}, K = {int(first['K'])}; median client: "
                f"{first['step_s']:g} s a step, {first['bandwidth']:g} MB/s; availability "
                f"{', '.join(dict.fromkeys(part['availability']))}", "",
                "| speeds | row | reached | simulated s to target | rounds to target | clients per round | "
                "s per round | final test accuracy (%) |",
                "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in part.itertuples():
            out.append(f"| {r.speed_label} | {label(r.algorithm, r.over_selection, r.deadline_s, r.late_work)} | "
                       f"{r.reached}/{r.seeds} | {st.to_target_cell(r, 'sim_s', 1)} | "
                       f"{st.to_target_cell(r, 'rounds', 1)} | {r.participants:.2f} | {r.s_per_round:.2f} | "
                       f"{st.accuracy_cell(r)} |")
        out.append("")
    return "\n".join(out)


def accuracy_vs_time(results: Results, seeds: pd.DataFrame, path: Path, metric: str = "test_acc") -> None:
    """One panel per (problem, speed profile): the mean over seeds of `metric` against the mean over seeds of
    sim_s at each evaluated round, one line per row of the table, with the target as a dotted line."""
    st.accuracy_vs_time(results, _order(seeds.drop_duplicates("run_id")).reset_index(drop=True), path, metric,
                        problem_label=problem_label, style=lambda run: "--" if run.algorithm == "FedNova" else "-",
                        label=lambda run: label(run.algorithm, run.over_selection, run.deadline_s, run.late_work))


def main(argv: list[str] | None = None) -> int:
    return st.main(argv, doc=__doc__, out="docs/systems", targets=TARGETS, seed_rows=seed_rows,
                   table=lambda seeds: markdown(summary(seeds)), figure=accuracy_vs_time,
                   figure_name="accuracy_vs_time.png")


if __name__ == "__main__":
    raise SystemExit(main())
