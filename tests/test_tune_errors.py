"""Bad input: one clear message naming the key, exit status 2, and nothing created (no files, no study)."""

from __future__ import annotations

import optuna
import pytest

from fedharness import cli

BASE = ["tune=default", "dataset=quadratic", "tune.plots=false"]
CASES = {
    "low >= high": (["tune.space.client_lr.low=2.0"], "tune.space.client_lr.low"),
    "log scale from 0": (["tune.space.client_lr.low=0.0"], "tune.space.client_lr.low"),
    "unknown config key": (["tune.space.foo={key: algorithm.no_such_key, low: 0.1, high: 1.0}"],
                           "algorithm.no_such_key"),
    "unknown tune key": (["tune.n_trails=3"], "tune.n_trails"),
    "budget below one round": (["tune.budget.total=20"], "tune.budget.total"),  # local_steps reach 50
    "rounds set by hand": (["rounds=10"], "rounds"),
    "unknown sampler": (["tune.sampler.name=bayes"], "tune.sampler.name"),
    "unknown metric": (["tune.objective.metric=accuracy"], "tune.objective.metric"),
    "subopt without a reference": (["tune.objective.metric=subopt", "reference=off"], "tune.objective.metric"),
    "pruning a target": (["tune.objective.target=0.1", "tune.pruner.name=median"], "tune.pruner.name"),
    "grid without choices": (["tune.sampler.name=grid"], "tune.space.client_lr"),
    "bad value for a part": (["tune.space.local_steps.log=false", "tune.space.local_steps.low=0"],
                             "algorithm.local_steps"),
    "unreachable postgresql": (["tune.storage=postgresql://someone:secret@127.0.0.1:1/nodb"],
                               "tune.storage"),
    "sqlite in a missing folder": (["tune.storage=sqlite:////nonexistent-dir/x/optuna.db"], "tune.storage"),
    "not a storage URL": (["tune.storage=nonsense"], "tune.storage"),
    "journal in a missing folder": (["tune.storage=journal:/nonexistent-dir/x/j.log"], "tune.storage"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_one_message_exit_2_nothing_created(tmp_path, capsys, case):
    extra, key = CASES[case]
    results = tmp_path / "results"
    code = cli.main(["tune", *BASE, f"results_dir={results}", *extra])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedharness: error:") and f"'{key}'" in lines[0], err
    assert "secret" not in err  # a password in a storage URL is never echoed
    assert not results.exists()  # no result files, no SQLite study file


def test_bad_input_creates_no_study_in_an_existing_storage(tmp_path, capsys):
    """The storage is reachable and already holds a study; a bad space must not add another one."""
    storage = f"sqlite:///{tmp_path}/shared.db"
    optuna.create_study(study_name="other", storage=storage)
    code = cli.main(["tune", *BASE, f"results_dir={tmp_path / 'r'}", f"tune.storage={storage}",
                     "tune.space.client_lr.high=0.0001"])
    assert code == 2 and "tune.space.client_lr.low" in capsys.readouterr().err
    assert [s.study_name for s in optuna.get_all_study_summaries(storage)] == ["other"]


def test_continuing_a_study_with_another_budget_is_refused(tmp_path, capsys):
    args = ["tune=quadratic_lr", f"results_dir={tmp_path}", "tune.plots=false", "tune.n_trials=1"]
    assert cli.main(["tune", *args]) == 0
    assert cli.main(["tune", *args, "tune.budget.total=31"]) == 2
    assert "'tune.study'" in capsys.readouterr().err


def test_compare_with_an_unknown_algorithm(tmp_path, capsys):
    code = cli.main(["tune", "--compare", "fedavg,nosuchalg", *BASE, f"results_dir={tmp_path / 'r'}"])
    assert code == 2 and "'--compare'" in capsys.readouterr().err and not (tmp_path / "r").exists()
