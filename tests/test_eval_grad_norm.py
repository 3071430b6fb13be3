"""eval.grad_norm: a run that skips the full gradient records grad_norm_sq as null and every other value with the
same bits; tuning trials skip it unless their objective is grad_norm_sq or the overrides ask for it; a bad value is
refused in one line naming the key."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from fedharness import cli
from fedharness.problems.data import DataProblem
from fedharness.problems.objectives import NetObjective
from fedharness.studies.tuning.spec import build_spec, trial_config

SMALL_RUN = ["run", "progress=false", "rounds=4", "eval_every=2", "replicas=2", "dataset.num_clients=10"]
VARYING = ("run_id", "wall_s")  # a run's own id and its timings


def _run(results, *overrides: str) -> tuple[pd.DataFrame, dict]:
    assert cli.main([*SMALL_RUN, f"results_dir={results}", *overrides]) == 0
    rounds = pd.read_parquet(results / "rounds").sort_values(["replica", "round"]).reset_index(drop=True)
    (config,) = pd.read_parquet(results / "runs").config_json
    return rounds, json.loads(config)


def test_a_run_without_the_gradient_norm_records_every_other_value_the_same(tmp_path):
    on, on_config = _run(tmp_path / "on")
    off, off_config = _run(tmp_path / "off", "eval.grad_norm=false")
    assert on_config["eval"]["grad_norm"] is True and off_config["eval"]["grad_norm"] is False
    assert len(on) == len(off) == 2 * 3  # two replicas, rounds 0, 2, 4
    assert off.grad_norm_sq.isna().all() and (on.grad_norm_sq > 0).all()
    assert on.test_loss.notna().all() and on.subopt.notna().all()  # the columns compared below hold values
    columns = [c for c in on.columns if c not in (*VARYING, "grad_norm_sq")]
    pd.testing.assert_frame_equal(on[columns], off[columns], check_exact=True, check_categorical=False)


def _tiny_net_problem() -> DataProblem:
    """A two-layer net (the autograd path of evaluation, no closed form): 60 samples of 5 features, 3 classes."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(60, 5)), rng.integers(0, 3, 60)
    objective = NetObjective(net, "tiny", 0.01, (5,))
    return DataProblem(objective, x, y, np.array_split(np.arange(60), 3), x[:20], y[:20], batch_size=4)


def test_a_net_evaluated_without_the_gradient_keeps_its_loss_bit_for_bit():
    problem = _tiny_net_problem()
    w = problem.init_params(3, seed=1)
    full, alone = problem.evaluate(w), problem.evaluate(w, grad_norm=False)
    assert alone.grad_norm_sq is None and (full.grad_norm_sq > 0).all()
    for name in ("train_loss", "test_loss", "test_acc"):
        np.testing.assert_array_equal(getattr(alone, name), getattr(full, name))


QUADRATIC_STUDY = ["tune", "tune=quadratic_lr", "tune.n_trials=2", "tune.batch=2", "tune.budget.total=4",
                   "tune.reports=2", "tune.plots=false"]


def test_trials_skip_the_gradient_norm_unless_something_reads_it():
    def trial_grad_norm(*overrides: str) -> bool:
        cfg, run_overrides = trial_config(build_spec(["tune=quadratic_lr", *overrides], probe=False),
                                          {"client_lr": 0.01})
        assert not any(o.startswith("eval.grad_norm=false") for o in run_overrides)  # a re-run records it
        return cfg["eval"]["grad_norm"]

    assert trial_grad_norm() is False
    assert trial_grad_norm("tune.objective.metric=grad_norm_sq") is True
    assert trial_grad_norm("eval.grad_norm=true") is True  # the run overrides (tune.base's come first in them)
    assert trial_grad_norm("tune.base=['dataset=quadratic','eval.grad_norm=true']") is True


@pytest.mark.parametrize("metric,recorded", [("grad_norm_sq", True), ("train_loss", False)])
def test_a_study_records_the_gradient_norm_where_its_objective_is_the_gradient_norm(tmp_path, metric, recorded):
    assert cli.main([*QUADRATIC_STUDY, f"tune.objective.metric={metric}", f"results_dir={tmp_path}"]) == 0
    trials = pd.read_parquet(tmp_path / "trials")
    rounds = pd.read_parquet(tmp_path / "rounds")
    assert len(trials) == 2 and trials.state.eq("COMPLETE").all() and len(rounds) == 2 * 3  # rounds 0, 2, 4
    assert rounds.grad_norm_sq.notna().all() if recorded else rounds.grad_norm_sq.isna().all()
    final = rounds[rounds["round"] == rounds["round"].max()].set_index("run_id")[metric]
    np.testing.assert_array_equal(np.sort(trials.value.to_numpy()), np.sort(final.to_numpy()))


def test_a_bad_value_is_one_line_naming_the_key_and_nothing_is_written(tmp_path, capsys):
    results = tmp_path / "results"
    assert cli.main(["run", f"results_dir={results}", "progress=false", "eval.grad_norm=maybe"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'eval.grad_norm': 'maybe'" in err[0] and "true or false" in err[0], err
    assert not results.exists()


class _OldStyleProblem:
    """A user's own Problem written before eval.grad_norm: its evaluate takes the models only."""

    def __init__(self, problem):
        self._problem = problem

    def __getattr__(self, name):
        return getattr(self._problem, name)

    def evaluate(self, w):
        return self._problem.evaluate(w)


def test_a_users_problem_whose_evaluate_takes_no_grad_norm_still_runs_with_it_off():
    """eval.grad_norm=false (a tuning trial's default) must not break a Problem without the argument: its
    evaluations compute grad_norm_sq as before; a built-in problem skips it."""
    from dataclasses import replace

    from fedharness.config.load import load_settings
    from fedharness.core.executors import InlineExecutor
    from fedharness.runs.execute import build_engine, prepare_run

    settings = load_settings(["rounds=2", "dataset.num_clients=10", "eval.grad_norm=false", "progress=false"])
    run = prepare_run(settings)
    builtin = build_engine(run, InlineExecutor(run.problem, run.algorithm.solver))
    old = replace(run, problem=_OldStyleProblem(run.problem))
    engine = build_engine(old, InlineExecutor(old.problem, old.algorithm.solver))
    state = engine.initial_state()
    (row,) = engine.evaluate(state)
    (skipped,) = builtin.evaluate(builtin.initial_state())
    assert row["grad_norm_sq"] > 0 and skipped["grad_norm_sq"] is None
    assert row["train_loss"] == skipped["train_loss"]
