"""The tuning code writes Optuna's tables itself (batch_writes, put_attrs): a database of another Optuna table
schema, or an installed Optuna of another, is refused at connect in one line, exit status 2, nothing written."""

from __future__ import annotations

import shutil

import optuna
import pytest
import sqlalchemy

from fedharness import cli
from fedharness.errors import ConfigError
from fedharness.studies.tuning import storage
from fedharness.studies.tuning.spec import build_spec

QUICK = ["tune=quadratic_lr", "tune.plots=false", "tune.sampler.name=random", "tune.n_trials=1"]


@pytest.fixture(scope="module")
def empty_database(tmp_path_factory):
    """A file of the installed Optuna's empty tables, made once (creating them takes a second or two)."""
    path = tmp_path_factory.mktemp("optuna") / "empty.db"
    optuna.storages.RDBStorage(f"sqlite:///{path}").engine.dispose()
    return path


def database_of_schema(empty_database, path, revision: str) -> str:
    """A copy of `empty_database` whose recorded schema revision is `revision`."""
    shutil.copyfile(empty_database, path)
    url = f"sqlite:///{path}"
    engine = sqlalchemy.create_engine(url)
    with engine.begin() as connection:
        connection.execute(sqlalchemy.text("UPDATE alembic_version SET version_num = :v"), {"v": revision})
    engine.dispose()
    return url


def tables(url: str) -> dict[str, int]:
    engine = sqlalchemy.create_engine(url)
    with engine.connect() as connection:
        counts = {t: connection.execute(sqlalchemy.text(f"SELECT COUNT(*) FROM {t}")).scalar()
                  for t in ("studies", "trials", "trial_user_attributes")}
    engine.dispose()
    return counts


def test_the_installed_optuna_has_the_schema_the_writes_know():
    assert storage.installed_schema() == storage.OPTUNA_SCHEMA


@pytest.mark.parametrize("revision,says", [
    ("v9.9.9.a", f"schema v9.9.9.a, one optuna {optuna.__version__} does not know"),
    ("v3.0.0.d", "schema v3.0.0.d, an older Optuna's: upgrade it with `optuna storage upgrade"),
])
def test_a_database_of_another_schema_is_refused_in_one_line(revision, says, empty_database, tmp_path, capsys):
    url = database_of_schema(empty_database, tmp_path / "optuna.db", revision)
    results = tmp_path / "out"
    assert cli.main(["tune", *QUICK, f"results_dir={results}", f"tune.storage={url}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'tune.storage'" in err and says in err, err
    assert not results.exists() and tables(url) == {"studies": 0, "trials": 0, "trial_user_attributes": 0}


def test_a_database_of_the_known_schema_passes(empty_database, tmp_path):
    url = database_of_schema(empty_database, tmp_path / "optuna.db", storage.OPTUNA_SCHEMA)
    storage.check_reachable(build_spec([*QUICK, f"results_dir={tmp_path}", f"tune.storage={url}"]))


def test_an_installed_optuna_of_another_schema_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "_installed_revisions", lambda: ("v5.1.0.a", storage.OPTUNA_SCHEMA))
    spec = build_spec([*QUICK, f"results_dir={tmp_path}", f"tune.storage=sqlite:///{tmp_path}/new.db"])
    with pytest.raises(ConfigError, match=f"the installed optuna {optuna.__version__} has schema v5.1.0.a"):
        storage.check_reachable(spec)
