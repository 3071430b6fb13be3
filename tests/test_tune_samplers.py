"""Samplers that use a batch well (issue 26): TPE's start-up trials form the first batch and its later batches are
model-based proposals (pending trials as constant liars); CMA-ES runs a batch as one generation; a batch never
exceeds the study's trials."""

from __future__ import annotations

import dataclasses

import optuna
import pytest

from fedharness import cli
from fedharness.studies.tuning.optuna_parts import ask_trial, make_sampler, next_batch_size
from fedharness.studies.tuning.spec import build_spec

# client_lr x E on a noisy quadratic, a budget of 40 local steps: a 20-trial study takes seconds
NOISY = ["tune=default", "dataset=quadratic", "dataset.noise=0.5", "algorithm.clients_per_round=4", "dtype=float32",
         "tune.budget.total=40", "tune.space.local_steps.high=4", "tune.plots=false"]


def _trials(results, study: str = "default-fedavg") -> list:
    return optuna.load_study(study_name=study, storage=f"sqlite:///{results}/optuna.db").get_trials()


def _random_proposal(spec, number: int) -> dict:
    """What the random sampler with the study's seed proposes for trial `number` (it reads no other trial)."""
    study = optuna.create_study(sampler=make_sampler(dataclasses.replace(spec, sampler="random"), 0, number))
    trial = study.ask()
    return {p.name: p.suggest(trial) for p in spec.params}


def test_batched_tpe_proposes_from_its_model_after_the_startup_trials(tmp_path):
    """Default TPE, tune.batch=16, 20 trials: the 10 start-up trials are one batch (the random sampler's points);
    the next 10 are one batch asked after those finished, none of them the random sampler's point. Before issue 26
    the first batch held 16 trials, all of them the random sampler's."""
    args = [*NOISY, "tune.n_trials=20", "tune.batch=16", f"results_dir={tmp_path}"]
    assert cli.main(["tune", *args]) == 0
    spec = build_spec(args, probe=False)
    trials = _trials(tmp_path)
    assert [t.state.name for t in trials] == ["COMPLETE"] * 20
    startup, model = trials[:10], trials[10:]
    assert all(t.params == _random_proposal(spec, t.number) for t in startup)
    assert all(t.params != _random_proposal(spec, t.number) for t in model)
    assert max(t.datetime_complete for t in startup) <= min(t.datetime_start for t in model)
    assert len({t.user_attrs["batch_id"] for t in startup}) == 1 and len({t.user_attrs["batch_id"] for t in model}) == 1
    assert len({(t.params["client_lr"], t.params["local_steps"]) for t in model}) == 10  # constant liar: spread out


def test_a_batched_cmaes_study_runs_each_batch_as_one_generation(tmp_path):
    """tune.batch=4 after 4 start-up trials: trials 4-7 are CMA-ES generation 0, trials 8-11 generation 1."""
    args = [*NOISY, "tune.sampler.name=cmaes", "tune.sampler.startup_trials=4", "tune.n_trials=12", "tune.batch=4",
            f"results_dir={tmp_path}"]
    assert make_sampler(build_spec(args, probe=False), 0)._popsize == 4
    assert cli.main(["tune", *args]) == 0
    generations = [t.system_attrs.get("cma:generation") for t in _trials(tmp_path)]
    assert generations == [None] * 4 + [0] * 4 + [1] * 4


@pytest.mark.parametrize("sampler, finished, live, size", [
    ("tpe", 0, 0, 10),      # the first batch: the start-up trials
    ("tpe", 3, 10, 0),      # start-up trials still running (another worker's): wait for them
    ("tpe", 4, 6, 4),       # two start-up trials failed: they are asked again, alone
    ("tpe", 10, 10, 16),    # model-based from here on
    ("tpe", 10, 30, 10),    # no more than the study lacks
    ("cmaes", 0, 0, 10),
    ("random", 0, 0, 16),   # no model: every batch is full
    ("grid", 0, 0, 16),
])
def test_the_next_batch_holds_start_up_trials_only_until_they_finished(sampler, finished, live, size):
    spec = dataclasses.replace(build_spec([*NOISY, "tune.n_trials=40", "tune.batch=16"], probe=False), sampler=sampler)
    assert next_batch_size(spec, finished, live) == size


def test_a_batch_larger_than_the_trials_is_refused_in_one_line(tmp_path, capsys):
    assert cli.main(["tune", *NOISY, "tune.n_trials=8", "tune.batch=16", f"results_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tune.batch" in err and "tune.n_trials" in err


def _value_at(trial, rung: int) -> float:
    return trial.intermediate_values[min(step for step in trial.intermediate_values if step >= rung)]


def test_batch_native_hyperband_ranks_each_rung_of_a_batch_together(tmp_path):
    """tune.batch=9, reduction factor 3, reports 10: the first batch is bracket 0 (rungs at 1, 3 and 9 reports: 9 ->
    3 -> 1 trials), the second bracket 1 (rungs 3 and 9: 9 -> 3 -> 1). At each rung the trials that go on are the
    best third of those that reached it, ranked on their values there; the others are pruned in the batched run,
    unless they spent their whole budget before the whole rung had reported (a slot with a larger E runs fewer
    rounds: then it is complete)."""
    args = [*NOISY, "tune.sampler.name=random", "tune.pruner.name=hyperband", "tune.n_trials=18", "tune.batch=9",
            f"results_dir={tmp_path}"]
    assert cli.main(["tune", *args]) == 0
    trials = _trials(tmp_path)
    for bracket, rungs in ((trials[:9], (1, 3, 9)), (trials[9:], (3, 9))):
        assert len({t.user_attrs["batch_id"] for t in bracket}) == 1
        entrants = bracket
        for rung in rungs:
            ranked = sorted(entrants, key=lambda t: (_value_at(t, rung), t.number))
            kept, out = ranked[:max(1, len(ranked) // 3)], ranked[max(1, len(ranked) // 3):]
            for t in out:
                finished_first = t.state.name == "COMPLETE" and max(t.intermediate_values) == 10
                assert finished_first or (t.state.name == "PRUNED" and max(t.intermediate_values) >= rung), rung
            entrants = kept
        assert [t.state.name for t in entrants] == ["COMPLETE"]
    assert sum(t.state.name == "PRUNED" for t in trials) >= 10


@pytest.mark.parametrize("override, key", [("tune.batch=2", "tune.pruner.name"),
                                           ("tune.pruner.min_resource=10", "tune.pruner.min_resource")])
def test_hyperband_without_a_batch_to_rank_is_refused_in_one_line(tmp_path, capsys, override, key):
    args = [*NOISY, "tune.pruner.name=hyperband", "tune.batch=9", override, f"results_dir={tmp_path}"]
    assert cli.main(["tune", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err


def test_tpe_treats_a_running_trial_as_a_constant_liar():
    """Trial 11's proposal after 10 finished trials, with trial 10 still running against trial 10 failed (TPE
    ignores a failed trial): the running trial, counted as the worst value seen, moves the proposal. Without the
    constant liar both proposals would be the same (the same seed: trial 11's, the same finished trials)."""
    spec = build_spec([*NOISY, "tune.n_trials=20"], probe=False)
    assert spec.sampler == "tpe" and spec.startup_trials == 10 and spec.objective.direction == "minimize"

    def next_proposal(trial_10: str) -> dict:
        study = optuna.create_study(direction="minimize")
        for k in range(10):  # finished: the value grows with the distance from client_lr = 0.1, local_steps = 2
            study.enqueue_trial({"client_lr": 10.0 ** (-3 + k / 3), "local_steps": 1 + k % 4})
            trial = study.ask()
            params = {p.name: p.suggest(trial) for p in spec.params}
            study.tell(trial, abs(k / 3 - 2) + abs(params["local_steps"] - 2))
        running = ask_trial(spec, study, 0, queued=False)  # trial 10: a point of the region the model favours
        assert running.number == 10
        {p.name: p.suggest(running) for p in spec.params}
        if trial_10 == "failed":
            study.tell(running, state=optuna.trial.TrialState.FAIL)
        trial = ask_trial(spec, study, 0, queued=False)
        assert trial.number == 11
        return {p.name: p.suggest(trial) for p in spec.params}

    assert next_proposal("running") != next_proposal("failed")
