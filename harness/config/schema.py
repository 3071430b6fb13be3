"""Every run-config key, each with its type, what is allowed and a one-line doc, and the checks of a config.

Each key is declared once, beside the code that uses it (run-level keys: harness/settings.py; a group option's:
beside its part, see GROUPS and algorithm_keys below); defaults live in the YAML under conf/
(`fedharness.config.compose.defaults()` reads them). `validate(cfg)` checks a composed config against the declarations and
raises the first ConfigError, naming the key, the value and what is allowed. A new key is one line where its part
declares its keys; a rule that ties keys together is one small function in RULES. Part names and a user's parts'
keys are read from the live registries, so a registered part is allowed as soon as it is registered.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from fedharness.algorithms.registry import algorithm_keys
from fedharness.registry.binding import Registry, key_parameters, takes_extra
from fedharness.core.ray_cluster import parse_address
from fedharness.config.compose import GROUPS as COMPOSED_GROUPS, MOVED, defaults, moved, own_section_defaults
from fedharness.errors import ConfigError, require


from fedharness.keys import Key, _is_int, _is_list, _is_real, anything, boolean, choice, integer, number, text  # noqa: F401
from fedharness.config.memory import check_memory
import fedharness.partitions  # noqa: F401  (the built-in partitioners register themselves)
import fedharness.problems  # noqa: F401  (the built-in data sets and models)
from fedharness.registry.groups import (ATTACKS, AVAILABILITIES, BUILTIN_STAGES, CADENCES, COMPRESSORS, SPEEDS,
                                       STALENESS, DATASETS, METRICS, MODELS, PARTITIONERS,
                                       STAGES)
from fedharness.settings import RunSettings, _frozen, keys_of, sections_of
from fedharness.results.store import open_store


# --- registries, read when a config is checked (parts can be registered at run time) -----------------------

def _partitions() -> tuple[str, ...]:
    return ("auto", *PARTITIONERS)  # auto: natural where the data has owners, else iid


# --- the keys ---------------------------------------------------------------------------------------------

# The run-level keys and sections are declared once, as the fields of harness/settings.py's RunSettings.
TOP: dict[str, Key] = keys_of(RunSettings)
SECTIONS: dict[str, dict[str, Key]] = {name: keys_of(cls) for name, cls in sections_of(RunSettings).items()}

# The keys of each group's options are declared beside the code that uses them, where it registers itself: a
# dataset's in its module under harness/problems/, a partition's beside its partitioner (partitions/core.py), a
# model's beside it (problems/objectives.py, problems/nets.py), all kept by their registries
# (fedharness.registry.groups); the algorithm's beside its parts (algorithms/*.py; a user's part declares its own
# when registered): algorithms.registry.algorithm_keys() collects them.
GROUPS = {"dataset": DATASETS, "partition": PARTITIONERS, "model": MODELS}  # attack: a part group, below

# Part groups: a group whose options are a registry's parts, each built from the group's own section with the keys
# its constructor's parameters name (fedharness.registry.binding: the signature is the schema), which a run may
# leave out: absent, the group is its `none` option, which builds nothing (conf/<group>/none.yaml). The checks,
# `fedharness config GROUP` and `run --help` read every part group alike, so a new stage group (compress, ...) is
# one entry here, its registry and its none.yaml.
PART_GROUPS: dict[str, Registry] = {"attack": ATTACKS, "compress": COMPRESSORS, "cadence": CADENCES, "speed": SPEEDS,
                                    "availability": AVAILABILITIES, "staleness": STALENESS}
NONE = "none"
# The part groups every run has (no `none`): their default option (conf/config.yaml's defaults list).
CHOSEN: dict[str, str] = {"cadence": "sync", "speed": "equal", "availability": "always", "staleness": "poly"}


def part_default(group: str) -> str:
    """The option a run without `group=` has: `none`, or a profile group's default."""
    return CHOSEN.get(group, NONE)
UNDECLARED = "a parameter of its constructor (no declared doc)"


def part_options(group: str) -> tuple[str, ...]:
    """The options of a part group: `none` (where the group may be left out), then every registered part (a
    user's too), read when called."""
    return (*(() if group in CHOSEN else (NONE,)), *PART_GROUPS[group])


def part_keys(group: str, option: str) -> dict[str, Key]:
    """The keys of an option of a part group besides `name`: the group's common keys, then those the option
    declared, or else its constructor's parameters (an undeclared user's part: its signature is its schema)."""
    registry = PART_GROUPS[group]
    if option == NONE and group not in CHOSEN:
        return dict(registry.common)
    declared = registry.declared(option)
    if declared is not None:
        return declared
    return {**registry.common, **{p.name: anything(UNDECLARED) for p in key_parameters(registry[option])}}


def part_section_keys(group: str, option: str) -> dict[str, Key]:
    """Every key of an option's section in a part group: `name`, then part_keys."""
    return {"name": text(f"the {group}"), **part_keys(group, option)}


def takes_any_key(group: str, option: str) -> bool:
    """Whether an option of a part group takes keys beyond part_keys: a constructor with `**params`."""
    return option != NONE and option in PART_GROUPS[group] and takes_extra(PART_GROUPS[group][option])


def group_keys(group: str, option: str) -> dict[str, Key] | None:
    """The keys of `option` in `group` (None: registered but not declared)."""
    name_doc = {"algorithm": "the named algorithm (conf/algorithm/)"}.get(group, f"the {group}")
    name = {"name": text(name_doc)}
    if group == "algorithm":
        return {**name, **algorithm_keys()}
    if (group, option) == ("partition", "auto"):
        return name
    if group in PART_GROUPS:
        return part_section_keys(group, option)
    keys = GROUPS[group].declared(option) if group in GROUPS else None
    return None if keys is None else {**name, **keys}


def batchable_keys() -> tuple[str, ...]:
    """The keys a slot of a batched run may set on its own: those declared `batchable` (fedharness.runs.batch)."""
    algorithm = tuple(f"algorithm.{name}" for name, spec in algorithm_keys().items() if spec.batchable)
    return (*(name for name, spec in TOP.items() if spec.batchable), *algorithm)


GROUP_NAMES: dict[str, Callable[[], tuple[str, ...]]] = {
    "dataset": DATASETS.names, "partition": _partitions, "model": MODELS.names,
}


# --- checking ---------------------------------------------------------------------------------------------


def settable(keys: Iterable[str], prefix: str) -> str:
    """The keys an unknown key's message names: a group's `name` is chosen as GROUP=NAME, not set as a key."""
    group = prefix.rstrip(".") in (*COMPOSED_GROUPS, *PART_GROUPS)
    return ", ".join(k for k in keys if not (group and k == "name"))


def _check_section(cfg: dict[str, Any], keys: dict[str, Key], prefix: str, extra_keys: bool = False) -> None:
    """`extra_keys`: a user's `_target_` section, whose other keys are its factory's parameters."""
    for key, value in cfg.items():
        if key not in keys and not extra_keys:
            where = f"'{prefix.rstrip('.')}'" if prefix else "the run"
            if prefix + key in MOVED:
                raise ConfigError(prefix + key, value, moved(prefix + key))
            raise ConfigError(prefix + key, value, f"no such key; keys of {where}: {settable(keys, prefix)}")
    for key, spec in keys.items():
        if key in cfg:
            spec.require(prefix + key, cfg[key])


def _check_group(cfg: dict[str, Any], group: str) -> None:
    gcfg = cfg[group]
    require(isinstance(gcfg, dict) and "name" in gcfg, group, gcfg, f"a {group} config with a name")
    name = gcfg["name"]
    if group in GROUP_NAMES:
        require(name in GROUP_NAMES[group](), group, name, "one of: " + ", ".join(GROUP_NAMES[group]()))
    keys = group_keys(group, name)
    if keys is not None:
        _check_section(gcfg, keys, f"{group}.", extra_keys="_target_" in gcfg)


def check_keys(cfg: dict[str, Any]) -> None:
    """Every key is known and holds an allowed value."""
    structure = {**TOP, **{s: anything("") for s in SECTIONS}, **{g: anything("") for g in (*GROUP_NAMES,
                                                                                            "algorithm", *PART_GROUPS)}}
    _check_section(cfg, structure, "")
    for section, keys in SECTIONS.items():
        if section in cfg:
            require(isinstance(cfg[section], dict), section, cfg[section], f"a mapping of: {', '.join(keys)}")
            _check_section(cfg[section], keys, f"{section}.")
    for group in (*GROUP_NAMES, "algorithm"):
        require(group in cfg, group, None, "every run config has a " + group)
        _check_group(cfg, group)


# --- a declared settings class (a tune or sweep spec): its keys and sections, recursively --------------------

def check_declared(cls: type, values: Any, prefix: str) -> None:
    """Every key of `values` is one `cls` declares (its keys, and its sections' keys in turn), and every declared key
    holds an allowed value (the YAML defaults set each one)."""
    keys, sections = keys_of(cls), sections_of(cls)
    names, where = [*keys, *sections], prefix.rstrip(".")
    require(isinstance(values, dict), where, values, f"a mapping of: {', '.join(names)}")
    for name, value in values.items():
        require(name in names, prefix + name, value, f"no such key; keys of '{where}': {', '.join(names)}")
    for name, spec in keys.items():
        spec.require(prefix + name, values.get(name))
    for name, section in sections.items():
        check_declared(section, values.get(name), f"{prefix}{name}.")


def declared_settings(cls: type, values: dict[str, Any]) -> Any:
    """The frozen settings of values check_declared has passed: lists as tuples, each section its own settings."""
    fields = {name: _frozen(values[name]) for name in keys_of(cls)}
    fields.update({name: declared_settings(section, values[name]) for name, section in sections_of(cls).items()})
    return cls(**fields)


# --- rules that tie keys together, in the order they are checked -----------------------------------------

LABELLED_PARTITIONS = ("iid", "classes_per_client", "shards", "dirichlet", "powerlaw")
ANALYTIC = ("quadratic", "quadratic_lazy", "li_toy")
WITHOUT_OWNERS = ("digits", "mnist", "fashion_mnist", "cifar10")  # centralised image sets: no natural clients
WITHOUT_REPLACEMENT = ("scheme_ii", "scheme_ii_transformed", "original", "yang_s2", "poisson")


def metrics_registered(cfg: dict[str, Any]) -> None:
    metrics = cfg.get("metrics") or []
    names = ", ".join(METRICS) or "none yet"
    require(all(m in METRICS for m in metrics), "metrics", metrics,
            f"a list of distinct registered metrics (fedharness.register_metric; registered: {names})")


def model_fits_dataset(cfg: dict[str, Any]) -> None:
    dataset, model = cfg["dataset"]["name"], cfg["model"]["name"]
    if dataset in ANALYTIC:
        require(model in ("auto", "quadratic"), "model", model,
                f"the {dataset} dataset is its own model: use model=auto or model=quadratic")
    else:
        require(model != "quadratic", "model", model,
                f"only the analytic datasets ({', '.join(ANALYTIC)}) use model=quadratic")


def partition_fits_dataset(cfg: dict[str, Any]) -> None:
    dataset, part = cfg["dataset"]["name"], cfg["partition"]["name"]
    if dataset in ANALYTIC:
        require(part == "auto", "partition", part, f"auto: the {dataset} dataset defines its clients itself "
                "(no labelled samples to split)")
    elif dataset == "synthetic_lazy":
        require(part in ("auto", "natural"), "partition", part,
                "auto or natural: synthetic_lazy generates each client's data itself")
    elif part == "natural":
        require(dataset not in WITHOUT_OWNERS, "partition", part,
                "needs a data set with an owner per sample: generated (synthetic, blobs), federated files (leaf, "
                f"tff, hf) or a registered one returning (x, y, owner); one of: {', '.join(LABELLED_PARTITIONS)}")


def ray_keys_need_ray(cfg: dict[str, Any]) -> None:
    parse_address(cfg["ray"]["address"])  # first: its message hides credentials, the one below would echo them
    if cfg["executor"] == "ray":
        require(cfg["num_shards"] == 1, "num_shards", cfg["num_shards"],
                "1 with executor=ray (its shards are ray.num_shards)")
        return
    default = own_section_defaults("ray")
    for key, value in cfg.get("ray", {}).items():
        require(value == default.get(key), f"ray.{key}", value,
                f"only used with executor=ray (executor is {cfg['executor']}); leave it at {default.get(key)!r}")


def shards_within_clients(cfg: dict[str, Any]) -> None:
    n = cfg["dataset"]["num_clients"]
    if n is None:  # every client the data has: known once the data are read
        return
    key = "ray.num_shards" if cfg["executor"] == "ray" else "num_shards"
    shards = cfg["ray"]["num_shards"] if cfg["executor"] == "ray" else cfg["num_shards"]
    require(shards <= n, key, shards, f"at most the number of clients (dataset.num_clients = {n})")


def sampled_within_clients(cfg: dict[str, Any]) -> None:
    acfg, n = cfg["algorithm"], cfg["dataset"]["num_clients"]
    if acfg["sampler"] in WITHOUT_REPLACEMENT and n is not None:
        require(acfg["clients_per_round"] <= n, "algorithm.clients_per_round", acfg["clients_per_round"],
                f"must be <= the number of clients ({n}) when sampling without replacement")


def unseen_leave_a_round(cfg: dict[str, Any]) -> None:
    """dataset.unseen_clients leaves at least a round's clients to train (problems/unseen.py)."""
    acfg, dcfg = cfg["algorithm"], cfg["dataset"]
    share, n = dcfg.get("unseen_clients") or 0, dcfg["num_clients"]
    if not share or n is None:
        return
    training = n - math.floor(share * n)
    need = 1 if acfg["sampler"] == "full" else acfg["clients_per_round"]
    require(training >= need, "dataset.unseen_clients", share,
            f"a share that leaves at least algorithm.clients_per_round = {need} of the {n} clients to train "
            f"(this one leaves {training})")


def ranges_ordered(cfg: dict[str, Any]) -> None:
    acfg = cfg["algorithm"]
    for low, high in (("steps_low", "steps_high"), ("epochs_low", "epochs_high"), ("steps_min", "steps_max")):
        require(acfg[high] >= acfg[low], f"algorithm.{high}", acfg[high], f"must be >= algorithm.{low} ({acfg[low]})")
    dcfg = cfg["dataset"]
    if dcfg["name"] in ("quadratic", "quadratic_lazy"):
        require(dcfg["mu"] <= dcfg["L"], "dataset.mu", dcfg["mu"], f"must satisfy 0 < mu <= L = {dcfg['L']}")


def fedexp_composes(cfg: dict[str, Any]) -> None:
    """FedExP's eta_g is derived for an average of the clients' updates at one server version (the paper's)."""
    acfg = cfg["algorithm"]
    if acfg["server_optimizer"] != "fedexp":
        return
    require(acfg["aggregator"] == "fedavg", "algorithm.aggregator", acfg["aggregator"],
            "fedavg with server_optimizer=fedexp (its step size is derived for a weighted average of the updates)")
    cadence = cfg["cadence"]["name"]
    require(cadence == "sync", "cadence", cadence, "sync with server_optimizer=fedexp (a synchronous round's updates)")


def mime_composes(cfg: dict[str, Any]) -> None:
    """Mime and MimeLite apply the server's momentum in the local steps and average the models (the paper's)."""
    acfg = cfg["algorithm"]
    if acfg["solver"] not in ("mime", "mimelite"):
        return
    why = f"with solver={acfg['solver']} (its clients apply the server's momentum; the models are averaged)"
    for key, allowed in (("server_optimizer", "sgd"), ("aggregator", "fedavg")):
        require(acfg[key] == allowed, f"algorithm.{key}", acfg[key], f"{allowed} {why}")
    for key in ("momentum", "mu", "weight_decay"):
        require(acfg[key] == 0, f"algorithm.{key}", acfg[key], f"0 {why}")
    require(cfg["cadence"]["name"] == "sync", "cadence", cfg["cadence"]["name"], f"sync {why}")


OWN_STEP_SOLVERS = ("pfedme", "perfedavg_fo", "perfedavg_hf", "apfl")  # algorithms/personalized.py


def own_step_plain(cfg: dict[str, Any]) -> None:
    """pFedMe, Per-FedAvg and APFL take their papers' local steps, averaged by FedAvg's weights: no momentum,
    prox term, weight decay or lr decay of the sgd solver's, and the fedavg aggregator."""
    acfg = cfg["algorithm"]
    solver = acfg["solver"]
    if solver not in OWN_STEP_SOLVERS:
        return
    why = f"with algorithm.solver={solver} (its local step is its paper's; the models are averaged)"
    for key, plain in (("momentum", 0), ("mu", 0), ("weight_decay", 0), ("lr_decay", 1), ("nesterov", False)):
        require(acfg[key] == plain, f"algorithm.{key}", acfg[key], f"{str(plain).lower()} {why}")
    require(acfg["aggregator"] == "fedavg", "algorithm.aggregator", acfg["aggregator"], f"fedavg {why}")


def per_client_steps(cfg: dict[str, Any]) -> None:
    acfg, n = cfg["algorithm"], cfg["dataset"]["num_clients"]
    if acfg["local_work"] == "per_client":
        steps = acfg.get("client_steps")
        require(steps is not None and (n is None or len(steps) == n), "algorithm.client_steps", steps,
                f"a list of {n} integers >= 1 (one per client) with local_work=per_client")
    if acfg["aggregator"] == "fednova" and acfg["tau_eff"] == "fixed":
        require(acfg.get("tau_eff_value") is not None, "algorithm.tau_eff_value", None,
                "a number > 0 with tau_eff=fixed")


def part_groups_known(cfg: dict[str, Any]) -> None:
    """Each part group the config has (absent: its `none`) names a registered option and sets only that option's
    keys, each holding an allowed value (a user's `_target_` or `**params` part takes any other key too)."""
    for group in PART_GROUPS:
        section = cfg.get(group)
        if section is None:
            continue
        require(isinstance(section, dict) and "name" in section, group, section, f"a {group} config with a name")
        name, options = section["name"], part_options(group)
        require(name in options, group, name, "one of: " + ", ".join(options))
        extra = "_target_" in section or takes_any_key(group, name)
        _check_section(section, part_section_keys(group, name), f"{group}.", extra_keys=extra)


def attack_known(cfg: dict[str, Any]) -> None:
    """A fraction in [0, 0.5), or [0, 1) with attack.fixed (a user's attack's too, whatever it declares);
    attack=none has fraction 0."""
    if cfg.get("attack") is None:
        return
    attack = cfg["attack"]
    ATTACKS.common["fraction"].require("attack.fraction", attack.get("fraction"))
    if not attack.get("fixed", False):  # a majority of a round's clients would outvote every robust rule
        require(attack["fraction"] < 0.5, "attack.fraction", attack["fraction"], "a finite number in [0, 0.5) "
                "(or in [0, 1) with attack.fixed=true: a fixed share of the training clients)")
    if attack["name"] == NONE:
        require(attack["fraction"] == 0, "attack.fraction", attack["fraction"],
                f"0 with attack=none; name an attack for Byzantine clients: one of {', '.join(ATTACKS)}")


def device_available(cfg: dict[str, Any]) -> None:
    device = cfg["device"]
    if device.startswith("cuda"):
        import torch

        require(torch.cuda.is_available(), "device", device, "CUDA is not available on this machine; use cpu")
    if cfg["executor"] == "ray":
        gpus = cfg["ray"]["gpus_per_shard"]
        if device.startswith("cuda"):
            require(gpus > 0, "ray.gpus_per_shard", gpus, f"device={device} needs a GPU share per shard (> 0)")
        else:
            require(gpus == 0, "ray.gpus_per_shard", gpus, f"GPU shares need device=cuda (device is {device})")
        require(gpus <= 1 or float(gpus).is_integer(), "ray.gpus_per_shard", gpus,
                "a share above 1 GPU must be a whole number")


def results_dir_writable(cfg: dict[str, Any]) -> None:
    """results_dir is, or can become, a writable directory; nothing is created but a removed probe file. An
    object-store URL is checked for its form here, and reached by the command (fedharness.results.store.check_writable)."""
    raw = cfg["results_dir"]
    if "://" in str(raw):
        open_store(str(raw))  # ConfigError for another scheme, or credentials in the URL
        return
    path = Path(raw).expanduser().absolute()
    parent = path
    while not parent.exists():
        parent = parent.parent
    require(parent.is_dir(), "results_dir", raw,
            f"a directory to write results into; '{parent}' is a file" if parent != path else
            "a directory to write results into, not an existing file")
    try:
        probe = parent / f".fedharness-probe-{os.getpid()}"
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as err:
        raise ConfigError("results_dir", raw, f"a writable directory; cannot write in '{parent}': "
                          f"{err.strerror or err}") from None


def stage_name(entry: Any) -> str:
    """A `stages` entry's name: the entry itself, or its mapping's `name`."""
    return entry if isinstance(entry, str) else entry["name"]


def stages_known(cfg: dict[str, Any]) -> None:
    """`stages`: registered stages, each once; an attack or DP that the config turns on is in the list (it runs
    where the list puts it, never added behind the user's back)."""
    names = [stage_name(e) for e in cfg.get("stages") or []]
    known = (*BUILTIN_STAGES, *STAGES)
    for name in names:
        require(name in known, "stages", name, "one of: " + ", ".join(known) + " (fedharness.register_stage adds yours)")
    require(len(set(names)) == len(names), "stages", names, "each stage at most once")
    for entry in cfg.get("stages") or []:
        if isinstance(entry, dict):
            require(entry["name"] not in BUILTIN_STAGES, "stages", entry, f"the bare name {entry['name']}: its "
                    f"keys are in its own section ({entry['name']}.KEY=VALUE)")
    attack = cfg.get("attack")
    if attack is not None and attack.get("name") != "none":
        require("attack" in names, "stages", names, f"a list with attack in it: attack={attack['name']} runs as the "
                "stage 'attack' (e.g. stages=[attack,dp])")
    dp = cfg.get("dp") or {}
    if dp.get("noise_multiplier") is not None or dp.get("target_epsilon") is not None:
        require("dp" in names, "stages", names, "a list with dp in it: dp.noise_multiplier or dp.target_epsilon "
                "runs as the stage 'dp' (e.g. stages=[attack,dp])")
    compress = cfg.get("compress")
    if compress is not None and compress.get("name") != NONE:
        require("compress" in names, "stages", names, f"a list with compress in it: compress={compress['name']} runs "
                "as the stage 'compress' (e.g. stages=[attack,compress,dp])")


def dp_covered(cfg: dict[str, Any]) -> None:
    """A DP run is one the accountant covers: a plain weighted sum of clipped updates (no
    dropout's rescaling, no robust rule, no unnoised per-client sums such as SCAFFOLD's), one source of z."""
    dp, acfg = cfg["dp"], cfg["algorithm"]
    if dp["noise_multiplier"] is None and dp["target_epsilon"] is None:
        return
    require(dp["noise_multiplier"] is None or dp["target_epsilon"] is None, "dp.target_epsilon", dp["target_epsilon"],
            f"null when dp.noise_multiplier is set ({dp['noise_multiplier']}): set one of the two")
    require(acfg["aggregator"] == "fedavg", "algorithm.aggregator", acfg["aggregator"],
            "fedavg with dp (DP-FedAvg noises a weighted sum of clipped updates)")
    require(acfg["dropout"] == 0, "algorithm.dropout", acfg["dropout"], "0 with dp (dropout rescales the weights)")
    require(acfg["solver"] not in ("scaffold", "mime", "mimelite"), "algorithm.solver", acfg["solver"],
            "not scaffold, mime or mimelite with dp (their control variates and gradients would leave the "
            "clients unclipped and unnoised)")
    sigma_b, z = dp["count_noise_multiplier"], dp["noise_multiplier"]
    if dp["adaptive"] and sigma_b is not None and z is not None:
        require(2 * sigma_b > z, "dp.count_noise_multiplier", sigma_b,
                f"> dp.noise_multiplier / 2 = {z / 2:g} (the count's noise is taken out of the update's budget)")


FEDDYN_PARTS = ("solver", "aggregator", "server_optimizer")
FEDDYN_SAMPLERS = ("full", "yang_s2")  # a fixed number of clients, uniformly without replacement


def feddyn_composes(cfg: dict[str, Any]) -> None:
    """FedDyn's three parts go together (the clients' g_k, the plain mean of their models, the server's h), and
    every round the server hears from the |P| clients its h assumes (Acar et al., Algorithm 1)."""
    acfg, cadence = cfg["algorithm"], cfg["cadence"]
    named = [kind for kind in FEDDYN_PARTS if acfg[kind] == "feddyn"]
    if not named:
        return
    why = f"with algorithm.{named[0]}=feddyn"
    for kind in FEDDYN_PARTS:
        require(acfg[kind] == "feddyn", f"algorithm.{kind}", acfg[kind], f"feddyn {why} (FedDyn's server step takes "
                "the plain mean of its clients' models and its own h: algorithm=feddyn)")
    require(acfg["sampler"] in FEDDYN_SAMPLERS, "algorithm.sampler", acfg["sampler"], f"full or yang_s2 {why} (its "
            "server takes |P| / N from the sampler: a fixed number of clients, uniformly without replacement)")
    require(acfg["dropout"] == 0, "algorithm.dropout", acfg["dropout"], f"0 {why} (its server assumes every sampled "
            "client returns)")
    for key, value, allowed in (("cadence", cadence["name"], "sync"), ("cadence.deadline_s", cadence.get("deadline_s"),
                                                                       None),
                                ("availability", cfg["availability"]["name"], "always"),
                                ("cadence.over_selection", cadence.get("over_selection", 1), 1)):
        require(value == allowed, key, value, f"{'null' if allowed is None else allowed} {why} (its server assumes "
                "every sampled client returns, in its round)")
    compress = (cfg.get("compress") or {}).get("name", NONE)
    require(compress == NONE, "compress", compress, f"none {why} (its server's h must see the updates its clients' "
            "g_k saw)")


PERSONAL_SOLVERS = ("ditto", "fedrep", "fedbabu", *OWN_STEP_SOLVERS)  # algorithms/personal.py, personalized.py
# The attacks a personal solver takes: Ditto's label poisoning (Li et al. 2021), the clients training on poisoned
# data, their personal models too; a forged update has no personal model behind it.
PERSONAL_ATTACKS = {"ditto": ("label_flip",)}


def personal_composes(cfg: dict[str, Any]) -> None:
    """A personal solver goes with server optimizers and samplers only (for now): not with dp, an attack (but
    Ditto's label flipping), compression, a deadline or an asynchronous schedule."""
    acfg, cadence = cfg["algorithm"], cfg["cadence"]
    solver = acfg["solver"]
    if solver not in PERSONAL_SOLVERS:
        return
    why = f"with algorithm.solver={solver}"
    dp = cfg["dp"]
    for key in ("noise_multiplier", "target_epsilon"):
        require(dp[key] is None, f"dp.{key}", dp[key], f"null {why} (its personal models are not privatized)")
    attack = (cfg.get("attack") or {}).get("name", NONE)
    allowed = (NONE, *PERSONAL_ATTACKS.get(solver, ()))
    require(attack in allowed, "attack", attack, f"{' or '.join(allowed)} {why} (not yet combined with personal "
            "models)")
    compress = (cfg.get("compress") or {}).get("name", NONE)
    require(compress == NONE, "compress", compress, f"none {why} (not yet combined with personal models)")
    require(cadence["name"] == "sync", "cadence", cadence["name"], f"sync {why} (its clients train from the "
            "round's global model)")
    require(cadence.get("deadline_s") is None, "cadence.deadline_s", cadence.get("deadline_s"), f"null {why} (a "
            "cut-off client's personal model would be half-trained)")


CLIENT_RULES = (shards_within_clients, sampled_within_clients, per_client_steps, unseen_leave_a_round)  # the rules that need N


def check_data_clients(cfg: dict[str, Any], num_clients: int) -> None:
    """dataset.num_clients=null (every client the data has): the rules that need N, once the data have said it."""
    known = {**cfg, "dataset": {**cfg["dataset"], "num_clients": num_clients}}
    for rule in CLIENT_RULES:
        rule(known)


RULES: tuple[Callable[[dict[str, Any]], None], ...] = (
    metrics_registered, model_fits_dataset, partition_fits_dataset, ray_keys_need_ray, shards_within_clients,
    sampled_within_clients, unseen_leave_a_round,
    ranges_ordered, per_client_steps, fedexp_composes, mime_composes, own_step_plain, part_groups_known, attack_known, stages_known, device_available,
    results_dir_writable,
    dp_covered, feddyn_composes, personal_composes,
)


def validate(cfg: dict[str, Any]) -> None:
    """Check a composed run config: every key, then the rules between keys, then the memory it needs."""
    check_keys(cfg)
    for rule in RULES:
        rule(cfg)
    check_memory(RunSettings.from_config(cfg))
