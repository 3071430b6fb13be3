"""`fedharness tune`: an Optuna study over run configs, every trial under the same budget.

Flow: compose `conf/tune/<name>.yaml` + overrides into a TuneSpec and validate everything
(space, objective, budget, a probe config at every end of the space, storage reachable)
before the study exists; then workers (this process, or `tune.parallel` Ray tasks) claim
trials until the study holds `tune.n_trials` finished ones (COMPLETE or PRUNED); then the
`trials/` Parquet, the best overrides and the plots are written.

Exactly n_trials, with any number of concurrent workers on one storage (workers.py); a trial whose
worker died is found by its missed heartbeats and its slot run again (lease.py). Failed trials never
count, so a resumed study re-runs them and keeps every finished trial.

The jobs have a module each: spec.py (compose and validate), storage.py (connect), optuna_parts.py (sampler,
pruner, the study), lease.py (heartbeats, lost trials), workers.py (claim and run trials; Ray tasks),
batch_writes.py (a tune.batch batch's storage writes, a transaction each), export.py (trials/, best overrides,
plots); this module runs a study from its start to its export.
"""

from __future__ import annotations

import logging
from typing import Callable

from fedharness.runs.lifecycle import RunInterrupted
from fedharness.sinks.masking import mask_secrets
from fedharness.results.store import ResultsStore
from fedharness.studies.tuning import storage
from fedharness.studies.tuning.export import export_study
from fedharness.studies.tuning.lease import trial_counts
from fedharness.studies.tuning.optuna_parts import open_study, quiet_optuna
from fedharness.studies.tuning.spec import TuneSpec
from fedharness.studies.tuning.workers import run_workers

log = logging.getLogger(__name__)


class StudyInterrupted(RunInterrupted):
    """SIGINT or SIGTERM while a study ran. The trial it cut short is FAIL (status interrupted) and its run
    `interrupted`; running the same command again continues the study to n_trials."""

    def __init__(self, signum: int, study: str, finished: int, n_trials: int):
        super().__init__(signum)
        self.study, self.finished, self.n_trials = study, finished, n_trials


def tune(spec: TuneSpec, store: ResultsStore, echo: Callable[[str], None] = log.info) -> dict:
    """Create or continue the study, run it to n_trials, export; returns the export summary. `store`: the results
    store the command opened (fedharness.runs.lifecycle.open_results: trial runs a killed worker left `running` are
    marked lost there). Progress lines (the study, then each trial as it finishes) go to `echo`: the
    `fedharness.studies.tuning` logger unless the command line passes print.
    Raises StudyInterrupted on SIGINT/SIGTERM once the study exists (in the main thread, inside interrupts_raised)."""
    quiet_optuna()
    storage.check_reachable(spec)  # looked up on the module: tests stand a local database in for a server
    study = open_study(spec, create=True)
    echo(f"[{spec.study}] {spec.n_trials} trials of {spec.sampler} ({spec.objective.name}, "
         f"{spec.objective.direction}; budget {spec.budget.total} {spec.budget.kind}) in {mask_secrets(spec.storage)}")
    try:
        run_workers(spec, store, echo, study)
        return export_study(spec, study, store)  # get_trials reads the storage: what every worker told
    except RunInterrupted as err:
        finished, _ = trial_counts(study.get_trials(deepcopy=False))
        raise StudyInterrupted(err.signum, spec.study, finished, spec.n_trials) from err
