"""A user's callbacks and metrics: hooks that see every round and can stop a run (recorded as stopped), and
metrics registered once that land as their own rounds/ columns and can be a tuning objective."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

import fedharness
from fedharness.registry.groups import METRICS


@pytest.fixture(autouse=True)
def _restore_metrics():
    saved = dict(METRICS)
    yield
    METRICS.clear()
    METRICS.update(saved)


class Recorder(fedharness.Callback):
    """Counts the hooks and keeps the models each evaluation saw; stops after round `stop_at` if set."""

    name = "recorder"

    def __init__(self, stop_at: int | None = None):
        self.stop_at, self.ends, self.evaluations = stop_at, [], {}

    def on_round_end(self, context):
        self.ends.append(context.round)
        return context.round == self.stop_at

    def on_evaluation(self, context):
        self.evaluations[context.round] = context.x.double().clone()


def _data_loss(w, split):
    loss, _ = split.model.loss_terms(w, split.x, split.y)
    return loss.double() / len(split.y)


def test_metrics_on_both_splits_equal_the_builtin_losses_they_recompute(tmp_path):
    """A metric sees the split's samples and the problem's model: recomputing the test loss and the train
    objective from them gives the built-in columns (float64, relative 1e-12)."""
    fedharness.register_metric("my_test_loss", _data_loss, split="test")
    fedharness.register_metric("my_train_loss", lambda w, s: _data_loss(w, s) + s.model.regularizer(w).double(),
                               split="train")
    r = fedharness.run(["dataset.num_clients=20", "algorithm.clients_per_round=5", "rounds=6", "eval_every=2",
                        "dtype=float64", "replicas=3", "reference=off", "metrics=[my_test_loss,my_train_loss]",
                        f"results_dir={tmp_path}"], progress=False)
    rounds = r.rounds
    assert len(rounds) == 4 * 3
    np.testing.assert_allclose(rounds.my_test_loss, rounds.test_loss, rtol=1e-12)
    np.testing.assert_allclose(rounds.my_train_loss, rounds.train_loss, rtol=1e-12)
    assert json.loads(r.runs.metrics[0]) == ["my_test_loss", "my_train_loss"]


def test_callbacks_see_every_round_and_a_metric_sees_the_models_they_saw(tmp_path):
    fedharness.register_metric("sq_norm", lambda w, s: (w.double() ** 2).sum(1))  # a quadratic: no samples
    seen = Recorder()
    r = fedharness.run(["dataset=quadratic", "rounds=9", "eval_every=3", "replicas=2", "metrics=[sq_norm]",
                        f"results_dir={tmp_path}"], callbacks=[seen], progress=False)
    assert r.status == "ok" and seen.ends == list(range(1, 10)) and sorted(seen.evaluations) == [3, 6, 9]
    rounds = r.rounds.query("round > 0").sort_values(["round", "replica"])
    expected = np.concatenate([(seen.evaluations[k] ** 2).sum(1).numpy() for k in (3, 6, 9)])
    np.testing.assert_allclose(rounds.sq_norm, expected, rtol=1e-12)
    assert json.loads(r.runs.callbacks[0]) == ["recorder"] and json.loads(r.runs.metrics[0]) == ["sq_norm"]


def test_a_callback_stops_the_run_after_its_round_recorded_as_stopped(tmp_path):
    stop = Recorder(stop_at=7)
    r = fedharness.run(["dataset=quadratic", "rounds=20", "eval_every=5", f"results_dir={tmp_path}"],
                       callbacks=[stop], progress=False)
    run = r.runs.iloc[0]
    assert (r.status, run.status, run.rounds_done, run.error) == ("stopped", "stopped", 7, "stopped by a callback")
    assert stop.ends == list(range(1, 8))
    assert sorted(r.rounds["round"].unique()) == [0, 5, 7]  # the stopping round is evaluated, so it is recorded
    assert sorted(stop.evaluations) == [5, 7]


def test_bad_callbacks_and_metric_names_are_one_line_errors(tmp_path):
    with pytest.raises(fedharness.ConfigError, match=r"'callbacks'.*lacks on_round_end, on_evaluation"):
        fedharness.run(["dataset=quadratic", "rounds=2", f"results_dir={tmp_path}"], callbacks=[object()],
                       progress=False)
    with pytest.raises(fedharness.ConfigError, match=r"'metric': 'test_acc' \(a column of the rounds/ table"):
        fedharness.register_metric("test_acc", lambda w, s: w.sum(1))
    with pytest.raises(fedharness.ConfigError, match=r"'metrics': \['nope'\].*registered: none yet"):
        fedharness.run(["dataset=quadratic", "rounds=2", "metrics=[nope]", f"results_dir={tmp_path}"])
    assert not (tmp_path / "runs").exists()


def test_a_user_metric_is_a_tuning_objective(tmp_path):
    """Each trial's value is its run's final sq_norm (mean over replicas), maximized as registered."""
    fedharness.register_metric("sq_norm", lambda w, s: (w.double() ** 2).sum(1), maximize=True)
    study = fedharness.tune(["tune=quadratic_lr", "tune.n_trials=3", "tune.plots=false", "tune.budget.total=30",
                             "tune.objective.metric=sq_norm", "tune.sampler.name=random", f"results_dir={tmp_path}"])
    rounds = pd.read_parquet(tmp_path / "rounds")
    runs = pd.read_parquet(tmp_path / "runs")
    final = rounds[rounds["round"] == rounds.groupby("run_id")["round"].transform("max")]
    by_trial = final.merge(runs[["run_id", "trial"]], on="run_id").groupby("trial").sq_norm.mean()
    values = study.trials.set_index("trial").value
    np.testing.assert_allclose(values.loc[by_trial.index], by_trial, rtol=1e-12)
    assert study.best_value == pytest.approx(by_trial.max(), rel=1e-12)


def test_the_reserved_metric_names_are_the_rounds_table_columns():
    from fedharness.contracts import ROUND_COLUMNS
    from fedharness.sinks.parquet import ROUND_SCHEMA

    assert set(ROUND_COLUMNS) == {"run_id", *ROUND_SCHEMA.names}
