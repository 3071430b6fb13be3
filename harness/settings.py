"""The run's settings: the validated config as one frozen, typed object, built once at load time.

Every run-level key is declared here, once, as a field with its Key (the check, what is allowed, a doc:
harness/keys.py); the schema's TOP and SECTIONS (harness/config/schema.py), `fedharness run --help` and the error
messages are generated from these fields. Defaults live in the YAML under conf/, never here.
`fedharness.config.load.load_settings` composes, validates and builds a RunSettings; the core, the backends and the
sinks read its typed fields. The group sections (dataset, partition, model, algorithm; attack where set) are PartSettings: the
option's name and its keys, which the part that uses them declares. `.config` keeps the plain validated dict for
what must round-trip as data (the runs/ row's config_json, checkpoints, `--cfg job`, the exact-reference cache).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping

from fedharness.contracts import PROTOCOLS
from fedharness.errors import ConfigError
from fedharness.keys import Key, _is_list, anything, boolean, choice, integer, number, text


PROFILE_GROUPS = ("cadence", "speed", "availability", "staleness")  # part groups every run config has


def key(spec: Key) -> Any:
    """A field that is a config key, declared by its Key; no default (the YAML under conf/ holds it)."""
    return field(metadata={"key": spec})


def section(cls: type) -> Any:
    """A field holding a section of keys (`ray`, `network`, `wandb`), itself a frozen dataclass of key fields."""
    return field(metadata={"section": cls})


def part() -> Any:
    """A field holding a group's option (`dataset=NAME` and its keys): a PartSettings."""
    return field(metadata={"part": True})


def keys_of(cls: type) -> dict[str, Key]:
    """The keys a settings class declares, in declaration order."""
    return {f.name: f.metadata["key"] for f in fields(cls) if "key" in f.metadata}


def sections_of(cls: type) -> dict[str, type]:
    return {f.name: f.metadata["section"] for f in fields(cls) if "section" in f.metadata}


def parts_of(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls) if "part" in f.metadata)


def _stage_entry(v: Any) -> bool:
    """A `stages` entry: a name, or a mapping with a name and the stage's keys."""
    return isinstance(v, str) or (isinstance(v, dict) and isinstance(v.get("name"), str))


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def _plain(value: Any) -> Any:
    """A settings value as config data: sections and parts as dicts, tuples as lists."""
    if isinstance(value, PartSettings):
        return value.as_dict()
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    return [_plain(v) for v in value] if isinstance(value, tuple) else copy.deepcopy(value)


def _section(cls: type, values: Mapping[str, Any]):
    return cls(**{name: _frozen(values[name]) for name in keys_of(cls)})


# --- sections ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RaySettings:
    """`executor=ray` (docs/cluster.md)."""

    address: str | None = key(Key(lambda v: v is None or (isinstance(v, str) and v != ""), "null, auto or host:port",
                                  "null: start a local Ray on 127.0.0.1; auto | host:port: join a running cluster"))
    num_shards: int = key(integer("long-lived ClientShard actors, each owning a cost-balanced set of clients", lo=1))
    cpus_per_shard: float = key(number("CPUs reserved per shard (fractions allowed); also the most torch threads "
                                       "a shard uses", lo=0, lo_open=True))
    gpus_per_shard: float = key(number("GPU share per shard (needs device=cuda), e.g. 0.25", lo=0))
    placement: str = key(choice("spread (one shard per node where possible) | pack", ("spread", "pack")))
    connect_timeout_s: float = key(number("bounded wait for the cluster to answer (s)", lo=0, lo_open=True))
    reserve_timeout_s: float = key(number("bounded wait for the shards' CPUs/GPUs (s)", lo=0, lo_open=True))
    max_restarts: int = key(integer("restarts of a dead shard per round before the run fails", lo=0))


@dataclass(frozen=True, slots=True)
class NetworkSettings:
    """Simulated wall-clock per round: Parquet column sim_s (Yang et al.'s Table 2)."""

    bandwidth_MB_per_s: float = key(number("each client's up- and downlink in MB/s (simulated sim_s)", lo=0,
                                           lo_open=True))
    compute_s_per_step: float = key(number("simulated seconds per local step", lo=0))
    upload_MB_per_s: float | None = key(number("each client's uplink in MB/s", lo=0, lo_open=True,
                                               null="network.bandwidth_MB_per_s, one link both ways"))


@dataclass(frozen=True, slots=True)
class WandbSettings:
    """Weights & Biases: config, per-round metrics, summary, the run's Parquet as an artifact."""

    enabled: bool = key(boolean("log config, per-round metrics, summary and the Parquet artifact to W&B"))
    project: str = key(text("W&B project"))
    entity: str | None = key(text("W&B entity", null="your default"))
    group: str | None = key(text("W&B group", null="the run's study"))
    tags: tuple[str, ...] = key(Key(lambda v: _is_list(v, lambda t: isinstance(t, str)), "a list of strings",
                                    "W&B tags"))
    mode: str = key(choice("auto (online with an API key, else offline) | online | offline",
                           ("auto", "online", "offline")))
    per_replica: bool = key(boolean("also log each replica's values as their own series (train_loss/replica_3); "
                                    "the history holds the replicas' mean and std per round either way"))


@dataclass(frozen=True, slots=True)
class DPSettings:
    """Client-level differential privacy, DP-FedAvg (algorithms/privacy.py, docs/privacy.md): on when
    noise_multiplier or target_epsilon is set."""

    noise_multiplier: float | None = key(number("z: Gaussian noise of std z * clip_norm on the sum of the clipped "
                                                "updates", lo=0, null="no DP, unless dp.target_epsilon is set"))
    target_epsilon: float | None = key(number("calibrate z so that the run's last round reaches this epsilon",
                                              lo=0, lo_open=True, null="z is dp.noise_multiplier"))
    clip_norm: float = key(number("C: each client's update clipped to this l2 norm (adaptive: its start)", lo=0,
                                  lo_open=True))
    delta: float = key(number("delta of the (epsilon, delta) guarantee", lo=0, hi=1, lo_open=True, hi_open=True))
    accountant: str = key(choice("rdp (Renyi DP) | pld (privacy loss distributions; tighter, slower)",
                                 ("rdp", "pld")))
    adaptive: bool = key(boolean("adaptive clipping (Andrew et al. 2021): C tracks a quantile of the update norms"))
    target_quantile: float = key(number("adaptive: the share of updates left unclipped that C aims at", lo=0, hi=1))
    clip_lr: float = key(number("adaptive: C <- C exp(-clip_lr (unclipped share - target_quantile))", lo=0,
                                lo_open=True))
    count_noise_multiplier: float | None = key(number("adaptive: std of the noise on the unclipped count; must "
                                                      "exceed z / 2", lo=0, lo_open=True,
                                                      null="max(clients_per_round / 20, z): Andrew et al.'s K/20, "
                                                      "raised to z where z >= K/10 (docs/privacy.md)"))

    @property
    def enabled(self) -> bool:
        return self.noise_multiplier is not None or self.target_epsilon is not None


def _protocols_ok(value: Any) -> bool:
    names = [value] if isinstance(value, str) else value
    return _is_list(names, lambda p: p in PROTOCOLS) and 0 < len(names) == len(set(names))


def _eval_samples_ok(value: Any) -> bool:
    return value is None or value == "all" or (isinstance(value, int) and not isinstance(value, bool) and value >= 2)


@dataclass(frozen=True, slots=True)
class EvalSettings:
    """What each evaluation computes and on what (docs/results.md, Evaluation on a sample): the training loss,
    grad_norm_sq and the test metrics over every sample or a fixed sample of them (`samples`); per-client
    evaluation (docs/results.md, Per-client evaluation), each client on its own held-out data; the clients a
    population too large to sum over (dataset=synthetic_lazy, quadratic_lazy) is measured on (`clients`)."""

    samples: int | str | None = key(Key(
        _eval_samples_ok, "null (all samples up to 100,000, else 10,000 of them), all, or an integer >= 2 and at "
        "most the training samples",
        "stored data: train_loss (with train_loss_se), grad_norm_sq (unbiased estimate) and test_loss/test_acc "
        "on a fixed uniform sample of this many training (and test) samples, drawn once from the data seed; "
        "null: every sample up to 100,000 training samples, else 10,000; all: every sample (exact)"))
    per_client: bool = key(boolean("evaluate every client (or `clients` of them) on its own held-out data: "
                                   "rounds/ gains client_acc_* and client_loss_* (mean, se, p10, p50, p90)"))
    clients: int | None = key(integer("per-client evaluation: a fixed uniform sample of this many clients (drawn "
                                      "once from the data seed), the mean's standard error in client_*_se; "
                                      "dataset=synthetic_lazy, quadratic_lazy: every metric exact while "
                                      "num_clients <= clients, above on this many clients drawn uniformly "
                                      "(train_loss_se)", lo=2,
                                      null="every client; synthetic_lazy: 100, quadratic_lazy: 10,000"))
    clients_table: bool = key(boolean("also write clients/: one row per (replica, round, client) with n, loss, "
                                      "acc"))
    grad_norm: bool = key(boolean("compute grad_norm_sq, ||grad F||^2 over the evaluated training data (a "
                                  "sample: its unbiased estimate), at each evaluation; false: that column is "
                                  "null and evaluation computes the training loss alone (tuning trials default "
                                  "to false: docs/tuning.md)"))
    personal: tuple[str, ...] = key(Key(
        _protocols_ok, f"one of {', '.join(PROTOCOLS)}, or a list of distinct ones",
        "per-client evaluation's protocols (docs/results.md, Personalized evaluation): global (the global model: "
        "client_*), finetune (each client's model after finetune_steps of SGD on its own data: "
        "client_*_finetune_*), personal (the algorithm's personal models: client_*_personal_*); anything but "
        "[global] turns on per_client"))
    finetune_steps: int = key(integer("finetune: plain SGD steps (algorithm.batch_size minibatches, no momentum, "
                                      "prox term, control variate or decay) from the global model", lo=0))
    finetune_lr: float | None = key(number("finetune: its step size", lo=0, lo_open=True,
                                           null="algorithm.client_lr"))
    finetune_every: int | None = key(integer("finetune: at evaluated rounds that are multiples of this (and the "
                                             "last)", lo=1, null="the last evaluation only"))

    def __post_init__(self):  # a single protocol is a one-element list; one besides global turns on per_client
        protocols = (self.personal,) if isinstance(self.personal, str) else tuple(self.personal)
        object.__setattr__(self, "personal", protocols)
        object.__setattr__(self, "per_client", self.per_client or protocols != ("global",))


# --- a group's option -------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PartSettings:
    """One option of a group (`dataset=synthetic`, `algorithm=fedprox`, ...): its name and its keys, read-only.

    The keys are declared beside the part that uses them; `params` holds them as a mapping (a part's builder takes
    them as keyword arguments), and each one reads as an attribute too: `settings.algorithm.batch_size`.
    """

    name: str
    params: Mapping[str, Any]

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> PartSettings:
        rest = {k: v for k, v in values.items() if k != "name"}
        return cls(values["name"], MappingProxyType(copy.deepcopy(rest)))

    def as_dict(self) -> dict[str, Any]:
        """The option as config data: `{"name": ..., **params}` (a fresh copy)."""
        return {"name": self.name, **copy.deepcopy(dict(self.params))}

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_"):
            params = object.__getattribute__(self, "params")
            if name in params:
                return params[name]
        raise AttributeError(f"{type(self).__name__} {object.__getattribute__(self, 'name')!r} has no key {name!r}")

    def __reduce__(self):
        return PartSettings.of, (self.as_dict(),)


# --- the run ----------------------------------------------------------------------------------------------

_RUN_ID = re.compile(r"^[A-Za-z0-9._=-]+$")


@dataclass(frozen=True, slots=True)
class RunSettings:
    """The validated run config, typed and frozen. Build it with `RunSettings.from_config` (or
    `fedharness.config.load.load_settings`); `replace(**changes)` gives a new one."""

    study: str = key(text("groups runs (tuning studies, sweeps)"))
    experiment: str = key(text("the experiment config this run belongs to (experiment=NAME picks a paper "
                               "reproduction)"))
    rounds: int = key(integer("communication rounds", lo=1, batchable=True))
    seed: int = key(integer("seed of every random stream (clients, minibatches, data)", lo=0, batchable=True))
    replicas: int = key(integer("independent seeds batched on one tensor axis", lo=1, batchable=True))
    eval_every: int = key(integer("rounds between evaluations (and Parquet rows)", lo=1, batchable=True))
    results_dir: str = key(text("where runs/ and rounds/ are written as Parquet: a folder, or an object store "
                                "as s3://bucket/prefix or gs://bucket/prefix (docs/cluster.md)"))
    executor: str = key(choice("inline | loop (one client at a time, the slow path that checks the batched one) | ray",
                               ("inline", "loop", "ray")))
    num_shards: int = key(integer("inline shards (the ray executor uses ray.num_shards)", lo=1))
    checkpoint_every: int = key(integer("rounds between checkpoints under <results_dir>/checkpoints/ (0: none)",
                                        lo=0))
    resume: str | None = key(Key(lambda v: v is None or (isinstance(v, str) and bool(_RUN_ID.match(v)) and v != ".."),
                                 "null, or the run_id of a checkpointed run (letters, digits, . _ - =)",
                                 "a run_id: continue that run from its last checkpoint"))
    dtype: str = key(choice("float32 | float64", ("float32", "float64")))
    device: str = key(Key(lambda v: isinstance(v, str) and re.fullmatch(r"cpu|cuda(:\d+)?", v) is not None,
                          "one of: cpu, cuda, cuda:N", "cpu | cuda | cuda:N"))
    progress: bool = key(boolean("show a progress bar on stderr"))
    metrics: tuple[str, ...] = key(Key(lambda v: _is_list(v, lambda m: isinstance(m, str)) and len(set(v)) == len(v),
                                       "a list of distinct metric names (fedharness.register_metric)",
                                       "your own metrics (fedharness.register_metric), computed at "
                                       "every evaluation, each a column of the rounds/ table"))
    stages: tuple[Any, ...] = key(Key(lambda v: _is_list(v, _stage_entry), "a list of stage names, or {name: NAME, "
                                      "KEY: VALUE} mappings for a stage's keys",
                                      "what happens to each client's update between its training and the server "
                                      "optimizer, in order (docs/architecture.md): attack (the attack group), dp "
                                      "(the dp section), compress (the compress group) and your own "
                                      "(fedharness.register_stage)"))
    threads: int | None = key(integer("torch threads; null: at the run's start, from the work of one local step, "
                                      "dim x clients per round x batch x replicas: one thread per 2^20 of it, at "
                                      "least 1, at most torch's default and the cores other processes leave free; "
                                      "recorded, and reused on resume", lo=1, null="automatic"))
    heterogeneity: bool = key(boolean("convex problems: solve every client's F_k* for Gamma = F* - sum p_k F_k*"))
    reference: str | bool = key(Key(lambda v: v in ("auto", "on", "off") or isinstance(v, bool),
                                    "one of: auto, on, off", "exact w*, F* for subopt/dist_to_opt: auto (where "
                                    "strongly convex), on (always, or fail), off"))  # YAML reads bare on/off as bools
    precision: str = key(choice("fp32 | tf32 (TF32 matmuls on CUDA) | bf16 (nets' training under bf16 autocast)",
                                ("fp32", "tf32", "bf16")))
    kernel: str = key(choice("nets' batched client gradients: auto (the fastest, timed once per shape on this "
                             "machine and remembered) | vmap | loop | loop_channels_last | fused (recurrent nets: "
                             "torch's fused LSTM, plain autograd, one client at a time)",
                             ("auto", "vmap", "loop", "loop_channels_last", "fused")))
    deterministic: bool = key(boolean("deterministic CUDA kernels (cuBLAS workspace, cuDNN): same bits run to run, "
                                      "slower"))
    sums: str = key(choice("how client contributions meet: exact (integer sums on a fixed-point grid, 8 bytes a "
                           "parameter: the same bits for any shard split) | float (float64 sums: a few percent "
                           "faster, the bits depend on the split)", ("exact", "float")))
    memory_budget_gb: float | None = key(number("GB (10^9 bytes) a batched training or evaluation step may use",
                                                lo=0, lo_open=True, null="half the device's free memory"))
    client_slots_on_disk: bool = key(boolean("keep the clients' slots (SCAFFOLD's c_i, FedBN's buffers, error "
                                             "feedback's residual, personal models) in a memory-mapped file per "
                                             "shard instead of memory: for slots beyond memory_budget_gb"))
    reference_timeout_s: float | None = key(number("each exact solve (w*; all clients' F_k* together) gives up "
                                                   "after this long", lo=0, lo_open=True, null="no bound"))
    scale: str | None = key(text("an experiment's scale: an entry of its `scales` (smoke, paper)"))
    scales: Any = key(anything("an experiment's sizes per scale (conf/experiment/)"))
    tune: Any = key(anything("a tuning study's settings (tune=NAME; checked by fedharness tune)"))
    ray: RaySettings = section(RaySettings)
    network: NetworkSettings = section(NetworkSettings)
    wandb: WandbSettings = section(WandbSettings)
    dp: DPSettings = section(DPSettings)
    eval: EvalSettings = section(EvalSettings)
    dataset: PartSettings = part()
    partition: PartSettings = part()
    model: PartSettings = part()
    algorithm: PartSettings = part()
    trial: int | None = field()  # not a config key: the tuning trial this run is (set by fedharness tune)
    attack: PartSettings | None = field()  # attack=NAME (algorithms/attacks.py), an optional group; None: no attack
    compress: PartSettings | None = field()  # compress=NAME (algorithms/compression.py), optional; None: dense updates
    cadence: PartSettings = field()  # cadence=NAME (algorithms/cadences.py): when the server steps
    speed: PartSettings = field()  # speed=NAME (algorithms/systems.py): each client's step time and links
    availability: PartSettings = field()  # availability=NAME (algorithms/systems.py): when each client is online
    staleness: PartSettings = field()  # staleness=NAME (algorithms/systems.py): s(tau) of a stale update
    config: dict[str, Any] = field(repr=False, compare=False)  # the plain validated config; read it, never change it

    @property
    def data_seed(self) -> int:
        """The seed the data are drawn from: dataset.data_seed (a key of every data set, declared with the data
        sets in registry/groups.py), else the run's seed."""
        chosen = self.dataset.data_seed
        return self.seed if chosen is None else chosen

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> RunSettings:
        """The settings of a validated config (harness/config/schema.py has checked every value; nothing is checked
        again). Keys that only some configs have (scale, scales, tune, trial) are None where absent."""
        config = copy.deepcopy(dict(cfg))
        values: dict[str, Any] = {name: _frozen(config.get(name)) for name in keys_of(cls)}
        values.update({name: _section(kind, config[name]) for name, kind in sections_of(cls).items()})
        values.update({name: PartSettings.of(config[name]) for name in parts_of(cls)})
        attack, compress = (PartSettings.of(config[g]) if config.get(g) is not None else None
                            for g in ("attack", "compress"))
        profiles = {g: PartSettings.of(config[g]) for g in PROFILE_GROUPS}
        return cls(**values, trial=config.get("trial"), attack=attack, compress=compress, **profiles, config=config)

    def replace(self, **changes: Any) -> RunSettings:
        """New settings with `changes` (fields: values, sections and parts as their settings objects); `.config`
        follows. A changed key is checked against its declaration."""
        config = copy.deepcopy(self.config)
        declared = keys_of(type(self))
        for name, value in changes.items():
            if name in declared and not declared[name].check(_plain(value)):
                raise ConfigError(name, value, str(declared[name].allowed))
            if name == "config" or name not in {f.name for f in fields(self)}:
                raise TypeError(f"RunSettings has no field {name!r} to replace")
            config[name] = _plain(value)
        return RunSettings.from_config(config)

    def __reduce__(self):  # pickles (to Ray workers) as its plain config, rebuilt on arrival
        return RunSettings.from_config, (self.config,)
