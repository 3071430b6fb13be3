"""A batch of trials' storage writes (tune.batch), each in one transaction where the study is in a database:
claiming the batch's trials with their heartbeats, and their COMPLETE outcomes (their settings attrs:
storage.held_writes).

Optuna's RDB storage opens a session, reads the trial and commits once per call (create_new_trial, set_user_attr,
tell): about a millisecond of Python each, some 10 calls a trial. Here the rows are written as Optuna's own calls
write them (the same tables and values, through its SQLAlchemy models: Optuna 4 and 5 share them), a batch's at a
time. A journal storage keeps Optuna's own calls (the callers fall back to them where these return None).
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from datetime import datetime
from typing import Any

from fedharness.studies.tuning.storage import (cache_written, database_of, put_attrs, tell_complete,
                                               trial_states, write_reports)

CREATE_ATTEMPTS = 5  # as Optuna's create_new_trial: numbering under the study's lock can deadlock on a server


def create_trials(study, count: int, heartbeat_at: float) -> list | None:
    """`count` new RUNNING trials of `study`, each with its user attr heartbeat_at, in one transaction (Optuna's
    create_new_trial and set_user_attr: two commits a trial); their FrozenTrials, in number order. As Optuna
    numbers a trial, the study's row is locked while they are numbered: the numbers are consecutive, the trials
    before them counted in the storage. None where the study is not in a database."""
    from optuna.exceptions import StorageInternalError
    from optuna.storages._rdb.storage import _create_scoped_session

    backend = database_of(study._storage)
    if backend is None:
        return None
    for attempt in range(CREATE_ATTEMPTS):
        try:
            with _create_scoped_session(backend.scoped_session) as session:
                created = _insert_trials(session, study._study_id, count, heartbeat_at)
            break
        except StorageInternalError:  # as Optuna's: a deadlock among workers numbering trials, tried again
            if attempt == CREATE_ATTEMPTS - 1:
                raise
            time.sleep(random.random() * 2.0)
    _cache_created(study, created)
    return created


def _insert_trials(session, study_id: int, count: int, heartbeat_at: float) -> list:
    from optuna.storages._rdb import models
    from optuna.trial import FrozenTrial, TrialState

    models.StudyModel.find_or_raise_by_id(study_id, session, for_update=True)
    rows = [models.TrialModel(study_id=study_id, number=None, state=TrialState.RUNNING,
                              datetime_start=datetime.now()) for _ in range(count)]
    session.add_all(rows)
    session.flush()  # their ids
    rows.sort(key=lambda row: row.trial_id)
    first = rows[0].count_past_trials(session)
    for i, row in enumerate(rows):
        row.number = first + i
    session.add_all([models.TrialUserAttributeModel(trial_id=row.trial_id, key="heartbeat_at",
                                                    value_json=json.dumps(heartbeat_at)) for row in rows])
    return [FrozenTrial(number=row.number, state=TrialState.RUNNING, value=None, values=None,
                        datetime_start=row.datetime_start, datetime_complete=None, params={}, distributions={},
                        user_attrs={"heartbeat_at": heartbeat_at}, system_attrs={}, intermediate_values={},
                        trial_id=row.trial_id) for row in rows]


def _cache_created(study, created: list) -> None:
    """Into the process's cache of the study, as Optuna's cached storage enters a trial it created (it takes a
    trial's parameters only for a trial it holds; Optuna 4 and 5): copies, as its later reads of the storage
    replace them, while each Trial keeps its own."""
    from optuna.storages._cached_storage import _StudyInfo

    cache = study._storage
    with cache._lock:
        if study._study_id not in cache._studies:
            cache._studies[study._study_id] = _StudyInfo()
        cache._add_trials_to_cache(study._study_id, copy.deepcopy(created))


class Completions:
    """Trials told COMPLETE together: `add` is study.tell(trial, value) with the outcome's user attrs and pending
    reports (storage.tell_complete) but for the write, which `commit` makes for every added trial at once.

    The sampler's after_trial is called in `add`, in the order trials are told, as study.tell calls it; a NaN
    value (Optuna tells it FAIL) and a journal storage are told at once, through tell_complete. A trial declared
    lost while it ran (its worker's heartbeats missed: another worker runs it again) is not written; `commit`
    returns the numbers of such trials, as tell_complete raises UpdateFinishedTrialError for one."""

    def __init__(self, study):
        self.study = study
        self.held: list[tuple[Any, float, dict[str, Any], dict[int, float]]] = []
        self.lost: set[int] = set()

    def add(self, trial, value: float, attrs: dict[str, Any], reports: dict[int, float] | None) -> None:
        import optuna
        from optuna.trial import TrialState

        if database_of(trial.storage) is None or math.isnan(value):
            try:
                tell_complete(trial, value, attrs, reports)
            except optuna.exceptions.UpdateFinishedTrialError:
                self.lost.add(trial.number)
            return
        study, frozen = self.study, trial._cached_frozen_trial
        study._thread_local.cached_all_trials = None  # as study.tell: the sampler's view of the trials is stale
        study.sampler.after_trial(optuna.pruners._filter_study(study, frozen), frozen, TrialState.COMPLETE,
                                  [float(value)])
        self.held.append((trial, float(value), attrs, reports or {}))

    def commit(self) -> set[int]:
        """Write every held trial's attrs, reports, value and state COMPLETE in one transaction, as Optuna's
        set_trial_state_values sets the last two; the numbers of the trials declared lost (not written)."""
        from optuna.storages._rdb import models
        from optuna.storages._rdb.storage import _create_scoped_session
        from optuna.trial import TrialState
        from sqlalchemy import insert, update

        if not self.held:
            return self.lost
        backend = database_of(self.study._storage)
        with _create_scoped_session(backend.scoped_session) as session:
            states = trial_states(session, [trial for trial, *_ in self.held], lock=True)
            live = [h for h in self.held if not states[h[0]._trial_id].is_finished()]
            self.lost |= {trial.number for trial, *_ in self.held if states[trial._trial_id].is_finished()}
            if live:
                put_attrs(session, [(trial, attrs) for trial, _, attrs, _ in live])
                for trial, _, _, reports in live:
                    write_reports(session, trial, reports)
                session.execute(insert(models.TrialValueModel), [
                    dict(zip(("value", "value_type"), models.TrialValueModel.value_to_stored_repr(value)),
                         trial_id=trial._trial_id, objective=0) for trial, value, _, _ in live])
                session.execute(update(models.TrialModel)
                                .where(models.TrialModel.trial_id.in_([t._trial_id for t, *_ in live]))
                                .values(state=TrialState.COMPLETE, datetime_complete=datetime.now())
                                .execution_options(synchronize_session=False))
        for trial, _, attrs, reports in live:
            cache_written(trial, attrs, reports)
        self.held = []
        return self.lost
