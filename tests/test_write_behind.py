"""A batch's records written together (harness/results/store.py WriteBehind, harness/runs/execute.py): each run's
objects land in the order they were made, reads see every write before them, a failed write is raised, and every
slot's `running` row is on disk before the batch trains."""

from __future__ import annotations

import threading
import time

import pyarrow.parquet as pq
import pytest

from fedharness.config.load import load_settings
from fedharness.contracts import Callback
from fedharness.results.store import FileStore, WriteBehind
from fedharness.runs.batch import Slot
from fedharness.runs.execute import execute_batch


class SlowStore(FileStore):
    """A folder whose writes of keys holding `slow` take 0.2 s; it logs each write as it ends."""

    def __init__(self, root, slow: str = "", fail: str | None = None):
        super().__init__(root)
        self.slow, self.fail, self.ended, self.lock = slow, fail, [], threading.Lock()

    def write(self, key: str, data: bytes) -> None:
        if self.slow and self.slow in key:
            time.sleep(0.2)
        if key == self.fail:
            raise OSError(f"disk full writing {key}")
        super().write(key, data)
        with self.lock:
            self.ended.append((key, data))


def test_a_runs_writes_land_in_order_while_other_runs_go_on(tmp_path):
    store = SlowStore(tmp_path, slow="run_id=a/run.parquet")
    writes = WriteBehind(store)
    writes.write("runs/run_id=a/run.parquet", b"running")
    writes.write("rounds/run_id=a/part-000000000-000000004.parquet", b"rows")
    writes.write("runs/run_id=a/run.parquet", b"ok")
    writes.write("runs/run_id=b/run.parquet", b"running")
    writes.drain()
    ended = store.ended
    # run b did not wait for run a's slow first write; run a's three writes ended in the order they were made
    assert ended[0] == ("runs/run_id=b/run.parquet", b"running")
    assert ended[1:] == [("runs/run_id=a/run.parquet", b"running"),
                         ("rounds/run_id=a/part-000000000-000000004.parquet", b"rows"),
                         ("runs/run_id=a/run.parquet", b"ok")]
    assert (tmp_path / "runs/run_id=a/run.parquet").read_bytes() == b"ok"
    writes.close()


def test_reads_and_listings_wait_for_the_writes_before_them(tmp_path):
    writes = WriteBehind(SlowStore(tmp_path, slow="run_id=a"))
    writes.write("runs/run_id=a/run.parquet", b"running")
    assert writes.list("runs") == ["runs/run_id=a/run.parquet"]
    writes.write("runs/run_id=a/run.parquet", b"ok")
    assert writes.read("runs/run_id=a/run.parquet") == b"ok"
    writes.write("runs/run_id=a/run.parquet", b"failed")
    assert writes.exists("runs/run_id=a/run.parquet")
    assert (tmp_path / "runs/run_id=a/run.parquet").read_bytes() == b"failed"
    writes.close()


def test_a_failed_write_is_raised_and_the_others_land(tmp_path):
    store = SlowStore(tmp_path, fail="runs/run_id=a/run.parquet")
    writes = WriteBehind(store)
    writes.write("runs/run_id=a/run.parquet", b"running")
    writes.write("runs/run_id=b/run.parquet", b"running")
    with pytest.raises(OSError, match="disk full writing runs/run_id=a/run.parquet"):
        writes.close()
    assert (tmp_path / "runs/run_id=b/run.parquet").read_bytes() == b"running"
    assert not (tmp_path / "runs/run_id=a").exists()


class SeesRunningRows(Callback):
    """After the first round: the runs/ rows on disk, read without the store."""

    def __init__(self, results):
        self.results, self.seen = results, None

    def on_round_end(self, context) -> None:
        if self.seen is None:
            self.seen = {p.parent.name: pq.read_table(p).column("status")[0].as_py()
                         for p in (self.results / "runs").glob("run_id=*/run.parquet")}


def test_every_slot_is_recorded_running_before_the_batch_trains(tmp_path):
    base = [f"results_dir={tmp_path}", "dataset.num_clients=8", "dataset.samples_per_client=20",
            "algorithm.clients_per_round=3", "algorithm.local_steps=2", "algorithm.batch_size=4", "rounds=3",
            "eval_every=3", "reference=off", "heterogeneity=false", "threads=1", "progress=false"]
    watch = SeesRunningRows(tmp_path)
    slots = [Slot(load_settings([*base, f"algorithm.client_lr={lr}"]), f"slot-{i}", hooks=[watch] if i == 0 else [])
             for i, lr in enumerate((0.01, 0.02, 0.05))]
    # the rows take 0.2 s each to write: without the wait for them, the first round would end before they land
    results = execute_batch(slots, batch_id="b", store=SlowStore(tmp_path, slow="runs/run_id=slot-"))
    assert watch.seen == {"run_id=slot-0": "running", "run_id=slot-1": "running", "run_id=slot-2": "running"}
    assert [r.status for r in results] == ["ok"] * 3
    for i in range(3):  # written when the batch returned: the final rows and every slot's rounds
        assert pq.read_table(tmp_path / f"runs/run_id=slot-{i}/run.parquet").column("status")[0].as_py() == "ok"
        assert pq.read_table(tmp_path / f"rounds/run_id=slot-{i}").column("round").to_pylist() == [0, 3]
