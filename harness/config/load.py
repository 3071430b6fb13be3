"""The run config: composed from conf/ and the overrides (harness/config/compose.py), a user's `_target_` parts
registered, then validated against the one schema (harness/config/schema.py); `load_settings` makes it the run's frozen,
typed settings (harness/settings.py), which is what the runner, the core, the backends and the sinks read."""

from __future__ import annotations

import copy
from typing import Any

from fedharness.config.compose import compose_raw, compose_values, defaults as defaults_of
from fedharness.extend import register_targets
from fedharness.registry.plugins import load_entry_points
from fedharness.config.schema import validate
from fedharness.settings import RunSettings, sections_of


def load_config(overrides: list[str], config_name: str = "config", values: list[str] | None = None) -> dict[str, Any]:
    """Compose the config with overrides (then `values`) and validate it against harness/config/schema.py. `values` are
    overrides that many calls vary over a fixed `overrides` (a study's trials): composed once (compose_values; with
    values=[], the composition those calls will reuse)."""
    load_entry_points()  # installed packages' parts, so that the config can name them
    values = None if values is None else list(values)
    plain = compose_raw(overrides, config_name) if values is None else compose_values(overrides, values, config_name)
    if any("_target_" in (plain.get(s) or {}) for s in ("dataset", "partition", "model", "algorithm", "attack", "compress")):
        register_targets(plain)  # a user's own parts, before validation names them
    validate(plain)
    chosen = _auto_model(plain)
    if chosen is not None:  # model=auto on natural-client data: composed as if the data's own model were named
        return load_config([*_without_model(overrides), f"model={chosen}"], config_name,
                           None if values is None else _without_model(values))
    return plain


def _auto_model(cfg: dict[str, Any]) -> str | None:
    """model=auto's choice where it reads the data (harness/problems/objectives.py auto_model), else None."""
    if (cfg.get("model") or {}).get("name") != "auto":
        return None  # the problems (torch, the data readers) are imported only where auto reads data
    from fedharness.problems.objectives import auto_model

    return auto_model(cfg)


def _without_model(overrides: list[str]) -> list[str]:
    """The overrides less any choice of the model group (`model=auto`), so that the chosen one is the only one."""
    return [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != "model"]


def load_settings(overrides: list[str], config_name: str = "config") -> RunSettings:
    """`load_config`'s validated config as the run's settings, built once here."""
    return RunSettings.from_config(load_config(overrides, config_name))


def recorded_settings(config: dict[str, Any]) -> RunSettings:
    """The settings of a config an earlier version recorded (a runs/ row's config_json): the top-level keys and the
    sections' keys added since then take today's defaults; nothing recorded changes."""
    defaults = compose_raw([])
    merged = copy.deepcopy(config)
    if isinstance(merged.get("systems"), dict):  # recorded before the cadence and profile groups
        merged.update(_groups_of_systems(merged.pop("systems")))
    for name, value in defaults.items():
        if name not in merged:
            merged[name] = copy.deepcopy(value)
        elif name in sections_of(RunSettings) and isinstance(merged[name], dict):
            merged[name] = {**value, **merged[name]}
    return RunSettings.from_config(merged)


# a recorded `systems` section's keys (before the cadence, speed, availability and staleness groups) -> (group, key)
_SYSTEMS_KEYS = {"speed_sigma": ("speed", "step_sigma"), "bandwidth_sigma": ("speed", "bandwidth_sigma"),
                 "slow_fraction": ("speed", "fraction"), "slow_factor": ("speed", "factor"),
                 "device_trace": ("speed", "file"), "trace_batch_size": ("speed", "samples_per_step"),
                 "duty_cycle": ("availability", "duty_cycle"), "period_s": ("availability", "period_s"),
                 "availability_trace": ("availability", "file"), "retry_s": ("cadence", "retry_s"),
                 "deadline_s": ("cadence", "deadline_s"), "over_selection": ("cadence", "over_selection"),
                 "late_work": ("cadence", "late_work"), "concurrency": ("cadence", "concurrency"),
                 "buffer": ("cadence", "buffer"), "refill": ("cadence", "refill"),
                 "max_staleness": ("cadence", "max_staleness"), "alpha": ("cadence", "alpha"),
                 "staleness_exponent": ("staleness", "exponent"), "staleness_cutoff": ("staleness", "cutoff")}


def _groups_of_systems(systems: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The groups a recorded `systems` section chose, each with the keys its chosen option has."""
    names = {"cadence": systems.get("mode", "sync"), "speed": systems.get("speed", "equal"),
             "availability": systems.get("availability", "always"), "staleness": systems.get("staleness", "poly")}
    groups = {group: dict(defaults_of(group, name)) for group, name in names.items()}
    if names["staleness"] == "hinge":
        groups["staleness"]["slope"] = systems.get("staleness_exponent", groups["staleness"]["slope"])
    for old, value in systems.items():
        group, key = _SYSTEMS_KEYS.get(old, (None, None))
        if group is not None and key in groups[group]:
            groups[group][key] = value
    return groups
