"""What a batch of slots (and a batch of trials) no longer pays once per slot, and that it changes nothing:

* slots whose samplers draw alike (equal seed, equal sampler) draw in one call (harness/core/slots.py), giving each
  slot exactly the rows of its own call;
* a batch of trials asks for its trials without Optuna's look for enqueued trials, which read every running trial
  each time (harness/studies/tuning/optuna_parts.py ask_trial), unless the study holds enqueued trials: then those
  are run first, as study.ask does.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import optuna
import pytest

from fedharness import cli
from fedharness.algorithms.samplers import Dropout, SchemeI, SchemeII, YangStrategy2
from fedharness.core.slots import SlotSampler, SlotSet


def _slots(samplers: list, seeds: list[int], replicas: list[int]) -> SlotSet:
    n = len(samplers)
    return SlotSet(list(range(n)), [SimpleNamespace(sampler=s) for s in samplers], np.array(seeds),
                   np.array(replicas), np.full(n, 10), np.ones(n, dtype=np.int64), {})


@pytest.mark.parametrize("make, other", [
    (lambda: SchemeII(20, 5), YangStrategy2(20, 5)), (lambda: SchemeI(20, 5), SchemeI(21, 5)),
    (lambda: Dropout(SchemeII(20, 5), 0.3), Dropout(SchemeII(20, 5), 0.6))], ids=["scheme_ii", "scheme_i", "dropout"])
def test_slots_that_draw_alike_draw_in_one_call_with_each_slots_own_rows(make, other):
    # slots 0, 1 and 4 share seed and sampler; 2 has another seed, 3 another sampler (class, K, dropout rate)
    slots = _slots([make(), make(), make(), other, make()], [0, 0, 1, 0, 0], [2, 1, 3, 2, 1])
    sampler = SlotSampler(slots)
    assert sampler.groups == [[0, 1, 4], [2], [3]]
    streams = slots.layout().stream_ids
    p = np.random.default_rng(0).dirichlet(np.ones(20))
    for rnd in range(4):
        got = sampler.select(0, streams, rnd, p)
        own = [a.sampler.select(int(slots.seeds[i]), streams[slots.rows(i)], rnd, p)
               for i, a in enumerate(slots.algorithms)]
        for name in ("clients", "weights", "lr_scale", "active"):
            parts = [getattr(sel, name) for sel in own]
            if all(part is None for part in parts):
                assert getattr(got, name) is None
                continue
            mine = [np.ones(len(sel.clients), bool) if part is None else part for sel, part in zip(own, parts)]
            assert np.array_equal(getattr(got, name), np.concatenate(mine)), (name, rnd)


def test_parts_that_cannot_be_compared_are_not_shared():
    class Opaque(SchemeII):
        __eq__ = None  # attributes of a kind whose comparison raises: never taken for equal

    a, b = SchemeII(20, 5), SchemeII(20, 5)
    a.extra, b.extra = Opaque(20, 5), object()
    assert SlotSampler(_slots([a, b], [0, 0], [1, 1])).groups == [[0], [1]]


QUAD = ["tune=default", "dataset=quadratic", "algorithm.clients_per_round=4", "dtype=float32",
        "tune.sampler.name=random", "tune.budget.total=20", "tune.space.local_steps.high=4", "tune.plots=false"]


def test_a_batch_runs_the_enqueued_trials_first_and_asks_for_the_rest(tmp_path, monkeypatch):
    results = tmp_path / "r"
    assert cli.main(["tune", *QUAD, "tune.n_trials=1", f"results_dir={results}"]) == 0
    storage = f"sqlite:///{results}/optuna.db"
    study = optuna.load_study(study_name="default-fedavg", storage=storage)
    study.enqueue_trial({"client_lr": 0.0123, "local_steps": 3})
    pops = []
    original = optuna.Study._pop_waiting_trial_id
    monkeypatch.setattr(optuna.Study, "_pop_waiting_trial_id", lambda self: pops.append(1) or original(self))
    assert cli.main(["tune", *QUAD, "tune.n_trials=4", "tune.batch=3", f"results_dir={results}"]) == 0
    trials = optuna.load_study(study_name="default-fedavg", storage=storage).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 4
    # the first batch: the study lacked 2 live trials, the enqueued one (number 1) and a new one
    assert trials[1].params == {"client_lr": 0.0123, "local_steps": 3}
    assert trials[1].user_attrs["batch_id"] == trials[2].user_attrs["batch_id"]
    assert "batch_id" not in trials[3].user_attrs  # the last, alone
    assert len(pops) == 2  # that batch's trials were asked for through study.ask; the last one, none left, not

    pops.clear()  # a study with none: no look for them
    assert cli.main(["tune", *QUAD, "tune.n_trials=7", "tune.batch=3", f"results_dir={results}"]) == 0
    trials = optuna.load_study(study_name="default-fedavg", storage=storage).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 7 and pops == []


def _study_records(results, storage: str) -> list[tuple]:
    """Each trial's params, value, intermediate values and the user attrs that do not name a run or a process."""
    per_run = ("run_id", "worker", "batch_id", "heartbeat_at")
    out = []
    for t in optuna.load_study(study_name="default-fedavg", storage=storage).get_trials():
        attrs = {k: v for k, v in t.user_attrs.items() if k not in per_run}
        attrs["overrides"] = [o for o in attrs["overrides"] if not o.startswith("results_dir=")]
        out.append((t.params, t.value, t.intermediate_values, attrs))
    return out


@pytest.mark.parametrize("batch", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_reports_kept_until_the_trial_ends_are_stored_as_reported_ones(tmp_path, batch):
    """Without a pruner a trial's reports are written with its outcome, in one transaction (storage.write_trial):
    the study holds what a pruner that reads them as they come (median, never pruning here) gets stored, and a
    journal storage, written call by call, the same."""
    common = [*QUAD, "tune.n_trials=3", f"tune.batch={batch}", "tune.reports=4"]
    median = [*common, "tune.pruner.name=median", "tune.pruner.warmup_steps=100"]
    runs = {"deferred": (common, "sqlite"), "reported": (median, "sqlite"), "journal": (common, "journal")}
    records = {}
    for name, (overrides, kind) in runs.items():
        results = tmp_path / name
        storage = f"sqlite:///{results}/optuna.db" if kind == "sqlite" else f"journal:{tmp_path}/{name}.log"
        extra = [] if kind == "sqlite" else [f"tune.storage={storage}"]
        assert cli.main(["tune", *overrides, *extra, f"results_dir={results}"]) == 0
        if kind == "journal":
            backend = optuna.storages.journal.JournalFileBackend(f"{tmp_path}/{name}.log")
            storage = optuna.storages.JournalStorage(backend)
        records[name] = _study_records(results, storage)
    assert len(records["deferred"]) == 3 and all(len(r[2]) == 4 for r in records["deferred"])  # steps 1..4
    assert records["deferred"] == records["reported"] == records["journal"]


def test_write_trial_stores_attrs_and_new_reports_together_or_nothing(tmp_path):
    from sqlalchemy.exc import IntegrityError

    from fedharness.studies.tuning.storage import write_trial

    storage = f"sqlite:///{tmp_path}/s.db"
    trial = optuna.create_study(study_name="s", storage=storage).ask()
    trial.report(1.0, 1)
    with pytest.raises(IntegrityError):  # step 1 was reported: the whole write is refused, nothing overwritten
        write_trial(trial, {"status": "ok"}, {1: 2.0, 2: 3.0})
    stored = optuna.load_study(study_name="s", storage=storage).trials[0]
    assert stored.user_attrs == {} and stored.intermediate_values == {1: 1.0}
    write_trial(trial, {"status": "ok", "rounds": 7}, {2: float("inf"), 3: 0.25})
    stored = optuna.load_study(study_name="s", storage=storage).trials[0]
    assert stored.user_attrs == {"status": "ok", "rounds": 7} == trial.user_attrs
    assert stored.intermediate_values == {1: 1.0, 2: float("inf"), 3: 0.25}


def test_hyperband_decides_a_rung_once_a_member_that_never_reports_has_left():
    """A slot that diverges at once never reports; once its run ends (the reporter's on_end tells the pruner) the
    bracket's first rung is decided among the others: 1/3 of the 5 that reported go on."""
    from fedharness.studies.tuning.halving import BatchHyperband

    pruner = BatchHyperband(reports=10, min_resource=1, reduction_factor=3)
    pruner.open_bracket(list(range(6)))  # bracket 0: rungs at 1, 3 and 9 reports
    study = SimpleNamespace(direction=optuna.study.StudyDirection.MINIMIZE)
    trials = [SimpleNamespace(number=n, intermediate_values={1: float(n)}) for n in range(5)]
    assert [pruner.prune(study, t) for t in trials] == [False] * 5  # trial 5 has not reported: no decision
    pruner.leave(5)
    assert [pruner.prune(study, t) for t in trials] == [False, True, True, True, True]  # the best (lowest) goes on


@pytest.mark.parametrize("batch", [1, 4])
def test_enqueued_trials_do_not_make_the_sampler_repeat_a_proposal(tmp_path, batch):
    """Each trial's sampler is seeded by the trial's own number: a popped enqueued trial keeps its number, so a seed
    taken from the study's length (the trials before the batch, plus the place in it) was given to two trials, and
    the random sampler proposed the same client_lr (a continuous axis) twice. Enqueued trials fix local_steps only:
    client_lr is sampled for every trial, and no two may be equal."""
    results = tmp_path / "r"
    assert cli.main(["tune", *QUAD, "tune.n_trials=1", f"results_dir={results}"]) == 0
    storage = f"sqlite:///{results}/optuna.db"
    study = optuna.load_study(study_name="default-fedavg", storage=storage)
    for steps in (2, 3):
        study.enqueue_trial({"local_steps": steps})
    assert cli.main(["tune", *QUAD, "tune.n_trials=11", f"tune.batch={batch}", f"results_dir={results}"]) == 0
    trials = optuna.load_study(study_name="default-fedavg", storage=storage).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 11
    assert [t.params["local_steps"] for t in trials[1:3]] == [2, 3]
    lrs = [t.params["client_lr"] for t in trials]
    assert len(set(lrs)) == 11, sorted(lrs)
