"""The run's cadence (algorithms/cadences.py) and systems clock (harness/core/clock.py) from its `cadence`, `speed`,
`availability`, `staleness` and `network` sections, and the checks that need the model's size or several parts: a
deadline no client can meet, over-selection a sampler cannot do, what a cadence whose updates span server versions
does not combine with."""

from __future__ import annotations

import numpy as np

from fedharness.algorithms.cadences import FedBuff, Synchronous
from fedharness.algorithms.systems import EqualSpeeds, LognormalSpeeds, SlowTailSpeeds, TraceSpeeds
from fedharness.contracts import SHARDS, Availability, Cadence, Speeds, UpdateAggregator
from fedharness.core.clock import SystemsClock, transfer_s
from fedharness.core.slots import takes_online
from fedharness.core.stages import Stages
from fedharness.errors import require
from fedharness.registry.groups import AVAILABILITIES, CADENCES, SPEEDS, STALENESS
from fedharness.settings import RunSettings


def speeds_for(settings: RunSettings, num_clients: int) -> Speeds:
    """The `speed` group's option, built with its keys and the network section, N and the batch size it asks for."""
    context = {"network": settings.network, "num_clients": num_clients,
               "batch_size": int(settings.algorithm.batch_size)}
    return SPEEDS.build(settings.speed.name, settings.speed.params, context)


def availability_for(settings: RunSettings, num_clients: int) -> Availability:
    return AVAILABILITIES.build(settings.availability.name, settings.availability.params,
                                {"num_clients": num_clients})


def systems_on(settings: RunSettings, cadence: Cadence) -> bool:
    """Whether any client differs from the uniform, always-online world of plain synchronous rounds (else no clock:
    every client the network's, core/planning.py NetworkModel)."""
    plain = isinstance(cadence, Synchronous) and cadence.deadline_s is None and cadence.over_selection == 1
    return settings.speed.name != "equal" or settings.availability.name != "always" or not plain


def clock_for(settings: RunSettings, algorithm, problem, client_bytes: tuple[int, int],
              cadence: Cadence) -> SystemsClock | None:
    """The run's SystemsClock (None: systems off, every client the network's), checked against the sizes of what
    each client sends (`client_bytes`: down, up); a synchronous cadence's deadline and over-selection."""
    num_clients = problem.num_clients
    if not systems_on(settings, cadence):
        return None
    deadline, keep, partial = None, None, False
    if isinstance(cadence, Synchronous):
        deadline, partial = cadence.deadline_s, cadence.late_work == "partial"
        if cadence.over_selection != 1:
            check_over_selection(cadence, settings, algorithm, num_clients)
            keep = int(settings.algorithm.clients_per_round)
    speeds = speeds_for(settings, num_clients)
    if deadline is not None:
        check_deadline(deadline, speeds, client_bytes)
    return SystemsClock(speeds, availability_for(settings, num_clients), deadline, keep, partial,
                        float(cadence.retry_s))


def cadence_for(settings: RunSettings, algorithm=None, problem=None, stages: Stages | None = None) -> Cadence:
    """The run's cadence (contracts.Cadence), built with its keys, its staleness function and K; with `problem`,
    refused (ConfigError naming the key) where it cannot hold."""
    staleness = STALENESS.build(settings.staleness.name, settings.staleness.params, {})
    context = {"staleness": staleness, "clients_per_round": int(settings.algorithm.clients_per_round)}
    cadence = CADENCES.build(settings.cadence.name, settings.cadence.params, context)
    if problem is None:
        return cadence
    flight = isinstance(cadence, FedBuff)
    if flight:
        C, M = cadence.concurrency, cadence.buffer
        require(C <= problem.num_clients, "cadence.concurrency", C, f"at most the {problem.num_clients} clients")
        require(M <= C, "cadence.buffer", M, f"at most cadence.concurrency ({C}): a step waits for M of the C in "
                "flight")
    if cadence.spans_versions:
        check_async_parts(settings, algorithm, stages or Stages())
    if flight:
        check_flight_memory(settings, cadence.concurrency, problem)
    return cadence


def check_flight_memory(settings: RunSettings, C: int, problem) -> None:
    """The C updates in flight of every replica within the memory budget."""
    held = C * problem.dim * 8 * settings.replicas  # the updates in flight, float64, in the driver
    budget = problem.memory_budget
    require(budget is None or held <= budget, "cadence.concurrency", C, f"at most what memory_budget_gb holds: "
            f"C x dim x 8 bytes x replicas in flight = {held / 1e9:.3g} GB > {(budget or 0) / 1e9:.3g} GB")


def check_async_parts(settings: RunSettings, algorithm, stages: Stages) -> None:
    """What a cadence whose updates span server versions does not combine with (yet): deadlines and
    over-selection (the staleness limit replaces them: they are the sync cadence's keys), samplers that cannot
    skip the clients in flight, dropout, update stages beyond the shards (privacy, attacks), aggregators that see
    the updates, a solver with server state (SCAFFOLD); fedasync mixes models, so only fedavg weights them."""
    alg, name = settings.algorithm, settings.cadence.name
    why = f"with cadence={name}"
    require(not algorithm.sampler.with_replacement and alg.sampler not in ("full", "poisson")
            and takes_online(algorithm.sampler), "algorithm.sampler", alg.sampler,
            f"a sampler without replacement that skips the clients in flight {why}: scheme_ii, "
            "scheme_ii_transformed, original or yang_s2")
    require(float(alg.dropout or 0) == 0, "algorithm.dropout", alg.dropout, f"0 {why} (use availability=...)")
    driver_side = [type(st).__name__ for st in stages.stages if st.place != SHARDS]
    require(not driver_side, "stages", driver_side, f"only stages that act on each update in the shards alone "
            f"(compression) {why}: privacy and attacks act on a round's updates or aggregate")
    require(not isinstance(algorithm.aggregator, UpdateAggregator), "algorithm.aggregator", alg.aggregator,
            f"fedavg or fednova {why}")
    require(name != "fedasync" or alg.aggregator == "fedavg", "algorithm.aggregator", alg.aggregator,
            "fedavg with cadence=fedasync (it mixes models: x <- (1 - a) x + a x_k)")
    require(algorithm.solver.comm_factor == 1, "algorithm.solver", alg.solver, f"a solver without server state {why}")


def check_over_selection(cadence: Synchronous, settings: RunSettings, algorithm, num_clients: int) -> None:
    sampler, value = settings.algorithm.sampler, cadence.over_selection
    require(not algorithm.sampler.with_replacement and sampler not in ("full", "poisson"),
            "cadence.over_selection", value, f"1 with sampler={sampler}: over-selection samples "
            "ceil(over_selection K) distinct clients, a sampler of K without replacement")
    require(float(settings.algorithm.dropout or 0) == 0, "cadence.over_selection", value,
            "1 with algorithm.dropout > 0 (dropout re-points dropped draws; use availability=...)")
    require(cadence.sampled(int(settings.algorithm.clients_per_round)) <= num_clients, "cadence.over_selection",
            value, f"at most N / K: ceil(over_selection K) of the {num_clients} clients")


def check_deadline(deadline_s: float, speeds: Speeds, client_bytes: tuple[int, int]) -> None:
    """ConfigError naming cadence.deadline_s when no client's transfer fits in it: decided where the links are
    bounded (equal and slow-tail links, a trace's fastest entry); lognormal links are not, and pass."""
    if isinstance(speeds, LognormalSpeeds):
        return
    if isinstance(speeds, TraceSpeeds):
        fastest = float(np.max(speeds.kbit_per_s)) / 8000.0
        links = EqualSpeeds(0.0, fastest).links(np.zeros(1), np.zeros(1), np.zeros((1, 1), dtype=np.int64))
    else:
        base = speeds.base if isinstance(speeds, SlowTailSpeeds) else speeds
        links = base.links(np.zeros(1), np.zeros(1), np.zeros((1, 1), dtype=np.int64))
    fastest_s = float(transfer_s(links, *client_bytes)[0, 0])
    require(deadline_s > fastest_s, "cadence.deadline_s", deadline_s, f"more than the fastest client's transfer "
            f"time, {fastest_s:.6g} s ({client_bytes[0]} bytes down and {client_bytes[1]} up)")
