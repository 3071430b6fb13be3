"""What the study-table tests (test_systems_table.py, test_async_table.py, test_compression_table.py) share: a tiny
sweep on digits, the Parquet rows it wrote read back independently of the tables (each replica's first evaluated
round meeting the target and its last round), and the table runner (studies/tables.py) run on it with a spec of
conf/table/, its table.md against the one today's table module wrote from the same sweep (tests/table_md/)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.dataset as ds

from fedharness.studies import tables
from fedharness.studies.reports.data import load_results
from fedharness.studies.sweep import run_sweep, spec_from_dict
from fedharness.studies.table_spec import read_spec, seed_rows, summary
from fedharness.studies.table_text import text

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


def table_of(name: str, res: str) -> pd.DataFrame:
    """The summary table of spec `name` of the sweep in `res`, with TARGET on digits."""
    spec = read_spec(name)
    return summary(spec, seed_rows(spec, load_results(res), {"digits": f"test_acc>={TARGET}"}))


def column_texts(name: str, header: str, table: pd.DataFrame) -> list[str]:
    """Spec `name`'s column `header`, each row of its summary `table`."""
    column = next(c for c in read_spec(name)["columns"] if c["header"] == header)
    return [text(column["cell"], r) for r in table.to_dict("records")]


def written(name: str, res: str, tmp_path, figure: str) -> str:
    """Run the table runner with spec `name` on `res` into tmp_path/docs, check that it wrote `figure` and that its
    table.md is the one today's module wrote from the same sweep (tests/table_md/NAME.md), and return it."""
    out = tmp_path / "docs"
    assert tables.main([name, res, "--out", str(out), "--target", f"digits=test_acc>={TARGET}"]) == 0
    text_ = (out / "table.md").read_text()
    assert (out / figure).stat().st_size > 0
    assert text_ == (Path(__file__).parent / "table_md" / f"{name}.md").read_text()
    return text_
