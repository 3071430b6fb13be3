"""The workers of a study: each claims and runs trials until the study holds n_trials finished ones, in this
process or as `tune.parallel` Ray tasks.

Exactly n_trials, with any number of concurrent workers on one storage: Optuna numbers trials serially (the
storage locks the study row), so a worker that asked for a trial keeps it only if fewer than n_trials non-failed
trials precede it; otherwise it is marked FAIL (user attr status=surplus) without running.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

from fedharness.backends import results_writer
from fedharness.core import ray_cluster
from fedharness.errors import ConfigError
from fedharness.base.extras import require_extra
from fedharness.registry.plugins import Carried, install, snapshot
from fedharness.runs.execute import execute
from fedharness.results.store import ResultsStore
from fedharness.studies.tuning.batched_trials import run_batch
from fedharness.studies.tuning.export import trial_status
from fedharness.studies.tuning.lease import Lease, reap_lost, trial_counts
from fedharness.studies.tuning.optuna_parts import ask_trial, open_study, quiet_optuna
from fedharness.studies.tuning.spec import TuneSpec
from fedharness.studies.tuning.trial import Reporter, tell_value, trial_line, trial_settings

logger = logging.getLogger(__name__)


def work(spec: TuneSpec, worker: int = 0, echo: Callable[[str], None] = logger.info,
         plugins: tuple[Carried, ...] = (), store: ResultsStore | None = None, study=None) -> int:
    """Claim and run trials until the study holds spec.n_trials finished ones; returns how many this ran.
    `plugins`: the driver's Python registrations, for a worker in another process. `store`: where the trials' runs
    record (a Ray worker gets the driver's, a results_writer.DriverStore; default: spec.results_dir's store).
    `study`: the study as the driver opened it, for a worker in its process (opening the storage again costs
    about 0.2 s: Optuna checks its tables); default: opened here."""
    install(plugins)
    quiet_optuna()
    study = study if study is not None else open_study(spec, worker)
    ran, poll = 0, min(1.0, spec.heartbeat_s)
    while True:
        trials = study.get_trials(deepcopy=False)
        if reap_lost(study, trials, spec):
            trials = study.get_trials(deepcopy=False)
        finished, live = trial_counts(trials)
        if finished >= spec.n_trials:
            return ran
        if live >= spec.n_trials:  # the remaining slots are running elsewhere: wait for them (or their loss)
            time.sleep(poll)
            continue
        if spec.batch > 1:  # tune.batch trials at once as one batched run
            ran += run_batch(spec, study, worker, echo, store, trials)
        else:
            ran += _run_one(spec, study, worker, len(trials), echo, store)


def _run_one(spec: TuneSpec, study, worker: int, trial_number: int,
             echo: Callable[[str], None] = logger.info, store: ResultsStore | None = None) -> int:
    """Ask for one trial, run it and tell it; 1 if it finished. `trial_number`: the study's length when the worker
    read it, the number a new trial gets unless another worker asks first; the sampler is seeded by the number the
    trial does get (an enqueued trial keeps its own), so the argument only names the race that the claim rule
    settles."""
    import optuna
    from optuna.trial import TrialState

    trial = ask_trial(spec, study, worker, queued=True)
    with Lease(trial, spec.heartbeat_s):
        earlier = [t for t in study.get_trials(deepcopy=False)
                   if t.number < trial.number and t.state != TrialState.FAIL]
        if len(earlier) >= spec.n_trials:
            trial.set_user_attr("status", "surplus")
            study.tell(trial, state=TrialState.FAIL)
            return 0
        try:
            value, reporter, attrs = run_trial(spec, trial, store)
        except optuna.TrialPruned:
            study.tell(trial, state=TrialState.PRUNED)
            echo(trial_line(spec, trial, None))
            return 1
        except BaseException as err:  # FAIL, not PRUNED, also when interrupted: the slot is run again
            interrupted = isinstance(err, KeyboardInterrupt)
            trial.set_user_attr("status", "interrupted" if interrupted else "failed")
            trial.set_user_attr("error", f"interrupted by {err}" if interrupted else f"{type(err).__name__}: {err}")
            study.tell(trial, state=TrialState.FAIL)
            raise
    return tell_value(spec, reporter, attrs, value, echo)


def run_trial(spec: TuneSpec, trial, store: ResultsStore | None = None) -> tuple[float, Reporter, dict]:
    """One trial: sample, build the config under the budget, run it (recording into `store`), score it. Returns
    its value, its reporter and the outcome's user attrs, which tell_value stores with the value, in one write."""
    import optuna

    settings, run_id = trial_settings(spec, trial)
    reporter = Reporter(spec, trial, settings.rounds)
    try:
        result = execute(settings, run_id=run_id, hooks=[reporter], store=store)
    except optuna.TrialPruned:
        reporter.finish({"status": "pruned", "budget_used": spec.budget.used(reporter.rows)})
        raise
    attrs = {"status": result.status, "budget_used": spec.budget.used(result.rows)}
    return spec.objective.value(result.rows, result.status), reporter, attrs


def connect_ray(address: str | None):
    """fedharness.core.ray_cluster's connection: a local Ray on 127.0.0.1 only, or a probed cluster address."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        return ray_cluster.connect(address)
    except ConfigError as err:  # name the tuner's key, not the executor's
        raise ConfigError("tune.ray_address", err.value, err.allowed) from None


def run_workers(spec: TuneSpec, store: ResultsStore, echo: Callable[[str], None] = logger.info, study=None) -> int:
    """Run the study to n_trials, the trials' runs recording into `store`: in this process, or as `parallel` Ray
    tasks with `resources` each. `study`: the driver's, which the worker in this process uses.

    Ray workers' output stays in Ray's logs (on a cluster it is on other machines); the driver
    echoes each trial as it lands in the storage instead.
    """
    if spec.parallel == 1:
        return work(spec, 0, echo, store=store, study=study)
    ray = require_extra("ray", "tune.parallel", spec.parallel)

    conn = connect_ray(spec.ray_address)
    try:
        res = dict(spec.resources)
        options = {"num_cpus": res.pop("num_cpus", 1), "num_gpus": res.pop("num_gpus", 0), "max_retries": 0}
        if res:
            options["resources"] = res
        task = ray.remote(work).options(**options)
        plugins = snapshot()  # the user's Python registrations, installed by each worker before its first trial
        # The workers record their runs through the driver (backends/results_writer.py): nodes need not share
        # results_dir. The Optuna storage is theirs to reach (a database server on a cluster: docs/tuning.md).
        with results_writer.driver_store(store) as remote:
            pending = [task.remote(spec, i, plugins=plugins, store=remote) for i in range(spec.parallel)]
            study, shown, ran = study if study is not None else open_study(spec), set(), 0
            while pending:
                done, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
                ran += sum(ray.get(done))  # raises a worker's error here
                for t in study.get_trials(deepcopy=False):
                    if t.state.is_finished() and t.number not in shown and t.user_attrs.get("status") != "surplus":
                        shown.add(t.number)
                        echo(trial_line(spec, t, t.value, trial_status(t)))
        return ran
    finally:
        conn.close()
