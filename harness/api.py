"""The Python API: `run`, `tune`, `sweep`, `report`, on the same code paths as the `fedharness` command.

Overrides are what the command line takes, as a list of `key=value` strings or as a mapping
(nested or dotted keys; values rendered the way Hydra parses them). Bad input raises ConfigError
before any work, exactly as the command line exits with status 2.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from fedharness.config.load import load_settings
from fedharness.config.overrides import dict_overrides
from fedharness.contracts import Callback
from fedharness.errors import ConfigError, raise_for_results_write, require
from fedharness.base.extras import require_extra
from fedharness.runs.lifecycle import open_results
from fedharness.base.progress import ProgressBar
from fedharness.runs.execute import execute
from fedharness.results import layout
from fedharness.results.store import ResultsStore, open_store
from fedharness.results.tables import read_run_table, run_table_keys
from fedharness.studies.sweep import plan, run_sweep

if TYPE_CHECKING:
    import pandas as pd  # imported where a table is read: a run's process never loads pandas (0.3 s)

Overrides = Sequence[str] | Mapping[str, Any] | None
log = logging.getLogger(__name__)


def as_overrides(overrides: Overrides = None, **kwargs: Any) -> list[str]:
    """`["k=v", ...]`, `{"k": v}` (nested or dotted keys) and keyword arguments, as Hydra overrides."""
    if overrides is None:
        out = []
    elif isinstance(overrides, Mapping):
        out = dict_overrides(dict(overrides))
    elif isinstance(overrides, (list, tuple)) and all(isinstance(o, str) for o in overrides):
        out = list(overrides)
    else:
        raise ConfigError("overrides", overrides, "a list of 'key=value' strings or a mapping of keys to values")
    return out + dict_overrides(kwargs)


@dataclass(frozen=True)
class Result:
    """The runs one call made and, read back from their Parquet files, their rows."""

    results_dir: str  # an absolute path or an object-store URL
    statuses: dict[str, str]  # run_id -> ok | diverged | failed
    rows: list[dict] = field(default_factory=list, repr=False)  # the last run's evaluated rows, as the engine made them

    @property
    def run_ids(self) -> list[str]:
        return list(self.statuses)

    @property
    def run_id(self) -> str:
        if len(self.statuses) != 1:
            raise ValueError(f"this result holds {len(self.statuses)} runs; use .run_ids or .runs")
        return next(iter(self.statuses))

    @property
    def status(self) -> str:
        return self.statuses[self.run_id]

    @cached_property
    def store(self) -> ResultsStore:
        """The results store, opened on the first read of the tables."""
        return open_store(self.results_dir)

    @property
    def runs(self) -> pd.DataFrame:
        """One row per run: the runs/ table (config_json, status, started_at, ...)."""
        return read_run_table(self.store, run_table_keys(self.store, layout.RUNS, self.run_ids))

    @property
    def rounds(self) -> pd.DataFrame:
        """One row per (run, replica, series, evaluated round): the rounds/ table."""
        return read_run_table(self.store, run_table_keys(self.store, layout.ROUNDS, self.run_ids))

    @property
    def clients(self) -> pd.DataFrame:
        """One row per (run, replica, evaluated round, client): the clients/ table (eval.clients_table=true)."""
        return read_run_table(self.store, run_table_keys(self.store, layout.CLIENTS, self.run_ids))


def run(overrides: Overrides = None, callbacks: Sequence[Callback] = (), **kwargs: Any) -> Result:
    """One run, as `fedharness run`: e.g. run({"dataset": "digits", "rounds": 20}) or run(["rounds=20"], seed=1).

    The tqdm progress bar follows the `progress` key (on by default, also in notebooks). `callbacks`
    (fedharness.Callback: on_round_end, on_evaluation) see every round; one returning True stops the run,
    which ends with status `stopped`.
    """
    for cb in callbacks:
        missing = [m for m in ("on_round_end", "on_evaluation") if not callable(getattr(cb, m, None))]
        require(not missing, "callbacks", cb, f"a fedharness.Callback (subclass it); this one lacks {', '.join(missing)}")
    settings = load_settings(as_overrides(overrides, **kwargs))
    store = open_results(settings.results_dir)
    bar = ProgressBar(settings.rounds, settings.progress)
    try:
        result = execute(settings, callbacks=callbacks, hooks=[bar], store=store)
    except OSError as err:
        raise_for_results_write(settings.results_dir, err)
        raise
    finally:
        bar.close()
    return Result(result.results_dir, {result.run_id: result.status}, result.rows)


@dataclass(frozen=True)
class Study:
    """A finished Optuna study: its best trial and every trial as a DataFrame (the trials/ table)."""

    name: str
    best_params: dict[str, Any] | None
    best_value: float | None
    trials: pd.DataFrame
    text: str  # the summary `fedharness tune` prints


def tune(overrides: Overrides = None, **kwargs: Any) -> Study:
    """A study, as `fedharness tune`: e.g. tune(["tune=quadratic_lr", "tune.n_trials=8"])."""
    from fedharness.studies.tuning.spec import build_spec  # here: a run's process skips the tuning modules
    from fedharness.studies.tuning.study import tune as run_study

    require_extra("optuna", "command", "tune")  # the `tune` extra
    spec = build_spec(as_overrides(overrides, **kwargs))
    summary = run_study(spec, open_results(spec.results_dir))
    return Study(spec.study, summary.get("best_params"), summary.get("best_value"), summary["table"].to_pandas(),
                 summary["text"])


def sweep(overrides: Overrides = None, **kwargs: Any) -> Result:
    """A grid of runs, as `fedharness sweep`: e.g. sweep(["sweep=local_steps", "algorithm.local_steps=1,5"]).

    A grid dimension is a comma-separated list in the list form (`key=a,b`); progress lines go to the
    `fedharness.api` logger (shown by `logging.basicConfig(level=logging.INFO)`).
    """
    spec, jobs = plan(as_overrides(overrides, **kwargs))
    done = run_sweep(spec, jobs, echo=log.info)
    statuses = {j.run_id: done.outcomes[j.run_id].status for j in jobs if j.run_id in done.outcomes}
    return Result(done.results_dir, statuses)


def report(results_dir: str | Path, targets: Sequence[str] | None = None, scale_key: str | None = None,
           out: str | None = None, study: str | None = None, bootstrap: int | None = None,
           level: float = 0.95, series: str = "iterate"):
    """Rounds to target, speedup fits, plots and Markdown, as `fedharness report`; returns the Report
    (`.tables` of DataFrames, `.figures`, `.markdown`)."""
    from fedharness.studies.reports.analysis import parse_target
    from fedharness.studies.reports.data import load_results
    from fedharness.studies.reports.report import build_report

    parsed = None if targets is None else [parse_target(t) for t in targets]
    return build_report(load_results(str(results_dir), study), parsed, scale_key, out, bootstrap, level, series)
