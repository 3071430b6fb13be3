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

import argparse
import math
from pathlib import Path

import numpy as np
import pandas as pd

from fedharness.studies.reports.analysis import parse_target, time_to_target
from fedharness.studies.reports.data import Results, load_results

# The target of each problem, by data set (the synthetic W1 with logistic regression; digits with the 2NN);
# `--target DATASET=METRIC>=V` replaces one.
TARGETS = {"synthetic": "test_acc>=0.5", "digits": "test_acc>=0.9"}
PROBLEMS = {("synthetic", "auto"): "W1: Synthetic(1,1), 100 clients x 200 samples, logistic regression",
            ("digits", "2nn"): "digits, 2NN"}  # by (data set, model); any other reads "DATASET, model MODEL"
SPEEDS = ("equal", "lognormal", "slow_tail", "trace")


def _problem_name(cfg: dict) -> str:
    return str(cfg.get("dataset.name"))


def problem_label(problem: str, model: str) -> str:
    return PROBLEMS.get((problem, model), f"{problem}, model {model}")


def _deadline(cfg: dict) -> float:
    value = cfg.get("systems.deadline_s")
    return math.nan if value is None else float(value)


def _speed_label(cfg: dict) -> str:
    """The speed profile and its parameters, in words."""
    speed = cfg.get("systems.speed") or "equal"
    if speed == "lognormal":
        return f"lognormal (speed_sigma {cfg.get('systems.speed_sigma'):g}, " \
               f"bandwidth_sigma {cfg.get('systems.bandwidth_sigma'):g})"
    if speed == "slow_tail":
        return f"slow_tail ({100 * float(cfg.get('systems.slow_fraction')):g}% of clients " \
               f"{float(cfg.get('systems.slow_factor')):g}x slower per step)"
    if speed == "trace":
        return f"trace ({cfg.get('systems.device_trace')})"
    return "equal"


def _availability_label(cfg: dict) -> str:
    availability = cfg.get("systems.availability") or "always"
    if availability == "duty_cycle":
        return f"duty_cycle {float(cfg.get('systems.duty_cycle')):g} of {float(cfg.get('systems.period_s')):g} s"
    if availability == "trace":
        return f"trace ({cfg.get('systems.availability_trace')})"
    return availability


def _row(cfg: dict) -> dict:
    """The table row a flattened config is: algorithm, deadline, late work, over-selection."""
    deadline = _deadline(cfg)
    return {"algorithm": "FedNova" if cfg.get("algorithm.aggregator") == "fednova" else "FedAvg",
            "model": str(cfg.get("model.name")), "deadline_s": deadline,
            "late_work": str(cfg.get("systems.late_work") or "drop") if not np.isnan(deadline) else "–",
            "over_selection": float(cfg.get("systems.over_selection") or 1.0),
            "speed": str(cfg.get("systems.speed") or "equal"), "speed_label": _speed_label(cfg),
            "availability": _availability_label(cfg), "K": int(cfg.get("algorithm.clients_per_round")),
            "step_s": float(cfg.get("network.compute_s_per_step") or 0.0),
            "bandwidth": float(cfg.get("network.bandwidth_MB_per_s"))}


def seed_rows(results: Results, targets: dict[str, str] | None = None) -> pd.DataFrame:
    """One row per (finished run, replica): problem, speed, algorithm, deadline, late work, over-selection,
    reached, round and simulated seconds to the problem's target (NaN when censored), the run's last round and
    sim_s there, the mean participants over rounds 1..last, and the final test accuracy."""
    targets = {**TARGETS, **(targets or {})}
    runs = results.runs[results.runs["status"].isin(["ok", "diverged"])]
    rounds = results.rounds[results.rounds["series"] == "iterate"]
    last = rounds[rounds["round"] == rounds.groupby(["run_id", "replica"])["round"].transform("max")]
    trained = rounds[rounds["round"] >= 1]
    participants = trained.groupby(["run_id", "replica"])["participants"].mean()
    frames = []
    for problem, group in runs.groupby(runs["cfg"].map(_problem_name), sort=False):
        target = parse_target(targets[problem]) if problem in targets else None
        sub = Results(results.store, group, rounds[rounds["run_id"].isin(group["run_id"])])
        ttt = time_to_target(sub, target) if target is not None else None
        for run in group.itertuples():
            fin = last[last["run_id"] == run.run_id].set_index("replica")
            hit = ttt[ttt["run_id"] == run.run_id].set_index("replica") if ttt is not None else None
            for rep, row in fin.iterrows():
                frames.append({
                    "problem": problem, "target": target.label if target else "", **_row(run.cfg),
                    "run_id": run.run_id, "replica": int(rep), "status": run.status,
                    "reached": bool(hit.loc[rep, "reached"]) if hit is not None else False,
                    "round": float(hit.loc[rep, "round"]) if hit is not None else math.nan,
                    "sim_s": float(hit.loc[rep, "sim_s"]) if hit is not None else math.nan,
                    "last_round": int(row["round"]), "last_sim_s": float(row["sim_s"]),
                    "participants": float(participants.get((run.run_id, rep), math.nan)),
                    "test_acc": float(row["test_acc"])})
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
        hit = g[g["reached"]]
        first = g.iloc[0]
        rows.append({**dict(zip(_KEYS, key)), "target": first["target"], "speed_label": first["speed_label"],
                     "availability": first["availability"], "K": int(first["K"]), "step_s": first["step_s"],
                     "bandwidth": first["bandwidth"], "seeds": len(g), "reached": len(hit),
                     "last_round": int(g["last_round"].max()),
                     "diverged": bool((g["status"] == "diverged").any()),
                     "sim_s_mean": hit["sim_s"].mean(), "sim_s_std": hit["sim_s"].std(),
                     "rounds_mean": hit["round"].mean(), "rounds_std": hit["round"].std(),
                     "participants": g["participants"].mean(),
                     "s_per_round": (g["last_sim_s"] / g["last_round"]).mean(),
                     "acc_mean": 100 * g["test_acc"].mean(), "acc_std": 100 * g["test_acc"].std()})
    return _order(pd.DataFrame(rows)).reset_index(drop=True)


def _pm(mean: float, std: float, digits: int) -> str:
    if np.isnan(std):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


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
        out += [f"**{problem_label(problem, model)}**: target {first['target']}, {int(part['seeds'].max())} seeds, "
                f"{int(part['last_round'].max())} rounds, K = {int(first['K'])}; median client: "
                f"{first['step_s']:g} s a step, {first['bandwidth']:g} MB/s; availability "
                f"{', '.join(dict.fromkeys(part['availability']))}", "",
                "| speeds | row | reached | simulated s to target | rounds to target | clients per round | "
                "s per round | final test accuracy (%) |",
                "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in part.itertuples():
            if r.reached:
                seconds, rounds = _pm(r.sim_s_mean, r.sim_s_std, 1), _pm(r.rounds_mean, r.rounds_std, 1)
            else:
                seconds = rounds = f"not reached (> {r.last_round})"
            acc = f"diverged after round {r.last_round}" if r.diverged else _pm(r.acc_mean, r.acc_std, 1)
            out.append(f"| {r.speed_label} | {label(r.algorithm, r.over_selection, r.deadline_s, r.late_work)} | "
                       f"{r.reached}/{r.seeds} | {seconds} | {rounds} | {r.participants:.2f} | {r.s_per_round:.2f} | "
                       f"{acc} |")
        out.append("")
    return "\n".join(out)


def accuracy_vs_time(results: Results, seeds: pd.DataFrame, path: Path, metric: str = "test_acc") -> None:
    """One panel per (problem, speed profile): the mean over seeds of `metric` against the mean over seeds of
    sim_s at each evaluated round, one line per row of the table, with the target as a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = results.rounds[results.rounds["series"] == "iterate"]
    runs = _order(seeds.drop_duplicates("run_id")).reset_index(drop=True)
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
            ax.plot(r["sim_s"], r[metric], color=colors[i % len(colors)], lw=1.4,
                    ls="--" if run.algorithm == "FedNova" else "-",
                    label=label(run.algorithm, run.over_selection, run.deadline_s, run.late_work))
        target = parse_target(cells["target"].iloc[0]) if cells["target"].iloc[0] else None
        if target is not None and target.metric == metric:
            ax.axhline(target.value, color="grey", ls=":", lw=1)
        ax.set_xlabel("simulated time sim_s (s, mean over seeds)")
        ax.set_ylabel(f"{metric} (mean over seeds)")
        ax.set_title(f"{problem_label(*problem)}\n{cells['speed_label'].iloc[0]}", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _targets(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        dataset, _, text = item.partition("=")
        parse_target(text)  # one line naming --target if it is not METRIC>=V
        out[dataset] = text
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results_dir")
    parser.add_argument("--out", default="docs/systems")
    parser.add_argument("--target", action="append", default=[], metavar="DATASET=METRIC>=V",
                        help=f"a problem's target (defaults: {', '.join(f'{k}={v}' for k, v in TARGETS.items())})")
    args = parser.parse_args(argv)
    results = load_results(args.results_dir)
    seeds = seed_rows(results, _targets(args.target))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(summary(seeds))
    (out / "table.md").write_text(table)
    accuracy_vs_time(results, seeds, out / "accuracy_vs_time.png")
    print(table)
    print(f"{len(seeds)} (run, seed) results; written: {out / 'table.md'}, {out / 'accuracy_vs_time.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
