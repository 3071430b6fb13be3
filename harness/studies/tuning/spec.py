"""A tuning study's spec: `conf/tune/<name>.yaml` over `conf/tune/_base.yaml` (every key's default) + `tune.*`
overrides, checked against the keys TuneSettings declares and made a TuneSpec.

Everything is checked before the study exists: the keys, the space, the objective, the budget, the sampler and
pruner settings, the storage URL's form, and a probe config at every end of the space (unknown keys, values a part
rejects, a budget smaller than one round). `trial_config` turns one point of the space into a run config.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from fedharness.algorithms.registry import build_algorithm
from fedharness.core.ray_cluster import parse_address
from fedharness.config.compose import CONF_DIR
from fedharness.config.help import describe_declared
from fedharness.config.load import load_config
from fedharness.base.mappings import merged
from fedharness.config.overrides import override_key, split_overrides
from fedharness.config.schema import check_declared, declared_settings
from fedharness.algorithms.series import build_series
from fedharness.errors import ConfigError, require
from fedharness.assembly.reference_policy import skip_reason
from fedharness.keys import Key, _is_list, _is_real, boolean, choice, integer, number, text
from fedharness.settings import RunSettings, key, section
from fedharness.sinks.masking import mask_secrets
from fedharness.results import layout
from fedharness.results.store import store_url
from fedharness.studies.tuning.budget import KINDS, Budget, problem_for
from fedharness.studies.tuning.objective import CLIENT_METRICS, DIRECTIONS, METRICS, USER_METRICS, Objective
from fedharness.studies.tuning.space import Param, grid_space, parse_space

SAMPLERS = ("tpe", "random", "grid", "cmaes")
PRUNERS = ("none", "median", "successive_halving", "hyperband")
DRIVEN_KEYS = ("rounds",)  # set by the budget for every trial
STUDY_NAME = r"[A-Za-z0-9][A-Za-z0-9_.\-]*"


# --- the keys of a tune config (defaults: conf/tune/_base.yaml) --------------------------------------------

@dataclass(frozen=True, slots=True)
class ObjectiveSettings:
    """What a trial is scored by (fedharness.studies.tuning.objective)."""

    metric: str = key(choice("train_loss | subopt | dist_to_opt | grad_norm_sq | test_loss | test_acc | "
                             "client_{acc,loss}_{mean,p10,p50,p90} (eval.per_client=true) (of the final round), or "
                             "your own (fedharness.register_metric)", lambda: (*METRICS, *USER_METRICS)))
    direction: str = key(choice("auto (test_acc and client_acc_* maximized, the rest minimized) | minimize | "
                                "maximize", DIRECTIONS))
    target: float | None = key(number("a number: the score is the rounds until the metric reaches it (minimized)",
                                      null="the metric's final value"))


@dataclass(frozen=True, slots=True)
class BudgetSettings:
    """Held fixed across trials: a trial runs the rounds it can afford (fedharness.studies.tuning.budget)."""

    kind: str = key(choice("local_steps (rounds x E) | rounds | grad_evals | bytes (up + down)", KINDS))
    total: int = key(integer("the budget of every trial, in `kind`", lo=1))


@dataclass(frozen=True, slots=True)
class SamplerSettings:
    name: str = key(choice("tpe | random | grid (every parameter needs choices) | cmaes", SAMPLERS))
    seed: int = key(integer("the sampler's seed (offset by worker_id)", lo=0))
    startup_trials: int = key(integer("random trials before TPE / CMA-ES take over; with tune.batch they form the "
                                      "first batch(es), whose values the model-based batches after them use", lo=0))


@dataclass(frozen=True, slots=True)
class PrunerSettings:
    name: str = key(choice("none | median | successive_halving | hyperband (batch-native: each tune.batch one "
                           "bracket, ranked at each rung); fed the metric at budget fractions 1/reports", PRUNERS))
    startup_trials: int = key(integer("median: trials finished before pruning starts", lo=0))
    warmup_steps: int = key(integer("median: reports before a trial can be pruned", lo=0))
    min_resource: int = key(integer("successive halving, hyperband: the first rung, in reports", lo=1))
    reduction_factor: int = key(integer("successive halving, hyperband: 1/this of a rung goes on to the next", lo=2))


@dataclass(frozen=True, slots=True)
class CompareSettings:
    """`fedharness tune --compare a,b,c`: each algorithm's best config re-run with fresh seeds."""

    replicas: int = key(integer("independent seeds of each re-run", lo=1))
    seed: int = key(integer("the re-runs' seed (the data stay those of the tuning seed)", lo=0))


def _resources() -> Key:
    return Key(lambda v: isinstance(v, dict) and all(_is_real(x) and x >= 0 for x in v.values()),
               "a mapping of Ray resource names (num_cpus, num_gpus, a node's own) to numbers >= 0",
               "Ray resource request of each task")


@dataclass(frozen=True, slots=True)
class TuneSettings:
    """A tune config, checked: `tune=NAME` (conf/tune/) over conf/tune/_base.yaml, with `tune.KEY=value`."""

    study: str | None = key(text("the study's name; re-running a study name continues it",
                                 null="<tune config name>-<algorithm>"))
    n_trials: int = key(integer("finished (complete or pruned) trials the study should hold; failed ones are re-run",
                                lo=1))
    base: tuple[str, ...] = key(Key(lambda v: _is_list(v, lambda o: isinstance(o, str)),
                                    "a list of run overrides, e.g. [dataset=quadratic]",
                                    "run overrides every trial starts from (the command line's come after these)"))
    space: dict = key(Key(lambda v: isinstance(v, dict), "a mapping name -> {key, type, low, high, log, step, choices}",
                          "the parameters: name -> {key: any run-config key by its dotted name, type, low, high, "
                          "log, step, choices}; tune.space.NAME=null drops one"))
    objective: ObjectiveSettings = section(ObjectiveSettings)
    budget: BudgetSettings = section(BudgetSettings)
    sampler: SamplerSettings = section(SamplerSettings)
    pruner: PrunerSettings = section(PrunerSettings)
    reports: int | None = key(integer("evaluations per trial (eval_every = rounds // reports)", lo=1,
                                      null="keep eval_every"))
    storage: str | None = key(text("any SQLAlchemy URL | journal:PATH", null="sqlite <results_dir>/optuna.db"))
    parallel: int = key(integer(">1: that many Ray tasks claim trials concurrently", lo=1))
    batch: int = key(integer(">1: each worker asks for this many trials at a time and trains them as one batched "
                             "run (at most n_trials; TPE treats a batch's trials as running: constant liar; CMA-ES "
                             "runs a batch as one generation, popsize = batch)", lo=1))
    resources: dict = key(_resources())
    ray_address: str | None = key(text("host:port of a cluster's GCS, or auto", null="a local Ray on 127.0.0.1"))
    worker_id: int = key(integer("offsets the sampler seed; give concurrent `fedharness tune` processes different "
                                 "ids", lo=0))
    heartbeat_s: float = key(number("a trial whose worker stops beating for 3 heartbeats is failed and re-run (s)",
                                    lo=0, lo_open=True))
    plots: bool = key(boolean("history.png and importance.png under <results_dir>/tune/<study>/"))
    compare: CompareSettings = section(CompareSettings)


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
    batch: int = 1           # trials asked at a time and trained as one batched run (fedharness.runs.batch)
    worker_id: int = 0
    resources: dict = field(default_factory=dict, hash=False)
    ray_address: str | None = None
    plots: bool = True
    compare: dict = field(default_factory=dict, hash=False)
    base_seed: int = 0
    base_data_seed: int | None = None

    def describe(self) -> dict:
        """What must match when a study is continued: the same objective and budget."""
        return {"objective": self.objective.name, "direction": self.objective.direction,
                "budget_kind": self.budget.kind, "budget_total": self.budget.total}


def split_tune(overrides: list[str]) -> tuple[str, list[str], list[str]]:
    """(tune config name, default unless `tune=NAME`; tune.* overrides; run overrides)."""
    name, tune_ovs, run_ovs = split_overrides(overrides, "tune")
    return name or "default", tune_ovs, run_ovs


@lru_cache(maxsize=1)
def _base_defaults() -> dict:
    """Every tune key's default: conf/tune/_base.yaml (read only: merged() copies)."""
    return OmegaConf.to_container(OmegaConf.load(CONF_DIR / "tune" / "_base.yaml"), resolve=True)


def compose_tune(tune_name: str, tune_ovs: list[str]) -> dict:
    """`conf/tune/<name>.yaml` over conf/tune/_base.yaml, with `tune.*` overrides applied as replacements, not
    merges; checked against TuneSettings' keys.

    So `tune.space.mu={key: algorithm.mu, low: 1.0e-4, high: 1.0, log: true}` adds or replaces a
    whole parameter, `tune.space.local_steps=null` drops one, and `tune.space.client_lr.high=0.5`
    sets one field. A key TuneSettings does not declare is refused, with or without `+`.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    tcfg = merged(_base_defaults(), load_config([f"+tune={tune_name}"])["tune"])
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
            node = node.setdefault(part, {})
            require(isinstance(node, dict), ".".join(["tune", *parents[:i + 1]]), node, "not a mapping")
        if ov.is_delete():
            node.pop(leaf, None)
        else:
            node[leaf] = ov.value()
    check_declared(TuneSettings, tcfg, "tune.")
    return tcfg


def describe_tune(option: str | None = None) -> str:
    """`fedharness config tune [NAME]` and `fedharness tune --help`: every tune.* key with its default and doc."""
    option = option or "default"
    return describe_declared("tune", option, TuneSettings, compose_tune(option, []))


def build_spec(overrides: list[str], extra_run_overrides: tuple[str, ...] = (), study: str | None = None,
               probe: bool = True) -> TuneSpec:
    """Compose and validate a tuning spec; raises ConfigError before any file or study exists."""
    tune_name, tune_ovs, run_ovs = split_tune(overrides)
    tune: TuneSettings = declared_settings(TuneSettings, compose_tune(tune_name, tune_ovs))
    run_overrides = tuple([*tune.base, *run_ovs, *extra_run_overrides])
    for ov in run_overrides:
        require(override_key(ov) not in DRIVEN_KEYS, override_key(ov), ov.partition("=")[2],
                "set by the budget in tuning; use tune.budget.kind=rounds tune.budget.total=N")
    base_cfg = load_config(list(run_overrides), values=[])  # composed once for the probes and every trial

    params = tuple(parse_space(tune.space))
    objective = Objective.of(tune.objective.metric, tune.objective.direction, tune.objective.target)
    budget = Budget(tune.budget.kind, tune.budget.total)
    if tune.sampler.name == "grid":
        size = math.prod(len(v) for v in grid_space(list(params)).values())
        require(tune.n_trials <= size, "tune.n_trials", tune.n_trials,
                f"the grid has {size} points: use at most {size}")
    require(tune.pruner.name == "none" or objective.target is None, "tune.pruner.name", tune.pruner.name,
            "pruning compares intermediate values of a final metric; use none with objective.target")
    require(tune.batch <= tune.n_trials, "tune.batch", tune.batch,
            f"at most tune.n_trials ({tune.n_trials}): a batch holds trials of this study only")
    if tune.pruner.name == "hyperband":
        require(tune.batch >= tune.pruner.reduction_factor, "tune.pruner.name", "hyperband",
                f"ranks the trials of a batch: set tune.batch >= tune.pruner.reduction_factor "
                f"({tune.pruner.reduction_factor}), or use successive_halving one trial at a time")
        require(tune.reports is not None and tune.pruner.min_resource < tune.reports, "tune.pruner.min_resource",
                tune.pruner.min_resource, f"hyperband's first rung, in reports: below tune.reports ({tune.reports})")
    if tune.parallel > 1:
        try:
            parse_address(tune.ray_address)
        except ConfigError as err:
            raise ConfigError("tune.ray_address", err.value, err.allowed) from None
    name = study or tune.study or f"{tune_name}-{base_cfg['algorithm']['name']}"
    require(bool(re.fullmatch(STUDY_NAME, name)), "tune.study", name, "letters, digits, '_', '.', '-'")
    results_dir = store_url(base_cfg["results_dir"])  # an absolute path or an object-store URL
    spec = TuneSpec(
        tune_name=tune_name, study=name, run_overrides=run_overrides, params=params, objective=objective,
        budget=budget, n_trials=tune.n_trials, sampler=tune.sampler.name, seed=tune.sampler.seed,
        startup_trials=tune.sampler.startup_trials, pruner=dataclasses.asdict(tune.pruner),
        storage=resolve_storage(tune.storage, results_dir), results_dir=results_dir, reports=tune.reports,
        heartbeat_s=float(tune.heartbeat_s), parallel=tune.parallel, batch=tune.batch, worker_id=tune.worker_id,
        resources=dict(tune.resources), ray_address=tune.ray_address, plots=tune.plots,
        compare=dataclasses.asdict(tune.compare), base_seed=base_cfg["seed"],
        base_data_seed=base_cfg["dataset"].get("data_seed"),
    )
    if probe:
        probe_space(spec, base_cfg)
    return spec


def probe_space(spec: TuneSpec, base_cfg: dict) -> None:
    """Build the config at both ends of every range and at every choice: unknown keys, values a part rejects
    and a budget smaller than one round all fail here, before the study is created."""
    _validate_builds(base_cfg, spec, "the base config")
    for p in spec.params:
        for value in p.extremes():
            ov = p.override(value)
            _validate_builds(load_config(list(spec.run_overrides), values=[ov]), spec, ov)


def _validate_builds(cfg: dict, spec: TuneSpec, context: str) -> None:
    problem = problem_for(cfg)
    build_algorithm({**cfg["algorithm"], "rounds": cfg["rounds"]}, problem)
    build_series(cfg["replicas"], **cfg["algorithm"])
    spec.budget.rounds_for(cfg, context)
    if spec.objective.metric in ("subopt", "dist_to_opt"):
        why = skip_reason(RunSettings.from_config(cfg), problem)
        require(why is None, "tune.objective.metric", spec.objective.metric,
                f"needs an exact reference, and this problem gets none ({why}); use train_loss or test_acc")
    if spec.objective.metric in CLIENT_METRICS:
        scored = RunSettings.from_config(cfg).eval  # eval.personal beyond [global] turns per_client on
        require(scored.per_client and "global" in scored.personal, "tune.objective.metric", spec.objective.metric,
                "needs eval.per_client=true (per-client evaluation of the global model), which the trials' runs "
                "do not have")


def trial_config(spec: TuneSpec, values: dict[str, Any]) -> tuple[dict, list[str]]:
    """The run config of one point of the space, and the overrides that rebuild it with `fedharness run`."""
    trial_values = [p.override(values[p.name]) for p in spec.params]
    overrides = [*spec.run_overrides, *trial_values]
    cfg = load_config(list(spec.run_overrides), values=trial_values)  # the study's base composed once
    if spec.objective.metric != "grad_norm_sq" and all(override_key(ov) != "eval.grad_norm" for ov in overrides):
        # nothing reads it: evaluations compute the loss alone. Not in `overrides`: no other value changes, and a
        # re-run of them (best.overrides, --compare) records grad_norm_sq too
        cfg["eval"]["grad_norm"] = False
    wanted = [m for m in spec.objective.run_metrics if m not in cfg["metrics"]]
    if wanted:  # the objective is a user metric: the trial's run computes it
        cfg["metrics"] = [*cfg["metrics"], *wanted]
        overrides.append(f"metrics=[{','.join(cfg['metrics'])}]")
    cfg["rounds"] = spec.budget.rounds_for(cfg, " ".join(p.override(values[p.name]) for p in spec.params))
    overrides.append(f"rounds={cfg['rounds']}")
    if spec.reports is not None:
        cfg["eval_every"] = max(1, cfg["rounds"] // spec.reports)
        overrides.append(f"eval_every={cfg['eval_every']}")
    cfg["results_dir"] = spec.results_dir
    cfg["progress"] = False
    return cfg, overrides


# ------------------------------------------------------------------------------------------- storage URL


def resolve_storage(url: Any, results_dir: str) -> str:
    """null -> SQLite file `<results_dir>/optuna.db`; `journal:PATH` -> Optuna journal file; else SQLAlchemy URL."""
    if url is None:
        require("://" not in results_dir, "tune.storage", url, f"a journal:PATH or a database URL: results_dir "
                f"{results_dir} is an object store, which cannot hold the SQLite file that null means")
        return "sqlite:///" + str(Path(results_dir) / layout.OPTUNA_DB)
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

