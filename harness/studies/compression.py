"""The compression table: rounds and MB to a target and the final test accuracy of each compressor (ratio or
levels, with and without error feedback) on each problem of `conf/sweep/compression.yaml`, mean and spread over
the replicas (seeds), as Markdown and a figure of accuracy against MB (docs/compression.md).

    python -m fedharness.studies.compression results/sweeps/compression --out docs/compression

Rounds and MB to the target are those of `fedharness report --target` (studies/reports/analysis.py's
time_to_target: the first evaluated round meeting it, and bytes_up + bytes_down by then). A seed that never
meets the target (censored) is counted in the `reached` column and left out of those two means; a cell none of
whose seeds met it reads "not reached (> R)", R the run's last round. The final accuracy is over every seed; a run
that diverged (a non-finite loss: every seed of it stops) reads "diverged after round R" there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from fedharness.studies import study_tables as st
from fedharness.studies.reports.data import Results

# The target of each problem, by data set (the synthetic W1 with logistic regression; digits with the 2NN);
# `--target DATASET=METRIC>=V` replaces one.
TARGETS = {"synthetic": "test_acc>=0.5", "digits": "test_acc>=0.9"}
PROBLEMS = {"synthetic": "W1: Synthetic(1,1), 100 clients x 200 samples, logistic regression",
            "digits": "digits, 2NN"}
ORDER = ("none", "topk", "randomk", "qsgd", "sign")
PARAM = {"topk": "ratio", "randomk": "ratio", "qsgd": "levels"}  # the key each compressor is swept over
VALUE_BYTES = {"float32": 4, "float64": 8}


def _compressor(cfg: dict) -> tuple[str, float, bool]:
    """(name, ratio or levels (nan where none), error feedback) of a flattened config."""
    name = cfg.get("compress.name") or "none"
    param = PARAM.get(name)
    value = float(cfg[f"compress.{param}"]) if param else math.nan
    return name, value, bool(cfg.get("compress.error_feedback")) and name != "none"


def dense_bytes(config: dict) -> int:
    """The dense model's bytes (what each sampled client downloads): its dim times the dtype's bytes, from the
    run's own problem, built again."""
    from fedharness.config.load import recorded_settings
    from fedharness.problems import build_problem

    settings = recorded_settings(config)  # recorded by an earlier version, perhaps: keys added since take defaults
    problem = build_problem(settings, config["algorithm"]["batch_size"])
    return int(problem.dim) * VALUE_BYTES[config["dtype"]]


def seed_rows(results: Results, targets: dict[str, str] | None = None) -> pd.DataFrame:
    """One row per (finished run, replica): problem, compressor, param, ef, reached, round and MB to the problem's
    target (NaN when censored), the run's last round, the final test accuracy and the bytes each client sent a
    round (bytes_up over the uploads, bytes_down over the dense model's bytes)."""
    dense: dict[str, int] = {}  # the dense bytes by the keys that fix the model: building a problem is slow
    frames = []
    for rep in st.replicas(results, {**TARGETS, **(targets or {})}):
        cfg = rep.run.cfg
        name, value, ef = _compressor(cfg)
        key = json.dumps([cfg.get(k) for k in sorted(cfg) if k.startswith(("dataset.", "model.", "partition."))]
                         + [cfg.get("algorithm.batch_size"), cfg.get("dtype")], default=str)
        if key not in dense:
            dense[key] = dense_bytes(json.loads(rep.run.config_json))
        up, down = int(rep.last["bytes_up"]), int(rep.last["bytes_down"])
        frames.append({**rep.cells("mb"), "compressor": name, "param": value, "ef": ef,
                       "up_per_client": up * dense[key] / down if down else math.nan, "dense_bytes": dense[key]})
    return pd.DataFrame(frames)


def _order(df: pd.DataFrame) -> pd.DataFrame:
    rank = {n: i for i, n in enumerate(ORDER)}
    first = {p: i for i, p in enumerate(PROBLEMS)}
    return df.assign(_p=df["problem"].map(lambda p: first.get(p, len(first))),
                     _r=df["compressor"].map(lambda n: rank.get(n, len(ORDER)))).sort_values(
        ["_p", "problem", "_r", "compressor", "param", "ef"], kind="stable").drop(columns=["_p", "_r"])


def summary(seeds: pd.DataFrame) -> pd.DataFrame:
    """One row per (problem, compressor, param, ef): seeds, reached, and mean and std (ddof 1, over the seeds that
    reached the target) of rounds and MB to it; the bytes a client sends a round; mean and std of the final test
    accuracy (%) over every seed."""
    rows = []
    keys = ["problem", "compressor", "param", "ef"]
    for (problem, name, value, ef), g in seeds.groupby(keys, sort=False, dropna=False):
        up = g["up_per_client"].unique()
        rows.append({"problem": problem, "compressor": name, "param": value, "ef": ef, "target": g["target"].iloc[0],
                     **st.seed_stats(g, rounds="round", mb="mb"),
                     "up_bytes": float(up[0]) if len(up) == 1 else math.nan,
                     "up_share": float(up[0]) / g["dense_bytes"].iloc[0] if len(up) == 1 else math.nan})
    return _order(pd.DataFrame(rows)).reset_index(drop=True)


def _param(name: str, value: float) -> str:
    if name not in PARAM:
        return "–"
    return f"s = {value:g}" if PARAM[name] == "levels" else f"{value:g}"


def markdown(table: pd.DataFrame) -> str:
    """One table per problem: 'mean ± std' over the seeds (rounds and MB over those that reached the target)."""
    out = []
    for problem, part in table.groupby("problem", sort=False):
        out += [st.heading(PROBLEMS.get(problem, problem), part), "",
                "| compressor | ratio / levels | error feedback | reached | rounds to target | MB to target "
                "(up + down) | bytes up per client per round | final test accuracy (%) |",
                "|---|---|---|---:|---:|---:|---:|---:|"]
        for r in part.itertuples():
            share = f" ({100 * r.up_share:.3g}%)" if not np.isnan(r.up_share) else ""
            ef = "–" if r.compressor == "none" else ("yes" if r.ef else "no")
            out.append(f"| {r.compressor} | {_param(r.compressor, r.param)} | {ef} | {r.reached}/{r.seeds} | "
                       f"{st.to_target_cell(r, 'rounds', 1)} | {st.to_target_cell(r, 'mb', 2)} | "
                       f"{r.up_bytes:,.0f}{share} | {st.accuracy_cell(r)} |")
        out.append("")
    return "\n".join(out)


def accuracy_vs_mb(results: Results, seeds: pd.DataFrame, path: Path, metric: str = "test_acc") -> None:
    """Per problem, the mean over seeds of `metric` against the mean MB sent by each evaluated round (log x); solid
    with error feedback (and dense), dashed without, thicker at the larger ratio or levels."""
    plt = st.pyplot()
    rounds = st.iterate_rounds(results)
    rounds = rounds.assign(mb=(rounds["bytes_up"].astype(float) + rounds["bytes_down"].astype(float)) / 1e6)
    runs = seeds.drop_duplicates("run_id").set_index("run_id")
    problems = list(dict.fromkeys(_order(seeds)["problem"]))
    colors = dict(zip(ORDER, plt.get_cmap("tab10").colors))
    fig, axes = plt.subplots(1, len(problems), figsize=(6.5 * len(problems), 4.4), squeeze=False)
    for ax, problem in zip(axes[0], problems):
        cells = _order(runs[runs["problem"] == problem].reset_index())
        params = {n: sorted(cells.loc[cells["compressor"] == n, "param"].unique()) for n in PARAM}
        for run in cells.itertuples():
            r = rounds[rounds["run_id"] == run.run_id].groupby("round")[[metric, "mb"]].mean()
            r = r[r["mb"] > 0]  # round 0, before anything is sent, has no place on a log axis
            bold = params.get(run.compressor, [math.nan])
            width = 0.8 + 1.4 * (bold.index(run.param) if run.compressor in PARAM else 0) / max(1, len(bold) - 1)
            ax.plot(r["mb"], r[metric], color=colors.get(run.compressor, "k"),
                    ls="-" if run.ef or run.compressor == "none" else "--", lw=width,
                    label=f"{run.compressor} {_param(run.compressor, run.param)}"
                          f"{' EF' if run.ef else ''}".replace(" –", ""))
        ax.set_xscale("log")
        st.finish_panel(ax, "MB sent (up + down, all clients)", metric, f"{PROBLEMS.get(problem, problem)}", 6,
                        ncol=2)
    st.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    return st.main(argv, doc=__doc__, out="docs/compression", targets=TARGETS, seed_rows=seed_rows,
                   table=lambda seeds: markdown(summary(seeds)), figure=accuracy_vs_mb,
                   figure_name="accuracy_vs_mb.png")


if __name__ == "__main__":
    raise SystemExit(main())
