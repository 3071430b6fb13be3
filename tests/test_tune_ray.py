"""Trials in parallel on Ray: `tune.parallel` tasks claim trials from one storage, exactly n_trials in all."""

from __future__ import annotations

import os

import optuna
import pandas as pd
import pytest

from fedharness import cli


@pytest.mark.slow
def test_parallel_ray_workers_share_one_journal_study(tmp_path):
    journal = tmp_path / "study.log"
    args = ["tune=quadratic_lr", "tune.space.client_lr.high=0.02", f"results_dir={tmp_path}", "tune.plots=false",
            "tune.n_trials=6", "tune.parallel=2", f"tune.storage=journal:{journal}",
            "tune.resources={num_cpus: 1, num_gpus: 0}"]
    assert cli.main(["tune", *args]) == 0
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    trials = optuna.load_study(study_name="quadratic_lr-fedavg", storage=storage).trials
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    assert sorted(t.number for t in complete) == list(range(6))
    assert all(t.user_attrs.get("status") == "surplus" for t in trials if t.state.name != "COMPLETE")
    runs = pd.read_parquet(tmp_path / "runs")
    assert sorted(runs.trial) == list(range(6)) and runs.status.eq("ok").all()
    assert len({t.params["client_lr"] for t in complete}) == 6  # workers propose different points
    pids = {int(t.user_attrs["worker"].rsplit(":", 1)[1]) for t in complete}
    assert os.getpid() not in pids  # the trials ran in Ray's worker processes, not in the driver
