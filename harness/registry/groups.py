"""The registries: one per group, filled by the built-ins beside their definitions and by a user's registrations
(fedharness.extend) through the same `Registry.add`.

* `PARTS[kind]`: the algorithm parts of each kind (sampler, local_work, ...). A part's constructor is called with
  the `algorithm` keys its parameters name (one shared section; the built-ins' keys are their modules' `KEYS`,
  a user's part declares its own) and the CONTEXT values it asks for (fedharness.algorithms.registry).
* `DATASETS`, `MODELS`, `PARTITIONERS`: the options of `dataset=`, `model=` and `partition=`, each called with
  its own section's keys and the context its builder offers (fedharness.problems.build_problem).
* `ATTACKS`: the options of `attack=` (the Byzantine clients' updates), each called with its own keys.
* `COMPRESSORS`: the options of `compress=` (what each client sends), each called with its own keys.
* `STAGES`: a user's update stages by name (fedharness.register_stage), the entries of the `stages` key.
* `METRICS`: a user's metrics by name (fedharness.register_metric).
* `CADENCES`: the options of `cadence=` (the shape of a server step, contracts.Cadence: sync, fedbuff, fedasync).
* `SPEEDS`, `AVAILABILITIES`: the options of `speed=` and `availability=` (each client's profile on the simulated
  clock, algorithms/systems.py); `STALENESS`: of `staleness=` (s(tau) of a stale update).
"""

from __future__ import annotations

from typing import Any, Callable

from fedharness.contracts import (Aggregator, LocalSolver, LocalWork, Metric, Sampler, Schedule, ServerOptimizer)
from fedharness.keys import boolean, integer, number
from fedharness.registry.binding import Registry

PROTOCOLS: dict[str, type] = {"sampler": Sampler, "local_work": LocalWork, "lr_schedule": Schedule,
                              "solver": LocalSolver, "aggregator": Aggregator, "server_optimizer": ServerOptimizer}
PARTS: dict[str, Registry] = {kind: Registry(f"algorithm.{kind}", section="algorithm", shared=True)
                              for kind in PROTOCOLS}
CONTEXT = ("problem", "num_clients", "rounds")  # what a part's constructor may ask for besides its keys

# Every data set's keys besides its own: the harness reads them (the clients to split into, the data's seed).
DATASETS = Registry("dataset", common={"num_clients": integer("N, the number of clients", lo=1),
                                       "data_seed": integer("seed of the data", lo=0, null="use the run's seed"),
                                       "unseen_clients": number("the share of the clients set apart: never "
                                                                "trained, evaluated as unseen_client_* "
                                                                "(problems/unseen.py)", lo=0, hi=1, hi_open=True)})
MODELS = Registry("model", reserved=("l2", "buffers", "head"))  # the harness's NetObjective reads these
PARTITIONERS = Registry("partition")

# `attack=NAME` (algorithms/attacks.py): what the Byzantine clients send; `attack.fraction` is every attack's.
ATTACKS = Registry("attack", common={
    "fraction": number("the share of each round's returned clients that are Byzantine (floor(fraction n), drawn "
                       "from the streams), below 0.5; with fixed: the share of the training clients", lo=0, hi=1,
                       hi_open=True),
    "fixed": boolean("true: the same floor(fraction N) training clients are Byzantine in every round they return "
                     "(the malicious devices of Li et al. 2021, drawn once per replica from the streams); false: "
                     "drawn anew each round")})

# `compress=NAME` (algorithms/compression.py): what each client sends in place of its update (contracts.Compressor);
# `compress.error_feedback` is every compressor's.
COMPRESSORS = Registry("compress", common={"error_feedback": boolean(
    "error feedback: each client adds what its last compressions left out to its next update and keeps what this "
    "one leaves out (its residual, kept with its state)")})

# `stages: [..., NAME]` (contracts.UpdateStage): a user's update stages (fedharness.register_stage), each called
# with its entry's keys. `attack`, `dp` and `compress` are the built-in stages, built from their own sections.
STAGES = Registry("stage", section="stages")
BUILTIN_STAGES = ("attack", "dp", "compress")

# `cadence=NAME` (algorithms/cadences.py): when the server steps; `cadence.retry_s` is every cadence's.
CADENCES = Registry("cadence", common={"retry_s": number(
    "how long a step lasts in which no client takes part (no deadline set, nobody online or in flight) (s)", lo=0,
    lo_open=True)})
# `speed=NAME`, `availability=NAME` (algorithms/systems.py): each client's step time and links, when it is online.
SPEEDS = Registry("speed")
AVAILABILITIES = Registry("availability")
# `staleness=NAME` (algorithms/systems.py): s(tau), the weight of an update tau server versions stale.
STALENESS = Registry("staleness")

METRICS: dict[str, Metric] = {}  # name -> Metric, filled by fedharness.register_metric


def part(kind: str, name: str, **bound: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Class (or function) decorator beside a part: `algorithm.<kind>=name` builds it. `bound` fixes arguments
    for this name (e.g. nesterov=True), which then are not config keys."""
    return PARTS[kind].register(name, **bound)


def part_names(kind: str) -> Callable[[], tuple[str, ...]]:
    """The names registered for `kind` when called (a `choice` key lists the live registry)."""
    return PARTS[kind].names
