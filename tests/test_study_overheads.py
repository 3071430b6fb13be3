"""What a study's trials no longer pay per trial, and that it changes nothing: a trial's config is its values set
into a copy of the study's composed base (plain dict, where it holds no interpolation); a finished trial's outcome
and value are one transaction (storage.tell_complete) instead of study.tell's read of the whole trial and commit."""

from __future__ import annotations

import optuna
import pytest
from omegaconf import OmegaConf
from optuna.trial import TrialState

from fedharness.config import compose as compose_module
from fedharness.config.compose import compose_values
from fedharness.config.load import load_config
from fedharness.studies.tuning.storage import tell_complete, write_trial

W1 = ["dataset.samples_per_client=200", "dataset.num_clients=100", "algorithm.clients_per_round=10"]  # benchmarks W1
VALUES = ["algorithm.client_lr=1e-05", "algorithm.local_steps=20", "seed=3"]


def test_values_on_a_base_without_interpolations_go_into_its_plain_dict(monkeypatch):
    """No OmegaConf update (nor a copy of the DictConfig) per trial; the config equals a full composition, types
    included (1 stays an int, 1e-05 a float)."""
    full = load_config([*W1, *VALUES])
    load_config(W1, values=["seed=4"])  # the study's base, composed once (through OmegaConf)
    monkeypatch.setattr(OmegaConf, "update", lambda *a, **k: pytest.fail("took the DictConfig path"))
    cfg = load_config(W1, values=VALUES)
    assert cfg == full and cfg["algorithm"]["local_steps"] == 20 and type(cfg["algorithm"]["client_lr"]) is float
    again = load_config(W1, values=["algorithm.client_lr=1", "algorithm.local_steps=2"])
    assert type(again["algorithm"]["client_lr"]) is int and again["algorithm"]["local_steps"] == 2
    assert load_config(W1, values=VALUES) == full  # the cached base was not changed by the trials before


def test_interpolations_take_the_omegaconf_path():
    """li_toy's rounds follow E through an interpolation: the plain dict cannot hold that, so it is not used."""
    assert compose_module._plain(tuple(compose_module.user_search_path() + ["experiment=li_toy"]), "config") is None
    assert load_config(["experiment=li_toy"], values=["algorithm.local_steps=7"])["rounds"] == 3000 // 7
    value = ["algorithm.server_lr=${algorithm.client_lr}"]  # a value that is an interpolation
    assert compose_values(W1, value) == compose_values([*W1, *value], [])
    assert compose_values(W1, value)["algorithm"]["server_lr"] == compose_values(W1, [])["algorithm"]["client_lr"]


def _told(storage: str, tell) -> optuna.trial.FrozenTrial:
    """A study with one trial (one param, one report, one attr), told by `tell`; the trial as the storage holds it."""
    study = optuna.create_study(study_name="s", storage=storage, sampler=optuna.samplers.RandomSampler(seed=0))
    trial = study.ask()
    trial.suggest_float("x", 0.0, 1.0)
    trial.set_user_attr("run_id", "r1")
    tell(study, trial)
    return optuna.load_study(study_name="s", storage=storage).trials[0]


def test_tell_complete_stores_what_write_trial_and_study_tell_store(tmp_path):
    """One transaction (storage.tell_complete) against Optuna's own calls: the same state, value, params, attrs and
    reports; without a read of the trial back (study.tell's storage.get_trial)."""
    attrs, reports = {"status": "ok", "budget_used": 400}, {1: 0.5, 2: 0.25}

    def optuna_calls(study, trial):
        write_trial(trial, attrs, reports)
        study.tell(trial, 0.125)

    def one_write(study, trial):
        reads = []
        real = study._storage.get_trial
        study._storage.get_trial = lambda trial_id: reads.append(trial_id) or real(trial_id)
        tell_complete(trial, 0.125, attrs, reports)
        assert reads == [] and trial.user_attrs == {"run_id": "r1", **attrs}

    a = _told(f"sqlite:///{tmp_path}/a.db", optuna_calls)
    b = _told(f"sqlite:///{tmp_path}/b.db", one_write)
    assert (b.state, b.value, b.params, b.user_attrs, b.intermediate_values) == \
        (a.state, a.value, a.params, a.user_attrs, a.intermediate_values) == \
        (TrialState.COMPLETE, 0.125, a.params, {"run_id": "r1", **attrs}, reports)
    assert b.datetime_complete is not None and b.datetime_complete >= b.datetime_start


def test_tell_complete_of_a_trial_declared_lost_writes_nothing(tmp_path):
    storage = f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(study_name="s", storage=storage)
    trial = study.ask()
    study.tell(trial.number, state=TrialState.FAIL)  # what reap_lost does to a trial whose heartbeat stopped
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        tell_complete(trial, 0.5, {"status": "ok"}, {1: 0.5})
    stored = optuna.load_study(study_name="s", storage=storage).trials[0]
    assert (stored.state, stored.value, stored.user_attrs, stored.intermediate_values) == (TrialState.FAIL, None,
                                                                                          {}, {})


def test_tell_complete_of_nan_fails_the_trial_as_study_tell_does(tmp_path):
    def nan(study, trial):
        with pytest.warns(UserWarning):
            tell_complete(trial, float("nan"), {"status": "ok"})

    stored = _told(f"sqlite:///{tmp_path}/s.db", nan)
    assert stored.state == TrialState.FAIL and stored.user_attrs == {"run_id": "r1", "status": "ok"}


def test_the_trials_table_is_built_column_by_column_as_from_pylist_builds_it(tmp_path):
    """trials/ without pandas (pa.Table.from_pylist imports it): the same table, nulls and a categorical included."""
    import pyarrow as pa

    from fedharness.studies.tuning.export import trial_rows, trials_table
    from fedharness.studies.tuning.spec import build_spec

    spec = build_spec(["tune=default", "dataset=quadratic", "tune.space.local_steps.high=4",
                       "+tune.space.momentum={type: categorical, choices: [0.0, 0.5, 'off'], key: algorithm.momentum}",
                       f"results_dir={tmp_path}"], probe=False)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for i in range(4):
        trial = study.ask()
        for p in spec.params:
            p.suggest(trial)
        trial.set_user_attr("budget_used", 40 + i)
        if i < 3:  # the last one stays RUNNING: no value, no end
            study.tell(trial, 0.5 + i)
    trials = study.get_trials()
    table = trials_table(spec, trials)
    rows = trial_rows(spec, trials)
    for r in rows:
        r["param_momentum"] = None if r["param_momentum"] is None else str(r["param_momentum"])
    expected = pa.Table.from_pylist([{f.name: r.get(f.name) for f in table.schema} for r in rows], schema=table.schema)
    assert table.equals(expected) and table.num_rows == 4 and table.column("value").null_count == 1
    assert set(table.column("param_momentum").to_pylist()) <= {"0.0", "0.5", "off"}


def test_adjacent_slots_with_alike_aggregators_get_one_call_and_each_its_own_coefficients():
    """FedAvg in slots 0-2, FedNova (steps) in 3-4, FedAvg again in 5: three calls; each slot's rows are exactly
    those of a call on its own rows (coefficients are row-wise)."""
    from types import SimpleNamespace

    import numpy as np

    from fedharness.algorithms.aggregators import NormalizedAverage, WeightedAverage
    from fedharness.contracts import WeightStats
    from fedharness.core.slots import SlotAggregator, SlotSet

    aggregators = [WeightedAverage(), WeightedAverage(), WeightedAverage(), NormalizedAverage(), NormalizedAverage(),
                   WeightedAverage()]
    replicas = np.array([2, 1, 3, 1, 2, 2])
    n = len(aggregators)
    slots = SlotSet(list(range(n)), [SimpleNamespace(aggregator=a) for a in aggregators], np.zeros(n, dtype=int),
                    replicas, np.full(n, 10), np.ones(n, dtype=np.int64), {})
    combined = SlotAggregator(slots)
    assert [(type(a).__name__, r.start, r.stop) for a, r in combined.runs] == \
        [("WeightedAverage", 0, 6), ("NormalizedAverage", 6, 9), ("WeightedAverage", 9, 11)]
    rng = np.random.default_rng(0)
    rows, k = int(replicas.sum()), 5
    q = rng.dirichlet(np.ones(k), size=rows)
    tau = rng.integers(1, 20, size=(rows, k)).astype(float)
    stats = WeightStats(tau * 0.05, tau * 0.0025, np.full((rows, k), 0.05), rng.uniform(0.5, 2, size=(rows, k)))
    got = combined.coefficients(q, stats, tau)
    for i, a in enumerate(aggregators):
        r = slots.rows(i)
        own = a.coefficients(q[r], WeightStats(stats.l1[r], stats.l2sq[r], stats.last[r], stats.scale[r]), tau[r])
        for name in ("coef", "tau_eff", "chi2", "slowdown"):
            assert np.array_equal(getattr(got, name)[r], getattr(own, name)), (i, name)


def test_a_study_in_one_process_opens_its_storage_once(tmp_path, monkeypatch):
    """The driver's study is its in-process worker's and its export's: one RDBStorage (Optuna checks its tables on
    each open, ~0.2 s), where there were three."""
    from fedharness import cli
    from fedharness.studies.tuning import storage

    opened = []
    real = storage.open_storage
    monkeypatch.setattr(storage, "open_storage", lambda spec, *a: opened.append(spec.storage) or real(spec, *a))
    assert cli.main(["tune", "tune=default", "dataset=quadratic", "algorithm.clients_per_round=4", "dtype=float32",
                     "tune.sampler.name=random", "tune.budget.total=20", "tune.space.local_steps.high=4",
                     "tune.plots=false", "tune.n_trials=2", f"results_dir={tmp_path}"]) == 0
    assert opened == [f"sqlite:///{tmp_path}/optuna.db"]
    trials = optuna.load_study(study_name="default-fedavg", storage=opened[0]).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    assert (tmp_path / "trials" / "study=default-fedavg" / "trials.parquet").exists()
