"""The search space: named parameters, each bound to any run-config key by its dotted name.

`tune.space` maps a short parameter name (what Optuna, the plots and `trials/` show) to
its definition:

    client_lr: {key: algorithm.client_lr, type: float, low: 1.0e-3, high: 1.0, log: true}
    local_steps: {key: algorithm.local_steps, type: int, low: 1, high: 20}
    aggregator: {key: algorithm.aggregator, type: categorical, choices: [fedavg, fednova]}

A sampled value becomes the Hydra override `key=value`, so any key of the run config can
be tuned and an unknown key fails the way `fedharness run key=value` does.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from fedharness.config.overrides import format_value
from fedharness.errors import ConfigError, require

TYPES = ("float", "int", "categorical")
FIELDS = {"key", "type", "low", "high", "log", "step", "choices"}
Scalar = bool | int | float | str | None


@dataclass(frozen=True)
class Param:
    name: str
    key: str
    type: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple[Scalar, ...] = ()

    def suggest(self, trial) -> Scalar:
        """Ask an Optuna trial for this parameter's value."""
        if self.type == "float":
            return trial.suggest_float(self.name, self.low, self.high, log=self.log, step=self.step)
        if self.type == "int":
            return trial.suggest_int(self.name, self.low, self.high, log=self.log, step=self.step or 1)
        return trial.suggest_categorical(self.name, list(self.choices))

    def extremes(self) -> list[Scalar]:
        """The values a probe config is built with: both ends of a range, every choice."""
        return [self.low, self.high] if self.type != "categorical" else list(self.choices)

    def override(self, value: Scalar) -> str:
        return f"{self.key}={format_value(value)}"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _parse_one(name: str, spec: Any) -> Param:
    where = f"tune.space.{name}"
    require(isinstance(spec, dict), where, spec, "a mapping with key, type and low/high or choices")
    for field in sorted(set(spec) - FIELDS):
        raise ConfigError(f"{where}.{field}", spec[field],
                          "not a field of a search-space entry; fields: " + ", ".join(sorted(FIELDS)))
    key = spec.get("key")
    require(isinstance(key, str) and bool(re.fullmatch(r"[A-Za-z_][\w.]*", key or "")), f"{where}.key", key,
            "the dotted name of a run-config key, e.g. algorithm.client_lr")
    kind = spec.get("type", "categorical" if "choices" in spec else "float")
    require(kind in TYPES, f"{where}.type", kind, "one of: " + ", ".join(TYPES))
    if kind == "categorical":
        choices = spec.get("choices")
        require(isinstance(choices, list) and len(choices) >= 1, f"{where}.choices", choices,
                "a non-empty list of values")
        for c in choices:
            require(c is None or isinstance(c, (bool, int, float, str)), f"{where}.choices", c,
                    "each choice must be a number, a string, a boolean or null")
        require(len(set(map(repr, choices))) == len(choices), f"{where}.choices", choices, "choices must differ")
        return Param(name, key, kind, choices=tuple(choices))
    low, high, log, step = spec.get("low"), spec.get("high"), bool(spec.get("log", False)), spec.get("step")
    if kind == "int":
        for field, v in (("low", low), ("high", high)):
            require(isinstance(v, int) and not isinstance(v, bool), f"{where}.{field}", v, "must be an integer")
    else:
        for field, v in (("low", low), ("high", high)):
            require(_is_number(v), f"{where}.{field}", v, "must be a finite number")
        low, high = float(low), float(high)
    require(low < high, f"{where}.low", low, f"must be < {where}.high ({high})")
    require(not log or low > 0, f"{where}.low", low, "must be > 0 on a log scale")
    if step is not None:
        require(_is_number(step) and step > 0, f"{where}.step", step, "must be a number > 0, or null")
        require(not log, f"{where}.step", step, "cannot be combined with log: true")
        require(kind != "int" or isinstance(step, int), f"{where}.step", step, "must be an integer for type int")
    return Param(name, key, kind, low, high, log, step)


def parse_space(space: Any) -> list[Param]:
    """Validate `tune.space` into Params (ConfigError naming the field on any problem)."""
    require(isinstance(space, dict) and len(space) >= 1, "tune.space", space,
            "a mapping name -> {key, type, low, high, log} with at least one parameter")
    params = [_parse_one(str(name), spec) for name, spec in space.items() if spec is not None]  # null: dropped
    require(len(params) >= 1, "tune.space", space, "at least one parameter that is not null")
    keys = [p.key for p in params]
    dup = next((k for k in keys if keys.count(k) > 1), None)
    require(dup is None, "tune.space", dup, "each config key may be tuned by one parameter only")
    return params


def grid_space(params: list[Param]) -> dict[str, list[Scalar]]:
    """Optuna's GridSampler search space; every parameter must list its choices."""
    for p in params:
        if p.type != "categorical":
            raise ConfigError(f"tune.space.{p.name}", p.type,
                              "the grid sampler needs `choices` on every parameter (type: categorical)")
    return {p.name: list(p.choices) for p in params}
