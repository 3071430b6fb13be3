"""Hydra composition: `conf/` (or the package's copy), a user's config folders and command-line overrides, as
plain dicts; unvalidated (harness/config/load.py validates)."""

from __future__ import annotations

import copy
import os
import re
from functools import lru_cache
from importlib.resources import files
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import AnyNode, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedharness.config.overrides import override_key
from fedharness.errors import ConfigError, require


def _conf_dir() -> Path:
    """$FEDHARNESS_CONF, else the configs shipped in the package: harness/conf, in a checkout a link to the
    top-level conf/ (resolved, so that conf/'s neighbours such as docs/ are CONF_DIR.parent there)."""
    override = os.environ.get("FEDHARNESS_CONF")
    return Path(override) if override else Path(str(files("fedharness") / "conf")).resolve()


CONF_DIR = _conf_dir()
GROUPS = ("dataset", "partition", "model", "algorithm", "attack", "compress", "cadence", "speed", "availability",
          "staleness", "experiment", "tune", "sweep")

# `${div:a,b}` = max(1, a // b) in configs, e.g. a budget of local steps: rounds: ${div:10000,${algorithm.local_steps}}
if not OmegaConf.has_resolver("div"):
    OmegaConf.register_new_resolver("div", lambda a, b: max(1, int(a) // int(b)))


def group_options(group: str) -> list[str]:
    """Config names of a group: conf/, the user's $FEDHARNESS_CONFIG_PATH folders, registered ones."""
    files = {p.stem for d in (CONF_DIR, *user_config_dirs()) for p in (Path(d) / group).glob("*.yaml")}
    stored = {n.removesuffix(".yaml") for n in ConfigStore.instance().repo.get(group, {})}
    return sorted(n for n in files | stored if not n.startswith("_"))


def user_config_dirs() -> list[str]:
    return [d for d in os.environ.get("FEDHARNESS_CONFIG_PATH", "").split(os.pathsep) if d]


# a removed key -> the key that now does its work (and where it is described)
MOVED = {"dataset.eval_clients": "eval.clients (docs/results.md, Evaluation on a sample)",
         "systems": "the groups cadence, speed, availability and staleness (docs/systems.md)",
         **{f"systems.{old}": f"{new} (docs/systems.md)" for old, new in (
             ("mode", "cadence=NAME (sync, fedbuff, fedasync)"), ("speed", "speed=NAME"),
             ("availability", "availability=NAME"), ("staleness", "staleness=NAME"),
             ("speed_sigma", "speed.step_sigma with speed=lognormal"),
             ("bandwidth_sigma", "speed.bandwidth_sigma with speed=lognormal"),
             ("slow_fraction", "speed.fraction with speed=slow_tail"),
             ("slow_factor", "speed.factor with speed=slow_tail"), ("device_trace", "speed.file with speed=trace"),
             ("trace_batch_size", "speed.samples_per_step with speed=trace"),
             ("duty_cycle", "availability.duty_cycle with availability=duty_cycle"),
             ("period_s", "availability.period_s with availability=duty_cycle"),
             ("availability_trace", "availability.file with availability=trace"),
             ("deadline_s", "cadence.deadline_s (cadence=sync)"),
             ("over_selection", "cadence.over_selection (cadence=sync)"),
             ("late_work", "cadence.late_work (cadence=sync)"), ("retry_s", "cadence.retry_s"),
             ("concurrency", "cadence.concurrency with cadence=fedbuff or fedasync"),
             ("buffer", "cadence.buffer with cadence=fedbuff"),
             ("refill", "cadence.refill with cadence=fedbuff or fedasync"),
             ("max_staleness", "cadence.max_staleness with cadence=fedbuff or fedasync"),
             ("alpha", "cadence.alpha with cadence=fedasync"),
             ("staleness_exponent", "staleness.exponent with staleness=poly, staleness.slope with staleness=hinge"),
             ("staleness_cutoff", "staleness.cutoff with staleness=hinge"))}}


def moved(key: str) -> str:
    return f"no such key: it is now {MOVED[key]}"


def _explain(overrides: list[str], err: Exception, config_name: str = "config") -> ConfigError:
    """Turn Hydra's exception into one message naming the key, the value and what is allowed."""
    for ov in overrides:
        key, _, value = ov.lstrip("+~").partition("=")
        if key in GROUPS and value not in group_options(key):
            return ConfigError(key, value, group_options(key))
    text = str(err).splitlines()[0]
    for ov in overrides:
        key, _, value = ov.lstrip("+~").partition("=")
        if key == "scale" and "'scales." in text:  # an experiment's scale picks an entry of its `scales`
            return ConfigError("scale", value, "one of: smoke, paper (the experiment's scales)")
        if key in MOVED:
            return ConfigError(key, value, moved(key))
        if f"'{key}'" in text:
            return _unknown_key(key, value, overrides, config_name)
    return ConfigError("overrides", " ".join(overrides), text)


def _unknown_key(key: str, value: str, overrides: list[str], config_name: str) -> ConfigError:
    """A key Hydra does not find: name the keys of its section as the command's group choices compose it
    (`attack=alie attack.nope=1`: alie's keys), or say that its group has no option chosen yet."""
    section = key.rpartition(".")[0]
    node: Any = _chosen(overrides, config_name)
    for part in filter(None, section.split(".")):
        node = node.get(part) if isinstance(node, dict) else None
    if section in GROUPS and node is None:  # an optional group left out (attack): its keys come with an option
        return ConfigError(key, value, f"no such key: no {section} is chosen; choose one first, {section}=NAME "
                                       f"(one of: {', '.join(group_options(section))})")
    if not isinstance(node, dict):
        return ConfigError(key, value, f"no such key; '{section}' is not a section")
    shown = sorted(k for k in node if not (section in GROUPS and k == "name"))  # name: chosen as GROUP=NAME
    return ConfigError(key, value, f"no such key; keys of '{section or 'the run'}': {', '.join(shown) or '(none)'}")


def _chosen(overrides: list[str], config_name: str) -> dict[str, Any]:
    """The config composed with only the command's group choices (`attack=alie`, `experiment=...`): the sections
    and keys an override may set. A choice that does not compose either leaves the defaults."""
    choices = [o for o in overrides if o.lstrip("+").partition("=")[0] in GROUPS and not o.startswith("~")]
    for attempt in (choices, []):
        try:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                cfg = compose(config_name=config_name, overrides=user_search_path() + attempt)
            return OmegaConf.to_container(cfg, resolve=False)
        except (ConfigCompositionException, MissingConfigException, OverrideParseException, OmegaConfBaseException):
            continue
    return {}


def user_search_path() -> list[str]:
    """`hydra.searchpath` for the config folders in $FEDHARNESS_CONFIG_PATH (os.pathsep-separated): a user's
    conf/<group>/<name>.yaml files, e.g. a model with a `_target_` (docs/extending.md)."""
    dirs = user_config_dirs()
    for d in dirs:
        require(Path(d).is_dir(), "FEDHARNESS_CONFIG_PATH", d, "not a folder")
    return [f"hydra.searchpath=[{','.join('file://' + str(Path(d).resolve()) for d in dirs)}]"] if dirs else []


def compose_raw(overrides: list[str], config_name: str = "config") -> dict[str, Any]:
    """The composed config as a plain dict, unvalidated; raise ConfigError for anything Hydra rejects."""
    search = user_search_path()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=search + list(overrides))
        return OmegaConf.to_container(cfg, resolve=True)
    except (ConfigCompositionException, MissingConfigException, OverrideParseException,
            OmegaConfBaseException) as err:
        raise _explain(overrides, err, config_name) from None


# --- many runs that differ only in values: compose once --------------------------------------------------

def compose_values(overrides: list[str], values: list[str], config_name: str = "config") -> dict[str, Any]:
    """compose_raw(overrides + values), composing `overrides` once per process when every one of `values` only sets
    an existing key (`algorithm.client_lr=0.1`, never a group or +/~): Hydra applies such value overrides to the
    composed config before resolving, which is what this does, so interpolations (`${div:10000,
    ${algorithm.local_steps}}`) still follow the values. Anything else, or any error, takes compose_raw's path
    (and its messages). A tuning study's trials compose in ~5 ms instead of ~0.25 s; where the composed config holds
    no interpolation and the keys set are untyped leaves, the values go into a copy of its plain dict (~0.2 ms,
    numbers read without Hydra's parser: _parsed_value; copying the DictConfig was most of the 5 ms)."""
    try:
        key = tuple(user_search_path() + list(overrides))
        base = _composed_unresolved(key, config_name)
        changes = _value_overrides(base, values)
        plain = _plain(key, config_name)
        if plain is not None and all(_plain_settable(base, k, v) for k, v in changes):
            cfg = copy.deepcopy(plain)
            for k, value in changes:
                *sections, leaf = k.split(".")
                node = cfg
                for section in sections:
                    node = node[section]
                node[leaf] = value
            return cfg
        cfg = copy.deepcopy(base)
        for k, value in changes:
            OmegaConf.update(cfg, k, value, merge=True)
        return OmegaConf.to_container(cfg, resolve=True)
    except (_NotValues, ConfigCompositionException, MissingConfigException, OverrideParseException,
            OmegaConfBaseException):
        return compose_raw([*overrides, *values], config_name)


def choices_and_values(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the group choices, the value overrides) of one command: Hydra composes the defaults from the choices, then
    applies the values in order, so compose_values(*this) is compose_raw(overrides) (a sweep's jobs share their
    choices: composed once). An override that adds or deletes (`+key=`, `~key`) keeps every override a choice,
    as its order among the values matters."""
    if any(o.startswith(("+", "~")) for o in overrides):
        return list(overrides), []
    values = [o for o in overrides if "=" in o and override_key(o) not in GROUPS and "/" not in override_key(o)
              and "@" not in override_key(o) and not o.startswith("hydra.")]
    return [o for o in overrides if o not in values], values


@lru_cache(maxsize=8)
def _plain(overrides: tuple[str, ...], config_name: str) -> dict[str, Any] | None:
    """The composed config as a plain dict, or None where it holds an interpolation (a value may then follow
    another: OmegaConf resolves it)."""
    cfg = _composed_unresolved(overrides, config_name)
    unresolved = OmegaConf.to_container(cfg, resolve=False)
    return None if "${" in repr(unresolved) else OmegaConf.to_container(cfg, resolve=True)


def _plain_settable(cfg: DictConfig, key: str, value: Any) -> bool:
    """Whether OmegaConf would store `value` at `key` as it is: an untyped leaf (AnyNode; a typed one converts or
    refuses) and no interpolation in the value."""
    node = cfg
    for part in key.split("."):
        node = node._get_node(part)
    return isinstance(node, AnyNode) and not (isinstance(value, str) and "${" in value)


class _NotValues(Exception):
    """An override that is not a plain value override of an existing key."""


@lru_cache(maxsize=8)
def _composed_unresolved(overrides: tuple[str, ...], config_name: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


def _value_overrides(cfg: DictConfig, values: list[str]) -> list[tuple[str, Any]]:
    """(key, value) of each override, parsed as Hydra parses it; _NotValues unless each sets an existing leaf."""
    out = []
    for text in values:
        key, value = _parsed_value(text)
        current = OmegaConf.select(cfg, key, default=_NotValues, throw_on_missing=False)
        if current is _NotValues or OmegaConf.is_config(current) or isinstance(value, (dict, list)):
            raise _NotValues(text)
        out.append((key, value))
    return out


# `dotted.key=number` as format_value writes a tuning trial's int or float (repr). In Hydra's grammar such a value
# is one INT token (read as int(text)) or one FLOAT token (float(text)) and the key one DOT_PATH or ID, so reading
# it here is what Hydra's parser gives, at a hundredth of its cost (tests/test_trial_config.py compares the two).
_NUMBER_OVERRIDE = re.compile(r"([A-Za-z_][A-Za-z0-9_-]*(?:\.[A-Za-z_][A-Za-z0-9_-]*)*)="
                              r"(-?(?:0|[1-9][0-9]*)(?:(\.[0-9]+)|(?:\.[0-9]+)?(e[+-][0-9]+))?)")


def _parsed_value(text: str) -> tuple[str, Any]:
    """(key, value) of one value override of an existing-looking key; _NotValues for any other override."""
    number = _NUMBER_OVERRIDE.fullmatch(text)
    if number is None:
        return _hydra_value(text)
    key, literal, fraction, exponent = number.groups()
    if key in GROUPS or key.startswith("hydra."):  # as _hydra_value refuses them
        raise _NotValues(text)
    return key, float(literal) if fraction or exponent else int(literal)


@lru_cache(maxsize=1024)
def _hydra_value(text: str) -> tuple[str, Any]:
    """Hydra's parse of one override (cached: a study's categorical and integer values repeat); _NotValues unless
    it only sets a value."""
    ov = _parser().parse_overrides([text])[0]
    key = ov.key_or_group
    changes = not (ov.is_add() or ov.is_force_add() or ov.is_delete() or ov.is_sweep_override())
    if not changes or ov.package is not None or "/" in key or key in GROUPS or ov.is_hydra_override():
        raise _NotValues(text)
    return key, ov.value()


@lru_cache(maxsize=1)
def _parser() -> OverridesParser:
    return OverridesParser.create()


# --- defaults, from the YAML ------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _composed(group: str | None, option: str | None) -> dict[str, Any]:
    return compose_raw([f"{group}={option}"] if group else [])


def defaults(group: str | None = None, option: str | None = None) -> dict[str, Any]:
    """The YAML defaults: the run's top-level keys and sections, or those of one option of a group."""
    cfg = _composed(group, option)
    return cfg[group] if group else cfg


@lru_cache(maxsize=None)
def own_section_defaults(section: str) -> dict[str, Any]:
    """defaults()[section] for a section that conf/config.yaml sets whole and no group option touches (`ray`),
    read from that one file: composing the whole config again costs a one-round run about 0.1 s
    (tests/test_startup.py checks the two agree)."""
    return OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml")[section], resolve=True)
