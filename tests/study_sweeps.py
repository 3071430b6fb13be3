"""What the study-table tests (test_systems_table.py, test_async_table.py, test_compression_table.py) share: a tiny
sweep on digits, the Parquet rows it wrote read back independently of the tables (each replica's first evaluated
round meeting the target and its last round), and the table's command run on it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.dataset as ds

from fedharness.studies.reports.data import load_results
from fedharness.studies.sweep import run_sweep, spec_from_dict

TARGET = 0.8


def tiny_sweep(tmp_path, grid: list[dict], *, ok: int, num_clients: int, sampler: str, clients_per_round: int,
               rounds: int, replicas: int, **base: Any) -> str:
    """Run the sweep `grid` over a tiny digits base (5 local steps, evaluated every round; `base` adds to it) into
    tmp_path/res and return that folder; `ok` runs must finish ok."""
    res = str(tmp_path / "res")
    data = {"results_dir": res, "runner": "local",
            "base": {"dataset": "digits", "dataset.num_clients": num_clients, "dataset.data_seed": 0,
                     "heterogeneity": False, "reference": "off", "threads": 1, "algorithm.sampler": sampler,
                     "algorithm.clients_per_round": clients_per_round, "algorithm.local_steps": 5, "rounds": rounds,
                     "eval_every": 1, "replicas": replicas, "eval.grad_norm": False, **base},
            "grid": grid}
    result = run_sweep(spec_from_dict(data, "tiny"), echo=lambda line: None)
    assert result.counts() == {"ok": ok}
    return res


def parquet_replicas(res: str) -> Iterator[tuple[Any, int, pd.DataFrame, pd.Series | None, pd.Series]]:
    """Each (run, replica) from the Parquet files alone: the runs/ row, the replica, its iterate rounds/ rows by
    round, the first of them meeting TARGET (test accuracy; None where none does) and the last."""
    runs = ds.dataset(f"{res}/runs", format="parquet", partitioning="hive").to_table().to_pandas()
    rounds = ds.dataset(f"{res}/rounds", format="parquet", partitioning="hive").to_table().to_pandas()
    rounds = rounds[rounds["series"] == "iterate"].sort_values("round")
    for run in runs.itertuples():
        for rep, r in rounds[rounds["run_id"] == run.run_id].groupby("replica"):
            hit = r[r["test_acc"] >= TARGET]
            yield run, rep, r, hit.iloc[0] if len(hit) else None, r.iloc[-1]


def at(first: pd.Series | None, column: str) -> float:
    """`column` of the first row meeting the target; NaN where none does."""
    return first[column] if first is not None else np.nan


def mb_at(first: pd.Series | None) -> float:
    """MB sent (up and down) by the first row meeting the target; NaN where none does."""
    return (first["bytes_up"] + first["bytes_down"]) / 1e6 if first is not None else np.nan


def table_of(module: Any, res: str) -> pd.DataFrame:
    """The study's summary table of the sweep in `res`, with TARGET on digits."""
    return module.summary(module.seed_rows(load_results(res), {"digits": f"test_acc>={TARGET}"}))


def written(module: Any, res: str, tmp_path, figure: str) -> str:
    """Run the study's command on `res` into tmp_path/docs, check that it wrote `figure`, and return table.md."""
    out = tmp_path / "docs"
    assert module.main([res, "--out", str(out), "--target", f"digits=test_acc>={TARGET}"]) == 0
    text = (out / "table.md").read_text()
    assert (out / figure).stat().st_size > 0
    return text
