"""The Parquet contract: what a run wrote reads back and equals what it computed; writes are atomic."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pyarrow.dataset as ds
import pyarrow.parquet as pq

from fedharness.runs.execute import execute
from fedharness.sinks.parquet import ROUND_SCHEMA, RUN_SCHEMA


def test_round_trip_matches_in_memory_rows(run_config, tmp_path):
    cfg = run_config("dataset.num_clients=10", "rounds=6", "eval_every=2", "replicas=2")
    result = execute(cfg)
    rounds = ds.dataset(tmp_path / "results" / "rounds", partitioning="hive").to_table()
    assert rounds.num_rows == len(result.rows) == 2 * 4  # rounds 0, 2, 4, 6 for 2 replicas
    assert set(rounds.column("run_id").to_pylist()) == {result.run_id}
    on_disk = sorted(rounds.drop(["run_id"]).to_pylist(), key=lambda r: (r["round"], r["replica"]))
    in_memory = sorted(result.rows, key=lambda r: (r["round"], r["replica"]))
    for disk, mem in zip(on_disk, in_memory):
        for name in ROUND_SCHEMA.names:
            assert disk[name] == mem.get(name), name
    assert all(r["test_acc"] is not None and r["subopt"] is not None for r in on_disk)
    assert [r["local_steps"] for r in on_disk if r["replica"] == 0] == [0, 40, 80, 120]


def test_null_where_a_metric_does_not_apply(run_config, tmp_path):
    execute(run_config("dataset=quadratic", "rounds=2", "eval_every=1"))
    rows = ds.dataset(tmp_path / "results" / "rounds", partitioning="hive").to_table().to_pylist()
    assert all(r["test_acc"] is None and r["test_loss"] is None for r in rows)
    assert all(r["subopt"] is not None for r in rows)
    assert rows[0]["tau_eff"] is None and rows[-1]["tau_eff"] == 20.0  # round 0 has no aggregation yet


def test_runs_row(run_config, tmp_path):
    cfg = run_config("dataset.num_clients=10", "rounds=2", "study=s1", "seed=4")
    result = execute(cfg)
    run = ds.dataset(tmp_path / "results" / "runs", partitioning="hive").to_table().to_pylist()
    assert len(run) == 1
    row = run[0]
    assert row["run_id"] == result.run_id and row["status"] == "ok" and row["rounds_done"] == 2
    assert (row["study"], row["algorithm"], row["dataset"], row["seed"]) == ("s1", "fedavg", "synthetic", 4)
    assert json.loads(row["config_json"])["rounds"] == 2
    assert "torch" in json.loads(row["versions_json"])
    assert set(RUN_SCHEMA.names) <= set(row)


def test_killed_writer_leaves_no_partial_file(tmp_path):
    """SIGKILL a process in the middle of writing large parts: every visible file is complete."""
    script = textwrap.dedent(f"""
        import pyarrow as pa
        from fedharness.results.tables import write_table
        from fedharness.results.store import FileStore
        table = pa.table({{"x": list(range(3_000_000))}})
        store = FileStore({str(tmp_path)!r})
        i = 0
        while True:
            write_table(store, f"part-{{i}}.parquet", table)
            print(i, flush=True)
            i += 1
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "0"  # at least one file done, the next one in progress
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    visible = sorted(p for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert visible
    for path in visible:
        assert pq.read_table(path).num_rows == 3_000_000
    assert ds.dataset(tmp_path, format="parquet").count_rows() == 3_000_000 * len(visible)


def test_diverging_run_is_recorded_with_the_rounds_before_it(run_config, tmp_path):
    # |1 - lr| = 2 per local step: the iterate grows 2^20 per round; its loss overflows float32 in round 4.
    cfg = run_config("dataset=quadratic", "algorithm.sampler=full", "algorithm.client_lr=3.0", "rounds=50",
                     "eval_every=1", "heterogeneity=false")
    result = execute(cfg)
    assert result.status == "diverged"
    run = ds.dataset(tmp_path / "results" / "runs", partitioning="hive").to_table().to_pylist()[0]
    rounds = ds.dataset(tmp_path / "results" / "rounds", partitioning="hive").to_table().to_pylist()
    assert run["status"] == "diverged" and run["rounds_done"] == 3
    assert sorted(r["round"] for r in rounds) == list(range(5))
    assert [r["train_loss"] is None for r in sorted(rounds, key=lambda r: r["round"])] == [False] * 4 + [True]
