"""Bring your own model, data set, partitioner or algorithm part, without editing fedharness (docs/extending.md).

Registration adds to the same registries `fedharness list`, validation and the builders use. Two ways in,
one mechanism: a call from Python (`fedharness.register_model(...)`), or a `_target_` in a config file,
which names the factory by its dotted import path and is registered when the config is loaded (also in
every Ray worker, since the config travels with the job).
"""

from __future__ import annotations

import functools
import importlib
import re
from typing import Any, Callable

from hydra.core.config_store import ConfigStore

from fedharness.algorithms.registry import BUILTIN_KEYS, PARTS, undeclared
from fedharness.contracts import PART_KEYS
from fedharness.keys import Key
from fedharness.errors import ConfigError, require
from fedharness.problems import DATASETS, MODELS
from fedharness.problems.nets import NETS
from fedharness.problems.user import USER_DATASETS
from fedharness.partitions import PARTITIONERS

_BUILTIN = {"model": set(MODELS), "dataset": set(DATASETS), "partition": {"auto", *PARTITIONERS},
            **{kind: set(reg) for kind, reg in PARTS.items()}}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


def _check(kind: str, name: str, factory: Any) -> None:
    require(isinstance(name, str) and _NAME.fullmatch(name) is not None, kind, name,
            "a name of letters, digits, '_', '-' and '.', starting with a letter")
    require(name not in _BUILTIN[kind], kind, name, f"a built-in {kind} name; register yours under another")
    require(callable(factory), kind, name, f"its factory must be callable, got {type(factory).__name__}")


def _store(group: str, name: str, node: dict[str, Any]) -> None:
    """A config node, so that `group=name` composes like a shipped conf/<group>/<name>.yaml."""
    ConfigStore.instance().store(group=group, name=name, node={"name": name, **node})


def _add_model(name: str, factory: Callable[..., Any]) -> None:
    _check("model", name, factory)
    NETS[name] = factory
    if name not in MODELS:
        MODELS.append(name)


def _add_dataset(name: str, factory: Callable[..., Any]) -> None:
    _check("dataset", name, factory)
    USER_DATASETS[name] = factory
    if name not in DATASETS:
        DATASETS.append(name)


def _add_partitioner(name: str, fn: Callable[..., Any]) -> None:
    _check("partition", name, fn)
    PARTITIONERS[name] = fn


def register_model(name: str, factory: Callable[..., Any], l2: float = 0.0, **defaults: Any) -> None:
    """`factory(in_shape, num_classes, **params) -> nn.Module` (a module class fits); `defaults` are its params,
    settable as `model.KEY=V`. The module must be a pure function of its parameters: no buffers."""
    _add_model(name, factory)
    _store("model", name, {"l2": l2, **defaults})


def register_dataset(name: str, factory: Callable[..., Any], num_clients: int = 10, **defaults: Any) -> None:
    """`factory(seed, **params) -> (train, test)`, each an (x, y) pair of arrays or a torch Dataset, test
    may be None; `defaults` are its params, settable as `dataset.KEY=V`. Any partitioner splits it."""
    _add_dataset(name, factory)
    _store("dataset", name, {"num_clients": num_clients, "data_seed": None, **defaults})


def register_partitioner(name: str, fn: Callable[..., Any], **defaults: Any) -> None:
    """`fn(labels, num_clients, rng, *, **params) -> list of index arrays`, params keyword-only, as the
    built-ins in partitions/core.py; `defaults` are its params, settable as `partition.KEY=V`."""
    _add_partitioner(name, fn)
    _store("partition", name, defaults)


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
    declared = {**PART_KEYS.get(factory, {}), **(keys or {})}  # a class registered again keeps its keys
    taken = sorted(declared.keys() & BUILTIN_KEYS.keys())
    require(not taken, kind, name, f"it declares built-in keys again ({', '.join(taken)}); use them undeclared")
    built = functools.partial(factory, **bound) if bound else factory
    missing = undeclared(built, declared)
    require(not missing, kind, name, f"its parameters {', '.join(missing)} are not declared keys: declare them, "
            f"e.g. register_part(..., keys={{'{missing[0] if missing else ''}': number('what it is', lo=0)}})")
    PART_KEYS[factory] = PART_KEYS[built] = declared
    PARTS[kind][name] = built
    return None


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
    for section, add in (("model", _add_model), ("dataset", _add_dataset), ("partition", _add_partitioner)):
        sub = cfg.get(section) or {}
        if "_target_" in sub:
            add(sub["name"], import_target(f"{section}._target_", sub["_target_"]))
    acfg = cfg.get("algorithm") or {}
    targets = acfg.get("_target_") or {}
    require(isinstance(targets, dict), "algorithm._target_", targets,
            "a mapping of part kinds to dotted paths, e.g. {aggregator: mypkg.parts.UniformAverage}")
    for kind, path in targets.items():
        require(kind in PARTS, f"algorithm._target_.{kind}", path, f"a part kind; one of: {', '.join(PARTS)}")
        register_part(kind, acfg[kind], import_target(f"algorithm._target_.{kind}", path))
