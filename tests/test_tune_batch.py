"""`tune.batch=B`: B trials asked at a time and trained as batched runs (harness/studies/tuning/batched_trials.py).

A batched random-sampler study proposes and records what the sequential one does; a pruned slot leaves its batch
at its report; a failed slot is recorded FAIL and its slot run again; the key is validated; runs group by config.
"""

from __future__ import annotations

import math
import os

import optuna
import pandas as pd
import pytest

from fedharness import cli
from fedharness.config.load import load_settings
from fedharness.studies.grouping import group_batches
from fedharness.studies.tuning import optuna_parts
from fedharness.studies.tuning.batched_trials import TrialFailed
from fedharness.studies.tuning.spec import build_spec
from fedharness.studies.tuning.trial import Reporter

# client_lr x E under a budget of local steps, so trials of one batch run different numbers of rounds
NOISY = ["tune=default", "dataset=quadratic", "dataset.noise=0.5", "algorithm.clients_per_round=4", "dtype=float32",
         "tune.sampler.name=random", "tune.budget.total=40", "tune.space.local_steps.high=4", "tune.plots=false"]


def _trials(results, study: str = "default-fedavg") -> list:
    return optuna.load_study(study_name=study, storage=f"sqlite:///{results}/optuna.db").get_trials()


def _runs(results) -> pd.DataFrame:
    return pd.read_parquet(results / "runs").assign(run_id=lambda d: d.run_id.astype(str))


@pytest.mark.slow
def test_batched_random_study_equals_the_sequential_one(tmp_path):
    """Same proposals, same values (float32: relative 1e-6), same rounds per trial; 7 trials in batches of 3."""
    seq, bat = tmp_path / "seq", tmp_path / "bat"
    assert cli.main(["tune", *NOISY, "tune.n_trials=7", f"results_dir={seq}"]) == 0
    assert cli.main(["tune", *NOISY, "tune.n_trials=7", "tune.batch=3", f"results_dir={bat}"]) == 0
    one, many = _trials(seq), _trials(bat)
    assert [t.number for t in many] == list(range(7)) and all(t.state.name == "COMPLETE" for t in many)
    assert len({t.params["local_steps"] for t in many}) > 1  # slots with different E (and rounds) batched
    for a, b in zip(one, many, strict=True):
        assert a.params == b.params
        assert a.user_attrs["rounds"] == b.user_attrs["rounds"]
        assert a.user_attrs["budget_used"] == b.user_attrs["budget_used"]
        assert math.isclose(a.value, b.value, rel_tol=1e-6), (a.number, a.value, b.value)
    # asked three at a time: trials 0-2 and 3-5 each one batched run; trial 6, the last, alone
    batch_of = [t.user_attrs.get("batch_id") for t in many]
    assert batch_of[0] == batch_of[1] == batch_of[2] != batch_of[3] == batch_of[4] == batch_of[5]
    assert None not in batch_of[:6] and batch_of[6] is None
    runs = _runs(bat)
    assert sorted(runs.trial) == list(range(7)) and runs.status.eq("ok").all()
    assert set(runs.run_id) == {t.user_attrs["run_id"] for t in many}


class OddTrialsAtStep2(optuna.pruners.BasePruner):
    """Prunes trials 1 and 3 at their second report (2/10 of their budget): which slots, and when, is known."""

    def prune(self, study, trial) -> bool:
        return trial.number % 2 == 1 and trial.last_step is not None and trial.last_step >= 2


def test_a_pruned_slot_leaves_its_batch_and_the_others_finish(tmp_path, monkeypatch):
    """Each slot reports to its own trial; a pruned slot's run stops at that report (status pruned) while the
    other slots of its batch spend their whole budget."""
    monkeypatch.setattr(optuna_parts, "make_pruner", lambda spec: OddTrialsAtStep2())
    assert cli.main(["tune", *NOISY, f"results_dir={tmp_path}", "tune.n_trials=4", "tune.batch=4"]) == 0
    trials = _trials(tmp_path)
    assert [t.state.name for t in trials] == ["COMPLETE", "PRUNED", "COMPLETE", "PRUNED"]
    runs = _runs(tmp_path).set_index("run_id")
    for t in trials:
        run, rounds = runs.loc[t.user_attrs["run_id"]], t.user_attrs["rounds"]
        if t.state.name == "PRUNED":
            assert t.user_attrs["status"] == run.status == "pruned"
            assert run.rounds_done == 2 * (rounds // 10)  # its second report: eval_every = rounds // reports
            assert t.user_attrs["budget_used"] == 2 * (rounds // 10) * t.params["local_steps"]
        else:
            assert run.status == "ok" and run.rounds_done == rounds and t.user_attrs["budget_used"] <= 40
            assert t.intermediate_values and max(t.intermediate_values) == 10  # it reported to the end


@pytest.mark.slow
def test_a_failed_slot_is_recorded_and_its_slot_run_again(tmp_path, monkeypatch):
    """Trial 1's run fails at its first report: it is FAIL (status failed, the error kept), trials 0 and 2 of its
    batch are told their values, the study stops with the error; the same command runs the slot again."""
    real = Reporter.__call__

    def failing(self, rows, state):
        if self.trial.number == 1:
            raise RuntimeError("boom in slot 1")
        return real(self, rows, state)

    monkeypatch.setattr(Reporter, "__call__", failing)
    args = ["tune", *NOISY, f"results_dir={tmp_path}", "tune.n_trials=3", "tune.batch=3"]
    with pytest.raises(TrialFailed, match="boom in slot 1"):
        cli.main(args)
    trials = _trials(tmp_path)
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL", "COMPLETE"]
    assert trials[1].user_attrs["status"] == "failed" and "boom in slot 1" in trials[1].user_attrs["error"]
    assert _runs(tmp_path).set_index("trial").status.to_dict() == {0: "ok", 1: "failed", 2: "ok"}

    monkeypatch.setattr(Reporter, "__call__", real)
    assert cli.main(args) == 0
    trials = _trials(tmp_path)
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL", "COMPLETE", "COMPLETE"]
    assert sorted(_runs(tmp_path).trial) == [0, 1, 2, 3]


@pytest.mark.parametrize("value", ["0", "-2", "1.5", "many", "true"])
def test_batch_must_be_an_integer_at_least_one(tmp_path, capsys, value):
    assert cli.main(["tune", *NOISY, f"results_dir={tmp_path}", f"tune.batch={value}"]) == 2
    err = capsys.readouterr().err
    assert "tune.batch" in err and "integer >= 1" in err
    assert not os.path.exists(tmp_path / "optuna.db")


def test_batch_defaults_to_one():
    assert build_spec([*NOISY], probe=False).batch == 1


def test_runs_that_differ_only_in_batchable_keys_share_a_batch():
    base = ["dataset=quadratic", "dataset.data_seed=0", "progress=false"]  # seeds share the data
    runs = [load_settings([*base, "algorithm.client_lr=0.1", "seed=1"]),
            load_settings([*base, "algorithm.client_lr=0.2", "algorithm.local_steps=3", "rounds=7"]),
            load_settings([*base, "algorithm.batch_size=3"]),  # another batch size: another batch
            load_settings([*base, "algorithm.server_lr=0.5", "algorithm.mu=0.1"]),
            load_settings([*base, "algorithm.batch_size=3", "seed=4"])]
    assert group_batches(runs, 8) == [[0, 1, 3], [2, 4]]
    assert group_batches(runs, 2) == [[0, 1], [2, 4], [3]]
    alone = [load_settings([*base, "algorithm.rr=gamma"])] * 2  # Richardson-Romberg couples replicas: never batched
    assert group_batches([runs[0], *alone, runs[1]], 8) == [[0, 3], [1], [2]]


@pytest.mark.slow
def test_parallel_ray_workers_each_run_batches(tmp_path):
    """tune.parallel=2 workers on one journal study, each asking for 3 trials at a time: exactly n_trials, each
    run once, in Ray's worker processes."""
    journal = tmp_path / "study.log"
    args = [*NOISY, f"results_dir={tmp_path}", "tune.n_trials=6", "tune.batch=3", "tune.parallel=2",
            f"tune.storage=journal:{journal}", "tune.resources={num_cpus: 1, num_gpus: 0}"]
    assert cli.main(["tune", *args]) == 0
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    trials = optuna.load_study(study_name="default-fedavg", storage=storage).trials
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    assert sorted(t.number for t in complete) == list(range(6))
    assert all(t.user_attrs.get("status") == "surplus" for t in trials if t.state.name != "COMPLETE")
    runs = _runs(tmp_path)
    assert sorted(runs.trial) == list(range(6)) and runs.status.eq("ok").all()
    assert set(runs.run_id) == {t.user_attrs["run_id"] for t in complete}
    pids = {int(t.user_attrs["worker"].rsplit(":", 1)[1]) for t in complete}
    assert os.getpid() not in pids
