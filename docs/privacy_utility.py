"""The privacy-utility table of docs/privacy.md from a `fedharness sweep sweep=privacy_utility` results folder:
each run's final test accuracy (mean and std over its replicas) against the epsilon its runs/ row records.

    python docs/privacy_utility.py results/sweeps/privacy_utility
"""

from __future__ import annotations

import json
import math
import sys

import pyarrow.dataset as ds


def table(results_dir: str) -> str:
    runs = ds.dataset(f"{results_dir}/runs", format="parquet", partitioning="hive").to_table().to_pandas()
    rounds = ds.dataset(f"{results_dir}/rounds", format="parquet", partitioning="hive").to_table().to_pandas()
    final = rounds[rounds["round"] == rounds.groupby("run_id")["round"].transform("max")]
    runs = runs.set_index("run_id").join(final.groupby("run_id").test_acc.agg(["mean", "std"]))
    dp = runs.config_json.map(lambda c: json.loads(c)["dp"])
    lines = ["| setting | clip norm C | noise multiplier z | epsilon (delta 1e-5) | test accuracy (mean ± std) |",
             "|---|---:|---:|---:|---:|"]
    def place(run_id: str) -> tuple:  # by epsilon (infinite last, no DP at the end), then larger C first
        eps, d = runs.epsilon[run_id], dp[run_id]
        return (math.inf if math.isnan(eps) else round(eps, 3), d["noise_multiplier"] is None, -d["clip_norm"])

    for run_id in sorted(runs.index, key=place):
        r, d = runs.loc[run_id], dp[run_id]
        if d["noise_multiplier"] is None:
            setting, clip, z = "FedAvg, no DP", "—", "—"
        else:
            setting = "clipped, no noise" if d["noise_multiplier"] == 0 else f"DP-FedAvg, target {d['target_epsilon']:g}"
            clip, z = f"{d['clip_norm']:g}", f"{d['noise_multiplier']:.3f}"
        eps = "∞" if math.isnan(r.epsilon) else f"{r.epsilon:.3f}"
        lines.append(f"| {setting} | {clip} | {z} | {eps} | {r['mean']:.3f} ± {r['std']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1]))
