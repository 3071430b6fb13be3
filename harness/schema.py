"""The one declaration of every run-config key: its type, what is allowed, and a one-line doc.

Defaults live in the YAML under conf/ (`fedharness.compose.defaults()` reads them); this module says what each key may
hold. `validate(cfg)` checks a composed config against it and raises the first ConfigError, naming
the key, the value and what is allowed. A new key is one line in the table of its section; a rule
that ties keys together is one small function in RULES. Part names are checked against the live
registries, so a registered part is allowed as soon as it is registered.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from fedharness.compose import defaults
from fedharness.errors import ConfigError, require


from fedharness.keys import Key, _is_int, _is_list, _is_real, anything, boolean, choice, integer, number, text  # noqa: F401


# --- registries, read when a config is checked (parts can be registered at run time) -----------------------

def _datasets() -> tuple[str, ...]:
    from fedharness.problems import DATASETS

    return tuple(DATASETS)


def _models() -> tuple[str, ...]:
    from fedharness.problems import MODELS

    return tuple(MODELS)


def _partitions() -> tuple[str, ...]:
    from fedharness.partitions import PARTITIONERS

    return ("auto", *PARTITIONERS)


def _parts(kind: str) -> Callable[[], tuple[str, ...]]:
    def names() -> tuple[str, ...]:
        from fedharness.algorithms.registry import PARTS

        return tuple(PARTS[kind])

    return names


# --- the keys ---------------------------------------------------------------------------------------------

_RUN_ID = re.compile(r"^[A-Za-z0-9._=-]+$")

TOP: dict[str, Key] = {
    "study": text("groups runs (tuning studies, sweeps)"),
    "experiment": text("the experiment config this run belongs to (experiment=NAME picks a paper reproduction)"),
    "rounds": integer("communication rounds", lo=1),
    "seed": integer("seed of every random stream (clients, minibatches, data)", lo=0),
    "replicas": integer("independent seeds batched on one tensor axis", lo=1),
    "eval_every": integer("rounds between evaluations (and Parquet rows)", lo=1),
    "results_dir": text("where runs/ and rounds/ are written as Parquet"),
    "executor": choice("inline | reference (per-client loop, for checking) | ray", ("inline", "reference", "ray")),
    "num_shards": integer("inline shards (the ray executor uses ray.num_shards)", lo=1),
    "checkpoint_every": integer("rounds between checkpoints under <results_dir>/checkpoints/ (0: none)", lo=0),
    "resume": Key(lambda v: v is None or (isinstance(v, str) and bool(_RUN_ID.match(v)) and v != ".."),
                  "null, or the run_id of a checkpointed run (letters, digits, . _ - =)",
                  "a run_id: continue that run from its last checkpoint"),
    "dtype": choice("float32 | float64", ("float32", "float64")),
    "device": Key(lambda v: isinstance(v, str) and re.fullmatch(r"cpu|cuda(:\d+)?", v) is not None,
                  "one of: cpu, cuda, cuda:N", "cpu | cuda | cuda:N"),
    "progress": boolean("show a progress bar on stderr"),
    "threads": integer("torch threads; null: 1 for one replica of a small model, else torch's default", lo=1,
                       null="automatic"),
    "heterogeneity": boolean("convex problems: solve every client's F_k* for Gamma = F* - sum p_k F_k*"),
    "reference": Key(lambda v: v in ("auto", "on", "off") or isinstance(v, bool), "one of: auto, on, off",
                     "exact w*, F* for subopt/dist_to_opt: auto (where strongly convex), on (always, or fail), off"),
    "precision": choice("fp32 | tf32 (TF32 matmuls on CUDA) | bf16 (nets' training under bf16 autocast)",
                        ("fp32", "tf32", "bf16")),
    "kernel": choice("nets' batched client gradients: auto (the fastest, timed once per shape on this machine and "
                     "remembered) | vmap | loop | loop_channels_last", ("auto", "vmap", "loop", "loop_channels_last")),
    "deterministic": boolean("deterministic CUDA kernels (cuBLAS workspace, cuDNN): same bits run to run, slower"),
    "memory_budget_gb": number("GB (10^9 bytes) a batched training or evaluation step may use", lo=0, lo_open=True,
                               null="half the device's free memory"),
    "reference_timeout_s": number("each exact solve (w*; all clients' F_k* together) gives up after this long",
                                  lo=0, lo_open=True, null="no bound"),
    "scale": text("an experiment's scale: an entry of its `scales` (smoke, paper)"),
    "scales": anything("an experiment's sizes per scale (conf/experiment/)"),
    "tune": anything("a tuning study's settings (tune=NAME; checked by fedharness tune)"),
}

SECTIONS: dict[str, dict[str, Key]] = {
    "ray": {
        "address": Key(lambda v: v is None or (isinstance(v, str) and v != ""), "null, auto or host:port",
                       "null: start a local Ray on 127.0.0.1; auto | host:port: join a running cluster"),
        "num_shards": integer("long-lived ClientShard actors, each owning a cost-balanced set of clients", lo=1),
        "cpus_per_shard": number("CPUs reserved per shard (fractions allowed)", lo=0, lo_open=True),
        "gpus_per_shard": number("GPU share per shard (needs device=cuda), e.g. 0.25", lo=0),
        "placement": choice("spread (one shard per node where possible) | pack", ("spread", "pack")),
        "connect_timeout_s": number("bounded wait for the cluster to answer (s)", lo=0, lo_open=True),
        "reserve_timeout_s": number("bounded wait for the shards' CPUs/GPUs (s)", lo=0, lo_open=True),
        "max_restarts": integer("restarts of a dead shard per round before the run fails", lo=0),
    },
    "network": {
        "bandwidth_MB_per_s": number("each client's up- and downlink in MB/s (simulated sim_s)", lo=0, lo_open=True),
        "compute_s_per_step": number("simulated seconds per local step", lo=0),
    },
    "wandb": {
        "enabled": boolean("log config, per-round metrics, summary and the Parquet artifact to W&B"),
        "project": text("W&B project"),
        "entity": text("W&B entity", null="your default"),
        "group": text("W&B group", null="the run's study"),
        "tags": Key(lambda v: _is_list(v, lambda t: isinstance(t, str)), "a list of strings", "W&B tags"),
        "mode": choice("auto (online with an API key, else offline) | online | offline",
                       ("auto", "online", "offline")),
    },
}

_DATA_SEED = integer("seed of the data", lo=0, null="use the run's seed")
_NUM_CLIENTS = integer("N, the number of clients", lo=1)
_SAMPLES = integer("samples per client", lo=2, null="n_k ~ lognormal(4, 2) + 50")
_FILES = {
    "num_clients": _NUM_CLIENTS,
    "data_dir": text("where the files are read from (torchvision's layout)"),
    "download": boolean("let torchvision download when the network allows"),
    "data_seed": _DATA_SEED,
}
_SYNTHETIC = {
    "num_clients": _NUM_CLIENTS,
    "alpha": number("how much the clients' models differ (Li et al.'s alpha)", lo=0),
    "beta": number("how much the clients' inputs differ (Li et al.'s beta)", lo=0),
    "samples_per_client": _SAMPLES,
    "data_seed": _DATA_SEED,
}

# Keys of each option of each group. An option that is registered but not declared here gets its `name`
# checked and its other keys passed to its builder unchecked; `declare` adds one.
GROUP_KEYS: dict[str, dict[str, dict[str, Key]]] = {
    "dataset": {
        "synthetic": _SYNTHETIC,
        "synthetic_lazy": {
            **_SYNTHETIC,
            "cache_mb": number("generated clients kept per process (MB); least recently used dropped", lo=0),
            "eval_clients": integer("metrics over clients 0..eval_clients-1", lo=1),
        },
        "blobs": {
            "num_clients": _NUM_CLIENTS,
            "variant": choice("noisy | heterogeneous (Mangold et al.)", ("noisy", "heterogeneous")),
            "dim": integer("feature dimension", lo=1),
            "samples_per_client": integer("training samples per client", lo=2),
            "std": number("blob standard deviation", lo=0, lo_open=True, null="2.0 noisy, 0.3 heterogeneous"),
            "shift": number("heterogeneous: std of each perturbed client's feature shift", lo=0),
            "data_seed": _DATA_SEED,
        },
        "quadratic": {
            "num_clients": _NUM_CLIENTS,
            "dim": integer("dimension d", lo=1),
            "spread": number("e_i ~ N(0, spread^2 I)", lo=0),
            "curvature": choice("identity | diagonal | random (eigenvalues uniform in [mu, L])",
                                ("identity", "diagonal", "random")),
            "mu": number("smallest eigenvalue", lo=0, lo_open=True),
            "L": number("largest eigenvalue", lo=0, lo_open=True),
            "noise": number("std of additive Gaussian gradient noise", lo=0),
            "data_seed": _DATA_SEED,
        },
        "li_toy": {
            "num_clients": integer("N, the number of clients", lo=2),
            "block": integer("p: each client's features live on p coordinates", lo=1),
            "mu": number("ridge term mu/2 ||w||^2", lo=0),
            "noise": number("std of additive Gaussian gradient noise", lo=0),
            "data_seed": integer("not used: the construction is deterministic", lo=0, null="the run's seed"),
        },
        "digits": _FILES, "mnist": _FILES, "fashion_mnist": _FILES, "cifar10": _FILES,
    },
    "partition": {
        "auto": {}, "iid": {}, "natural": {},
        "classes_per_client": {"classes": integer("distinct labels per client", lo=1)},
        "shards": {"shards_per_client": integer("label-sorted shards dealt to each client", lo=1)},
        "dirichlet": {"alpha": number("Dir(alpha) label proportions; small is skewed", lo=0, lo_open=True),
                      "min_size": integer("redraw until every client has this many samples", lo=1)},
        "powerlaw": {"exponent": number("client sizes proportional to rank^-exponent", lo=0, lo_open=True),
                     "min_size": integer("samples every client gets first", lo=1),
                     "label_sorted": boolean("deal in label-sorted order (label skew too)")},
    },
    "model": {
        **{m: {"l2": number("l2 weight: + l2 ||w||^2", lo=0)} for m in ("auto", "logreg", "linreg", "2nn", "cnn",
                                                                           "resnet18", "vgg11")},
        "quadratic": {},
    },
}

_RATE = {"lo": 0, "hi": 1, "hi_open": True}
# Every named algorithm has fedavg's keys (conf/algorithm/*.yaml start from fedavg.yaml).
ALGORITHM: dict[str, Key] = {
    "sampler": choice("which clients a round samples, and their weights", _parts("sampler")),
    "clients_per_round": integer("K, clients sampled per round", lo=1),
    "dropout": number("probability a sampled client does not return", **_RATE),
    "local_work": choice("how many local steps each client makes", _parts("local_work")),
    "local_steps": integer("E (Li et al.), K (Yang et al.), H (Mangold et al.): local steps", lo=1),
    "local_epochs": integer("local_work=epochs: local_epochs * ceil(n_k / b) steps", lo=1),
    "steps_low": integer("local_work=random_steps: tau ~ U{steps_low..steps_high}", lo=1),
    "steps_high": integer("local_work=random_steps: upper end", lo=1),
    "epochs_low": integer("local_work=random_epochs: E ~ U{epochs_low..epochs_high}", lo=1),
    "epochs_high": integer("local_work=random_epochs: upper end", lo=1),
    "steps_mean": number("local_work=gaussian_steps: mean of N(steps_mean, steps_std^2)", lo=0, lo_open=True),
    "steps_std": number("local_work=gaussian_steps: standard deviation", lo=0),
    "steps_min": integer("local_work=gaussian_steps: clipped below at", lo=1),
    "steps_max": integer("local_work=gaussian_steps: clipped above at", lo=1),
    "local_work_min": boolean("FedAvg-min: every sampled client makes the round's minimum tau"),
    "batch_size": integer("minibatch size b", lo=1),
    "client_lr": number("eta_L / gamma, the client step size", lo=0, lo_open=True),
    "lr_schedule": choice("constant | inverse_round | inverse_step | li_theory | step_decay", _parts("lr_schedule")),
    "lr_beta": number("lr_schedule=inverse_step: eta_t = lr_beta / (t + lr_gamma)", lo=0, lo_open=True),
    "lr_gamma": number("lr_schedule=inverse_step: offset gamma", lo=0, lo_open=True),
    "decay_at": Key(lambda v: _is_list(v, lambda f: _is_real(f) and 0 < f < 1) and len(v) > 0
                    and all(a < b for a, b in zip(v, v[1:])), "an increasing list of fractions in (0, 1)",
                    "lr_schedule=step_decay: fractions of the rounds where the lr is multiplied by decay_factor"),
    "decay_factor": number("lr_schedule=step_decay: factor", lo=0, hi=1, lo_open=True),
    "server_lr": number("eta_g; 1 is plain FedAvg", lo=0, lo_open=True),
    "solver": choice("local solver", _parts("solver")),
    "momentum": number("client momentum (buffer reset each round)", **_RATE),
    "nesterov": boolean("Nesterov client momentum"),
    "mu": number("proximal term mu/2 ||w - w_r||^2 (FedProx)", lo=0),
    "weight_decay": number("client weight decay", lo=0),
    "lr_decay": number("exponential decay of the local lr within a round", lo=0, hi=1, lo_open=True),
    "aggregator": choice("fedavg | fednova", _parts("aggregator")),
    "tau_eff": choice("FedNova: steps (sum p tau) | l1 (sum p ||a||_1) | fixed", ("steps", "l1", "fixed")),
    "tau_eff_value": number("tau_eff=fixed: its value", lo=0, lo_open=True, null="not fixed"),
    "server_optimizer": choice("sgd | momentum | nesterov | adam | yogi", _parts("server_optimizer")),
    "server_momentum": number("server_optimizer=momentum/nesterov: beta", **_RATE),
    "server_beta1": number("server_optimizer=adam/yogi: beta1", **_RATE),
    "server_beta2": number("server_optimizer=adam/yogi: beta2", **_RATE),
    "server_eps": number("server_optimizer=adam/yogi: tau, the adaptivity", lo=0, lo_open=True),
    "client_steps": Key(lambda v: v is None or _is_list(v, lambda s: _is_int(s) and s >= 1),
                        "null or a list of integers >= 1, one per client",
                        "local_work=per_client: each client's fixed tau_i"),
    "average": boolean("also record the Polyak-Ruppert average of the iterates (series average)"),
    "burn_in": number("fraction of the rounds before averaging starts", **_RATE),
    "rr": choice("Richardson-Romberg: none | gamma (gamma and 2 gamma) | H (H and 2H)", ("none", "gamma", "H")),
    "rr_shared_noise": boolean("the coupled replicas share their random streams"),
}


def declare(group: str, option: str, keys: dict[str, Key]) -> None:
    """Declare the keys (besides `name`) of a newly registered option of a group, e.g. a dataset."""
    GROUP_KEYS.setdefault(group, {})[option] = keys


def group_keys(group: str, option: str) -> dict[str, Key] | None:
    """The keys of `option` in `group` (None: registered but not declared)."""
    name_doc = {"algorithm": "the named algorithm (conf/algorithm/)"}.get(group, f"the {group}")
    name = {"name": text(name_doc)}
    if group == "algorithm":
        return {**name, **ALGORITHM}
    keys = GROUP_KEYS.get(group, {}).get(option)
    return None if keys is None else {**name, **keys}


GROUP_NAMES: dict[str, Callable[[], tuple[str, ...]]] = {
    "dataset": _datasets, "partition": _partitions, "model": _models,
}


# --- checking ---------------------------------------------------------------------------------------------

def _check_section(cfg: dict[str, Any], keys: dict[str, Key], prefix: str, extra_keys: bool = False) -> None:
    """`extra_keys`: a user's `_target_` section, whose other keys are its factory's parameters."""
    for key, value in cfg.items():
        if key not in keys and not extra_keys:
            where = f"'{prefix.rstrip('.')}'" if prefix else "the run"
            raise ConfigError(prefix + key, value, f"no such key; keys of {where}: {', '.join(keys)}")
    for key, spec in keys.items():
        if key in cfg:
            require(spec.check(cfg[key]), prefix + key, cfg[key], str(spec.allowed))


def _uses_user_parts(group: str, gcfg: dict[str, Any]) -> bool:
    """An algorithm with a user's part: its other keys (e.g. algorithm.clip) are that part's parameters."""
    from fedharness.algorithms.registry import BUILTIN_PARTS

    return group == "algorithm" and any(gcfg.get(kind) not in names for kind, names in BUILTIN_PARTS.items())


def _check_group(cfg: dict[str, Any], group: str) -> None:
    gcfg = cfg[group]
    require(isinstance(gcfg, dict) and "name" in gcfg, group, gcfg, f"a {group} config with a name")
    name = gcfg["name"]
    if group in GROUP_NAMES:
        require(name in GROUP_NAMES[group](), group, name, "one of: " + ", ".join(GROUP_NAMES[group]()))
    keys = group_keys(group, name)
    if keys is not None:
        _check_section(gcfg, keys, f"{group}.", extra_keys="_target_" in gcfg or _uses_user_parts(group, gcfg))


def check_keys(cfg: dict[str, Any]) -> None:
    """Every key is known and holds an allowed value."""
    structure = {**TOP, **{s: anything("") for s in SECTIONS}, **{g: anything("") for g in (*GROUP_NAMES,
                                                                                            "algorithm")}}
    _check_section(cfg, structure, "")
    for section, keys in SECTIONS.items():
        if section in cfg:
            require(isinstance(cfg[section], dict), section, cfg[section], f"a mapping of: {', '.join(keys)}")
            _check_section(cfg[section], keys, f"{section}.")
    for group in (*GROUP_NAMES, "algorithm"):
        require(group in cfg, group, None, "every run config has a " + group)
        _check_group(cfg, group)


# --- rules that tie keys together, in the order they are checked -----------------------------------------

LABELLED_PARTITIONS = ("iid", "classes_per_client", "shards", "dirichlet", "powerlaw")
ANALYTIC = ("quadratic", "li_toy")
WITHOUT_REPLACEMENT = ("scheme_ii", "scheme_ii_transformed", "original", "yang_s2")


def model_fits_dataset(cfg: dict[str, Any]) -> None:
    dataset, model = cfg["dataset"]["name"], cfg["model"]["name"]
    if dataset in ANALYTIC:
        require(model in ("auto", "quadratic"), "model", model,
                f"the {dataset} dataset is its own model: use model=auto or model=quadratic")
    else:
        require(model != "quadratic", "model", model, "only the quadratic and li_toy datasets use model=quadratic")


def partition_fits_dataset(cfg: dict[str, Any]) -> None:
    dataset, part = cfg["dataset"]["name"], cfg["partition"]["name"]
    if dataset in ANALYTIC:
        require(part == "auto", "partition", part, f"auto: the {dataset} dataset defines its clients itself "
                "(no labelled samples to split)")
    elif dataset == "synthetic_lazy":
        require(part in ("auto", "natural"), "partition", part,
                "auto or natural: synthetic_lazy generates each client's data itself")
    elif part == "natural":
        require(dataset in ("synthetic", "blobs"), "partition", part,
                f"needs a generated dataset (synthetic, blobs); one of: {', '.join(LABELLED_PARTITIONS)}")


def ray_keys_need_ray(cfg: dict[str, Any]) -> None:
    from fedharness.backends.ray_cluster import parse_address

    parse_address(cfg["ray"]["address"])  # first: its message hides credentials, the one below would echo them
    if cfg["executor"] == "ray":
        require(cfg["num_shards"] == 1, "num_shards", cfg["num_shards"],
                "1 with executor=ray (its shards are ray.num_shards)")
        return
    default = defaults()["ray"]
    for key, value in cfg.get("ray", {}).items():
        require(value == default.get(key), f"ray.{key}", value,
                f"only used with executor=ray (executor is {cfg['executor']}); leave it at {default.get(key)!r}")


def shards_within_clients(cfg: dict[str, Any]) -> None:
    n = cfg["dataset"]["num_clients"]
    key = "ray.num_shards" if cfg["executor"] == "ray" else "num_shards"
    shards = cfg["ray"]["num_shards"] if cfg["executor"] == "ray" else cfg["num_shards"]
    require(shards <= n, key, shards, f"at most the number of clients (dataset.num_clients = {n})")


def sampled_within_clients(cfg: dict[str, Any]) -> None:
    acfg, n = cfg["algorithm"], cfg["dataset"]["num_clients"]
    if acfg["sampler"] in WITHOUT_REPLACEMENT:
        require(acfg["clients_per_round"] <= n, "algorithm.clients_per_round", acfg["clients_per_round"],
                f"must be <= the number of clients ({n}) when sampling without replacement")


def ranges_ordered(cfg: dict[str, Any]) -> None:
    acfg = cfg["algorithm"]
    for low, high in (("steps_low", "steps_high"), ("epochs_low", "epochs_high"), ("steps_min", "steps_max")):
        require(acfg[high] >= acfg[low], f"algorithm.{high}", acfg[high], f"must be >= algorithm.{low} ({acfg[low]})")
    dcfg = cfg["dataset"]
    if dcfg["name"] == "quadratic":
        require(dcfg["mu"] <= dcfg["L"], "dataset.mu", dcfg["mu"], f"must satisfy 0 < mu <= L = {dcfg['L']}")


def per_client_steps(cfg: dict[str, Any]) -> None:
    acfg, n = cfg["algorithm"], cfg["dataset"]["num_clients"]
    if acfg["local_work"] == "per_client":
        steps = acfg.get("client_steps")
        require(steps is not None and len(steps) == n, "algorithm.client_steps", steps,
                f"a list of {n} integers >= 1 (one per client) with local_work=per_client")
    if acfg["aggregator"] == "fednova" and acfg["tau_eff"] == "fixed":
        require(acfg.get("tau_eff_value") is not None, "algorithm.tau_eff_value", None,
                "a number > 0 with tau_eff=fixed")


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
    """results_dir is, or can become, a writable directory; nothing is created but a removed probe file."""
    raw = cfg["results_dir"]
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


RULES: tuple[Callable[[dict[str, Any]], None], ...] = (
    model_fits_dataset, partition_fits_dataset, ray_keys_need_ray, shards_within_clients, sampled_within_clients,
    ranges_ordered, per_client_steps, device_available, results_dir_writable,
)


def validate(cfg: dict[str, Any]) -> None:
    """Check a composed run config: every key, then the rules between keys, then the memory it needs."""
    check_keys(cfg)
    for rule in RULES:
        rule(cfg)
    from fedharness.memory import check_memory

    check_memory(cfg)
