"""One registry per group, and signature binding: how every registered option is built from its config section.

A group (a kind of algorithm part, a data set, a model, a partitioner) is a `Registry`: name -> factory, built-ins
and a user's registrations alike. A factory's signature is its schema: `Registry.build` calls it with the
section's keys its parameters name and the context values (what the builder knows besides the config) it asks
for; a factory with `**params` also takes the section's other keys, except those the harness reads itself
(`reserved`). Keys are declared beside the option that uses them and kept here by option name.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Mapping

from fedharness.errors import ConfigError
from fedharness.keys import Key


def key_parameters(factory: Callable[..., Any]) -> list[inspect.Parameter]:
    """The parameters the builder fills by name, from the config keys and the context (not those bound at
    registration, not *args or **params)."""
    bound = factory.keywords if isinstance(factory, functools.partial) else {}
    return [p for p in inspect.signature(factory).parameters.values()
            if p.name not in bound and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def takes_extra(factory: Callable[..., Any]) -> bool:
    """Whether the factory takes `**params` (a user's factory: the section's other keys are its own)."""
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(factory).parameters.values())


class Registry(dict):
    """The options of one group, name -> factory; `option_keys[name]`: the keys that option declared (besides
    `common`, the keys every option of the group has). An option without declared keys is built unchecked.

    `shared`: the options read one shared section (the `algorithm` keys), so a key one part does not name is
    another part's, never an error or a `**params` argument."""

    def __init__(self, group: str, *, section: str | None = None, common: Mapping[str, Key] | None = None,
                 reserved: tuple[str, ...] = (), shared: bool = False):
        super().__init__()
        self.group = group  # the key that names an option: dataset, algorithm.solver, ...
        self.section = section or group  # the section its keys are under
        self.common = dict(common or {})
        self.reserved = ("name", "_target_", *self.common, *reserved)
        self.shared = shared
        self.option_keys: dict[str, dict[str, Key]] = {}

    def add(self, name: str, factory: Callable[..., Any], keys: Mapping[str, Key] | None = None,
            **bound: Any) -> Callable[..., Any]:
        """Register `factory` (with `bound` arguments fixed) as option `name`, declaring its `keys`."""
        self[name] = functools.partial(factory, **bound) if bound else factory
        if keys is not None:
            self.option_keys[name] = dict(keys)
        return factory

    def register(self, name: str, keys: Mapping[str, Key] | None = None,
                 **bound: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator form of `add`, used beside a built-in's definition."""
        return lambda factory: self.add(name, factory, keys, **bound)

    def names(self) -> tuple[str, ...]:
        return tuple(self)

    def declared(self, name: str) -> dict[str, Key] | None:
        """The keys of option `name` besides `name` (None: registered without declared keys)."""
        return None if name not in self.option_keys else {**self.common, **self.option_keys[name]}

    def build(self, name: str, values: Mapping[str, Any], context: Mapping[str, Any]) -> Any:
        """The option `name` built from its section `values` and the `context` (ConfigError: not registered)."""
        if name not in self:
            raise ConfigError(self.group, name, self.keys())
        return self[name](**self.arguments(self[name], values, context))

    def arguments(self, factory: Callable[..., Any], values: Mapping[str, Any],
                  context: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments of `factory`: context values and section keys its parameters name (absent ones:
        the parameter's default), and with `**params` the section's other keys."""
        kwargs: dict[str, Any] = {}
        for p in key_parameters(factory):
            if p.name in context:
                kwargs[p.name] = context[p.name]
            elif p.name in values:
                kwargs[p.name] = values[p.name]
            elif p.default is inspect.Parameter.empty:
                raise ConfigError(f"{self.section}.{p.name}", None,
                                  f"a value (its {self.group} has no default): +{self.section}.{p.name}=...")
        if self.shared:
            return kwargs
        rest = {k: v for k, v in values.items() if k not in kwargs and k not in self.reserved}
        if takes_extra(factory):
            return {**kwargs, **rest}
        if rest:
            key, value = next(iter(rest.items()))
            raise ConfigError(f"{self.section}.{key}", value, "not a parameter of its factory; its parameters: "
                              + (", ".join(p.name for p in key_parameters(factory)) or "none"))
        return kwargs
