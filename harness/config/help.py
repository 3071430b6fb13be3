"""Help text from the schema: groups with their options, keys with their YAML defaults and one-line docs."""

from __future__ import annotations

from typing import Any

from fedharness.config import schema
from fedharness.algorithms.registry import user_keys
from fedharness.config.compose import group_options
from fedharness.config.overrides import format_value
from fedharness.errors import ConfigError
from fedharness.extend import register_targets
from fedharness.registry.plugins import load_entry_points
from fedharness.settings import keys_of, sections_of

HELP_GROUPS = ("dataset", "partition", "model", "algorithm")
WIDTH = 34  # "key = default" column


def _shown(value: Any) -> str:
    """A default as it is written on the command line."""
    return value if isinstance(value, str) and value else format_value(value)


def _line(key: str, default: Any, doc: str) -> str:
    left = f"  {key} = {_shown(default)}"
    if len(left) > WIDTH:
        return f"{left}\n{'':<{WIDTH}}  {doc}"
    return f"{left:<{WIDTH}}  {doc}"


def _options_line(group: str, default: str) -> str:
    names = [f"{o}*" if o == default else o for o in group_options(group)]
    return f"  {group:<11}{', '.join(names)}"


def describe_run() -> str:
    """The groups and every top-level and section key of a run (`fedharness run --help`)."""
    load_entry_points()  # installed packages' options are listed too
    top = schema.defaults()
    lines = ["config groups (group=OPTION, * the default; `fedharness config GROUP` shows a group's keys):"]
    lines += [_options_line(g, top[g]["name"]) for g in HELP_GROUPS]
    lines.append(_options_line("experiment", "") + "  (paper reproductions; none by default)")
    lines.append(_options_line("attack", "") + "  (Byzantine clients, attack.fraction; none by default)")
    lines += ["", "keys (key = default  doc); set any as key=value, e.g. rounds=50 ray.num_shards=4:"]
    for key, spec in schema.TOP.items():
        if key in top:
            lines.append(_line(key, top[key], spec.doc))
    for section, keys in schema.SECTIONS.items():
        lines += [_line(f"{section}.{key}", top[section].get(key), spec.doc) for key, spec in keys.items()]
    return "\n".join(lines)


def describe_group(group: str, option: str | None = None) -> str:
    """A group's options and the keys of one option (the default one unless named): `fedharness config GROUP`."""
    if group not in HELP_GROUPS:
        raise ConfigError("group", group, HELP_GROUPS)
    load_entry_points()  # installed packages' options and keys are described too
    option = option or schema.defaults()[group]["name"]
    if option not in group_options(group):
        raise ConfigError(group, option, group_options(group))
    values = schema.defaults(group, option)
    if "_target_" in values:
        register_targets({group: values})  # a user's parts, so that their declared keys are known
    keys = schema.group_keys(group, values["name"]) or {}
    lines = [f"{group} options (`{group}=OPTION`, * the one shown; `fedharness config {group} OPTION` for another):",
             _options_line(group, option), "", f"keys of {group}={option} (`{group}.KEY=value`):"]
    lines += [_line(f"{group}.{key}", value, keys[key].doc if key in keys else "") for key, value in values.items()]
    if group == "algorithm":  # a registered user's part's keys, which no YAML holds: its constructor's defaults
        lines += [_line(f"+{group}.{key}", default, f"{spec.doc} (a user's part)")
                  for key, (spec, default) in user_keys().items() if key not in values]
    return "\n".join(lines)


def declared_lines(cls: type, values: dict[str, Any], prefix: str) -> list[str]:
    """`key = default  doc` for every key a settings class declares, its sections' keys after its own."""
    lines = [_line(prefix + name, values.get(name), spec.doc) for name, spec in keys_of(cls).items()]
    for name, section in sections_of(cls).items():
        lines += declared_lines(section, values.get(name) or {}, f"{prefix}{name}.")
    return lines


def describe_declared(group: str, option: str | None, cls: type, values: dict[str, Any]) -> str:
    """The configs of a study group (tune, sweep) and the keys with one's values, or with their defaults where none is
    named (`fedharness config tune [NAME]`)."""
    shown = f"{group}={option}" if option else f"every {group} config, at their defaults"
    lines = [f"{group} configs (`{group}=NAME`; `fedharness config {group} NAME` shows one's values):",
             _options_line(group, option or ""), "",
             f"keys of {shown} (key = value  doc); set any as {group}.KEY=value:"]
    return "\n".join(lines + declared_lines(cls, values, f"{group}."))
