"""Hydra configs: compose `conf/` with command-line overrides into a plain, validated dict."""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from harness.errors import ConfigError, require


def _conf_dir() -> Path:
    """$FEDHARNESS_CONF, else the configs shipped in the package: harness/conf, in a checkout a link to the
    top-level conf/ (resolved, so that conf/'s neighbours such as docs/ are CONF_DIR.parent there)."""
    override = os.environ.get("FEDHARNESS_CONF")
    return Path(override) if override else Path(str(files("harness") / "conf")).resolve()


CONF_DIR = _conf_dir()
GROUPS = ("dataset", "partition", "model", "algorithm", "experiment", "tune", "sweep")

# `${div:a,b}` = max(1, a // b) in configs, e.g. a budget of local steps: rounds: ${div:10000,${algorithm.local_steps}}
if not OmegaConf.has_resolver("div"):
    OmegaConf.register_new_resolver("div", lambda a, b: max(1, int(a) // int(b)))


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml") if not p.stem.startswith("_"))


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


def load_config(overrides: list[str], config_name: str = "config") -> dict[str, Any]:
    """Compose the config with overrides; raise ConfigError for anything Hydra rejects."""
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=list(overrides))
        plain = OmegaConf.to_container(cfg, resolve=True)
    except (ConfigCompositionException, MissingConfigException, OverrideParseException,
            OmegaConfBaseException) as err:
        raise _explain(overrides, err) from None
    validate_run(plain)
    return plain


def _positive_int(cfg: dict, key: str) -> None:
    v = cfg[key]
    require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, key, v, "must be an integer >= 1")


def validate_run(cfg: dict[str, Any]) -> None:
    """Top-level keys; the parts validate their own keys when built."""
    for key in ("rounds", "replicas", "eval_every", "num_shards"):
        _positive_int(cfg, key)
    require(isinstance(cfg["seed"], int) and cfg["seed"] >= 0, "seed", cfg["seed"], "must be an integer >= 0")
    threads = cfg.get("threads")
    require(threads is None or (isinstance(threads, int) and threads >= 1), "threads", threads,
            "null (automatic) or an integer >= 1")
    require(cfg["dtype"] in ("float32", "float64"), "dtype", cfg["dtype"], "one of: float32, float64")
    require(cfg["executor"] in ("inline", "reference", "ray"), "executor", cfg["executor"],
            "one of: inline, ray, reference")
    device = str(cfg["device"])
    require(device == "cpu" or device.startswith("cuda"), "device", device, "one of: cpu, cuda, cuda:N")
    if device.startswith("cuda"):
        import torch

        require(torch.cuda.is_available(), "device", device, "CUDA is not available on this machine; use cpu")
    if cfg["executor"] == "ray":
        from harness.ray_cluster import RAY_DEFAULTS, validate_ray_config

        validate_ray_config({**RAY_DEFAULTS, **(cfg.get("ray") or {})}, device)
    from harness.checkpoint import validate_checkpoint_config

    validate_checkpoint_config(cfg)
