"""Storages: exactly n_trials finished trials (SQLite, journal file, two processes on PostgreSQL),
continuing a study by name, and resuming one whose process was killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import optuna
import pandas as pd
import pytest
import sqlalchemy

from fedharness import cli
from fedharness.studies.tuning.optuna_parts import open_study
from fedharness.studies.tuning.spec import build_spec
from fedharness.studies.tuning.storage import check_reachable
from fedharness.studies.tuning.workers import _run_one, work
from tuner_support import paced_tuners

PG_URL = os.environ.get("FEDHARNESS_TEST_PG_URL")
# a small space below 2 / lambda_max, so every trial converges and has a finite value
QUICK = ["tune=quadratic_lr", "tune.space.client_lr.high=0.02", "tune.plots=false", "tune.sampler.name=random"]




def _trials(storage: str, study: str) -> list:
    return optuna.load_study(study_name=study, storage=storage).get_trials(deepcopy=False)


def _states(trials) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in trials:
        out[t.state.name] = out.get(t.state.name, 0) + 1
    return out


def _runs(results) -> pd.DataFrame:
    return pd.read_parquet(results / "runs").assign(run_id=lambda d: d.run_id.astype(str))


def _tuner(args: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "fedharness.cli", "tune", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def test_sqlite_one_process_runs_exactly_n_trials_and_a_rerun_continues(tmp_path):
    args = [*QUICK, f"results_dir={tmp_path}", "tune.study=s", "tune.n_trials=5"]
    assert cli.main(["tune", *args]) == 0
    storage = f"sqlite:///{tmp_path}/optuna.db"
    first = {t.number: (t.value, t.params) for t in _trials(storage, "s")}
    assert sorted(first) == [0, 1, 2, 3, 4]
    assert _states(_trials(storage, "s")) == {"COMPLETE": 5}
    runs = _runs(tmp_path)
    assert sorted(runs.trial) == [0, 1, 2, 3, 4] and runs.status.eq("ok").all() and runs.study.eq("s").all()

    assert cli.main(["tune", *args[:-1], "tune.n_trials=7"]) == 0  # same name: continues to 7
    after = _trials(storage, "s")
    assert _states(after) == {"COMPLETE": 7}
    assert {t.number: (t.value, t.params) for t in after if t.number < 5} == first
    assert len({t.params["client_lr"] for t in after}) == 7  # continuing does not replay earlier proposals

    assert cli.main(["tune", *args[:-1], "tune.n_trials=7"]) == 0  # already there: nothing more runs
    assert len(_trials(storage, "s")) == 7 and len(_runs(tmp_path)) == 7
    table = pd.read_parquet(tmp_path / "trials")
    assert sorted(table.trial) == list(range(7)) and table.status.eq("ok").all()


def test_journal_file_storage(tmp_path):
    journal = tmp_path / "study.log"
    assert cli.main(["tune", *QUICK, f"results_dir={tmp_path}", "tune.n_trials=3",
                     f"tune.storage=journal:{journal}"]) == 0
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    assert _states(_trials(storage, "quadratic_lr-fedavg")) == {"COMPLETE": 3}
    assert not (tmp_path / "optuna.db").exists()


def test_a_trial_claimed_past_n_trials_is_surplus_and_never_runs(tmp_path):
    """The claim rule, with the race made deterministic: another worker asks for a trial between
    our count and our ask, so the one we are handed is number n_trials; it must not run."""
    spec = build_spec([*QUICK, f"results_dir={tmp_path}", "tune.n_trials=2"])
    check_reachable(spec)
    study = open_study(spec, create=True)
    assert _run_one(spec, study, 0, 0) == 1  # trial 0 runs
    other = study.ask()  # trial 1: "another worker" holds it, heartbeat fresh
    other.set_user_attr("heartbeat_at", time.time())
    assert _run_one(spec, study, 0, 2) == 0  # trial 2 comes after n_trials live ones: surplus
    surplus = study.trials[2]
    assert surplus.state.name == "FAIL" and surplus.user_attrs["status"] == "surplus"
    assert "run_id" not in surplus.user_attrs and len(_runs(tmp_path)) == 1  # it never ran
    study.tell(other, 1.0)
    assert work(spec) == 0  # the study is full: nothing more runs
    assert _states(study.trials) == {"COMPLETE": 2, "FAIL": 1}


@pytest.mark.timeout(120)  # without the reaping, work() would wait for the dead trial forever
def test_a_trial_whose_worker_stopped_beating_is_failed_and_run_again(tmp_path):
    spec = build_spec([*QUICK, f"results_dir={tmp_path}", "tune.n_trials=1", "tune.heartbeat_s=1"])
    check_reachable(spec)
    study = open_study(spec, create=True)
    dead = study.ask()  # a worker that died: its last heartbeat is old
    dead.set_user_attr("heartbeat_at", time.time() - 60)
    assert work(spec) == 1
    trials = study.get_trials()
    assert [(t.number, t.state.name) for t in trials] == [(0, "FAIL"), (1, "COMPLETE")]
    assert pd.read_parquet(tmp_path / "runs").trial.tolist() == [1]


@pytest.mark.skipif(not PG_URL, reason="FEDHARNESS_TEST_PG_URL is not set (.ci/run starts a PostgreSQL "
                                       "server on 127.0.0.1 and sets it)")
def test_two_concurrent_tuners_on_one_postgresql_study(tmp_path):
    study, n = f"pg-{uuid.uuid4().hex[:8]}", 8
    args = [*QUICK, f"results_dir={tmp_path}", f"tune.study={study}", f"tune.n_trials={n}", f"tune.storage={PG_URL}"]
    procs = paced_tuners([[*args, f"tune.worker_id={w}"] for w in (0, 1)], tmp_path / "barrier",
                         "fedharness.studies.tuning.workers:run_trial")
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    ran = [o.count(f"[{study}] trial ") for o in outs]
    assert all(r >= 1 for r in ran), outs  # both processes did work

    trials = _trials(PG_URL, study)
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(complete) == n
    assert sorted(t.number for t in complete) == list(range(n))  # none lost, none duplicated
    assert all(t.user_attrs.get("status") == "surplus" for t in trials if t.state.name != "COMPLETE")
    runs = _runs(tmp_path)
    assert sorted(runs.trial) == list(range(n)) and runs.status.eq("ok").all()  # each trial ran exactly once
    assert set(runs.run_id) == {t.user_attrs["run_id"] for t in complete}


@pytest.mark.slow
def test_study_resumed_after_sigkill_keeps_its_finished_trials(tmp_path):
    storage = f"sqlite:///{tmp_path}/optuna.db"
    args = [*QUICK, f"results_dir={tmp_path}", "tune.study=k", "tune.n_trials=6", "tune.budget.total=1500",
            "tune.heartbeat_s=1"]
    proc = _tuner(args)
    deadline = time.time() + 240
    done: dict = {}
    while time.time() < deadline and proc.poll() is None:
        if (tmp_path / "optuna.db").exists():
            try:
                done = {t.number: (t.value, t.params) for t in _trials(storage, "k") if t.state.name == "COMPLETE"}
            except (KeyError, sqlalchemy.exc.SQLAlchemyError):  # the tuner is creating the tables or the study
                done = {}
        if len(done) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None and len(done) >= 2, "the tuner finished or stalled before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = _trials(storage, "k")
    done = {t.number: (t.value, t.params) for t in killed if t.state.name == "COMPLETE"}
    assert len(done) < 6

    assert cli.main(["tune", *args]) == 0
    trials = _trials(storage, "k")
    complete = {t.number: (t.value, t.params) for t in trials if t.state.name == "COMPLETE"}
    assert len(complete) == 6
    assert {k: complete[k] for k in done} == done  # the finished trials are kept as they were
    lost = [t for t in trials if t.state.name == "FAIL"]
    assert all(t.number not in done for t in lost)
    table = pd.read_parquet(tmp_path / "trials")
    assert set(table.status) <= {"ok", "lost"} and (table.status == "ok").sum() == 6
