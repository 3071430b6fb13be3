"""A user's parts in every process: what the driver registered travels with the work, and installed packages
declare theirs through an entry-point group (docs/extending.md, "Plugins").

* `snapshot()` is every user registration of this process (fedharness.extend.user_registrations: models, data
  sets, partitioners, algorithm parts and metrics, with their config defaults and declared keys), pickled; a Ray shard
  actor, a sweep's Ray task and a tuning worker call `install(snapshot)` before they compose or build anything.
  Each registration is pickled by reference (the worker imports the object's module, as for a `_target_`) and,
  when that module is not part of an installed package (a notebook, a script, a folder put on sys.path), also
  by value with cloudpickle: the worker uses the first of the two that loads, so code that exists only in the
  driver still runs there. They travel as bytes, so a worker reports a registration it cannot load by name.
* A package lists `name = "module"` or `name = "module:function"` under its
  `[project.entry-points."fedharness.registry.plugins"]`: `load_entry_points()` imports the module (its registrations
  run) or calls the function with no arguments, once per process, before the first config is composed or run
  built (driver and workers alike).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable

from fedharness.errors import ConfigError
from fedharness.extend import restore, user_registrations

GROUP = "fedharness.registry.plugins"
logger = logging.getLogger(__name__)
_loaded = False


@dataclass(frozen=True)
class Carried:
    """One registration on its way to another process: pickled by reference, and by value where needed."""

    kind: str
    name: str
    by_reference: bytes
    by_value: bytes | None


def load_entry_points() -> None:
    """Load every installed package's `fedharness.registry.plugins` entry point, the first time this is called."""
    global _loaded
    if _loaded:
        return
    _loaded = True  # before loading: a plugin that composes a config must not load the plugins again
    for ep in importlib.metadata.entry_points(group=GROUP):
        try:
            target = ep.load()
            if inspect.isfunction(target):
                target()
            elif not isinstance(target, ModuleType):
                raise TypeError(f"it names a {type(target).__name__}; name a module, or a function of no arguments")
        except ConfigError:
            raise
        except Exception as err:
            raise ConfigError(f"entry point {GROUP}", f"{ep.name} = {ep.value}",
                              f"loading it failed ({type(err).__name__}: {err})") from None


def snapshot() -> tuple[Carried, ...]:
    """This process's user registrations, ready to travel as a task's or an actor's argument."""
    from ray import cloudpickle

    out = []
    for kind, name, factory, extra in user_registrations():
        entry = (kind, name, factory, extra)
        try:
            by_reference = cloudpickle.dumps(entry)
        except Exception as err:  # e.g. a closure over a lock or an open file: the workers go without it
            logger.warning(f"{kind} {name!r} stays in this process: it cannot be pickled for the Ray workers "
                           f"({type(err).__name__}: {err})")
            continue
        out.append(Carried(kind, name, by_reference, _by_value(entry)))
    return tuple(out)


def install(carried: tuple[Carried, ...]) -> None:
    """Register the driver's registrations in this process (after the installed packages' own)."""
    load_entry_points()
    if not carried:
        return
    from ray import cloudpickle

    for item in carried:
        try:
            entry = cloudpickle.loads(item.by_reference)
        except (ImportError, AttributeError) as err:
            if item.by_value is None:
                raise ConfigError(item.kind, item.name, f"registered in the driver, but its module cannot be "
                                  f"imported in this worker ({type(err).__name__}: {err}); install its "
                                  "package on every node") from None
            entry = cloudpickle.loads(item.by_value)
        restore(*entry)


def travel_by_value(objects: Iterable[Any]) -> None:
    """Have cloudpickle copy the classes of `objects` by value where their package is not installed (a user's
    module beside a notebook, a test module), so a Ray worker that cannot import it still gets them: an update
    stage's client work travels with each round's plan (contracts.ClientWork), with the parts it holds (a user's
    compressor in the compress stage's work): the objects' classes and their attributes'. Each class is looked at
    once per process (this runs every round)."""
    from ray import cloudpickle

    objects = list(objects)
    held = [value for obj in objects for value in getattr(obj, "__dict__", {}).values()]
    for kind in {type(obj) for obj in (*objects, *held)} - _TRAVELLING:
        _TRAVELLING.add(kind)
        module = _uninstalled_package(kind.__module__)
        if module is not None and module.__name__ not in cloudpickle.list_registry_pickle_by_value():
            cloudpickle.register_pickle_by_value(module)


_TRAVELLING: set[type] = set()  # the classes travel_by_value has looked at


def _by_value(entry: tuple) -> bytes | None:
    """The entry pickled with its factory's package by value, or None: an installed package (imported by the
    worker), or a factory cloudpickle cannot copy (the by-reference copy must do)."""
    from ray import cloudpickle

    module = _uninstalled_package(_module_name(entry[2]))
    if module is None:
        return None
    already = module.__name__ in cloudpickle.list_registry_pickle_by_value()
    if not already:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(entry)
    except Exception:  # e.g. a module-level object that cannot be pickled
        return None
    finally:
        if not already:
            cloudpickle.unregister_pickle_by_value(module)


def _uninstalled_package(module_name: str) -> ModuleType | None:
    """The top-level package of `module_name` where a worker could not import it (not installed), else None."""
    module = sys.modules.get(module_name.partition(".")[0])
    return None if module is None or _installed(module) else module


def _module_name(factory: Any) -> str:
    factory = getattr(factory, "func", factory)  # a functools.partial (register_part's bound arguments)
    return getattr(factory, "__module__", None) or ""


def _installed(module: ModuleType) -> bool:
    """Whether a module comes with Python or an installed package (the worker imports it the same way), or
    is fedharness itself; `__main__` is pickled by value by cloudpickle anyway."""
    if module.__name__ in ("fedharness", "__main__") or module.__name__ in sys.builtin_module_names:
        return True
    origin = getattr(module, "__file__", None)
    if origin is None:
        return False
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return any(Path(origin).resolve().is_relative_to(Path(root).resolve()) for root in roots)
