"""Optuna's parts of a study: its sampler and pruner, and the study itself, opened on the storage.

Optuna is imported inside each function: it is an optional extra, paid for only when a study runs.
"""

from __future__ import annotations

import warnings

import numpy as np

from fedharness.errors import ConfigError, require
from fedharness.sinks.masking import mask_secrets
from fedharness.studies.tuning import storage
from fedharness.studies.tuning.space import grid_space
from fedharness.studies.tuning.spec import TuneSpec


MODEL_BASED = ("tpe", "cmaes")  # samplers whose proposals come from finished trials after their start-up trials


def make_sampler(spec: TuneSpec, worker: int, trial_number: int = 0):
    """A sampler seeded by (seed, worker, trial number).

    Optuna's samplers keep no state but their random generator (CMA-ES keeps its own in the
    trials), so a fresh one per trial makes trial k's proposal depend only on the seed and the
    trials before it: a resumed or continued study goes on where it stopped instead of replaying
    its first proposals, and concurrent workers (worker index, tune.worker_id) propose different points.

    For batches (tune.batch) and concurrent workers: TPE treats the trials still running as the worst values seen
    (constant liar), so the trials of one batch spread out instead of piling on one point; CMA-ES runs a batch as one
    generation (popsize = tune.batch), which is how it is meant to run in parallel.
    """
    import optuna

    seed = int(np.random.SeedSequence([spec.seed, spec.worker_id, worker, trial_number]).generate_state(1)[0])
    if spec.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if spec.sampler == "grid":
        class Grid(optuna.samplers.GridSampler):
            def after_trial(self, study, trial, state, values) -> None:
                """No study.stop() when the grid is used up: the worker loop stops at n_trials (<= grid size)."""

        # grid ids index the seeded shuffle of the grid, so every instance must use the same seed
        return Grid(grid_space(list(spec.params)), seed=spec.seed)
    if spec.sampler == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed, n_startup_trials=spec.startup_trials,
                                            popsize=spec.batch if spec.batch > 1 else None,
                                            warn_independent_sampling=False)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=spec.startup_trials, constant_liar=True)


def next_batch_size(spec: TuneSpec, finished: int, live: int) -> int:
    """How many trials the next batch asks for: tune.batch, no more than the study still lacks. A model-based
    sampler proposes from finished trials, and a batch asks for all its trials before any finishes, so while its
    start-up trials have not finished a batch holds only start-up trials (the first batch is the start-up phase),
    and 0 (wait for them) once they are all asked for: the next batch's proposals are then all model-based."""
    size = min(spec.batch, spec.n_trials - live)
    if spec.sampler in MODEL_BASED and finished < spec.startup_trials:
        size = min(size, spec.startup_trials - live)
    return max(size, 0)


def make_pruner(spec: TuneSpec):
    import optuna

    p = spec.pruner
    if p["name"] == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=p["startup_trials"], n_warmup_steps=p["warmup_steps"])
    if p["name"] == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=p["min_resource"],
                                                      reduction_factor=p["reduction_factor"])
    if p["name"] == "hyperband":
        from fedharness.studies.tuning.halving import BatchHyperband

        return BatchHyperband(spec.reports, p["min_resource"], p["reduction_factor"])
    return optuna.pruners.NopPruner()


def ask_trial(spec: TuneSpec, study, worker: int, queued: bool):
    """`study.ask()` with the trial's sampler seeded by the trial's own number (make_sampler), so no two trials of a
    worker share a seed. The number is known only once the trial exists: an enqueued (WAITING) trial keeps the
    number it was given when enqueued, so a seed taken from the study's length repeated an earlier trial's
    proposal. `queued`: the study may hold WAITING trials (ask() runs those first); False skips that look, which
    reads every unfinished trial of the study (params, attrs, reports) from the storage: a batch of B trials asked
    one after another paid B such reads of up to B running trials. The rest is what ask() does (optuna 4 and 5):
    the sampler's cached view of the trials is dropped, so that it sees the trials asked for before this one."""
    study._thread_local.cached_all_trials = None
    trial_id = study._pop_waiting_trial_id() if queued else None
    if trial_id is None:
        trial_id = study._storage.create_new_trial(study._study_id)
    return start_trial(spec, study, worker, trial_id)


def start_trial(spec: TuneSpec, study, worker: int, trial_id: int, created=None):
    """The Trial of a created (RUNNING) trial `trial_id`, as ask_trial makes it: its sampler seeded by its number.
    `created`: the trial's FrozenTrial where this process has just created it (batch_writes.create_trials, a
    batch's trials together, each started just before it is sampled): optuna.Trial() then takes it instead of
    reading the trial back from the storage (a read of each of its tables, ~2 ms)."""
    import optuna

    study._thread_local.cached_all_trials = None
    if created is None:
        trial = optuna.Trial(study, trial_id)  # reads the trial, its number with it (a running trial is not cached)
    else:
        trial = _trial_of_created(study, created)
    study.sampler = make_sampler(spec, worker, trial.number)
    # Trial() told the previous sampler before_trial (Optuna's samplers: nothing to do); tell the trial's own
    frozen = trial._cached_frozen_trial
    study.sampler.before_trial(optuna.pruners._filter_study(study, frozen), frozen)
    return trial


class _CreatedTrialStorage:
    """The study's storage, but for get_trial of the one trial just created, which returns its FrozenTrial."""

    def __init__(self, storage, created):
        self.storage, self.created = storage, created

    def get_trial(self, trial_id: int):
        return self.created if trial_id == self.created._trial_id else self.storage.get_trial(trial_id)

    def __getattr__(self, name: str):
        return getattr(self.storage, name)


def _trial_of_created(study, created):
    """optuna.Trial(study, id) over the study's storage, with its one read of the trial served by `created`: its
    constructor is left to Optuna (it differs between Optuna 4 and 5), only the storage it reads through is lent
    for the call, then given back, to the study and to the trial."""
    import optuna

    storage = study._storage
    study._storage = _CreatedTrialStorage(storage, created)
    try:
        trial = optuna.Trial(study, created._trial_id)
    finally:
        study._storage = storage
    trial.storage = storage
    return trial


def open_bracket(study, trials: list) -> None:
    """Tell a batch-native pruner (halving.py) which trials train together; other pruners judge each trial alone."""
    if hasattr(study.pruner, "open_bracket"):
        study.pruner.open_bracket([t.number for t in trials])


def close_slot(study, number: int) -> None:
    """Tell a batch-native pruner that trial `number`'s run has ended (its slot left the batch)."""
    if hasattr(study.pruner, "leave"):
        study.pruner.leave(number)


def open_study(spec: TuneSpec, worker: int = 0, create: bool = False):
    """Create the study (or continue it: same objective and budget required), or load it in a worker."""
    import optuna

    store = storage.open_storage(spec)  # looked up on the module: tests stand a local database in for a server
    if create:
        study = optuna.create_study(study_name=spec.study, storage=store, sampler=make_sampler(spec, worker),
                                    pruner=make_pruner(spec), direction=spec.objective.direction,
                                    load_if_exists=True)
        require(study.direction.name.lower() == spec.objective.direction, "tune.objective.direction",
                spec.objective.direction, f"study {spec.study} exists as {study.direction.name.lower()}")
        held = study.user_attrs.get("fedharness")
        if held is None:
            study.set_user_attr("fedharness", spec.describe())
        elif held != spec.describe():
            raise ConfigError("tune.study", spec.study,
                              f"exists in {mask_secrets(spec.storage)} with {held}; a continued study keeps its "
                              "objective and budget: use another tune.study")
        return study
    return optuna.load_study(study_name=spec.study, storage=store, sampler=make_sampler(spec, worker),
                             pruner=make_pruner(spec))


def quiet_optuna() -> None:
    """Optuna's own INFO lines off (the workers report each trial), and its experimental-feature warnings."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
