"""Help text from the schema: groups with their options, keys with their YAML defaults and one-line docs."""

from __future__ import annotations

import inspect
import re
from typing import Any

from fedharness.config import schema
from fedharness.algorithms.registry import user_keys
from fedharness.config.compose import group_options
from fedharness.config.overrides import format_value
from fedharness.errors import ConfigError
from fedharness.extend import register_targets, stage_defaults
from fedharness.registry.binding import key_parameters
from fedharness.registry.groups import BUILTIN_STAGES, STAGES
from fedharness.registry.plugins import load_entry_points
from fedharness.settings import RunSettings, keys_of, sections_of

HELP_GROUPS = ("dataset", "partition", "model", "algorithm")
STUDY_GROUPS = ("tune", "sweep")  # described by fedharness.studies (fedharness.cli cmd_config)
WIDTH = 34  # "key = default" column


def _shown(value: Any) -> str:
    """A default as it is written on the command line."""
    return value if isinstance(value, str) and value else format_value(value)


def _line(key: str, default: Any, doc: str) -> str:
    left = f"  {key} = {_shown(default)}"
    if len(left) > WIDTH:
        return f"{left}\n{'':<{WIDTH}}  {doc}"
    return f"{left:<{WIDTH}}  {doc}"


def _options_line(group: str, default: str, options: list[str] | tuple[str, ...] | None = None) -> str:
    """The group's options, `default` starred; `options`: the group's config names unless given."""
    names = [f"{o}*" if o == default else o for o in (group_options(group) if options is None else options)]
    return f"  {group + ' ':<11}{', '.join(names)}"


def describe_run() -> str:
    """The groups and every top-level and section key of a run (`fedharness run --help`)."""
    load_entry_points()  # installed packages' options are listed too
    top = schema.defaults()
    lines = ["config groups (group=OPTION, * the default; `fedharness config GROUP` shows a group's keys):"]
    lines += [_options_line(g, top[g]["name"]) for g in HELP_GROUPS]
    lines.append(_options_line("experiment", "") + "  (paper reproductions; none by default)")
    lines += [_options_line(g, schema.part_default(g), schema.part_options(g)) for g in schema.PART_GROUPS]
    lines += ["", "keys (key = default  doc); set any as key=value, e.g. rounds=50 ray.num_shards=4:"]
    for key, spec in schema.TOP.items():
        if key in top:
            lines.append(_line(key, top[key], spec.doc))
    for section, keys in schema.SECTIONS.items():
        lines += [_line(f"{section}.{key}", top[section].get(key), spec.doc) for key, spec in keys.items()]
    for group in schema.PART_GROUPS:  # each option's own keys: they exist only once the option is chosen
        lines += ["", f"{group} options and their keys ({group}=OPTION, then {group}.KEY=value):"]
        lines += [line for option in schema.part_options(group) for line in _option_block(group, option)]
    return "\n".join(lines)


def describe_group(group: str, option: str | None = None) -> str:
    """A group's options and the keys of one option (the default one unless named): `fedharness config GROUP`."""
    if group in schema.PART_GROUPS:
        return describe_part_group(group, option)
    if group == "stages":
        return describe_stages(option)
    if group not in HELP_GROUPS:
        raise ConfigError("group", group, (*HELP_GROUPS, *schema.PART_GROUPS, "stages", *STUDY_GROUPS))
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


def describe_stages(option: str | None = None) -> str:
    """The update stages a run's `stages` list may name (`fedharness config stages [NAME]`): attack, dp and
    compress, whose keys are their own sections', and a user's registered stages with their keys (constructor parameters and
    registered defaults)."""
    load_entry_points()
    names = (*BUILTIN_STAGES, *STAGES)
    if option is not None and option not in names:
        raise ConfigError("stages", option, f"one of: {', '.join(names)}")
    default = schema.defaults()["stages"]
    lines = [f"update stages (`stages=[...]` in the order they run; the default: {format_value(default)}):",
             "  " + ", ".join(names), ""]
    for name in (option,) if option else names:
        lines += _stage_block(name)
    return "\n".join(lines)


def _stage_block(name: str) -> list[str]:
    if name in schema.PART_GROUPS:
        what = {"attack": "the Byzantine clients", "compress": "the compressed client updates"}.get(name, "the parts")
        return [f"{name}: {what} of the {name} group (its keys: fedharness config {name})"]
    if name == "dp":
        dp = schema.defaults()["dp"]
        keys = keys_of(sections_of(RunSettings)["dp"])
        return ["dp: DP-FedAvg, on when dp.noise_multiplier or dp.target_epsilon is set (docs/privacy.md)",
                *(_line(f"dp.{k}", v, keys[k].doc if k in keys else "") for k, v in dp.items())]
    factory = STAGES[name]
    values = {p.name: p.default for p in key_parameters(factory)}
    values.update(stage_defaults(name))
    return [f"{name}: {_first_sentence(factory)} (keys: stages=[{{name: {name}, KEY: VALUE}}])",
            *(_line(k, None if v is inspect.Parameter.empty else v, "") for k, v in values.items())]


def describe_part_group(group: str, option: str | None = None) -> str:
    """A part group's options (attack, ...), each with what it does and its keys, or one option's alone:
    `fedharness config GROUP [OPTION]`. A part registered from Python is described like a built-in."""
    load_entry_points()  # installed packages' parts are described too
    options = schema.part_options(group)
    if option is not None and option not in options:
        raise ConfigError(group, option, f"one of: {', '.join(options)}")
    if option is None:
        head = f"{group} options (`{group}=OPTION`, * the default; `fedharness config {group} OPTION` shows one):"
        shown, marked, what = options, schema.part_default(group), "what each does"
    else:
        head = f"{group} options (`{group}=OPTION`, * the one shown; `fedharness config {group}` shows every one):"
        shown, marked, what = (option,), option, "what it does"
    lines = [head, _options_line(group, marked, options), "",
             f"{what}, and its keys (key = default  doc), set as {group}.KEY=value:"]
    return "\n".join(lines + [line for name in shown for line in _option_block(group, name)])


def _option_block(group: str, option: str) -> list[str]:
    """`group=option: what it does`, then its keys (not `name`: that is chosen as group=option)."""
    values = _option_values(group, option)
    keys = schema.part_keys(group, option)
    names = [*keys, *(k for k in values if k not in keys and k != "name")]  # a `**params` part's own config keys
    return [f"{group}={option}: {_option_doc(group, option)}",
            *(_line(f"{group}.{k}", values.get(k), keys[k].doc if k in keys else schema.UNDECLARED) for k in names)]


def _option_values(group: str, option: str) -> dict[str, Any]:
    """An option's defaults: its constructor's, overridden by its config (conf/<group>/<option>.yaml, or the
    node a Python registration stored), which is what `group=option` composes."""
    factory = schema.PART_GROUPS[group].get(option)
    values = {} if factory is None else {p.name: p.default for p in key_parameters(factory)
                                         if p.default is not inspect.Parameter.empty}
    if option in group_options(group):
        values.update(schema.defaults(group, option))
    return values


def _option_doc(group: str, option: str) -> str:
    """An option's one-line doc: the first sentence of its constructor's own docstring."""
    if option == schema.NONE:
        return f"no {group} (the default: a run without `{group}=`)"
    return _first_sentence(schema.PART_GROUPS[group][option])


def _first_sentence(factory: Any) -> str:
    """The first sentence of a factory's own docstring (a class's __doc__ is not inherited)."""
    doc = getattr(factory, "func", factory).__doc__
    if not doc:
        return "(its constructor has no docstring)"
    text = " ".join(doc.strip().split("\n\n")[0].split())
    end = re.search(r"\.\s+(?=[A-Z])", text)  # a sentence ends at '. ' before a capital ("et al. 2019" goes on)
    return text[:end.start() + 1] if end else text


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
