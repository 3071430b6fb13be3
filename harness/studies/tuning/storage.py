"""Where a study lives: connect to its storage (SQLite, an Optuna journal file, or an SQLAlchemy URL) once
before anything is created, and open it for the study's workers; write a trial's rows in one transaction where
Optuna's calls take one each (write_trial, tell_complete; a batch's settings: held_writes)."""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any, Iterator

from fedharness.errors import ConfigError, require
from fedharness.results import layout
from fedharness.sinks.masking import mask_secrets
from fedharness.studies.tuning.spec import TuneSpec


def _engine_kwargs(url: str) -> dict:
    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": 60}}
    if url.startswith("postgresql"):
        return {"pool_pre_ping": True, "connect_args": {"connect_timeout": 10}}
    return {"pool_pre_ping": True}


# The alembic revision of Optuna's tables that this package writes itself (batch_writes, put_attrs, tell_complete:
# rows through Optuna's SQLAlchemy models, not its API). Optuna 3.2 to 5.0 share it; pyproject allows optuna 4 and
# 5. A storage or an installed Optuna of another schema is refused before anything is written.
OPTUNA_SCHEMA = "v3.2.0.a"


def check_reachable(spec: TuneSpec) -> None:
    """Connect once before anything is created: an unreachable storage is a ConfigError, not a traceback; so is a
    database of another Optuna table schema than the one written here (check_schema)."""
    if spec.storage.startswith("journal:"):
        parent = Path(spec.storage[len("journal:"):]).parent
        require(parent.is_dir() and os.access(parent, os.W_OK), "tune.storage", spec.storage,
                f"the journal's folder {parent} must exist and be writable")
        return
    import sqlalchemy

    if spec.storage == "sqlite:///" + str(Path(spec.results_dir) / layout.OPTUNA_DB):
        Path(spec.results_dir).mkdir(parents=True, exist_ok=True)
    from alembic.migration import MigrationContext

    try:
        engine = sqlalchemy.create_engine(spec.storage, **_engine_kwargs(spec.storage))
        with engine.connect() as connection:
            stored = MigrationContext.configure(connection).get_current_revision()  # None: no Optuna tables yet
        engine.dispose()
    except Exception as err:  # driver missing, host down, bad credentials, unwritable file ...
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError("tune.storage", mask_secrets(spec.storage), f"cannot connect: {mask_secrets(first)}") from None
    check_schema(spec.storage, stored)


def check_schema(storage: str, stored: str | None) -> None:
    """The installed Optuna's table schema and the storage's (`stored`, None for a database without Optuna's
    tables: they will be created at the installed schema) must be OPTUNA_SCHEMA; else one line naming both."""
    import optuna

    installed = installed_schema()
    require(installed == OPTUNA_SCHEMA, "tune.storage", mask_secrets(storage),
            f"an Optuna of table schema {OPTUNA_SCHEMA} (optuna>=4.0,<6), the tables fedharness writes itself; the "
            f"installed optuna {optuna.__version__} has schema {installed}")
    if stored in (None, OPTUNA_SCHEMA):
        return
    remedy = "an older Optuna's: upgrade it with `optuna storage upgrade --storage <URL>`" \
        if stored in _installed_revisions() else f"one optuna {optuna.__version__} does not know"
    raise ConfigError("tune.storage", mask_secrets(storage), f"a database of Optuna table schema {OPTUNA_SCHEMA} "
                      f"(optuna 4 and 5), the tables fedharness writes itself; this one has schema {stored}, {remedy}")


def open_storage(spec: TuneSpec, attempts: int = 5):
    import optuna
    from sqlalchemy.exc import SQLAlchemyError

    if spec.storage.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(spec.storage[len("journal:"):]))
    for attempt in range(attempts):
        try:
            store = optuna.storages.RDBStorage(spec.storage, engine_kwargs=_engine_kwargs(spec.storage),
                                               skip_compatibility_check=True)
            _check_schema(store)
            if spec.storage.startswith("sqlite"):
                _write_ahead(store.engine)
            return store
        except SQLAlchemyError:
            # Workers starting together on an empty database race to create Optuna's tables; the
            # loser hits a duplicate (or a lock) and finds the tables there when it tries again.
            if attempt == attempts - 1:
                raise
            time.sleep(0.5 * (attempt + 1))


def _check_schema(store) -> None:
    """Optuna's schema check, with the schema's head revision read once per process: RDBStorage's own check loads
    alembic's script folder (every migration file) on each open, ~30 ms, to learn a revision that cannot change while
    the process runs. The stored revision is read each time; a mismatch gets Optuna's own check and its message. Through
    the storage's _version_manager (Optuna 4 and 5), the object RDBStorage checks with."""
    manager = store._version_manager
    if manager.get_current_version() != installed_schema():
        manager.check_table_schema_compatibility()


@cache
def _installed_revisions() -> tuple[str, ...]:
    """The installed Optuna's schema revisions, newest first (its alembic scripts, read once per process)."""
    from alembic.script import ScriptDirectory
    from optuna.storages import _rdb

    scripts = ScriptDirectory(str(Path(_rdb.__file__).parent / "alembic"))
    return tuple(revision.revision for revision in scripts.walk_revisions())


def installed_schema() -> str:
    """The installed Optuna's head schema revision: what it creates and expects."""
    return _installed_revisions()[0]


def _write_ahead(engine) -> None:
    """SQLite in write-ahead-log mode with synchronous=NORMAL: a commit appends to optuna.db-wal without waiting for
    the disk (10 ms a commit on this machine, ~20 of them a trial), and readers never block the writer. A committed
    trial still survives the process being killed (only a power cut can lose the last commits), and the workers of
    one machine share the file as before."""
    from sqlalchemy import event

    def pragmas(connection, _record) -> None:
        cursor = connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    event.listen(engine, "connect", pragmas)
    engine.dispose()  # the connection that created the tables was opened without them


def write_trial(trial, attrs: dict[str, Any], reports: dict[int, float] | None = None) -> None:
    """Set the running trial's user `attrs` and intermediate values `reports` (step -> value, steps it has not
    reported yet), as trial.set_user_attr and trial.report would, in one transaction where the study is in a
    database. Optuna's RDB storage opens a session, reads the trial (and a report's step) and commits once per
    call, about a millisecond of Python each; a trial wrote some 20 of them, so a batch of 64 spent more on them
    than on its training. Here: one check that the trial is running, then its attrs and reports as rows
    (put_attrs, write_reports: as a batch's are written). Another storage (a journal) gets each call."""
    backend = database_of(trial.storage)
    if backend is None:
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        for step, value in (reports or {}).items():
            trial.report(value, step)
        return
    from optuna.storages._rdb.storage import _create_scoped_session

    if not reports and _hold(trial, attrs):  # inside held_writes: written with the batch's
        return
    with _create_scoped_session(backend.scoped_session) as session:  # an IntegrityError is raised, all rolled back
        _check_running(session, backend, [trial])
        _write_without_commit(session, trial, attrs, reports or {})
    cache_written(trial, attrs, reports or {})


def tell_complete(trial, value: float, attrs: dict[str, Any], reports: dict[int, float] | None = None) -> None:
    """write_trial(trial, attrs, reports), then study.tell(trial, value): in one transaction where the study is in
    a database and `value` is a number. study.tell reads the whole trial back from the storage first (its params,
    attributes and reports, to hand them to the sampler's after_trial) and commits on its own; here the sampler
    gets the trial as this process holds it (the same values: every write went through it) and the value and
    state COMPLETE are set with the attributes, as Optuna's set_trial_state_values sets them (Optuna 4 and 5). A
    trial finished meanwhile (declared lost) raises UpdateFinishedTrialError and nothing is written, as
    study.tell would; a NaN (Optuna tells it FAIL, with a warning) and a journal take Optuna's own calls."""
    import math
    from datetime import datetime

    import optuna
    from optuna.trial import TrialState

    backend = database_of(trial.storage)
    if backend is None or math.isnan(value):
        write_trial(trial, attrs, reports)
        trial.study.tell(trial, value)
        return
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session

    study, frozen, values = trial.study, trial._cached_frozen_trial, [float(value)]
    study._thread_local.cached_all_trials = None  # as study.tell: the sampler's cached view of the trials is stale
    try:
        study.sampler.after_trial(optuna.pruners._filter_study(study, frozen), frozen, TrialState.COMPLETE, values)
    finally:
        with _create_scoped_session(backend.scoped_session) as session:
            model = models.TrialModel.find_or_raise_by_id(trial._trial_id, session, for_update=True)
            backend.check_trial_is_updatable(trial._trial_id, model.state)
            _write_without_commit(session, trial, attrs, reports or {})
            backend._set_trial_value_without_commit(session, model, 0, values[0])
            model.state = TrialState.COMPLETE
            model.datetime_complete = datetime.now()
    cache_written(trial, attrs, reports or {})


def database_of(storage) -> "optuna.storages.RDBStorage | None":
    """The RDB storage behind `storage` (Optuna's cache of it), or None for another storage (a journal)."""
    import optuna

    backend = storage._backend if isinstance(storage, optuna.storages._CachedStorage) else storage
    return backend if isinstance(backend, optuna.storages.RDBStorage) else None


def _write_without_commit(session, trial, attrs: dict[str, Any], reports: dict[int, float]) -> None:
    """The running trial's attrs and reports into the session (the caller checked that it is running)."""
    if attrs:
        put_attrs(session, [(trial, attrs)])
    write_reports(session, trial, reports)


def write_reports(session, trial, reports: dict[int, float]) -> None:
    """Insert the running trial's new intermediate values as rows (their (trial, step) is unique in the schema: a
    step stored before fails the transaction, it is never overwritten)."""
    from optuna.storages._rdb import models

    rows = models.TrialIntermediateValueModel
    stored = {step: rows.intermediate_value_to_stored_repr(value) for step, value in reports.items()}
    session.add_all([rows(trial_id=trial._trial_id, step=step, intermediate_value=value,
                          intermediate_value_type=kind) for step, (value, kind) in stored.items()])


def cache_written(trial, attrs: dict[str, Any], reports: dict[int, float]) -> None:
    """What trial.user_attrs and the pruner read back, as Optuna's setters keep it."""
    frozen = trial._cached_frozen_trial
    frozen.user_attrs.update(attrs)
    frozen.intermediate_values.update(reports)


class _Held(threading.local):
    writes: list | None = None  # (trial, attrs) held by write_trial inside held_writes; None: write at once


_HELD = _Held()


@contextmanager
def held_writes() -> Iterator[None]:
    """Inside the block, this thread's storage.write_trial calls without reports, for trials in a database, are
    held (each trial's user_attrs updated at once, as the call does) and written when the block ends, also when
    it raises, all in one transaction."""
    _HELD.writes = []
    try:
        yield
    finally:
        writes, _HELD.writes = _HELD.writes, None
        _write_all(writes)


def _hold(trial, attrs: dict[str, Any]) -> bool:
    """True if `attrs` for `trial` (in a database) are held for held_writes' one transaction, its user_attrs
    updated now (write_trial asks)."""
    if _HELD.writes is None:
        return False
    _HELD.writes.append((trial, attrs))
    cache_written(trial, attrs, {})
    return True


def _write_all(writes: list[tuple[Any, dict[str, Any]]]) -> None:
    """Each (trial, attrs) as write_trial(trial, attrs), in one transaction; nothing where a trial was finished
    meanwhile (UpdateFinishedTrialError, as write_trial). The trials are in one database."""
    from optuna.storages._rdb.storage import _create_scoped_session

    if not writes:
        return
    backend = database_of(writes[0][0].storage)
    with _create_scoped_session(backend.scoped_session) as session:
        _check_running(session, backend, [trial for trial, _ in writes])
        put_attrs(session, writes)


def trial_states(session, trials: list, lock: bool = False) -> dict:
    """trial id -> its state in the storage (row-locked until the transaction ends if `lock`)."""
    from optuna.storages._rdb import models

    query = session.query(models.TrialModel.trial_id, models.TrialModel.state).filter(
        models.TrialModel.trial_id.in_([trial._trial_id for trial in trials]))
    return dict(query.with_for_update().all() if lock else query.all())


def _check_running(session, backend, trials: list) -> None:
    """Optuna's check for each trial: UpdateFinishedTrialError for the first one finished."""
    states = trial_states(session, trials)
    for trial in trials:
        backend.check_trial_is_updatable(trial._trial_id, states[trial._trial_id])


def put_attrs(session, writes: list[tuple[Any, dict[str, Any]]]) -> None:
    """Set user attrs: each trial's stored attrs of those keys deleted, then all inserted, two statements for the
    batch (Optuna's set_trial_user_attr: a read of the trial and an upsert per attr); value_json as Optuna's."""
    from optuna.storages._rdb import models
    from sqlalchemy import and_, delete, insert, or_

    rows = models.TrialUserAttributeModel
    by_keys: dict[tuple[str, ...], list[int]] = {}
    for trial, attrs in writes:
        by_keys.setdefault(tuple(sorted(attrs)), []).append(trial._trial_id)
    session.execute(delete(rows).where(or_(*[and_(rows.trial_id.in_(ids), rows.key.in_(keys))
                                             for keys, ids in by_keys.items()]))
                    .execution_options(synchronize_session=False))
    values = [{"trial_id": trial._trial_id, "key": key, "value_json": json.dumps(value)}
              for trial, attrs in writes for key, value in attrs.items()]
    if values:
        session.execute(insert(rows), values)
