"""`fedharness tune`: an Optuna study over run configs, every trial under the same budget.

Flow: compose `conf/tune/<name>.yaml` + overrides into a TuneSpec and validate everything
(space, objective, budget, a probe config at every end of the space, storage reachable)
before the study exists; then workers (this process, or `tune.parallel` Ray tasks) claim
trials until the study holds `tune.n_trials` finished ones (COMPLETE or PRUNED); then the
`trials/` Parquet, the best overrides and the plots are written.

Exactly n_trials, with any number of concurrent workers on one storage: Optuna numbers
trials serially (the storage locks the study row), so a worker that asked for a trial keeps
it only if fewer than n_trials non-failed trials precede it; otherwise it is marked FAIL
(user attr status=surplus) without running. A worker whose process dies stops refreshing
its trial's heartbeat (user attr `heartbeat_at`); after 3 heartbeats the trial is marked
FAIL (status lost) by whoever is still running, and its slot is run again. Failed trials
never count, so a resumed study re-runs them and keeps every finished trial.
"""

from __future__ import annotations

import math
import os
import platform
import re
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedharness.errors import ConfigError, require
from fedharness.lifecycle import RunInterrupted
from fedharness.sinks.masking import mask_secrets
from fedharness.studies.tuning.budget import Budget
from fedharness.studies.tuning.objective import Objective
from fedharness.studies.tuning.space import Param, grid_space, parse_space

SAMPLERS = ("tpe", "random", "grid", "cmaes")
PRUNERS = ("none", "median", "successive_halving")
DRIVEN_KEYS = ("rounds",)  # set by the budget for every trial
STUDY_NAME = r"[A-Za-z0-9][A-Za-z0-9_.\-]*"


@dataclass(frozen=True)
class TuneSpec:
    """Everything a worker needs (plain data: it travels to Ray workers)."""

    tune_name: str
    study: str
    run_overrides: tuple[str, ...]
    params: tuple[Param, ...]
    objective: Objective
    budget: Budget
    n_trials: int
    sampler: str
    seed: int
    startup_trials: int
    pruner: dict = field(hash=False)
    storage: str = ""
    results_dir: str = ""
    reports: int | None = 10
    heartbeat_s: float = 10.0
    parallel: int = 1
    worker_id: int = 0
    resources: dict = field(default_factory=dict, hash=False)
    ray_address: str | None = None
    plots: bool = True
    compare: dict = field(default_factory=dict, hash=False)
    base_seed: int = 0
    base_data_seed: int | None = None

    @property
    def out_dir(self) -> Path:
        return Path(self.results_dir) / "tune" / self.study

    def describe(self) -> dict:
        """What must match when a study is continued: the same objective and budget."""
        return {"objective": self.objective.name, "direction": self.objective.direction,
                "budget_kind": self.budget.kind, "budget_total": self.budget.total}


# ---------------------------------------------------------------------------------------------- spec


def _override_key(ov: str) -> str:
    return ov.lstrip("+~").partition("=")[0]


def split_overrides(overrides: list[str]) -> tuple[str, list[str], list[str]]:
    """(tune config name, tune.* overrides, run overrides)."""
    name, tune_ovs, run_ovs = "default", [], []
    for ov in overrides:
        key = _override_key(ov)
        if key == "tune":
            name = ov.partition("=")[2]
        elif key.startswith("tune."):
            tune_ovs.append(ov)
        else:
            run_ovs.append(ov)
    return name, tune_ovs, run_ovs


def compose_tune(tune_name: str, tune_ovs: list[str]) -> dict:
    """`conf/tune/<name>.yaml` with `tune.*` overrides applied as replacements, not merges.

    So `tune.space.mu={key: algorithm.mu, low: 1.0e-4, high: 1.0, log: true}` adds or replaces a
    whole parameter, `tune.space.local_steps=null` drops one, and `tune.space.client_lr.high=0.5`
    sets one field. Outside `tune.space` a key must exist unless it is added with `+`.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    from fedharness.config import load_config

    tcfg = load_config([f"+tune={tune_name}"])["tune"]
    try:
        parsed = OverridesParser.create().parse_overrides(list(tune_ovs))
    except OverrideParseException as err:
        raise ConfigError("tune", " ".join(tune_ovs), str(err).splitlines()[0]) from None
    for ov in parsed:
        key = ov.key_or_group
        require(not ov.is_sweep_override(), key, ov.input_line, "one value per key (tuning is not a sweep)")
        *parents, leaf = key.split(".")[1:]
        node = tcfg
        for i, part in enumerate(parents):
            require(isinstance(node, dict) and (part in node or ov.is_add() or ov.is_force_add()),
                    ".".join(["tune", *parents[:i + 1]]), None, "not a key of the tune config")
            node = node.setdefault(part, {})
            require(isinstance(node, dict), ".".join(["tune", *parents[:i + 1]]), node, "not a mapping")
        in_space = parents[:1] == ["space"]
        if ov.is_delete():
            node.pop(leaf, None)
            continue
        require(leaf in node or in_space or ov.is_add() or ov.is_force_add(), key, ov.value(),
                f"not a key of the tune config; keys here: {', '.join(sorted(node))} (a new one: +{key}=...)")
        node[leaf] = ov.value()
    return tcfg


def _int(tcfg: dict, key: str, low: int, allow_none: bool = False) -> int | None:
    v = tcfg.get(key)
    if v is None and allow_none:
        return None
    require(isinstance(v, int) and not isinstance(v, bool) and v >= low, f"tune.{key}", v,
            f"must be an integer >= {low}" + (", or null" if allow_none else ""))
    return v


def _sub(tcfg: dict, key: str) -> dict:
    v = tcfg.get(key) or {}
    require(isinstance(v, dict), f"tune.{key}", v, "a mapping")
    return v


def build_spec(overrides: list[str], extra_run_overrides: tuple[str, ...] = (), study: str | None = None,
               probe: bool = True) -> TuneSpec:
    """Compose and validate a tuning spec; raises ConfigError before any file or study exists."""
    from fedharness.config import load_config

    tune_name, tune_ovs, run_ovs = split_overrides(overrides)
    tcfg = compose_tune(tune_name, tune_ovs)
    base = tcfg.get("base") or []
    require(isinstance(base, list) and all(isinstance(b, str) for b in base), "tune.base", base,
            "a list of run overrides, e.g. [dataset=quadratic]")
    run_overrides = tuple([*base, *run_ovs, *extra_run_overrides])
    for ov in run_overrides:
        require(_override_key(ov) not in DRIVEN_KEYS, _override_key(ov), ov.partition("=")[2],
                "set by the budget in tuning; use tune.budget.kind=rounds tune.budget.total=N")
    base_cfg = load_config(list(run_overrides))

    params = tuple(parse_space(tcfg.get("space")))
    objective = Objective.from_config(tcfg.get("objective"))
    budget = Budget.from_config(tcfg.get("budget"))
    scfg, pcfg = _sub(tcfg, "sampler"), _sub(tcfg, "pruner")
    sampler = scfg.get("name", "tpe")
    require(sampler in SAMPLERS, "tune.sampler.name", sampler, "one of: " + ", ".join(SAMPLERS))
    seed = scfg.get("seed", 0)
    require(isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0, "tune.sampler.seed", seed,
            "must be an integer >= 0")
    startup = scfg.get("startup_trials", 10)
    require(isinstance(startup, int) and startup >= 0, "tune.sampler.startup_trials", startup,
            "must be an integer >= 0")
    n_trials = _int(tcfg, "n_trials", 1)
    if sampler == "grid":
        size = math.prod(len(v) for v in grid_space(list(params)).values())
        require(n_trials <= size, "tune.n_trials", n_trials, f"the grid has {size} points: use at most {size}")
    pruner = _check_pruner(pcfg, objective)
    reports = _int(tcfg, "reports", 1, allow_none=True)
    heartbeat = tcfg.get("heartbeat_s", 10)
    require(isinstance(heartbeat, (int, float)) and not isinstance(heartbeat, bool) and heartbeat > 0,
            "tune.heartbeat_s", heartbeat, "must be a number of seconds > 0")
    resources = _sub(tcfg, "resources")
    for k, v in resources.items():
        require(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0, f"tune.resources.{k}", v,
                "must be a number >= 0")

    if _int(tcfg, "parallel", 1) > 1:
        from fedharness.backends.ray_cluster import parse_address

        try:
            parse_address(tcfg.get("ray_address"))
        except ConfigError as err:
            raise ConfigError("tune.ray_address", err.value, err.allowed) from None
    algorithm = base_cfg["algorithm"]["name"]
    name = study or tcfg.get("study") or f"{tune_name}-{algorithm}"
    require(isinstance(name, str) and bool(re.fullmatch(STUDY_NAME, name)), "tune.study", name,
            "letters, digits, '_', '.', '-'")
    results_dir = str(Path(base_cfg["results_dir"]).resolve())
    spec = TuneSpec(
        tune_name=tune_name, study=name, run_overrides=run_overrides, params=params, objective=objective,
        budget=budget, n_trials=n_trials, sampler=sampler, seed=seed, startup_trials=startup, pruner=pruner,
        storage=resolve_storage(tcfg.get("storage"), results_dir), results_dir=results_dir, reports=reports,
        heartbeat_s=float(heartbeat), parallel=_int(tcfg, "parallel", 1), worker_id=_int(tcfg, "worker_id", 0),
        resources=dict(resources), ray_address=tcfg.get("ray_address"), plots=bool(tcfg.get("plots", True)),
        compare=_sub(tcfg, "compare"), base_seed=base_cfg["seed"],
        base_data_seed=base_cfg["dataset"].get("data_seed"),
    )
    if probe:
        probe_space(spec, base_cfg)
    return spec


def _check_pruner(pcfg: dict, objective: Objective) -> dict:
    name = pcfg.get("name", "none")
    require(name in PRUNERS, "tune.pruner.name", name, "one of: " + ", ".join(PRUNERS))
    require(name == "none" or objective.target is None, "tune.pruner.name", name,
            "pruning compares intermediate values of a final metric; use none with objective.target")
    out = {"name": name, "startup_trials": pcfg.get("startup_trials", 5), "warmup_steps": pcfg.get("warmup_steps", 2),
           "min_resource": pcfg.get("min_resource", 1), "reduction_factor": pcfg.get("reduction_factor", 3)}
    for key in ("startup_trials", "warmup_steps"):
        require(isinstance(out[key], int) and out[key] >= 0, f"tune.pruner.{key}", out[key], "an integer >= 0")
    for key, low in (("min_resource", 1), ("reduction_factor", 2)):
        require(isinstance(out[key], int) and out[key] >= low, f"tune.pruner.{key}", out[key], f"an integer >= {low}")
    return out


def probe_space(spec: TuneSpec, base_cfg: dict) -> None:
    """Build the config at both ends of every range and at every choice: unknown keys, values a part rejects
    and a budget smaller than one round all fail here, before the study is created."""
    from fedharness.config import load_config

    _validate_builds(base_cfg, spec, "the base config")
    for p in spec.params:
        for value in p.extremes():
            ov = p.override(value)
            _validate_builds(load_config([*spec.run_overrides, ov]), spec, ov)


def _validate_builds(cfg: dict, spec: TuneSpec, context: str) -> None:
    from fedharness.algorithms.registry import build_algorithm
    from fedharness.core.series import build_series
    from fedharness.studies.tuning.budget import problem_for

    problem = problem_for(cfg)
    build_algorithm({**cfg["algorithm"], "rounds": cfg["rounds"]}, problem)
    build_series(cfg["algorithm"], cfg["replicas"])
    spec.budget.rounds_for(cfg, context)
    if spec.objective.metric in ("subopt", "dist_to_opt"):
        from fedharness.reference_policy import skip_reason

        why = skip_reason(cfg, problem)
        require(why is None, "tune.objective.metric", spec.objective.metric,
                f"needs an exact reference, and this problem gets none ({why}); use train_loss or test_acc")


def trial_config(spec: TuneSpec, values: dict[str, Any]) -> tuple[dict, list[str]]:
    """The run config of one point of the space, and the overrides that rebuild it with `fedharness run`."""
    from fedharness.config import load_config

    overrides = [*spec.run_overrides, *(p.override(values[p.name]) for p in spec.params)]
    cfg = load_config(overrides)
    cfg["rounds"] = spec.budget.rounds_for(cfg, " ".join(p.override(values[p.name]) for p in spec.params))
    overrides.append(f"rounds={cfg['rounds']}")
    if spec.reports is not None:
        cfg["eval_every"] = max(1, cfg["rounds"] // spec.reports)
        overrides.append(f"eval_every={cfg['eval_every']}")
    cfg["results_dir"] = spec.results_dir
    cfg["progress"] = False
    return cfg, overrides


# ------------------------------------------------------------------------------------------- storage


def resolve_storage(url: Any, results_dir: str) -> str:
    """null -> SQLite file `<results_dir>/optuna.db`; `journal:PATH` -> Optuna journal file; else SQLAlchemy URL."""
    if url is None:
        return "sqlite:///" + str(Path(results_dir) / "optuna.db")
    require(isinstance(url, str) and url != "", "tune.storage", url,
            "null (SQLite under results_dir), journal:PATH, or an SQLAlchemy URL")
    if url.startswith("journal:"):
        path = url[len("journal:"):]
        path = path[2:] if path.startswith("//") else path
        require(path != "", "tune.storage", url, "journal:PATH names the journal file")
        return "journal:" + str(Path(path).resolve())
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        make_url(url)
    except ArgumentError as err:
        raise ConfigError("tune.storage", mask_secrets(url), f"not an SQLAlchemy URL ({err})") from None
    return url


def _engine_kwargs(url: str) -> dict:
    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": 60}}
    if url.startswith("postgresql"):
        return {"pool_pre_ping": True, "connect_args": {"connect_timeout": 10}}
    return {"pool_pre_ping": True}


def check_reachable(spec: TuneSpec) -> None:
    """Connect once before anything is created: an unreachable storage is a ConfigError, not a traceback."""
    if spec.storage.startswith("journal:"):
        parent = Path(spec.storage[len("journal:"):]).parent
        require(parent.is_dir() and os.access(parent, os.W_OK), "tune.storage", spec.storage,
                f"the journal's folder {parent} must exist and be writable")
        return
    import sqlalchemy

    if spec.storage == "sqlite:///" + str(Path(spec.results_dir) / "optuna.db"):
        Path(spec.results_dir).mkdir(parents=True, exist_ok=True)
    try:
        engine = sqlalchemy.create_engine(spec.storage, **_engine_kwargs(spec.storage))
        with engine.connect():
            pass
        engine.dispose()
    except Exception as err:  # driver missing, host down, bad credentials, unwritable file ...
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError("tune.storage", mask_secrets(spec.storage), f"cannot connect: {mask_secrets(first)}") from None


def open_storage(spec: TuneSpec, attempts: int = 5):
    import optuna
    from sqlalchemy.exc import SQLAlchemyError

    if spec.storage.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(spec.storage[len("journal:"):]))
    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(spec.storage, engine_kwargs=_engine_kwargs(spec.storage))
        except SQLAlchemyError:
            # Workers starting together on an empty database race to create Optuna's tables; the
            # loser hits a duplicate (or a lock) and finds the tables there when it tries again.
            if attempt == attempts - 1:
                raise
            time.sleep(0.5 * (attempt + 1))


def make_sampler(spec: TuneSpec, worker: int, trial_number: int = 0):
    """A sampler seeded by (seed, worker, trial number).

    Optuna's samplers keep no state but their random generator (CMA-ES keeps its own in the
    trials), so a fresh one per trial makes trial k's proposal depend only on the seed and the
    trials before it: a resumed or continued study goes on where it stopped instead of replaying
    its first proposals, and concurrent workers (worker index, tune.worker_id) propose different points.
    """
    import numpy as np
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
                                            warn_independent_sampling=False)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=spec.startup_trials)


def make_pruner(spec: TuneSpec):
    import optuna

    p = spec.pruner
    if p["name"] == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=p["startup_trials"], n_warmup_steps=p["warmup_steps"])
    if p["name"] == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=p["min_resource"],
                                                      reduction_factor=p["reduction_factor"])
    return optuna.pruners.NopPruner()


def open_study(spec: TuneSpec, worker: int = 0, create: bool = False):
    """Create the study (or continue it: same objective and budget required), or load it in a worker."""
    import optuna

    storage = open_storage(spec)
    if create:
        study = optuna.create_study(study_name=spec.study, storage=storage, sampler=make_sampler(spec, worker),
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
    return optuna.load_study(study_name=spec.study, storage=storage, sampler=make_sampler(spec, worker),
                             pruner=make_pruner(spec))


# -------------------------------------------------------------------------------------------- trials


class _Lease:
    """Refreshes the trial's `heartbeat_at` user attr while it runs, so others can tell a dead worker."""

    def __init__(self, trial, every_s: float):
        self.trial, self.every_s = trial, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self) -> "_Lease":
        self.trial.set_user_attr("heartbeat_at", time.time())
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.trial.set_user_attr("heartbeat_at", time.time())
            except Exception:  # the trial was finished meanwhile (or the storage is gone): stop beating
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _last_beat(t) -> float:
    return float(t.user_attrs.get("heartbeat_at", t.datetime_start.timestamp() if t.datetime_start else 0.0))


def _reap_lost(study, trials, spec: TuneSpec) -> None:
    from optuna.trial import TrialState

    grace = 3 * spec.heartbeat_s
    now = time.time()
    for t in trials:
        if t.state == TrialState.RUNNING and now - _last_beat(t) > grace:
            study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
            print(f"[{spec.study}] trial {t.number}: lost (no heartbeat for {now - _last_beat(t):.0f} s); "
                  "its slot is run again", flush=True)


def _counts(trials) -> tuple[int, int]:
    """(finished, live): finished = COMPLETE + PRUNED; live = finished + RUNNING + WAITING."""
    from optuna.trial import TrialState

    finished = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    live = sum(t.state != TrialState.FAIL for t in trials)
    return finished, live


def work(spec: TuneSpec, worker: int = 0) -> int:
    """Claim and run trials until the study holds spec.n_trials finished ones; returns how many this ran."""
    _quiet_optuna()
    study = open_study(spec, worker)
    ran, poll = 0, min(1.0, spec.heartbeat_s)
    while True:
        trials = study.get_trials(deepcopy=False)
        _reap_lost(study, trials, spec)
        finished, live = _counts(study.get_trials(deepcopy=False))
        if finished >= spec.n_trials:
            return ran
        if live >= spec.n_trials:  # the remaining slots are running elsewhere: wait for them (or their loss)
            time.sleep(poll)
            continue
        ran += _run_one(spec, study, worker, len(trials))


def _run_one(spec: TuneSpec, study, worker: int, trial_number: int) -> int:
    import optuna
    from optuna.trial import TrialState

    study.sampler = make_sampler(spec, worker, trial_number)
    trial = study.ask()
    with _Lease(trial, spec.heartbeat_s):
        earlier = [t for t in study.get_trials(deepcopy=False)
                   if t.number < trial.number and t.state != TrialState.FAIL]
        if len(earlier) >= spec.n_trials:
            trial.set_user_attr("status", "surplus")
            study.tell(trial, state=TrialState.FAIL)
            return 0
        try:
            value = run_trial(spec, trial)
        except optuna.TrialPruned:
            study.tell(trial, state=TrialState.PRUNED)
            _log_trial(spec, trial, None)
            return 1
        except BaseException as err:  # FAIL, not PRUNED, also when interrupted: the slot is run again
            interrupted = isinstance(err, KeyboardInterrupt)
            trial.set_user_attr("status", "interrupted" if interrupted else "failed")
            trial.set_user_attr("error", f"interrupted by {err}" if interrupted else f"{type(err).__name__}: {err}")
            study.tell(trial, state=TrialState.FAIL)
            raise
    try:
        study.tell(trial, value)
    except optuna.exceptions.UpdateFinishedTrialError:  # declared lost while it ran (missed heartbeats)
        print(f"[{spec.study}] trial {trial.number}: finished after it was declared lost; not counted", flush=True)
        return 0
    _log_trial(spec, trial, value)
    return 1


def run_trial(spec: TuneSpec, trial) -> float:
    """One trial: sample, build the config under the budget, run it (recording `study` and `trial`), score it."""
    import optuna

    from fedharness.runner import execute, new_run_id

    values = {p.name: p.suggest(trial) for p in spec.params}
    cfg, overrides = trial_config(spec, values)
    cfg["study"], cfg["trial"] = spec.study, trial.number
    if isinstance(cfg.get("wandb"), dict):  # W&B hook: one run per trial, grouped by study (group null = study)
        cfg["wandb"]["tags"] = [*cfg["wandb"].get("tags", []), f"trial={trial.number}"]
    run_id = new_run_id()
    worker = f"{platform.node()}:{os.getpid()}"
    for key, value in (("run_id", run_id), ("rounds", cfg["rounds"]), ("overrides", overrides), ("worker", worker)):
        trial.set_user_attr(key, value)
    reporter = _Reporter(spec, trial, cfg["rounds"])
    try:
        result = execute(cfg, progress=None, run_id=run_id, on_eval=reporter)
    except optuna.TrialPruned:
        trial.set_user_attr("status", "pruned")
        trial.set_user_attr("budget_used", spec.budget.used(reporter.rows))
        raise
    trial.set_user_attr("status", result.status)
    trial.set_user_attr("budget_used", spec.budget.used(result.rows))
    return spec.objective.value(result.rows, result.status)


class _Reporter:
    """Feeds pruners: after each evaluation, the objective's metric at step = the budget fraction spent,
    in units of 1/reports, so trials with different local steps are compared at equal budget."""

    def __init__(self, spec: TuneSpec, trial, rounds: int):
        self.spec, self.trial, self.rounds = spec, trial, rounds
        self.reports = spec.reports or rounds
        self.last_step = 0
        self.rows: list[dict] = []

    def __call__(self, rows: list[dict], state) -> None:
        import optuna

        self.rows = rows
        if self.spec.objective.target is not None or not rows:
            return
        rnd = rows[0]["round"]
        step = round(self.reports * rnd / self.rounds)
        value = self.spec.objective.intermediate(rows)
        if rnd == 0 or step <= self.last_step or value is None:
            return
        self.last_step = step
        self.trial.report(value, step)
        if self.trial.should_prune():
            raise optuna.TrialPruned(f"pruned at round {rnd} ({step}/{self.reports} of the budget)")


def _log_trial(spec: TuneSpec, trial, value: float | None, status: str | None = None) -> None:
    attrs = trial.user_attrs
    status = status or attrs.get("status")
    shown = "-" if value is None else f"{value:.6g}"
    params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items())
    print(f"[{spec.study}] trial {trial.number}: {spec.objective.name} = {shown} ({status}; "
          f"{attrs.get('rounds')} rounds, {attrs.get('budget_used')}/{spec.budget.total} {spec.budget.kind}) "
          f"{params}", flush=True)


def _quiet_optuna() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


# ------------------------------------------------------------------------------------------- workers


def connect_ray(address: str | None):
    """fedharness.backends.ray_cluster's connection: a local Ray on 127.0.0.1 only, or a probed cluster address."""
    from fedharness.backends import ray_cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        return ray_cluster.connect(address)
    except ConfigError as err:  # name the tuner's key, not the executor's
        raise ConfigError("tune.ray_address", err.value, err.allowed) from None


def run_workers(spec: TuneSpec) -> int:
    """Run the study to n_trials: in this process, or as `parallel` Ray tasks with `resources` each.

    Ray workers' output stays in Ray's logs (on a cluster it is on other machines); the driver
    prints each trial as it lands in the storage instead.
    """
    if spec.parallel == 1:
        return work(spec, 0)
    import ray

    from fedharness.studies.tuning.export import trial_status

    conn = connect_ray(spec.ray_address)
    try:
        res = dict(spec.resources)
        options = {"num_cpus": res.pop("num_cpus", 1), "num_gpus": res.pop("num_gpus", 0), "max_retries": 0}
        if res:
            options["resources"] = res
        task = ray.remote(work).options(**options)
        pending = [task.remote(spec, i) for i in range(spec.parallel)]
        study, shown, ran = open_study(spec), set(), 0
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            ran += sum(ray.get(done))  # raises a worker's error here
            for t in study.get_trials(deepcopy=False):
                if t.state.is_finished() and t.number not in shown and t.user_attrs.get("status") != "surplus":
                    shown.add(t.number)
                    _log_trial(spec, t, t.value, trial_status(t))
        return ran
    finally:
        conn.close()


# -------------------------------------------------------------------------------------------- driver


class StudyInterrupted(RunInterrupted):
    """SIGINT or SIGTERM while a study ran. The trial it cut short is FAIL (status interrupted) and its run
    `interrupted`; running the same command again continues the study to n_trials."""

    def __init__(self, signum: int, study: str, finished: int, n_trials: int):
        super().__init__(signum)
        self.study, self.finished, self.n_trials = study, finished, n_trials


def tune(spec: TuneSpec) -> dict:
    """Create or continue the study, run it to n_trials, export; returns the export summary.
    Raises StudyInterrupted on SIGINT/SIGTERM once the study exists (in the main thread, inside interrupts_raised)."""
    from fedharness.studies.tuning.export import export_study

    from fedharness.lifecycle import mark_lost_runs

    _quiet_optuna()
    check_reachable(spec)
    mark_lost_runs(spec.results_dir)  # trial runs a killed worker left `running`
    study = open_study(spec, create=True)
    print(f"[{spec.study}] {spec.n_trials} trials of {spec.sampler} ({spec.objective.name}, "
          f"{spec.objective.direction}; budget {spec.budget.total} {spec.budget.kind}) in {mask_secrets(spec.storage)}",
          flush=True)
    try:
        run_workers(spec)
        return export_study(spec, open_study(spec))
    except RunInterrupted as err:
        finished, _ = _counts(study.get_trials(deepcopy=False))
        raise StudyInterrupted(err.signum, spec.study, finished, spec.n_trials) from err
