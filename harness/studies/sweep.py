"""`fedharness sweep`: a study grid from `conf/sweep/NAME.yaml` plus Hydra-style command-line sweeps, run as Ray tasks.

A sweep config names what every run shares (`base`), what varies (`grid`: a cartesian product; `zip`: keys that
vary together, e.g. a horizon tied to the number of clients), and how step sizes are set per grid point
(`protocol`: fixed, Yang et al.'s theory schedule, or a tuned override file). Every point is composed and
validated before any run starts, so a bad key stops the sweep with one message and no files. Each point is
one `fedharness.runs.execute.execute` in a Ray task with its resource request; all runs land in one results directory with
`study` = the sweep's name. A run that fails is recorded with status=failed and the others go on.
"""

from __future__ import annotations

import datetime as _dt
import itertools
import json
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedharness.algorithms.step_sizes import yang_two_sided
from fedharness.backends import results_writer
from fedharness.core import ray_cluster
from fedharness.config.compose import CONF_DIR, choices_and_values, group_options
from fedharness.config.help import describe_declared
from fedharness.config.load import load_config, load_settings
from fedharness.base.mappings import merged
from fedharness.config.overrides import dict_overrides, format_value, override_key, split_overrides
from fedharness.config.schema import check_declared, declared_settings
from fedharness.errors import ConfigError, require
from fedharness.keys import Key, _is_int, _is_list, _is_real, choice, integer, number, text
from fedharness.base.extras import require_extra
from fedharness.registry.plugins import Carried, install, snapshot
from fedharness.settings import key, section
from fedharness.runs.lifecycle import RunInterrupted, interrupts_raised, open_results, record_failed_run
from fedharness.base.progress import echo
from fedharness.runs.batch import Slot
from fedharness.runs.execute import execute_runs, new_run_id
from fedharness.results import layout
from fedharness.results.store import ResultsStore
from fedharness.studies.grouping import group_batches

PROTOCOLS = ("fixed", "theory", "tuned")
RUNNERS = ("ray", "local")
PROTOCOL_KEYS = {"fixed": ("name",), "theory": ("name", "c1", "c2", "T"), "tuned": ("name", "file", "keys")}


# ---------------------------------------------------------------- the keys of a sweep config (defaults: conf/sweep/_base.yaml)

@dataclass(frozen=True, slots=True)
class ProtocolSettings:
    """How the step sizes are set per grid point; a protocol's keys are left at their defaults by the others."""

    name: str = key(choice("fixed (as configured) | theory (Yang et al.'s two-sided step sizes) | tuned (a tuner's "
                           "override file)", PROTOCOLS))
    c1: float = key(number("theory: client_lr = c1 / (K sqrt(T))", lo=0, lo_open=True))
    c2: float = key(number("theory: server_lr = c2 sqrt(K n)", lo=0, lo_open=True))
    T: int | None = key(integer("theory: the horizon", lo=1, null="each run's rounds"))
    file: str | None = key(text("tuned: the tuner's override file (YAML/JSON mapping, or one key=value per line); "
                                "'{algorithm}' in it is replaced by each point's algorithm", null="none"))
    keys: tuple[str, ...] | None = key(Key(lambda v: v is None or _is_list(v, lambda k: isinstance(k, str)),
                                           "null (every override in the file) or a list of keys to take from it",
                                           "tuned: the keys taken from the file; null: every override in it"))


def _is_grid(v: Any) -> bool:
    return isinstance(v, dict) or (isinstance(v, list) and len(v) >= 1 and all(isinstance(g, dict) for g in v))


@dataclass(frozen=True, slots=True)
class SweepSettings:
    """A sweep config, checked: conf/sweep/NAME.yaml (or a YAML file) over conf/sweep/_base.yaml, with sweep.KEY=V."""

    name: str | None = key(text("the sweep's name: the study of every run", null="the config's file name"))
    description: str | None = key(Key(lambda v: v is None or isinstance(v, str), "a string", "what the sweep shows"))
    results_dir: str | None = key(text("where every run of the sweep records", null="results/sweeps/<name>"))
    base: dict = key(Key(lambda v: isinstance(v, dict), "a mapping of run keys to values, e.g. {rounds: 100}",
                         "run key -> value, every run's (dotted keys: dataset.num_clients: 100)"))
    grid: dict = key(Key(_is_grid, "a mapping of run keys to lists of values, or a non-empty list of such mappings",
                         "run key -> list of values (a cartesian product), or a list of such grids (their union)"))
    zip: tuple = key(Key(lambda v: _is_list(v, lambda z: isinstance(z, list)),
                         "a list of lists of grid keys that vary together, e.g. [[algorithm.clients_per_round, rounds]]",
                         "lists of grid keys that vary together"))
    protocol: ProtocolSettings = section(ProtocolSettings)
    resources: dict = key(Key(lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
                              "a mapping of Ray resource names (num_cpus, num_gpus, a node's own) to numbers >= 0 "
                              "(fractions allowed)", "Ray resource request of each run"))
    runner: str = key(choice("ray (a Ray task per run) | local (one after the other in this process)", RUNNERS))
    batch: bool | int = key(Key(lambda v: isinstance(v, bool) or (_is_int(v) and v >= 1),
                                "true (points that differ only in batchable keys train as one batched run), false "
                                "(one run each), or an integer >= 1 (at most that many runs per batched run)",
                                "fold points that differ only in batchable keys into batched runs"))
    address: str | None = key(text("auto or host:port: a running Ray cluster", null="a local Ray"))
    report: dict = key(Key(lambda v: isinstance(v, dict), "a mapping", "fedharness report's settings for this study "
                           "(targets, scale_key, ...)"))


# ---------------------------------------------------------------- the spec

@dataclass
class SweepSpec:
    name: str
    results_dir: str
    base: list[str] = field(default_factory=list)  # overrides every run gets
    grid: list[dict[str, list[str]]] = field(default_factory=list)  # union of cartesian products
    zip: list[list[str]] = field(default_factory=list)  # keys of one grid that vary together
    protocol: dict[str, Any] = field(default_factory=lambda: {"name": "fixed"})
    resources: dict[str, float] = field(default_factory=lambda: {"num_cpus": 1, "num_gpus": 0})
    runner: str = "ray"
    address: str | None = None
    report: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    batch: bool | int = True  # fold points that differ only in batchable keys into batched runs (at most N each)


@dataclass
class Job:
    index: int
    run_id: str
    point: dict[str, str]  # the grid values of this point, as override strings
    overrides: list[str]  # everything the run is composed from


@dataclass
class JobOutcome:
    run_id: str
    status: str  # ok | diverged | failed
    seconds: float
    error: str | None = None
    worker: str | None = None  # host:pid of the process that ran it


def _mapping_overrides(section: str, value: Any) -> list[str]:
    require(isinstance(value, dict), section, value, "a mapping of run keys to values, e.g. {rounds: 100}")
    return [f"{k}={format_value(v)}" for k, v in value.items()]


def _grid(section: str, value: Any) -> list[dict[str, list[str]]]:
    grids = list(value) if isinstance(value, (list, tuple)) else [value]
    out = []
    for i, g in enumerate(grids):
        key = section if len(grids) == 1 else f"{section}[{i}]"
        require(isinstance(g, dict), key, g, "a mapping of run keys to lists of values")
        dims = {}
        for k, vals in g.items():
            vals = vals if isinstance(vals, list) else [vals]
            require(len(vals) >= 1, f"{key}.{k}", vals, "a non-empty list of values")
            dims[str(k)] = [format_value(v) for v in vals]
        out.append(dims)
    return out


def spec_from_dict(data: dict[str, Any], name: str) -> SweepSpec:
    """Check a sweep config (read over conf/sweep/_base.yaml, already merged with `sweep.*` overrides): its spec."""
    values = merged(_base_defaults(), data)
    check_declared(SweepSettings, values, "sweep.")
    settings: SweepSettings = declared_settings(SweepSettings, values)
    name = settings.name or name
    resources = dict(settings.resources)
    for resource, amount in resources.items():  # each entry checked alone, so the error names it
        require(_is_real(amount) and amount >= 0, f"sweep.resources.{resource}", amount,
                "a number >= 0 (fractions allowed)")
    require(resources["num_cpus"] > 0 or resources["num_gpus"] > 0, "sweep.resources.num_cpus",
            resources["num_cpus"], "a job needs some CPU or GPU")
    spec = SweepSpec(
        name=name, results_dir=settings.results_dir or f"results/sweeps/{name}",
        base=_mapping_overrides("sweep.base", settings.base), grid=_grid("sweep.grid", settings.grid),
        zip=[list(z) for z in settings.zip], protocol=_protocol(settings.protocol), resources=resources,
        runner=settings.runner, address=settings.address, report=dict(settings.report),
        description=settings.description or "", batch=settings.batch,
    )
    _check_zip(spec)
    return spec


def _protocol(protocol: ProtocolSettings) -> dict[str, Any]:
    """The named protocol's keys (the others' stay at their defaults), as the spec and its manifest hold them."""
    own, default = PROTOCOL_KEYS[protocol.name], _base_defaults()["protocol"]
    for name in ProtocolSettings.__dataclass_fields__:
        value = getattr(protocol, name)
        require(name in own or value == default[name], f"sweep.protocol.{name}", value,
                f"not a key of protocol {protocol.name} (its keys: {', '.join(own)}); leave it at {default[name]!r}")
    if protocol.name == "tuned":
        require(protocol.file is not None, "sweep.protocol.file", None,
                "a path to the tuner's override file (YAML/JSON mapping, or one key=value per line); "
                "'{algorithm}' in it is replaced by each point's algorithm")
    out = {name: getattr(protocol, name) for name in own}
    if protocol.name == "theory":
        out.update(c1=float(protocol.c1), c2=float(protocol.c2))
    if protocol.name == "tuned" and protocol.keys is not None:
        out["keys"] = list(protocol.keys)
    return out


@lru_cache(maxsize=1)
def _base_defaults() -> dict[str, Any]:
    """Every sweep key's default: conf/sweep/_base.yaml (read only: merged() copies)."""
    return OmegaConf.to_container(OmegaConf.load(CONF_DIR / "sweep" / "_base.yaml"))


def _check_zip(spec: SweepSpec) -> None:
    for z in spec.zip:
        for g in spec.grid:
            present = [k for k in z if k in g]
            if not present:
                continue
            require(len(present) == len(z), "sweep.zip", z, f"every key of a zip group must be in the grid "
                    f"(missing: {', '.join(k for k in z if k not in g)})")
            lengths = {k: len(g[k]) for k in z}
            require(len(set(lengths.values())) == 1, "sweep.zip", z,
                    f"keys that vary together need lists of one length (got {lengths})")


def read_config(name: str) -> tuple[dict[str, Any], str]:
    """conf/sweep/NAME.yaml, or a path to a YAML file, read as Hydra reads YAML (1e-3 is a float): (its mapping, its
    file name)."""
    path = Path(name)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        require(name in group_options("sweep"), "sweep", name, group_options("sweep") or "(no configs in conf/sweep)")
        path = CONF_DIR / "sweep" / f"{name}.yaml"
    data = OmegaConf.to_container(OmegaConf.load(path)) or {}
    require(isinstance(data, dict), "sweep", name, f"{path} must hold a mapping")
    return data, path.stem


def load_spec(name: str, sweep_overrides: list[str]) -> SweepSpec:
    """conf/sweep/NAME.yaml (or a path to a YAML file) merged with `sweep.KEY=VALUE` overrides."""
    data, stem = read_config(name)
    try:
        merged_cfg = OmegaConf.merge(OmegaConf.create(data), OmegaConf.from_dotlist(sweep_overrides))
    except OmegaConfBaseException as err:
        raise ConfigError("sweep", " ".join(sweep_overrides), str(err).splitlines()[0]) from None
    return spec_from_dict(OmegaConf.to_container(merged_cfg, resolve=True), stem)


def describe_sweep(name: str | None = None) -> str:
    """`fedharness config sweep [NAME]` and `fedharness sweep --help`: every sweep.* key with its default and doc
    (NAME's values where a config is named)."""
    values = merged(_base_defaults(), read_config(name)[0] if name else {})
    return describe_declared("sweep", name, SweepSettings, values)


# ---------------------------------------------------------------- command line

def split_args(args: list[str]) -> tuple[str, list[str], list[str], dict[str, list[str]]]:
    """`sweep=NAME`, `sweep.KEY=V` (sweep settings, as KEY=V), plain overrides, and Hydra sweeps (`k=a,b`, range())."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    name, own, rest = split_overrides(args, "sweep")
    require(name is not None, "sweep", None, "name a study: fedharness sweep sweep=NAME "
            f"(one of: {', '.join(group_options('sweep')) or 'none yet'})")
    for ov in own:
        require(not ov.startswith("~"), override_key(ov), ov, "a sweep key is set (sweep.KEY=VALUE), not removed")
    sweep_keys = [ov.lstrip("+")[len("sweep."):] for ov in own]
    plain, sweeps = [], {}
    try:
        parsed = OverridesParser.create().parse_overrides(rest)
    except OverrideParseException as err:
        raise ConfigError("overrides", " ".join(rest), str(err).splitlines()[0]) from None
    for text, ov in zip(rest, parsed):
        if ov.is_sweep_override():
            sweeps[ov.key_or_group] = list(ov.sweep_string_iterator())
        else:
            plain.append(text)
    return name, sweep_keys, plain, sweeps


def apply_cli(spec: SweepSpec, plain: list[str], sweeps: dict[str, list[str]]) -> SweepSpec:
    """Command-line sweeps become grid dimensions; a plain `k=v` fixes k (removing it from the grid).

    A zip keeps its other keys zipped: a fixed zipped key leaves the zip (every point of the zip gets the value),
    and a command-line list for a zipped key replaces that key's column, so it must have the zip's length.
    """
    base = list(spec.base)
    fixed = set()
    for text in plain:
        key = override_key(text)
        if key == "results_dir":
            spec.results_dir = text.partition("=")[2]
            continue
        base.append(text)
        fixed.add(key)
    zipped = {k for z in spec.zip for k in z}
    grid = []
    for g in spec.grid or [{}]:
        for key, vals in sweeps.items():
            if key in zipped and key in g:
                _check_zip_column(spec, g, key, vals)
        g = {k: sweeps.get(k, v) if k in zipped else v for k, v in g.items() if k not in fixed}
        g = {k: v for k, v in g.items() if k in zipped or k not in sweeps}
        g.update({k: v for k, v in sweeps.items() if k not in g})
        grid.append(g)
    spec.base, spec.grid = base, grid
    spec.zip = [kept for kept in ([k for k in z if k not in fixed] for z in spec.zip) if kept]
    _check_zip(spec)
    return spec


def _check_zip_column(spec: SweepSpec, g: dict[str, list[str]], key: str, vals: list[str]) -> None:
    """A command-line list for a zipped key replaces its column: it needs the zip's length."""
    group = next(z for z in spec.zip if key in z)
    length = len(g[key])
    require(len(vals) == length, key, ",".join(vals), f"{key} varies together with "
            f"{', '.join(k for k in group if k != key)} (sweep zip): give one value (the same for every point) "
            f"or {length} comma-separated values")


# ---------------------------------------------------------------- expansion

def grid_points(spec: SweepSpec) -> list[dict[str, str]]:
    """Every point of the union of grids; zipped keys advance together, in the order the config lists them."""
    points: list[dict[str, str]] = []
    for g in spec.grid or [{}]:
        dims: list[list[dict[str, str]]] = []
        done: set[str] = set()
        for key in g:
            if key in done:
                continue
            group = next((z for z in spec.zip if key in z), [key])
            dims.append([dict(zip(group, vals)) for vals in zip(*(g[k] for k in group))])
            done.update(group)
        for combo in itertools.product(*dims):
            point: dict[str, str] = {}
            for part in combo:
                point.update(part)
            if point not in points:
                points.append(point)
    return points


def read_override_file(path: str | Path) -> list[str]:
    """A tuner's best-parameter file: a YAML/JSON mapping (nested or dotted keys), a list, or key=value lines."""
    path = Path(path)
    require(path.is_file(), "sweep.protocol.file", str(path), "no such file")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml", ".json"):
        data = OmegaConf.to_container(OmegaConf.create(text))  # read as Hydra reads YAML: 1e-3 is a float
        if isinstance(data, dict):
            return dict_overrides(data)
        require(isinstance(data, list), "sweep.protocol.file", str(path), "a mapping or a list of key=value")
        return [str(x) for x in data]
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def clients_per_round(cfg: dict[str, Any]) -> int:
    """n in Yang et al.: all m clients under full participation, else the sampler's clients per round."""
    alg = cfg["algorithm"]
    return int(cfg["dataset"]["num_clients"] if alg["sampler"] == "full" else alg["clients_per_round"])


def theory_step_sizes(cfg: dict[str, Any], c1: float, c2: float, T: int | None = None) -> tuple[float, float]:
    """The theory protocol's (client_lr, server_lr) for a run config: Yang et al.'s two-sided step sizes
    (fedharness.algorithms.step_sizes.yang_two_sided) with K = algorithm.local_steps, n = clients_per_round(cfg)
    and T = the protocol's T, else the run's rounds."""
    alg = cfg["algorithm"]
    require(alg["local_work"] == "steps", "algorithm.local_work", alg["local_work"],
            "the theory protocol needs a fixed number of local steps K (local_work=steps)")
    require(alg["lr_schedule"] == "constant", "algorithm.lr_schedule", alg["lr_schedule"],
            "the theory protocol sets constant step sizes (lr_schedule=constant)")
    return yang_two_sided(int(alg["local_steps"]), clients_per_round(cfg), int(T or cfg["rounds"]), c1, c2)


def expand(spec: SweepSpec, new_id: Callable[[], str] | None = None) -> list[Job]:
    """Compose and validate every point (ConfigError before any file); protocol step sizes are set here."""
    new_id = new_id or new_run_id
    forced = [f"results_dir={spec.results_dir}", f"study={spec.name}", "progress=false"]
    jobs: list[Job] = []
    seen_ids: set[str] = set()
    for index, point in enumerate(grid_points(spec)):
        require("results_dir" not in point and "study" not in point, "sweep.grid", sorted(point),
                "results_dir and study are the sweep's own (one directory, study = the sweep's name)")
        overrides = list(spec.base)
        if spec.protocol["name"] == "tuned":
            algorithm = load_config(spec.base + [f"{k}={v}" for k, v in point.items()] + forced)["algorithm"]["name"]
            tuned = read_override_file(spec.protocol["file"].replace("{algorithm}", algorithm))
            keys = spec.protocol.get("keys")
            overrides += [o for o in tuned if keys is None or override_key(o) in keys]
        overrides += [f"{k}={v}" for k, v in point.items()] + forced
        choices, values = choices_and_values(overrides)
        cfg = load_config(choices, values=values)  # points that share their choices are composed once
        if spec.protocol["name"] == "theory":
            client_lr, server_lr = theory_step_sizes(cfg, spec.protocol["c1"], spec.protocol["c2"],
                                                     spec.protocol.get("T"))
            # Known keys, positive floats: the run composes these overrides again before it starts.
            overrides += [f"algorithm.client_lr={client_lr!r}", f"algorithm.server_lr={server_lr!r}"]
        run_id = new_id()
        while run_id in seen_ids:
            run_id = new_id()
        seen_ids.add(run_id)
        jobs.append(Job(index, run_id, point, overrides))
    require(len(jobs) >= 1, "sweep.grid", spec.grid, "the grid has no points")
    return jobs


# ---------------------------------------------------------------- running

def record_failure(overrides: list[str], run_id: str, error: str, store: ResultsStore) -> None:
    """A runs/ row with status=failed for a sweep run whose task ended before the run recorded its own end."""
    record_failed_run(load_settings(overrides), run_id, error, store)


def _task_start(num_threads: int) -> tuple[float, str]:
    """A sweep task's torch threads; its start time and worker name (host:pid) for its outcomes."""
    import platform

    import torch

    torch.set_num_threads(max(1, num_threads))
    return time.perf_counter(), f"{platform.node()}:{os.getpid()}"


def run_unit(overrides: list[list[str]], run_ids: list[str], num_threads: int = 1,
             plugins: tuple[Carried, ...] = (), store: ResultsStore | None = None) -> list[JobOutcome]:
    """Grid points as one run (this is what a Ray task runs, with the driver's registrations in `plugins`): one
    alone, or several that differ only in batchable keys as one batched run (fedharness.runs.batch), each recorded
    as its own run under its own run id; `seconds` is the run's. Never raises: failures become outcomes. `store`:
    where the runs record (a Ray task gets the driver's, a results_writer.DriverStore; default: the store their
    results_dir names)."""
    start, worker = _task_start(num_threads)
    try:
        install(plugins)
        slots = [Slot(load_settings(ovs), run_id) for ovs, run_id in zip(overrides, run_ids)]
        results = execute_runs(slots, store=store)  # records every run's end itself
    except Exception as err:  # refused before any run started (a bad config): nothing recorded yet
        error = f"{type(err).__name__}: {err}"
        try:
            for ovs, run_id in zip(overrides, run_ids):
                record_failure(ovs, run_id, error, store)
        except Exception:
            error += "\n(could not record the failure: " + traceback.format_exc(limit=1).strip() + ")"
        return [JobOutcome(run_id, "failed", time.perf_counter() - start, error, worker) for run_id in run_ids]
    seconds = time.perf_counter() - start
    return [JobOutcome(r.run_id, r.status, seconds, (r.error or "failed in its batch") if r.status == "failed" else None,
                       worker) for r in results]


def batch_units(jobs: list[Job], spec: SweepSpec) -> list[list[Job]]:
    """The jobs as the runs that execute them: points that differ only in batchable keys (fedharness.runs.batch)
    fold into one batched run of at most `sweep.batch` points; one job each with `sweep.batch: false`."""
    size = len(jobs) if spec.batch is True else int(spec.batch)
    if size <= 1:
        return [[job] for job in jobs]
    groups = group_batches([load_settings(job.overrides) for job in jobs], size)
    return [[jobs[i] for i in group] for group in groups]


def _run_local(units: list[list[Job]], spec: SweepSpec, on_done: Callable[[Job, JobOutcome], None],
               store: ResultsStore) -> None:
    threads = max(1, int(spec.resources["num_cpus"]))
    for unit in units:
        outcomes = run_unit([j.overrides for j in unit], [j.run_id for j in unit], threads, store=store)
        for job, outcome in zip(unit, outcomes):
            on_done(job, outcome)


def _run_ray(units: list[list[Job]], spec: SweepSpec, on_done: Callable[[Job, JobOutcome], None],
             store: ResultsStore) -> None:
    """One task per run (a job, or a batched run of several) with the sweep's resource request; results are handled
    as they finish. The tasks record through the driver (backends/results_writer.py): nodes need not share the
    results folder."""
    import ray

    cpus, gpus = spec.resources["num_cpus"], spec.resources["num_gpus"]
    custom = {k: v for k, v in spec.resources.items() if k not in ("num_cpus", "num_gpus")}
    task = ray.remote(run_unit).options(num_cpus=cpus, num_gpus=gpus, resources=custom, max_retries=0)
    threads = max(1, int(cpus))
    plugins = snapshot()  # the user's Python registrations, installed by each task before it composes its run
    with results_writer.driver_store(store) as remote:  # the driver's store: a relative results_dir is the driver's
        pending = {task.remote([j.overrides for j in unit], [j.run_id for j in unit], threads, plugins, remote): unit
                   for unit in units}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            unit = pending.pop(done[0])
            try:
                outcomes = ray.get(done[0])
            except Exception as err:  # the worker died (killed, out of memory): its runs are failed
                error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                for job in unit:
                    record_failure(job.overrides, job.run_id, error, store)
                outcomes = [JobOutcome(job.run_id, "failed", float("nan"), error) for job in unit]
            for job, outcome in zip(unit, outcomes):
                on_done(job, outcome)


def _check_job_fits(resources: dict[str, float]) -> None:
    """A request no node can meet would wait forever: say which resource instead."""
    nodes = ray_cluster.alive_nodes()
    for key, amount in resources.items():
        resource = {"num_cpus": "CPU", "num_gpus": "GPU"}.get(key, key)
        key = f"sweep.resources.{key}"
        largest = max((n["Resources"].get(resource, 0.0) for n in nodes), default=0.0)
        require(amount <= largest, key, amount, f"no node of the Ray cluster has {amount:g} {resource} "
                f"(the largest has {largest:g})")


@dataclass
class SweepResult:
    spec: SweepSpec
    jobs: list[Job]
    outcomes: dict[str, JobOutcome]
    manifest: str  # its key in the results store: sweeps/<name>-<time>.json
    results_dir: str  # the results store's url: an absolute path or an object-store URL

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for o in self.outcomes.values():
            out[o.status] = out.get(o.status, 0) + 1
        return out


def _write_manifest(store: ResultsStore, key: str, spec: SweepSpec, jobs: list[Job],
                    outcomes: dict[str, JobOutcome], started: str) -> None:
    """sweeps/<name>-<time>.json beside runs/ and rounds/: the grid of each run, read by `fedharness report`."""
    scale_key = spec.report.get("scale_key", "algorithm.clients_per_round")
    data = {
        "name": spec.name, "started_at": started, "spec": asdict(spec), "scale_key": scale_key,
        "grid_keys": sorted({k for j in jobs for k in j.point}),
        "jobs": [{"run_id": j.run_id, "point": j.point,
                  **({} if j.run_id not in outcomes else {"status": outcomes[j.run_id].status,
                                                          "seconds": outcomes[j.run_id].seconds,
                                                          "error": outcomes[j.run_id].error,
                                                          "worker": outcomes[j.run_id].worker})}
                 for j in jobs],
    }
    store.write(key, json.dumps(data, indent=1, default=str).encode())


def _label(point: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items()) or "(base config)"


def run_sweep(spec: SweepSpec, jobs: list[Job] | None = None, echo: Callable[[str], None] = print) -> SweepResult:
    """Run every job (Ray tasks, or in this process with runner=local); progress goes to `echo`."""
    jobs = jobs if jobs is not None else expand(spec)
    conn = None
    if spec.runner == "ray":  # reach the cluster and check the request fits before any file is written
        require_extra("ray", "sweep.runner", "ray")  # without the extra: one line naming fedharness[ray]

        conn = ray_cluster.connect(spec.address)
        try:
            _check_job_fits(spec.resources)
        except BaseException:
            conn.close()
            raise
    store = open_results(spec.results_dir)  # opened once here for the sweep's every run (CLI and Python API alike)
    started = _dt.datetime.now(_dt.timezone.utc)
    manifest = layout.manifest_key(spec.name, started.strftime("%Y%m%d-%H%M%S"))
    outcomes: dict[str, JobOutcome] = {}
    _write_manifest(store, manifest, spec, jobs, outcomes, started.isoformat(timespec="seconds"))
    cpus, gpus = spec.resources["num_cpus"], spec.resources["num_gpus"]
    request = f"{cpus:g} CPU" + (f", {gpus:g} GPU" if gpus else "")
    echo(f"sweep {spec.name}: {len(jobs)} runs, protocol {spec.protocol['name']}, runner {spec.runner} "
         f"({request} per run); results in {spec.results_dir}/")
    t0 = time.perf_counter()
    width = len(str(len(jobs)))

    def on_done(job: Job, outcome: JobOutcome) -> None:
        outcomes[job.run_id] = outcome
        secs = "" if math.isnan(outcome.seconds) else f"{outcome.seconds:6.1f}s"
        line = f"[{len(outcomes):>{width}}/{len(jobs)}] {outcome.status:<8} {secs:>7}  {job.run_id}  {_label(job.point)}"
        if outcome.error:
            line += f"\n    error: {outcome.error.splitlines()[0][:300]}"
        echo(line)

    try:
        (_run_local if spec.runner == "local" else _run_ray)(batch_units(jobs, spec), spec, on_done, store)
    finally:
        _write_manifest(store, manifest, spec, jobs, outcomes, started.isoformat(timespec="seconds"))
        if conn is not None:
            conn.close()
    result = SweepResult(spec, jobs, outcomes, manifest, store.url)
    counts = ", ".join(f"{n} {s}" for s, n in sorted(result.counts().items()))
    echo(f"sweep {spec.name} done in {time.perf_counter() - t0:.1f}s: {counts}. "
         f"Report: fedharness report {spec.results_dir}")
    return result


def plan(args: list[str]) -> tuple[SweepSpec, list[Job]]:
    """The sweep and its runs from `sweep=NAME [k=v ...] [k=a,b,c ...] [sweep.KEY=V ...]` (CLI and Python API)."""
    name, sweep_keys, plain, sweeps = split_args(args)
    spec = apply_cli(load_spec(name, sweep_keys), plain, sweeps)
    return spec, expand(spec)


def main(args: list[str], dry_run: bool = False) -> int:
    """`fedharness sweep sweep=NAME [k=v ...] [k=a,b,c ...] [sweep.KEY=V ...]`."""
    spec, jobs = plan(args)
    if dry_run:
        for job in jobs:
            print(f"{job.run_id}  {' '.join(job.overrides)}")
        print(f"{len(jobs)} runs (dry run: nothing started)")
        return 0
    try:
        with interrupts_raised():
            result = run_sweep(spec, jobs, echo=echo)
    except KeyboardInterrupt as err:  # SIGINT/SIGTERM: the running run recorded itself as interrupted
        print(f"fedharness: sweep {spec.name} interrupted ({err or 'SIGINT'}); the runs that finished are in "
              f"{spec.results_dir}/ and listed in its sweeps/ manifest", file=sys.stderr)
        return err.exit_code if isinstance(err, RunInterrupted) else 130
    return 0 if result.counts().get("failed", 0) == 0 else 3
