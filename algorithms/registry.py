"""The registry: every part an algorithm is composed of, by name, and how a config builds it.

A part registers itself beside its class (`fedharness.registry.groups.part`); a named algorithm
(`conf/algorithm/<name>.yaml`) is a choice of parts and their keys. A part's constructor signature is its
schema: `build_algorithm` calls each selected part with the `algorithm` keys its parameters name (declared once,
in the KEYS of the module that uses them; harness/config/schema.py has checked every value) and the CONTEXT values
it asks for, so nothing here repeats a key's name or a check.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

from fedharness.algorithms import (aggregators, local_work, local_work_fixed, personal, personalized, robust, samplers,
                                   schedules, server, solvers)
from fedharness.algorithms import attacks  # noqa: F401  (the attacks register themselves)
from fedharness.algorithms import compression  # noqa: F401  (and the compressors)
from fedharness.algorithms import series
from fedharness.contracts import Algorithm, Problem, training_clients
from fedharness.errors import ConfigError
from fedharness.registry.binding import key_parameters
from fedharness.registry.groups import CONTEXT, PARTS, PROTOCOLS
from fedharness.keys import Key, integer

KEYS: dict[str, Key] = {"batch_size": integer("minibatch size b", lo=1)}  # the Algorithm's own

# The `algorithm` keys each module declares, in the order they are listed (help, errors).
DECLARED: tuple[dict[str, Key], ...] = (samplers.KEYS, local_work.KEYS, KEYS, schedules.KEYS, server.KEYS, solvers.KEYS,
                                        personal.KEYS, aggregators.KEYS, robust.KEYS, local_work_fixed.KEYS, series.KEYS,
                                        personalized.KEYS)


def _declared() -> dict[str, Key]:
    """The built-in parts' keys; a key declared by two modules is a bug, refused when fedharness is imported."""
    keys: dict[str, Key] = {}
    for declared in DECLARED:
        twice = keys.keys() & declared.keys()
        if twice:
            raise TypeError(f"algorithm keys declared twice: {', '.join(sorted(twice))}")
        keys.update(declared)
    return keys


BUILTIN_KEYS: dict[str, Key] = _declared()
BUILTIN_PARTS: dict[str, frozenset[str]] = {kind: frozenset(reg) for kind, reg in PARTS.items()}  # before any user's


def undeclared(factory: Callable[..., Any], keys: Mapping[str, Key] | None = None) -> list[str]:
    """The parameters of a part's constructor that are neither a declared key (built-in or in `keys`) nor
    CONTEXT: the builder could not fill them."""
    known = {*BUILTIN_KEYS, *(keys or {}), *CONTEXT}
    return [p.name for p in key_parameters(factory) if p.name not in known]


def _check_builtins() -> None:
    for kind, registry in PARTS.items():
        for name, factory in registry.items():
            if undeclared(factory):
                raise TypeError(f"{kind} {name!r}: parameters {undeclared(factory)} are not declared algorithm keys")


_check_builtins()


def user_keys() -> dict[str, tuple[Key, Any]]:
    """The keys the user's parts registered now declare, with their constructors' defaults (None: required)."""
    found: dict[str, tuple[Key, Any]] = {}
    for registry in PARTS.values():
        for name, factory in registry.items():
            declared = registry.option_keys.get(name, {})
            if not declared:  # no keys of its own (every built-in): skip reading its signature (~1 ms a validation)
                continue
            for p in key_parameters(factory):
                if p.name in declared:
                    found[p.name] = (declared[p.name], None if p.default is inspect.Parameter.empty else p.default)
    return found


def algorithm_keys() -> dict[str, Key]:
    """Every key of the `algorithm` section besides `name`: the built-in parts' and those of the user's parts
    registered now (harness/config/schema.py checks a config against these)."""
    return {**BUILTIN_KEYS, **{key: spec for key, (spec, _) in user_keys().items()}}


def build(factory: Callable[..., Any], acfg: Mapping[str, Any], context: Mapping[str, Any]) -> Any:
    """`factory` called with the CONTEXT values and `algorithm` keys its parameters name (absent keys: the
    parameter's default)."""
    return factory(**PARTS["sampler"].arguments(factory, acfg, context))  # every kind binds the one section alike


def build_part(kind: str, acfg: Mapping[str, Any], context: Mapping[str, Any]) -> Any:
    """The part `acfg[kind]` names, checked against its Protocol (a user's part may lack a member)."""
    name = acfg[kind]
    built = PARTS[kind].build(name, acfg, context)
    protocol = PROTOCOLS[kind]
    if not isinstance(built, protocol):
        raise ConfigError(f"algorithm.{kind}", name, f"the part it builds lacks a member of {protocol.__name__} "
                          f"(subclass fedharness.contracts.{protocol.__name__} for the defaults)")
    return built


def build_algorithm(acfg: Mapping[str, Any], problem: Problem, rounds: int | None = None) -> Algorithm:
    """The Algorithm of the validated `algorithm` section; `rounds`: the run's (step_decay needs it)."""
    # the samplers draw from the training clients, ids 0.. (dataset.unseen_clients: the others are numbered last)
    context = {"problem": problem, "num_clients": training_clients(problem),
               **({} if rounds is None else {"rounds": rounds})}
    parts = {kind: build_part(kind, acfg, context) for kind in PARTS}
    built = {"sampler": build(samplers.with_dropout, acfg, {"inner": parts["sampler"]}),
             "local_work": build(local_work.with_min, acfg, {"inner": parts["local_work"]}),
             "schedule": parts["lr_schedule"], "solver": parts["solver"], "aggregator": parts["aggregator"],
             "server": parts["server_optimizer"]}
    return build(Algorithm, acfg, built)  # and its own keys: name, batch_size
