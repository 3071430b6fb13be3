"""A tuning study's spec: `conf/tune/<name>.yaml` + `tune.*` overrides, composed and validated into a TuneSpec.

Everything is checked before the study exists: the space, the objective, the budget, the sampler and pruner
settings, the storage URL's form, and a probe config at every end of the space (unknown keys, values a part
rejects, a budget smaller than one round). `trial_config` turns one point of the space into a run config.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedharness.algorithms.registry import build_algorithm
from fedharness.core.ray_cluster import parse_address
from fedharness.config.load import load_config
from fedharness.algorithms.series import build_series
from fedharness.errors import ConfigError, require
from fedharness.assembly.reference_policy import skip_reason
from fedharness.settings import RunSettings
from fedharness.sinks.masking import mask_secrets
from fedharness.results.store import open_store
from fedharness.studies.tuning.budget import Budget, problem_for
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
    batch: int = 1           # trials asked at a time and trained as one batched run (fedharness.runs.batch)
    worker_id: int = 0
    resources: dict = field(default_factory=dict, hash=False)
    ray_address: str | None = None
    plots: bool = True
    compare: dict = field(default_factory=dict, hash=False)
    base_seed: int = 0
    base_data_seed: int | None = None

    @property
    def out_prefix(self) -> str:
        """Where the study's own files (best.overrides, plots) go in its results store."""
        return f"tune/{self.study}"

    def describe(self) -> dict:
        """What must match when a study is continued: the same objective and budget."""
        return {"objective": self.objective.name, "direction": self.objective.direction,
                "budget_kind": self.budget.kind, "budget_total": self.budget.total}



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
        try:
            parse_address(tcfg.get("ray_address"))
        except ConfigError as err:
            raise ConfigError("tune.ray_address", err.value, err.allowed) from None
    algorithm = base_cfg["algorithm"]["name"]
    name = study or tcfg.get("study") or f"{tune_name}-{algorithm}"
    require(isinstance(name, str) and bool(re.fullmatch(STUDY_NAME, name)), "tune.study", name,
            "letters, digits, '_', '.', '-'")
    results_dir = open_store(base_cfg["results_dir"]).url  # an absolute path or an object-store URL
    spec = TuneSpec(
        tune_name=tune_name, study=name, run_overrides=run_overrides, params=params, objective=objective,
        budget=budget, n_trials=n_trials, sampler=sampler, seed=seed, startup_trials=startup, pruner=pruner,
        storage=resolve_storage(tcfg.get("storage"), results_dir), results_dir=results_dir, reports=reports,
        heartbeat_s=float(heartbeat), parallel=_int(tcfg, "parallel", 1), batch=_int(tcfg, "batch", 1),
        worker_id=_int(tcfg, "worker_id", 0),
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
    _validate_builds(base_cfg, spec, "the base config")
    for p in spec.params:
        for value in p.extremes():
            ov = p.override(value)
            _validate_builds(load_config([*spec.run_overrides, ov]), spec, ov)


def _validate_builds(cfg: dict, spec: TuneSpec, context: str) -> None:
    problem = problem_for(cfg)
    build_algorithm({**cfg["algorithm"], "rounds": cfg["rounds"]}, problem)
    build_series(cfg["replicas"], **cfg["algorithm"])
    spec.budget.rounds_for(cfg, context)
    if spec.objective.metric in ("subopt", "dist_to_opt"):
        why = skip_reason(RunSettings.from_config(cfg), problem)
        require(why is None, "tune.objective.metric", spec.objective.metric,
                f"needs an exact reference, and this problem gets none ({why}); use train_loss or test_acc")


def trial_config(spec: TuneSpec, values: dict[str, Any]) -> tuple[dict, list[str]]:
    """The run config of one point of the space, and the overrides that rebuild it with `fedharness run`."""
    trial_values = [p.override(values[p.name]) for p in spec.params]
    overrides = [*spec.run_overrides, *trial_values]
    cfg = load_config(list(spec.run_overrides), values=trial_values)  # the study's base composed once
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

