"""Bring your own model, data set, partitioner or algorithm part, without editing fedharness (docs/extending.md).

Registration adds to the same registries (fedharness.registry.groups) the built-ins register themselves in and
`fedharness list`, validation and the builders read, through the same `Registry.add`. Two ways in, one
mechanism: a call from Python (`fedharness.register_model(...)`), or a `_target_` in a config file, which names
the factory by its dotted import path and is registered when the config is loaded (also in every Ray worker,
since the config travels with the job). What is registered from Python reaches Ray workers
too: fedharness.registry.plugins carries `user_registrations()` with the work and `restore`s them there.
"""

from __future__ import annotations

import functools
import importlib
import re
from typing import Any, Callable

from hydra.core.config_store import ConfigStore

import fedharness.partitions  # noqa: F401  (the built-in partitioners, registered before _BUILTIN is taken)
import fedharness.problems  # noqa: F401  (the built-in data sets and models)
from fedharness.algorithms.registry import BUILTIN_KEYS, undeclared
from fedharness.contracts import ROUND_COLUMNS, Metric
from fedharness.errors import ConfigError, require
from fedharness.keys import Key, anything
from fedharness.registry.binding import Registry
from fedharness.registry.groups import (ATTACKS, AVAILABILITIES, BUILTIN_STAGES, CADENCES, COMPRESSORS, DATASETS,
                                       METRICS, MODELS, PARTITIONERS, PARTS, SPEEDS, STAGES, STALENESS)

GROUPS: dict[str, Registry] = {"model": MODELS, "dataset": DATASETS, "partition": PARTITIONERS, "attack": ATTACKS,
                               "compress": COMPRESSORS, "stage": STAGES, "cadence": CADENCES, "speed": SPEEDS,
                               "availability": AVAILABILITIES, "staleness": STALENESS}
PROFILES = ("cadence", "speed", "availability", "staleness")  # the part groups every run has an option of
_BUILTIN = {"model": set(MODELS), "dataset": set(DATASETS), "partition": {"auto", *PARTITIONERS},
            "attack": {"none", *ATTACKS}, "compress": {"none", *COMPRESSORS}, "stage": {*BUILTIN_STAGES, *STAGES},
            **{group: set(GROUPS[group]) for group in PROFILES},
            **{kind: set(reg) for kind, reg in PARTS.items()}}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_NODES: dict[tuple[str, str], dict[str, Any]] = {}  # (group, name) -> the config defaults of a Python registration


def _check(kind: str, name: str, factory: Any) -> None:
    require(isinstance(name, str) and _NAME.fullmatch(name) is not None, kind, name,
            "a name of letters, digits, '_', '-' and '.', starting with a letter")
    require(name not in _BUILTIN[kind], kind, name, f"a built-in {kind} name; register yours under another")
    require(callable(factory), kind, name, f"its factory must be callable, got {type(factory).__name__}")


def _store(group: str, name: str, node: dict[str, Any]) -> None:
    """A config node, so that `group=name` composes like a shipped conf/<group>/<name>.yaml."""
    ConfigStore.instance().store(group=group, name=name, node={"name": name, **node})
    _NODES[(group, name)] = node  # carried to Ray workers with the factory (fedharness.registry.plugins)


def _add(group: str, name: str, factory: Callable[..., Any]) -> None:
    """A user's model, data set or partitioner: its keys are its factory's own, passed to it unchecked."""
    _check(group, name, factory)
    GROUPS[group].add(name, factory)


def register_model(name: str, factory: Callable[..., Any], l2: float = 0.0, buffers: str = "average",
                   head: str | None = None, **defaults: Any) -> None:
    """`factory(in_shape, num_classes, **params) -> nn.Module` (a module class fits); `defaults` are its params,
    settable as `model.KEY=V`. Any module: BatchNorm's buffers are averaged (`buffers=local`: kept per client),
    nn.Dropout draws from the run's streams; `head`: the name of its head module (FedRep, FedBABU; None: the
    module's `head_module` attribute if it has one) (docs/extending.md)."""
    _add("model", name, factory)
    _store("model", name, {"l2": l2, "buffers": buffers, "head": head, **defaults})


def register_dataset(name: str, factory: Callable[..., Any], num_clients: int = 10, **defaults: Any) -> None:
    """`factory(seed, **params) -> (train, test)`, each an (x, y) pair of arrays or a torch Dataset, test
    may be None; `defaults` are its params, settable as `dataset.KEY=V`. Any partitioner splits it; (x, y, owner)
    triples also name each sample's owner, one client per owner under partition=natural."""
    _add("dataset", name, factory)
    _store("dataset", name, {"num_clients": num_clients, "data_seed": None, "unseen_clients": 0, **defaults})


def register_partitioner(name: str, fn: Callable[..., Any], **defaults: Any) -> None:
    """`fn(labels, num_clients, rng, *, **params) -> list of index arrays`, params keyword-only, as the
    built-ins in partitions/core.py; `defaults` are its params, settable as `partition.KEY=V`."""
    _add("partition", name, fn)
    _store("partition", name, defaults)


def register_attack(name: str, factory: Callable[..., Any], fraction: float = 0.2, **defaults: Any) -> None:
    """`factory(**params)` -> an object with `forge(own, honest, keys) -> [b, dim]` (fedharness.contracts.Attack:
    what the round's Byzantine clients send); `attack=name` selects it, `attack.fraction` (default `fraction`)
    is the share of Byzantine clients, `defaults` its params, settable as `attack.KEY=V` (docs/robustness.md)."""
    _add("attack", name, factory)
    _store("attack", name, {"fraction": fraction, "fixed": False, **defaults})


def register_compressor(name: str, factory: Callable[..., Any], error_feedback: bool = False,
                        **defaults: Any) -> None:
    """`factory(**params)` -> an object with `compress(v, keys) -> [m, dim]` (each row as the server decodes what
    its client sends) and `encoded_bytes(dim, value_bytes) -> int` (fedharness.contracts.Compressor: the size
    bytes_up counts); `compress=name` selects it, `compress.error_feedback` (default `error_feedback`) wraps it in
    error feedback, `defaults` are its params, settable as `compress.KEY=V` (docs/compression.md)."""
    _add("compress", name, factory)
    _store("compress", name, {"error_feedback": error_feedback, **defaults})


def register_stage(name: str, factory: Callable[..., Any], **defaults: Any) -> None:
    """`factory(**keys)` -> an update stage (fedharness.contracts.UpdateStage: subclass it for the defaults): what
    happens to each client's update between its training and the server optimizer. A run names it in its `stages`
    list, in the order the stages run (`stages=[attack,dp,NAME]`), its keys in a mapping entry
    (`stages=[{name:NAME,KEY:V}]`); `defaults` are the keys' values when the entry does not set them. It reaches Ray
    shards, sweep tasks and tuning workers as every registration does (docs/extending.md)."""
    _add("stage", name, factory)
    _NODES[("stage", name)] = dict(defaults)  # carried to Ray workers with the factory


def register_option(group: str, name: str, factory: Callable[..., Any], *, keys: dict[str, Key] | None = None,
                    **defaults: Any) -> None:
    """An option of a group every run has (cadence, speed, availability, staleness): `group=name` selects it,
    `defaults` are its keys' values, settable as `group.KEY=V`; `keys` declares them (fedharness.keys: number(...),
    ...; else any value passes to the factory). The builder calls `factory` with those keys and with
    the context its parameters ask for by name:

    * cadence (contracts.Cadence: subclass it, or a built-in of fedharness.algorithms.cadences): `staleness` (the
      run's staleness function), `clients_per_round`; `cadence.retry_s` is every cadence's key;
    * speed (contracts.Speeds): `network` (the network section), `num_clients`, `batch_size`;
    * availability (contracts.Availability): `num_clients`;
    * staleness (contracts.Staleness): none.

    It reaches Ray shards, sweep tasks and tuning workers as every registration does (docs/extending.md)."""
    require(group in PROFILES, "group", group, PROFILES)
    _check(group, name, factory)
    declared = keys if keys is not None else {k: anything(f"a key of {group}={name} (its factory's)") for k in defaults}
    GROUPS[group].add(name, factory, declared)
    _store(group, name, {**({"retry_s": 60.0} if group == "cadence" else {}), **defaults})


def stage_defaults(name: str) -> dict[str, Any]:
    """The keys' values a stage was registered with (register_stage's `defaults`)."""
    return dict(_NODES.get(("stage", name)) or {})


def register_part(kind: str, name: str, factory: Callable[..., Any] | None = None, *,
                  keys: dict[str, Key] | None = None, **bound: Any) -> Any:
    """A part of kind sampler, local_work, lr_schedule, solver, aggregator or server_optimizer, selected by
    `algorithm.<kind>=name` (harness/contracts.py: what each kind must provide; subclass its Protocol for the
    defaults). The builder calls `factory` with the `algorithm` keys its parameters name, and with `problem`,
    `num_clients` or `rounds` where it asks; `keys` declares the keys of its own (fedharness.keys: number(...),
    ...), which the schema then checks and `fedharness config algorithm` lists; `bound` fixes arguments. Without
    `factory`, a class decorator: `@fedharness.register_part("solver", "mine", keys={...})`."""
    if factory is None:
        return lambda f: register_part(kind, name, f, keys=keys, **bound) or f
    require(kind in PARTS, "kind", kind, PARTS.keys())
    _check(kind, name, factory)
    declared = {**PARTS[kind].option_keys.get(name, {}), **(keys or {})}  # registered again, it keeps its keys
    taken = sorted(declared.keys() & BUILTIN_KEYS.keys())
    require(not taken, kind, name, f"it declares built-in keys again ({', '.join(taken)}); use them undeclared")
    built = functools.partial(factory, **bound) if bound else factory
    missing = undeclared(built, declared)
    require(not missing, kind, name, f"its parameters {', '.join(missing)} are not declared keys: declare them, "
            f"e.g. register_part(..., keys={{'{missing[0] if missing else ''}': number('what it is', lo=0)}})")
    PARTS[kind].add(name, built, declared)
    return None


def register_metric(name: str, fn: Callable[..., Any], split: str = "test", maximize: bool = False) -> None:
    """`fn(w, split) -> R numbers`: w [R, dim] the global models (one row per replica, flat parameters), split a
    fedharness.contracts.DataSplit (`.x`, `.y`: the `split` samples as the model takes them, None for a problem
    without samples; `.model`: the problem's model, with `loss_terms`). A run that names it in its `metrics`
    key computes it at every evaluation into its own rounds/ column; `tune.objective.metric=name` tunes it
    (`maximize`: larger is better)."""
    require(isinstance(name, str) and name.isidentifier(), "metric", name,
            "a name usable as a column: letters, digits and '_', not starting with a digit")
    require(name not in ROUND_COLUMNS, "metric", name, "a column of the rounds/ table already; choose another name")
    require(callable(fn), "metric", name, f"its function must be callable, got {type(fn).__name__}")
    require(split in ("train", "test"), "metric split", split, "train or test")
    METRICS[name] = Metric(name, fn, split, bool(maximize))


def import_target(key: str, path: Any) -> Any:
    """The object a dotted path `package.module.attribute` names."""
    module, _, attr = str(path).rpartition(".")
    require(isinstance(path, str) and bool(module), key, path, "a dotted import path, e.g. mypkg.models.MyNet")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(key, path, f"cannot be imported ({type(err).__name__}: {err}); is its package on "
                          "PYTHONPATH?") from None


def register_targets(cfg: dict[str, Any]) -> None:
    """Register every `_target_` of a config: `model`, `dataset` and `partition` name one factory each
    (registered under the section's `name`); `algorithm._target_` maps part kinds to factories."""
    for group in GROUPS:
        section = cfg.get(group) or {}
        if "_target_" in section:
            _add(group, section["name"], import_target(f"{group}._target_", section["_target_"]))
    acfg = cfg.get("algorithm") or {}
    targets = acfg.get("_target_") or {}
    require(isinstance(targets, dict), "algorithm._target_", targets,
            "a mapping of part kinds to dotted paths, e.g. {aggregator: mypkg.parts.UniformAverage}")
    for kind, path in targets.items():
        require(kind in PARTS, f"algorithm._target_.{kind}", path, f"a part kind; one of: {', '.join(PARTS)}")
        register_part(kind, acfg[kind], import_target(f"algorithm._target_.{kind}", path))


def user_registrations() -> list[tuple[str, str, Any, Any]]:
    """Every registration of a user's part held now, however it was made (a register_* call, `groups.part`,
    a `_target_`, an entry point): (kind, name, factory, extra), extra being a model's, data set's or
    partitioner's config defaults (None without), a part's declared keys, or a metric's split and direction.
    fedharness.registry.plugins carries these to Ray workers; `restore` puts one back."""
    out = [(group, name, factory, _NODES.get((group, name)))
           for group, registry in GROUPS.items() for name, factory in registry.items() if name not in _BUILTIN[group]]
    out += [(kind, name, factory, registry.option_keys.get(name))
            for kind, registry in PARTS.items() for name, factory in registry.items() if name not in _BUILTIN[kind]]
    out += [("metric", m.name, m.fn, {"split": m.split, "maximize": m.maximize}) for m in METRICS.values()]
    return out


def restore(kind: str, name: str, factory: Any, extra: Any) -> None:
    """Register one of `user_registrations()` again, in another process, as it was in the one that made it."""
    if kind == "metric":
        register_metric(name, factory, **extra)
        return
    if kind == "stage":
        register_stage(name, factory, **(extra or {}))
        return
    if kind in GROUPS:
        _add(kind, name, factory)
        if extra is not None:
            _store(kind, name, extra)
        return
    require(kind in PARTS, "kind", kind, PARTS.keys())
    _check(kind, name, factory)
    PARTS[kind].add(name, factory, extra)
