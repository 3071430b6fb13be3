"""The drift table: for each problem, algorithm, E and participation of `conf/sweep/drift.yaml`, the subopt floor
each algorithm reaches and the rounds it takes to come within 10x of it (docs/algorithms.md, Drift).

    python -m fedharness.studies.drift results/sweeps/drift --out docs/drift

Per seed (replica): the floor is the median of subopt = F(x) - F* over the last 10% of the evaluated rounds, and
the rounds to the floor the first evaluated round whose subopt is at most 10 times that floor. A cell is the median
over the seeds; "diverged" where a seed's subopt is not finite. FedExP is read on its reported iterate, the average
of its last two (series last_two); every other algorithm on its iterate.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from fedharness.studies.reports.data import Results, load_results

ORDER = ("fedavg", "fedprox", "scaffold", "fednova", "fedexp", "mime", "mimelite")  # others after, by name
SERIES = {"fedexp": "last_two"}  # the series an algorithm reports (default: iterate)
LAST = 0.1  # the floor: the median over this last fraction of the evaluated rounds
ABOVE = 10.0  # rounds to come within this factor of the floor


def seed_rows(results: Results) -> pd.DataFrame:
    """One row per (run, seed): problem, algorithm, E, participation, floor and rounds to ABOVE x floor."""
    rows = []
    for run in results.runs.itertuples():
        cfg, name = run.cfg, run.cfg.get("algorithm.name")
        mine = results.rounds[(results.rounds["run_id"] == run.run_id)
                              & (results.rounds["series"] == SERIES.get(name, "iterate"))]
        K = cfg.get("algorithm.clients_per_round")
        part = "full" if cfg.get("algorithm.sampler") == "full" else f"K = {K}"
        for replica, g in mine.groupby("replica"):
            sub = g.sort_values("round")["subopt"].to_numpy(dtype=np.float64)
            rounds = g.sort_values("round")["round"].to_numpy()
            floor = np.nan
            reach = np.nan
            if len(sub) and np.isfinite(sub).all():
                floor = float(np.median(sub[-max(1, int(round(LAST * len(sub)))):]))
                reach = float(rounds[np.argmax(sub <= ABOVE * max(floor, 0.0))])
            rows.append({"problem": cfg.get("dataset.name"), "algorithm": name, "E": cfg.get("algorithm.local_steps"),
                         "participation": part, "replica": replica, "floor": floor, "rounds": reach})
    return pd.DataFrame(rows)


def summary(seeds: pd.DataFrame) -> pd.DataFrame:
    """Median over the seeds of each cell (NaN: some seed diverged)."""
    rank = {n: i for i, n in enumerate(ORDER)}
    table = (seeds.groupby(["problem", "participation", "E", "algorithm"], sort=False)
             .agg(seeds=("replica", "size"), floor=("floor", lambda v: v.median(skipna=False)),
                  rounds=("rounds", lambda v: v.median(skipna=False))).reset_index())
    table["_r"] = table["algorithm"].map(lambda n: rank.get(n, len(ORDER)))
    return table.sort_values(["problem", "participation", "E", "_r", "algorithm"]).drop(columns="_r")


def markdown(table: pd.DataFrame) -> str:
    """One table per (problem, participation): a row per algorithm, floor and rounds at each E."""
    out = []
    for (problem, part), t in table.groupby(["problem", "participation"], sort=False):
        Es = sorted(t["E"].unique())
        out += [f"**{problem}, {part}** (median of {int(t['seeds'].max())} seeds: subopt floor / rounds to "
                f"{ABOVE:g}x above it)", "",
                "| algorithm | " + " | ".join(f"E = {E}" for E in Es) + " |", "|---|" + "---:|" * len(Es)]
        for name, r in t.groupby("algorithm", sort=False):
            cells = []
            for E in Es:
                c = r[r["E"] == E]
                cells.append("–" if c.empty else "diverged" if np.isnan(c["floor"].iloc[0])
                             else f"{c['floor'].iloc[0]:.2e} / {c['rounds'].iloc[0]:.0f}")
            out.append(f"| {name} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results_dir")
    parser.add_argument("--out", default="docs/drift")
    args = parser.parse_args(argv)
    text = markdown(summary(seed_rows(load_results(args.results_dir))))
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
