"""The run config: composed from conf/ and the overrides (harness/config/compose.py), a user's `_target_` parts
registered, then validated against the one schema (harness/config/schema.py); `load_settings` makes it the run's frozen,
typed settings (harness/settings.py), which is what the runner, the core, the backends and the sinks read."""

from __future__ import annotations

from typing import Any

from fedharness.config.compose import compose_raw, compose_values
from fedharness.extend import register_targets
from fedharness.registry.plugins import load_entry_points
from fedharness.config.schema import validate
from fedharness.settings import RunSettings


def load_config(overrides: list[str], config_name: str = "config", values: list[str] | None = None) -> dict[str, Any]:
    """Compose the config with overrides (then `values`) and validate it against harness/config/schema.py. `values` are
    overrides that many calls vary over a fixed `overrides` (a study's trials): composed once (compose_values; with
    values=[], the composition those calls will reuse)."""
    load_entry_points()  # installed packages' parts, so that the config can name them
    values = None if values is None else list(values)
    plain = compose_raw(overrides, config_name) if values is None else compose_values(overrides, values, config_name)
    if any("_target_" in (plain.get(s) or {}) for s in ("dataset", "partition", "model", "algorithm", "attack")):
        register_targets(plain)  # a user's own parts, before validation names them
    dp_sampling(plain, [*overrides, *(values or [])])
    validate(plain)
    return plain


def dp_sampling(cfg: dict[str, Any], overrides: list[str]) -> None:
    """A DP run (dp.noise_multiplier or dp.target_epsilon set) samples its clients by Poisson, the sampling its
    accountant covers, unless the overrides name a sampler: that one stays, and the schema refuses it unless it is
    poisson (harness/config/schema.py dp_covered)."""
    dp = cfg.get("dp") or {}
    named = any(o.lstrip("+~").split("=", 1)[0] == "algorithm.sampler" for o in overrides)
    if (dp.get("noise_multiplier") is not None or dp.get("target_epsilon") is not None) and not named:
        cfg["algorithm"]["sampler"] = "poisson"


def load_settings(overrides: list[str], config_name: str = "config") -> RunSettings:
    """`load_config`'s validated config as the run's settings, built once here."""
    return RunSettings.from_config(load_config(overrides, config_name))
