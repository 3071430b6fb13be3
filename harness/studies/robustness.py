"""The robustness table: final test accuracy of each aggregation rule under each attack (`conf/sweep/robustness.yaml`),
mean and spread over the replicas (seeds), as Markdown and a heat map (docs/robustness.md).

    python -m fedharness.studies.robustness results/sweeps/robustness --out docs/robustness
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from fedharness.results.store import open_store
from fedharness.results.tables import read_run_table, run_table_keys

RULES = {("mean", 1): "FedAvg (mean)", ("median", 1): "median", ("median", 2): "median + bucketing (s=2)",
         ("trimmed_mean", 1): "trimmed mean", ("trimmed_mean", 2): "trimmed mean + bucketing (s=2)",
         ("krum", 1): "Krum", ("krum", 2): "Krum + bucketing (s=2)", ("geometric_median", 1): "RFA (geometric median)",
         ("centered_clip", 1): "CC", ("centered_clip", 2): "CC + bucketing (s=2)"}
ATTACKS = ("none", "sign_flip", "gaussian", "scaling", "label_flip", "alie", "ipm")
PARTITIONS = {"iid": "i.i.d.", "dirichlet": "Dirichlet(0.5)"}


def final_accuracy(results_dir: str) -> pd.DataFrame:
    """One row per (run, replica): partition, rule, attack, fraction and the last evaluated round's test_acc."""
    store = open_store(results_dir)
    runs = read_run_table(store, run_table_keys(store, "runs"))
    runs = runs[runs["status"] == "ok"]
    rounds = read_run_table(store, run_table_keys(store, "rounds", runs["run_id"]))
    rounds = rounds[rounds["series"] == "iterate"]
    last = rounds[rounds["round"] == rounds.groupby("run_id")["round"].transform("max")]
    rows = []
    for run in runs.itertuples():
        cfg = json.loads(run.config_json)
        acfg, attack = cfg["algorithm"], cfg.get("attack") or {"name": "none", "fraction": 0.0}
        rule = RULES.get((acfg["aggregator"], acfg.get("bucket_size", 1)))
        for rep in last[last["run_id"] == run.run_id].itertuples():
            rows.append({"partition": cfg["partition"]["name"], "rule": rule, "attack": attack["name"],
                         "fraction": float(attack["fraction"]), "replica": rep.replica, "test_acc": rep.test_acc})
    return pd.DataFrame(rows)


def _columns(acc: pd.DataFrame) -> list[tuple[str, float]]:
    present = set(zip(acc["attack"], acc["fraction"]))
    return [(a, f) for a in ATTACKS for f in (0.0, 0.1, 0.2) if (a, f) in present]


def _label(attack: str, fraction: float) -> str:
    return "none" if attack == "none" else f"{attack} {fraction:.0%}"


def summary(acc: pd.DataFrame, partition: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Mean and standard deviation (ddof 1, over replicas) of test accuracy in %: rules x (attack, fraction)."""
    part = acc[acc["partition"] == partition]
    stats = part.groupby(["rule", "attack", "fraction"])["test_acc"].agg(["mean", "std"]) * 100
    cols, rules = _columns(acc), [r for r in RULES.values() if r in set(part["rule"])]
    mean = pd.DataFrame([[stats["mean"].get((r, a, f), np.nan) for a, f in cols] for r in rules], rules,
                        [_label(a, f) for a, f in cols])
    std = pd.DataFrame([[stats["std"].get((r, a, f), np.nan) for a, f in cols] for r in rules], rules, mean.columns)
    return mean, std


def markdown(acc: pd.DataFrame) -> str:
    """One table per partition: 'mean ± std' of test accuracy (%) over the seeds."""
    out = []
    for partition, title in PARTITIONS.items():
        if partition not in set(acc["partition"]):
            continue
        mean, std = summary(acc, partition)
        out += [f"**{title}**", "", "| rule | " + " | ".join(mean.columns) + " |",
                "|---|" + "---:|" * len(mean.columns)]
        for rule in mean.index:
            cells = [f"{m:.1f} ± {s:.1f}" for m, s in zip(mean.loc[rule], std.loc[rule])]
            out.append(f"| {rule} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def heat_map(acc: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in PARTITIONS if p in set(acc["partition"])]
    fig, axes = plt.subplots(1, len(parts), figsize=(6.5 * len(parts) + 1.5, 4.2), squeeze=False, sharey=True)
    for ax, partition in zip(axes[0], parts):
        mean, _ = summary(acc, partition)
        image = ax.imshow(mean.to_numpy(), vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(mean.columns)), mean.columns, rotation=60, ha="right", fontsize=8)
        ax.set_yticks(range(len(mean.index)), mean.index, fontsize=8)  # shared: the left panel's labels
        for (i, j), value in np.ndenumerate(mean.to_numpy()):
            ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=7)
        ax.set_title(f"digits, {PARTITIONS[partition]}: final test accuracy (%)", fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results_dir")
    parser.add_argument("--out", default="docs/robustness")
    args = parser.parse_args(argv)
    acc = final_accuracy(args.results_dir)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(acc)
    (out / "table.md").write_text(table)
    heat_map(acc, out / "robustness.png")
    print(table)
    print(f"{len(acc)} (run, seed) results; written: {out / 'table.md'}, {out / 'robustness.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
