"""Result sinks. Parquet, hive-partitioned by run_id, every file written to a temporary name and renamed."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from fedharness.files import atomic_write

ROUND_SCHEMA = pa.schema([
    ("replica", pa.int64()), ("series", pa.string()), ("round", pa.int64()),
    ("local_steps", pa.int64()), ("grad_evals", pa.int64()),
    ("bytes_up", pa.int64()), ("bytes_down", pa.int64()), ("wall_s", pa.float64()), ("sim_s", pa.float64()),
    ("train_loss", pa.float64()), ("subopt", pa.float64()), ("dist_to_opt", pa.float64()),
    ("grad_norm_sq", pa.float64()), ("test_loss", pa.float64()), ("test_acc", pa.float64()),
    ("lr", pa.float64()), ("server_lr", pa.float64()),
    ("tau_eff", pa.float64()), ("chi2", pa.float64()), ("slowdown", pa.float64()),
])

RUN_SCHEMA = pa.schema([
    ("study", pa.string()), ("experiment", pa.string()), ("algorithm", pa.string()),
    ("dataset", pa.string()), ("partition", pa.string()), ("model", pa.string()),
    ("seed", pa.int64()), ("n_replicas", pa.int64()), ("status", pa.string()), ("rounds_done", pa.int64()),
    ("config_json", pa.string()), ("git_sha", pa.string()), ("started_at", pa.string()),
    ("finished_at", pa.string()), ("versions_json", pa.string()), ("host", pa.string()),
    ("error", pa.string()), ("trial", pa.int64()),
    ("f_star", pa.float64()), ("gamma_heterogeneity", pa.float64()),
    ("pid", pa.int64()), ("pid_start", pa.int64()),  # the writing process: a `running` row whose one is gone is lost
    ("callbacks", pa.string()), ("metrics", pa.string()),  # JSON lists: the run's callbacks and its own metrics
    ("split_invariant", pa.bool_()),  # rows independent of the shard split (docs/cluster.md, Same bits)
])


def atomic_write_table(table: pa.Table, path: Path) -> None:
    """The table as one Parquet file at `path`, whole or not at all."""
    atomic_write(path, lambda f: pq.write_table(table, f))


def _table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    return pa.Table.from_pylist([{f.name: row.get(f.name) for f in schema} for row in rows], schema=schema)


class ParquetSink:
    """`<results_dir>/runs/run_id=<id>/run.parquet` and `<results_dir>/rounds/run_id=<id>/part-*.parquet`."""

    def __init__(self, results_dir: str | Path, run_id: str, extra_columns: Sequence[str] = ()):
        """`extra_columns`: the run's own metrics (the `metrics` key), float64 columns after the built-in ones."""
        self.root, self.run_id = Path(results_dir), run_id
        self.round_schema = pa.schema([*ROUND_SCHEMA, *(pa.field(name, pa.float64()) for name in extra_columns)])
        self.rounds_dir = self.root / "rounds" / f"run_id={run_id}"
        self.pending: list[dict] = []

    def write_run(self, row: dict) -> None:
        atomic_write_table(_table([row], RUN_SCHEMA), self.root / "runs" / f"run_id={self.run_id}" / "run.parquet")

    def add_rounds(self, rows: list[dict]) -> None:
        self.pending.extend(rows)

    def pending_part(self) -> tuple[str, bytes] | None:
        """The buffered rows as one Parquet part: (file name by its round range, bytes); None when none."""
        if not self.pending:
            return None
        rounds = [r["round"] for r in self.pending]
        buf = pa.BufferOutputStream()
        pq.write_table(_table(self.pending, self.round_schema), buf)
        return f"part-{min(rounds):09d}-{max(rounds):09d}.parquet", buf.getvalue().to_pybytes()

    def write_part(self, part: tuple[str, bytes]) -> None:
        name, data = part
        atomic_write(self.rounds_dir / name, lambda f: f.write(data))

    def flush(self, part: tuple[str, bytes] | None = None) -> None:
        """Write the buffered rows as one part named by its round range (resume drops parts past a checkpoint);
        `part`: them as pending_part gave them. The buffer empties only once the part is written, so a signal
        that cuts this short leaves the rows for the flush that records the run's end."""
        part = part or self.pending_part()
        if part is not None:
            self.write_part(part)
        self.pending = []

    def drop_after(self, last_round: int) -> None:
        """Remove parts holding rounds after `last_round`, so a resumed run writes each round once."""
        for part in self.rounds_dir.glob("part-*.parquet"):
            if int(part.stem.split("-")[1]) > last_round:
                part.unlink()
