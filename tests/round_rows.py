"""A run's rounds/ rows read back from its Parquet, sorted, for comparing runs bit for bit."""

from __future__ import annotations

import pyarrow.dataset as ds

from fedharness.config.load import load_settings
from fedharness.runs.execute import execute

COLUMNS = ["replica", "round", "train_loss", "grad_norm_sq", "test_loss", "test_acc", "local_steps", "bytes_up",
           "bytes_down"]


def rows(results_dir, run_id: str) -> list[tuple]:
    table = ds.dataset(results_dir / "rounds" / f"run_id={run_id}", format="parquet").to_table(
        columns=COLUMNS).to_pylist()
    return sorted(tuple(r[c] for c in COLUMNS) for r in table)


def run_rows(base: list[str], results_dir, run_id: str, *extra: str) -> list[tuple]:
    """Run `base` + `extra` under `results_dir` (status ok) and read its rows."""
    assert execute(load_settings([*base, f"results_dir={results_dir}", *extra]), run_id=run_id).status == "ok"
    return rows(results_dir, run_id)
