"""A batch of trials' storage writes (harness/studies/tuning/batch_writes.py): its trials created with their
heartbeats in one transaction, their settings attrs in one, their COMPLETE outcomes in one, whatever the batch's
size; every trial RUNNING with its heartbeat before the batch trains; a trial declared lost while it ran not
written; a NaN told FAIL as study.tell tells it; an interrupted batch leaves none of its trials RUNNING."""

from __future__ import annotations

import os
import threading
import uuid

import optuna
import pandas as pd
import pytest
import sqlalchemy
from optuna.trial import TrialState

from fedharness import cli
from fedharness.studies.tuning import batched_trials, storage
from fedharness.studies.tuning.batch_writes import Completions, create_trials
from tuner_support import paced_tuners

QUAD = ["tune=default", "dataset=quadratic", "algorithm.clients_per_round=4", "dtype=float32",
        "tune.sampler.name=random", "tune.budget.total=20", "tune.space.local_steps.high=4", "tune.plots=false"]
STUDY = "default-fedavg"
PG_URL = os.environ.get("FEDHARNESS_TEST_PG_URL")
OWN_TABLES = ("trials", "trial_user_attributes", "trial_values", "trial_intermediate_values")  # not trial_params


def _writes(statement: str) -> bool:
    """Does `statement` write a trial's row, its attrs, value or reports (the sampler's trial_params aside)?"""
    words = statement.split()
    verb = words[0].upper()
    table = words[2] if verb in ("INSERT", "DELETE") else words[1] if verb == "UPDATE" else ""
    return table.strip('"') in OWN_TABLES


def _count_write_transactions(monkeypatch) -> list[int]:
    """Per run_batch call: how many committed transactions of this thread wrote to OWN_TABLES."""
    per_batch, wrote, counting = [], [False], threading.get_ident()

    def on_statement(conn, cursor, statement, *args) -> None:
        if threading.get_ident() == counting and _writes(statement):
            wrote[0] = True

    def on_commit(conn) -> None:
        if threading.get_ident() == counting and wrote[0] and per_batch:
            per_batch[-1] += 1
        wrote[0] = False

    real_open = storage.open_storage

    def open_storage(spec, *args):
        store = real_open(spec, *args)
        sqlalchemy.event.listen(store.engine, "before_cursor_execute", on_statement)
        sqlalchemy.event.listen(store.engine, "commit", on_commit)
        return store

    real_batch = batched_trials.run_batch

    def run_batch(*args, **kwargs):
        per_batch.append(0)
        return real_batch(*args, **kwargs)

    monkeypatch.setattr(storage, "open_storage", open_storage)
    monkeypatch.setattr(batched_trials, "run_batch", run_batch)
    monkeypatch.setattr("fedharness.studies.tuning.workers.run_batch", run_batch)
    return per_batch


@pytest.mark.parametrize("batch", [4, 8])
def test_a_batch_writes_its_trials_in_three_transactions_whatever_its_size(tmp_path, monkeypatch, batch):
    """Create (with heartbeats), settings attrs, outcomes: 3 transactions a batch; Optuna's calls made 3 a trial
    and more (ask, heartbeat, each attr, tell). Two batches, each of `batch` trials."""
    per_batch = _count_write_transactions(monkeypatch)
    assert cli.main(["tune", *QUAD, f"tune.n_trials={2 * batch}", f"tune.batch={batch}",
                     f"results_dir={tmp_path}"]) == 0
    assert per_batch == [3, 3]
    trials = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{tmp_path}/optuna.db").get_trials()
    assert [t.number for t in trials] == list(range(2 * batch))
    assert all(t.state == TrialState.COMPLETE and t.value is not None for t in trials)
    assert all({"heartbeat_at", "run_id", "rounds", "overrides", "worker", "status", "budget_used", "batch_id"}
               <= set(t.user_attrs) for t in trials)


def test_every_trial_of_a_batch_is_running_with_its_heartbeat_and_settings_before_it_trains(tmp_path, monkeypatch):
    """What another worker (or a resumed study) reads from the storage once the batch's training has started."""
    seen = []
    real = batched_trials.execute_runs

    def execute_runs(slots, **kwargs):
        stored = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{tmp_path}/optuna.db").get_trials()
        seen.append([(t.number, t.state, sorted(t.user_attrs)) for t in stored])
        return real(slots, **kwargs)

    monkeypatch.setattr(batched_trials, "execute_runs", execute_runs)
    assert cli.main(["tune", *QUAD, "tune.n_trials=5", "tune.batch=5", f"results_dir={tmp_path}"]) == 0
    attrs = sorted(["heartbeat_at", "overrides", "rounds", "run_id", "worker"])
    assert len(seen) >= 1 and seen[0] == [(n, TrialState.RUNNING, attrs) for n in range(5)]


def _study(tmp_path):
    return optuna.create_study(study_name="s", storage=f"sqlite:///{tmp_path}/s.db",
                               sampler=optuna.samplers.RandomSampler(seed=0))


def test_created_trials_are_numbered_after_the_study_and_a_journal_gets_none(tmp_path):
    study = _study(tmp_path)
    study.ask()  # trial 0, by Optuna
    created = create_trials(study, 3, 12.5)
    assert [t.number for t in created] == [1, 2, 3]
    stored = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/s.db").get_trials()
    assert [(t.number, t.state, t.user_attrs) for t in stored[1:]] == \
        [(n, TrialState.RUNNING, {"heartbeat_at": 12.5}) for n in (1, 2, 3)]
    assert [t.datetime_start for t in stored[1:]] == [t.datetime_start for t in created]
    trial = optuna.Trial(study, created[1]._trial_id)  # the cache holds it: it takes parameters
    assert trial.suggest_int("k", 1, 1) == 1 and study.trials[2].params == {"k": 1}
    journal = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(f"{tmp_path}/j.log"))
    assert create_trials(optuna.create_study(storage=journal), 2, 1.0) is None


def test_a_trial_declared_lost_is_not_written_and_the_others_are(tmp_path):
    study = _study(tmp_path)
    trials = [study.ask() for _ in range(3)]
    study.tell(1, state=TrialState.FAIL)  # what reap_lost does to a trial whose heartbeat stopped
    completions = Completions(study)
    for i, trial in enumerate(trials):
        completions.add(trial, 0.5 + i, {"status": "ok", "n": i}, {1: 2.0 + i, 2: 1.0 + i})
    assert completions.commit() == {1}
    stored = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/s.db").get_trials()
    assert [(t.state, t.value, t.user_attrs, t.intermediate_values) for t in stored] == [
        (TrialState.COMPLETE, 0.5, {"status": "ok", "n": 0}, {1: 2.0, 2: 1.0}),
        (TrialState.FAIL, None, {}, {}),
        (TrialState.COMPLETE, 2.5, {"status": "ok", "n": 2}, {1: 4.0, 2: 3.0})]
    assert all(t.datetime_complete >= t.datetime_start for t in stored)


def test_a_nan_is_told_fail_at_once_and_a_number_waits_for_the_commit(tmp_path):
    study = _study(tmp_path)
    nan, number = study.ask(), study.ask()
    completions = Completions(study)
    with pytest.warns(UserWarning):
        completions.add(nan, float("nan"), {"status": "ok"}, None)
    completions.add(number, 0.25, {"status": "ok"}, None)
    states = [t.state for t in optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/s.db").trials]
    assert states == [TrialState.FAIL, TrialState.RUNNING]
    assert completions.commit() == set()
    stored = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/s.db").trials
    assert (stored[1].state, stored[1].value) == (TrialState.COMPLETE, 0.25)


def test_a_batch_that_fails_while_sampling_leaves_none_of_its_trials_running(tmp_path, monkeypatch):
    """The third trial's sampling raises: the three claimed (status failed) and the two created but not started
    are all FAIL; the settings of the two sampled were written."""
    real, calls = batched_trials.trial_settings, []

    def trial_settings(spec, trial):
        calls.append(trial.number)
        if len(calls) == 3:
            raise RuntimeError("sampling broke")
        return real(spec, trial)

    monkeypatch.setattr(batched_trials, "trial_settings", trial_settings)
    with pytest.raises(RuntimeError, match="sampling broke"):
        cli.main(["tune", *QUAD, "tune.n_trials=5", "tune.batch=5", f"results_dir={tmp_path}"])
    trials = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{tmp_path}/optuna.db").get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL] * 5
    assert [t.user_attrs.get("status") for t in trials] == ["failed"] * 3 + [None] * 2
    assert ["run_id" in t.user_attrs for t in trials] == [True, True, False, False, False]


def test_a_database_whose_schema_is_not_optunas_head_is_refused(tmp_path):
    """The head revision is read once per process, the stored one at each open: a mismatch gets Optuna's check."""
    from fedharness.studies.tuning.spec import build_spec

    spec = build_spec([*QUAD, f"results_dir={tmp_path}"], probe=False)
    tmp_path.mkdir(exist_ok=True)
    storage.open_storage(spec)
    engine = sqlalchemy.create_engine(spec.storage)
    with engine.begin() as conn:
        conn.execute(sqlalchemy.text("UPDATE alembic_version SET version_num = 'v3.0.0.a'"))
    engine.dispose()
    with pytest.raises(RuntimeError, match="no longer compatible"):
        storage.open_storage(spec)


@pytest.mark.skipif(not PG_URL, reason="needs a PostgreSQL server: FEDHARNESS_TEST_PG_URL (.ci/postgres.sh)")
def test_two_batched_tuners_on_one_postgresql_study(tmp_path):
    """Exactly n_trials COMPLETE, each trained once; the trials past n_trials are surplus and never ran."""
    study, n = f"pgb-{uuid.uuid4().hex[:8]}", 10
    args = [*QUAD, f"results_dir={tmp_path}", f"tune.study={study}", f"tune.n_trials={n}", "tune.batch=3",
            f"tune.storage={PG_URL}"]
    # their batches train long enough to overlap, so that their trials are created side by side
    procs = paced_tuners([[*args, f"tune.worker_id={w}"] for w in (0, 1)], tmp_path / "barrier",
                         "fedharness.studies.tuning.batched_trials:execute_runs")
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all(o.count(f"[{study}] trial ") >= 1 for o in outs), outs  # both processes told trials
    trials = optuna.load_study(study_name=study, storage=PG_URL).get_trials()
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == n
    assert all(t.user_attrs.get("status") == "surplus" for t in trials if t.state != TrialState.COMPLETE)
    runs = pd.read_parquet(tmp_path / "runs")
    assert sorted(runs.trial) == sorted(t.number for t in complete) and runs.status.eq("ok").all()


@pytest.mark.parametrize("reports", [None, {1: 0.5}])
def test_writing_a_trial_declared_lost_raises_and_writes_nothing(tmp_path, reports):
    """write_trial (one trial's attrs, and its reports) on a trial another worker has finished: Optuna's
    UpdateFinishedTrialError, as trial.set_user_attr gives, and none of its rows written."""
    url = f"sqlite:///{tmp_path}/lost.db"
    study = optuna.create_study(study_name="lost", storage=url)
    trial = study.ask()
    optuna.load_study(study_name="lost", storage=url).tell(trial.number, state=TrialState.FAIL)  # reaped elsewhere
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        storage.write_trial(trial, {"status": "ok"}, reports)
    [stored] = optuna.load_study(study_name="lost", storage=url).get_trials()
    assert "status" not in stored.user_attrs and stored.intermediate_values == {}
