"""Batched sweeps: grid points that differ only in batchable keys (seeds, step sizes, E, ...) train as one batched
run (fedharness.runs.batch), with the runs/ and rounds/ rows of the unbatched sweep; `sweep.batch` turns it off."""

from __future__ import annotations

import itertools
import json

import pandas as pd
import pytest

from fedharness.errors import ConfigError
from fedharness.studies.sweep import batch_units, expand, plan, run_sweep, spec_from_dict

# dataset.data_seed set: runs of different seeds share the data, so they can share a batch
BASE = {"dataset": "quadratic", "dataset.num_clients": 20, "dataset.data_seed": 0, "rounds": 4, "eval_every": 2}
# seed, client_lr and E are batchable; batch_size is not: two batched runs of 4 points each
GRID = {"algorithm.batch_size": [2, 4], "seed": [0, 1], "algorithm.local_steps": [1, 3]}
VOLATILE_RUNS = ["started_at", "finished_at", "pid", "pid_start", "batch_id"]  # when and where, not what
VOLATILE_ROUNDS = ["wall_s"]


def spec(results_dir, **kw):
    return spec_from_dict({"results_dir": str(results_dir), "runner": "local", "base": dict(BASE), **kw}, "t")


def _same_ids(s):
    counter = itertools.count()
    return expand(s, new_id=lambda: f"run-{next(counter):02d}")


def _table(results_dir, kind: str, volatile: list[str]) -> pd.DataFrame:
    frame = pd.read_parquet(results_dir / kind).assign(run_id=lambda d: d.run_id.astype(str))
    frame = frame.drop(columns=[c for c in volatile if c in frame.columns])
    if "config_json" in frame.columns:  # the two sweeps write to two folders: the same config otherwise
        frame["config_json"] = [json.dumps({k: v for k, v in json.loads(c).items() if k != "results_dir"})
                                for c in frame.config_json]
    keys = ["run_id", *[k for k in ("series", "replica", "round") if k in frame.columns]]
    return frame.sort_values(keys).reset_index(drop=True)


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 11 s idle
def test_points_fold_into_batched_runs_by_everything_but_batchable_keys(tmp_path):
    s = spec(tmp_path, grid=GRID)
    jobs = _same_ids(s)
    units = batch_units(jobs, s)
    assert [len(u) for u in units] == [4, 4]
    assert all(len({j.point["algorithm.batch_size"] for j in u}) == 1 for u in units)
    assert sorted(j.run_id for u in units for j in u) == sorted(j.run_id for j in jobs)  # run ids as planned
    assert [len(u) for u in batch_units(jobs, spec(tmp_path, grid=GRID, batch=3))] == [3, 1, 3, 1]
    assert [len(u) for u in batch_units(jobs, spec(tmp_path, grid=GRID, batch=False))] == [1] * 8
    own_data = spec(tmp_path, grid=GRID, base={**BASE, "dataset.data_seed": None})  # the seed picks the data
    assert [len(u) for u in batch_units(_same_ids(own_data), own_data)] == [2, 2, 2, 2]
    alone = spec(tmp_path, grid=GRID, base={**BASE, "checkpoint_every": 2})  # a checkpointed run is never batched
    assert [len(u) for u in batch_units(_same_ids(alone), alone)] == [1] * 8


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 11 s idle
def test_a_batched_sweep_records_the_rows_of_the_unbatched_one(tmp_path):
    grid = {"seed": [0, 1], "algorithm.local_steps": [1, 3], "algorithm.client_lr": [0.02, 0.05]}
    base = {**BASE, "dataset.noise": 0.5, "algorithm.clients_per_round": 4}  # stochastic gradients, sampled clients
    outcomes = {}
    for batch in (True, False):
        s = spec(tmp_path / str(batch), grid=grid, batch=batch, base=base)
        outcomes[batch] = run_sweep(s, _same_ids(s), echo=lambda line: None)
        assert outcomes[batch].counts() == {"ok": 8}
    assert [len(u) for u in batch_units(outcomes[True].jobs, outcomes[True].spec)] == [8]
    runs = pd.read_parquet(tmp_path / "True" / "runs")
    assert runs.batch_id.nunique() == 1 and runs.batch_id.notna().all()  # one batched run recorded 8 runs
    for kind, volatile in (("runs", VOLATILE_RUNS), ("rounds", VOLATILE_ROUNDS)):
        batched, alone = (_table(tmp_path / str(b), kind, volatile) for b in (True, False))
        assert len(batched) == (8 if kind == "runs" else 8 * 3)
        pd.testing.assert_frame_equal(batched, alone, check_exact=False, rtol=1e-6)


@pytest.mark.parametrize("value", ["yes", 0, -2, 1.5])
def test_batch_is_true_false_or_a_positive_integer(tmp_path, value):
    with pytest.raises(ConfigError) as err:
        spec(tmp_path, grid=GRID, batch=value)
    assert err.value.key == "sweep.batch"


def test_the_command_line_turns_batching_off(tmp_path):
    fixed = ["sweep=local_steps", "sweep.runner=local", "algorithm.local_steps=1,5", "algorithm.clients_per_round=1",
             "rounds=100", "eval_every=10", f"results_dir={tmp_path}"]  # 2 points, E = 1 and 5
    s, jobs = plan([*fixed, "sweep.batch=false"])
    assert s.batch is False and [len(u) for u in batch_units(jobs, s)] == [1, 1]
    s, jobs = plan(fixed)
    assert s.batch is True and [len(u) for u in batch_units(jobs, s)] == [2]
