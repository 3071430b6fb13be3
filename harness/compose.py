"""Hydra composition: `conf/` (or the package's copy), a user's config folders and command-line overrides, as
plain dicts; unvalidated (harness/config.py validates)."""

from __future__ import annotations

import os
from functools import lru_cache
from importlib.resources import files
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedharness.errors import ConfigError, require


def _conf_dir() -> Path:
    """$FEDHARNESS_CONF, else the configs shipped in the package: harness/conf, in a checkout a link to the
    top-level conf/ (resolved, so that conf/'s neighbours such as docs/ are CONF_DIR.parent there)."""
    override = os.environ.get("FEDHARNESS_CONF")
    return Path(override) if override else Path(str(files("fedharness") / "conf")).resolve()


CONF_DIR = _conf_dir()
GROUPS = ("dataset", "partition", "model", "algorithm", "experiment", "tune", "sweep")

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


def _explain(overrides: list[str], err: Exception) -> ConfigError:
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
        if f"'{key}'" in text:
            section, _, _ = key.rpartition(".")
            return ConfigError(key, value, f"no such key; keys of '{section or 'the run'}': {_known_keys(section)}")
    return ConfigError("overrides", " ".join(overrides), text)


def _known_keys(section: str) -> str:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = OmegaConf.to_container(compose(config_name="config"), resolve=False)
    for part in filter(None, section.split(".")):
        cfg = cfg.get(part, {}) if isinstance(cfg, dict) else {}
    return ", ".join(sorted(cfg)) if isinstance(cfg, dict) else "(none)"


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
        raise _explain(overrides, err) from None


# --- defaults, from the YAML ------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _composed(group: str | None, option: str | None) -> dict[str, Any]:
    return compose_raw([f"{group}={option}"] if group else [])


def defaults(group: str | None = None, option: str | None = None) -> dict[str, Any]:
    """The YAML defaults: the run's top-level keys and sections, or those of one option of a group."""
    cfg = _composed(group, option)
    return cfg[group] if group else cfg
