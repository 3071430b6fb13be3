"""threads: null resolves at the run's start from the work of a step and the cores other processes leave free; the
runs/ row and the checkpoint record the count, and a resumed run reuses it whatever the load then."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch

from fedharness.assembly.build import build_parts
from fedharness.base import runtime
from fedharness.config.load import load_settings
from fedharness.runs.execute import execute, prepare_run
from ray_support import QUADRATIC, read_rounds

# dim 100,000: the loss sums more than 2^16 values, and torch splits such a sum over its threads, so the rows'
# bits differ between 1 and 2 threads (checked below); a step's work, dim x 5 clients x batch 24 = 12M, asks for 2.
RUN = ["dataset=quadratic_lazy", "dataset.dim=100000", "dataset.num_clients=100",
       "dtype=float64", "algorithm.clients_per_round=5", "algorithm.local_steps=2", "eval_every=1",
       "reference=off", "heterogeneity=false", "progress=false"]
COMPARED = ("train_loss", "grad_norm_sq", "subopt", "dist_to_opt")


@pytest.fixture
def two_cores(monkeypatch):
    """torch may use 2 threads (the tests' process runs on 1: conftest) and `free` holds what free_cores reports,
    with every call counted; torch's setting is put back afterwards."""
    free, calls = {"cores": 2}, []

    def fake_free_cores() -> int:
        calls.append(free["cores"])
        return free["cores"]

    monkeypatch.setattr(runtime, "available_threads", lambda: 2)
    monkeypatch.setattr(runtime, "free_cores", fake_free_cores)
    monkeypatch.setattr(runtime, "_SET", runtime._SET)  # undone after the test, as torch's threads below
    before = torch.get_num_threads()
    yield free, calls
    torch.set_num_threads(before)


def _threads(results, run_id: str) -> int | None:
    """The thread count the run's runs/ row records."""
    row = pq.read_table(results / "runs" / f"run_id={run_id}" / "run.parquet").to_pylist()[0]
    return json.loads(row["config_json"])["threads"]


def _checkpointed_threads(results, run_id: str) -> int | None:
    meta = json.loads((results / "checkpoints" / f"run_id={run_id}" / "meta.json").read_text())
    return meta["config"]["threads"]


def _rows(results, run_id: str) -> list[tuple]:
    return [(r["round"], *(r[name] for name in COMPARED)) for r in read_rounds(results, run_id)]


def _crash_at(results, stop_round: int) -> None:
    def on_eval(rows, state):
        if state.round == stop_round:
            raise RuntimeError("driver crashed")

    with pytest.raises(RuntimeError, match="driver crashed"):
        execute(load_settings([f"results_dir={results}", *RUN, "rounds=4", "checkpoint_every=2"]), run_id="cut",
                        on_eval=on_eval)


def test_a_resumed_run_keeps_its_thread_count_under_another_load(tmp_path, two_cores):
    """Started beside a busy process (1 core free: 1 thread), resumed on a quiet machine (2 free: a new run takes
    2, with other bits): the resumed rounds repeat the uninterrupted run's bits."""
    free, _ = two_cores
    free["cores"] = 1
    execute(load_settings([f"results_dir={tmp_path / 'whole'}", *RUN, "rounds=4"]), run_id="whole")
    assert _threads(tmp_path / "whole", "whole") == 1 and torch.get_num_threads() == 1
    free["cores"] = 2
    execute(load_settings([f"results_dir={tmp_path / 'quiet'}", *RUN, "rounds=1"]), run_id="quiet")
    assert _threads(tmp_path / "quiet", "quiet") == 2
    quiet = _rows(tmp_path / "quiet", "quiet")  # rounds 0 and 1
    assert quiet != _rows(tmp_path / "whole", "whole")[:2]  # 1 and 2 threads: other bits

    free["cores"] = 1
    _crash_at(tmp_path / "cut", 3)  # last checkpoint at round 2
    assert _checkpointed_threads(tmp_path / "cut", "cut") == 1
    free["cores"] = 2
    execute(load_settings([f"results_dir={tmp_path / 'cut'}", *RUN, "rounds=4", "checkpoint_every=2",
                           "resume=cut"]))
    assert _threads(tmp_path / "cut", "cut") == 1 and torch.get_num_threads() == 1
    assert _rows(tmp_path / "cut", "cut") == _rows(tmp_path / "whole", "whole")  # the same bits, not just close


def test_a_checkpoint_that_recorded_null_resumes_on_the_works_count(tmp_path, two_cores):
    """A checkpoint written before the count was recorded: the run resumes (its config still says null) on the
    work's count, 2, whatever the load (1 core free here)."""
    free, calls = two_cores
    free["cores"] = 1
    _crash_at(tmp_path / "cut", 3)
    meta = tmp_path / "cut" / "checkpoints" / "run_id=cut" / "meta.json"
    old = json.loads(meta.read_text())
    old["config"]["threads"] = None
    meta.write_text(json.dumps(old))
    calls[:] = []
    result = execute(load_settings([f"results_dir={tmp_path / 'cut'}", *RUN, "rounds=4", "checkpoint_every=2",
                                    "resume=cut"]))
    assert result.status == "ok" and [r["round"] for r in result.rows] == [3, 4]
    assert _threads(tmp_path / "cut", "cut") is None and torch.get_num_threads() == 2 and calls == []


def test_tiny_work_takes_one_thread_without_reading_the_load(two_cores):
    _, calls = two_cores
    settings = load_settings([*RUN[:1], "dataset.dim=10", *RUN[2:]])  # 10 x 5 x 24: far below 2^20 a thread
    assert prepare_run(settings).settings.threads == 1 and calls == []
    assert prepare_run(settings.replace(threads=2)).settings.threads == 2 and calls == []  # explicit: kept


@pytest.mark.parametrize("others, want", [(0.0, 2), (0.24, 2), (0.26, 1), (1.0, 1), (1.2, 1), (3.0, 1)])
def test_free_cores_counts_a_core_idle_three_quarters_of_the_window(monkeypatch, others, want):
    """Over a 0.2 s window (a fake clock) the machine's 2 cores were busy `others` cores' worth beside this
    process's own 0.1 s of CPU: a core counts as free when at least CORE_FREE = 3/4 of it was idle."""
    clock = {"t": 0.0, "own": 0.0, "busy": 100.0}

    class FakeTime:
        @staticmethod
        def monotonic() -> float:
            return clock["t"]

        @staticmethod
        def process_time() -> float:
            return clock["own"]

        @staticmethod
        def sleep(seconds: float) -> None:
            clock["t"] += seconds
            clock["own"] += 0.1
            clock["busy"] += (others + 0.5) * seconds  # this process's 0.1 s in 0.2 s: half a core

    monkeypatch.setattr(runtime, "time", FakeTime)
    monkeypatch.setattr(runtime, "_busy_seconds", lambda cpus: clock["busy"])
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: {0, 1})
    assert runtime.free_cores(0.2) == want


@pytest.mark.slow  # starts a Ray shard process for each case
@pytest.mark.parametrize("threads, cpus, want", [(1, 2, 1), (2, 1, 1), (2, 2, 2)])
def test_ray_shards_take_the_runs_threads_within_their_cpus(local_ray, threads, cpus, want):
    from fedharness.backends.ray_executor import RayExecutor

    settings = load_settings([*QUADRATIC, "executor=ray", "ray.num_shards=1", f"ray.cpus_per_shard={cpus}",
                              f"threads={threads}"])
    problem, algorithm = build_parts(settings)
    executor = RayExecutor(settings, problem, algorithm.solver)
    try:
        assert [info["threads"] for info in executor.infos] == [want]
    finally:
        executor.close()
