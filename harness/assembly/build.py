"""The problem and the algorithm a config describes. The driver and every Ray shard build them here, alike."""

from __future__ import annotations

import math
from typing import Any, Callable

from fedharness.algorithms.byzantine import Adversary
from fedharness.algorithms.compression import Compression
from fedharness.algorithms.registry import build_algorithm
from fedharness.assembly.privacy import privacy_for
from fedharness.assembly.systems import cadence_for
from fedharness.config.schema import check_data_clients, stage_name
from fedharness.contracts import SHARDS, Attack, Compressor, CopyEvaluation, IndependentInclusion, Labelled, \
    PersonalSolver, UpdateAggregator, UpdateStage, training_clients
from fedharness.core.buffers import buffer_dim
from fedharness.core.client_store import declared_slots, require_slots_fit, slot_holders
from fedharness.core.executors import entry_bytes, require_fits_budget
from fedharness.core.stages import Stages
from fedharness.errors import ConfigError, require
from fedharness.extend import register_targets, stage_defaults
from fedharness.registry.plugins import load_entry_points
from fedharness.problems import build_problem
from fedharness.registry.groups import ATTACKS, COMPRESSORS, PARTS, STAGES
from fedharness.settings import RunSettings


def algorithm_for(settings: RunSettings, problem):
    """The algorithm's parts; its sampler draws what the cadence asks of it (Cadence.sampled: ceil(over_selection K)
    where rounds over-select, C a server version for FedBuff and FedAsync)."""
    keys = {**settings.algorithm.as_dict(), "rounds": settings.rounds}  # schedules: rounds
    if keys.get("clients_per_round") is not None:
        keys["clients_per_round"] = cadence_for(settings).sampled(int(keys["clients_per_round"]))
    return build_algorithm(keys, problem)


def build_parts(settings: RunSettings):
    """Problem and algorithm of the settings; Ray shards call this too, so they build exactly what the driver has."""
    load_entry_points()  # installed packages' parts, also in a fresh Ray worker
    register_targets(settings.config)  # a user's `_target_` parts, also in a fresh Ray worker
    problem = build_problem(settings, settings.algorithm.batch_size)
    if settings.dataset.num_clients is None:  # every client the data has: now known
        check_data_clients(settings.config, problem.num_clients)
    algorithm = algorithm_for(settings, problem)
    require_fits_budget(problem, algorithm.solver)  # memory_budget_gb, before any reference solve or file
    check_personal(settings, problem, algorithm.solver)
    return problem, algorithm


def check_personal(settings: RunSettings, problem, solver) -> None:
    """ConfigError naming eval.personal unless the run can score each protocol: personal needs a solver that keeps
    a personal model (contracts.PersonalSolver: ditto, fedrep, fedbabu, pfedme, perfedavg_fo, perfedavg_hf, apfl);
    finetune and personal a problem that scores each client's own model (contracts.CopyEvaluation)."""
    protocols = list(settings.eval.personal)
    require("personal" not in protocols or isinstance(solver, PersonalSolver), "eval.personal", protocols,
            f"global and/or finetune: algorithm.solver={settings.algorithm.solver} keeps no personal model (the "
            "personal protocol needs one that does: ditto, fedrep, fedbabu, pfedme, perfedavg_fo, perfedavg_hf, apfl)")
    require(not {"finetune", "personal"} & set(protocols) or isinstance(problem, CopyEvaluation), "eval.personal",
            protocols, f"global: dataset={settings.dataset.name} cannot score a model of each client's own")


def adversary_for(settings: RunSettings, algorithm, problem) -> Adversary | None:
    """The run's attack as an update stage (None: attack=none), its needs checked (`check_needs`)."""
    attack = settings.attack
    if attack is None or attack.name == "none":
        return None
    built = ATTACKS.build(attack.name, attack.as_dict(), {})
    require(isinstance(built, Attack), "attack", attack.name,
            "its factory must build an object with forge(own, honest, keys) (fedharness.contracts.Attack)")
    fixed = bool(attack.as_dict().get("fixed", False))
    adversary = Adversary(built, float(attack.fraction), fixed, training_clients(problem))
    check_needs(adversary, "attack", attack.name, settings, algorithm, problem)
    return adversary


def compression_for(settings: RunSettings, problem) -> Compression | None:
    """The run's compressed updates as an update stage (None: compress=none); refused on a model with buffers
    (their running statistics are averaged, not sent as an update) (error feedback's residuals are checked with the run's
    other client slots: check_slots)."""
    compress = settings.compress
    if compress is None or compress.name == "none":
        return None
    built = COMPRESSORS.build(compress.name, compress.as_dict(), {})
    require(isinstance(built, Compressor), "compress", compress.name, "its factory must build an object with "
            "compress(v, keys) and encoded_bytes(dim, value_bytes) (fedharness.contracts.Compressor)")
    require(buffer_dim(problem) == 0, "compress", compress.name, f"a model without buffers: model "
            f"{settings.model.name}'s {buffer_dim(problem)} running statistics (BatchNorm) are averaged as they "
            "are, not sent as a compressed update")
    return Compression(built, bool(compress.error_feedback))


def check_slots(settings: RunSettings, problem, solver, stages) -> None:
    """ConfigError naming memory_budget_gb, the largest client slot and client_slots_on_disk unless a shard's
    slots (every part's: SCAFFOLD's c_i, FedBN's buffers, error feedback's residual, a user's) for each of its
    clients that can take part, and its largest batched step (a round's copies in the shard, or as many as the
    budget leaves beside the slots: at least one), fit the memory budget (a lazy population of 10^8 clients keeps
    slots only for the clients that trained). A copy is counted at one local step: a round's length is drawn with
    the round, and the shard sizes each round's chunks from it."""
    slots = declared_slots(problem, [solver, *stages.stages])
    alg = settings.algorithm
    per_round = problem.num_clients if alg.sampler == "full" else alg.clients_per_round
    shards = settings.ray.num_shards if settings.executor == "ray" else settings.num_shards
    holders = slot_holders(problem.num_clients, shards, settings.rounds, per_round)
    copies = settings.replicas * min(per_round, math.ceil(problem.num_clients / shards))  # a shard's round, at most
    require_slots_fit(slots, problem.memory_budget, holders, settings.replicas, entry_bytes(problem, solver, 1),
                      copies, settings.client_slots_on_disk)


# the built-in stages, each built from its own section (registry/groups.py BUILTIN_STAGES: the `stages` entries)
BUILTIN: dict[str, Callable[[RunSettings, Any, Any], UpdateStage | None]] = {
    "attack": adversary_for, "dp": lambda settings, algorithm, problem: privacy_for(settings, problem),
    "compress": lambda settings, algorithm, problem: compression_for(settings, problem)}


def stages_for(settings: RunSettings, algorithm, problem) -> Stages:
    """The run's update stages in the order of its `stages` key: the built-ins from their own sections (left out
    when off), a user's from the registry with its entry's keys; each one's needs and the order its declarations
    ask for (contracts.UpdateStage: place, last) checked before the run starts."""
    named = []
    for entry in settings.stages:
        name = stage_name(entry)
        if name in BUILTIN:
            stage = BUILTIN[name](settings, algorithm, problem)
        else:
            keys = {} if isinstance(entry, str) else {k: v for k, v in entry.items() if k != "name"}
            stage = STAGES.build(name, {**stage_defaults(name), **keys}, {"problem": problem})
            require(isinstance(stage, UpdateStage), "stages", name, "its factory must build an update stage "
                    "(subclass fedharness.contracts.UpdateStage)")
        if stage is not None:
            named.append((name, stage))
    check_order(named)
    for name, stage in named:
        check_needs(stage, "stages", name, settings, algorithm, problem)
    return Stages([stage for _, stage in named])


def check_order(named: list[tuple[str, UpdateStage]]) -> None:
    """No stage that acts in the shards after one whose change must be the last there (contracts.UpdateStage)."""
    names = [name for name, _ in named]
    for i, (name, stage) in enumerate(named):
        after = [later for later, s in named[i + 1:] if s.place == SHARDS]
        require(not (stage.last and after), "stages", names, f"{after[0] if after else ''} before {name} (e.g. "
                f"stages=[attack,compress,dp]): {name}'s change to each update must be the last before the sum "
                f"(DP-FedAvg's guarantee bounds the clipped updates; error feedback would add unclipped residuals "
                f"after it)")


def check_needs(stage: UpdateStage, key: str, value: str, settings: RunSettings, algorithm, problem) -> None:
    """ConfigError naming the key to change unless the run has what the stage (`key`=`value`) needs
    (contracts.UpdateStage)."""
    what = f"{key}={value}" if key == "attack" else f"the stage {value}"
    for need in sorted(stage.needs):
        if need == "updates":
            seeing = [name for name, factory in PARTS["aggregator"].items()
                      if isinstance(factory, type) and issubclass(factory, UpdateAggregator)]
            require(isinstance(algorithm.aggregator, UpdateAggregator), "algorithm.aggregator",
                    settings.algorithm.aggregator,
                    f"{what} acts on each client's update where the updates meet the aggregator, so it needs one "
                    f"that sees them ({settings.algorithm.aggregator} is summed on the shards): one of "
                    f"{', '.join(seeing)} (mean is FedAvg's weighted mean)")
        elif need == "labels":
            require(isinstance(problem, Labelled), key, value,
                    f"a data set whose clients train on class labels (digits, mnist, ...); dataset "
                    f"{settings.dataset.name} has none")
        elif need == "poisson":
            require(isinstance(algorithm.sampler, IndependentInclusion), "algorithm.sampler",
                    settings.algorithm.sampler, f"poisson with {what} (the accountant covers Poisson-sampled "
                    "Gaussian rounds only): add algorithm.sampler=poisson, or run algorithm=dp_fedavg")
        else:
            raise ConfigError(key, value, f"needs {need!r}, which no run provides (known needs: updates, "
                              "labels, poisson)")
