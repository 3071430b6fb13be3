"""A user follows a study in optuna-dashboard (docs/tuning.md): the storage a study writes (SQLite in write-ahead-log
mode) loads in the dashboard's own WSGI app, which answers its study list and each trial as its browser page asks;
the trial lines say which batch a trial trained in."""

from __future__ import annotations

import io
import json
import sqlite3
from wsgiref.util import setup_testing_defaults

import pytest

from fedharness import cli

NOISY = ["tune=default", "dataset=quadratic", "dataset.noise=0.5", "algorithm.clients_per_round=4", "dtype=float32",
         "tune.sampler.name=random", "tune.budget.total=40", "tune.space.local_steps.high=4", "tune.plots=false"]


def _get(app, path: str) -> dict:
    environ = {"PATH_INFO": path, "REQUEST_METHOD": "GET", "wsgi.input": io.BytesIO()}
    setup_testing_defaults(environ)
    status = []
    body = b"".join(app(environ, lambda s, headers, exc_info=None: status.append(s)))
    assert status[0].startswith("200"), (path, status, body[:200])
    return json.loads(body)


def test_the_study_storage_loads_in_optuna_dashboard(tmp_path, capsys):
    dashboard = pytest.importorskip("optuna_dashboard", reason="optuna-dashboard is in the tune extra")
    assert cli.main(["tune", *NOISY, "tune.n_trials=4", "tune.batch=2", f"results_dir={tmp_path}"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "] trial " in line]
    assert len(lines) == 4 and all("batch " in line for line in lines)  # e.g. "(ok; batch 1 of 2 trials; ..."
    url = f"sqlite:///{tmp_path}/optuna.db"
    assert sqlite3.connect(tmp_path / "optuna.db").execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    app = dashboard.wsgi(url)
    studies = _get(app, "/api/studies")["study_summaries"]
    assert [s["study_name"] for s in studies] == ["default-fedavg"]
    detail = _get(app, f"/api/studies/{studies[0]['study_id']}")
    trials = detail["trials"]
    assert [t["state"] for t in trials] == ["Complete"] * 4
    assert all({p["name"] for p in t["params"]} == {"client_lr", "local_steps"} for t in trials)
    assert all(len(t["intermediate_values"]) > 0 for t in trials)  # the reports the pruner reads, per trial
