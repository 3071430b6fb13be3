"""The run's systems clock (harness/core/clock.py) from its `systems` and `network` sections, and the checks that
need the model's size: a deadline no client can meet, over-selection a sampler cannot do."""

from __future__ import annotations

import math

import numpy as np

from fedharness.algorithms.systems import (AlwaysOnline, ConstantStaleness, DutyCycle, EqualSpeeds, HingeStaleness,
                                           LognormalSpeeds, PolyStaleness, SlowTailSpeeds, TraceAvailability,
                                           TraceSpeeds)
from fedharness.contracts import Cadence, Speeds, UpdateAggregator, UpdateStage
from fedharness.core.clock import SystemsClock, transfer_s
from fedharness.algorithms.cadences import FedAsync, FedBuff, Synchronous
from fedharness.core.slots import takes_online
from fedharness.core.stages import Stages
from fedharness.errors import require
from fedharness.problems.device_traces import read_availability_trace, read_device_trace
from fedharness.settings import NetworkSettings, RunSettings, SystemsSettings


def speeds_for(systems: SystemsSettings, network: NetworkSettings, batch_size: int, num_clients: int) -> Speeds:
    base = EqualSpeeds(network.compute_s_per_step, network.bandwidth_MB_per_s, network.upload_MB_per_s)
    if systems.speed == "lognormal":
        return LognormalSpeeds(base, systems.speed_sigma, systems.bandwidth_sigma, num_clients)
    if systems.speed == "slow_tail":
        return SlowTailSpeeds(base, systems.slow_fraction, systems.slow_factor, num_clients)
    if systems.speed == "trace":
        require(systems.device_trace is not None, "systems.device_trace", None, "a file (speed=trace reads it)")
        trace = read_device_trace(systems.device_trace)
        return TraceSpeeds(trace.ms_per_sample, trace.kbit_per_s, systems.trace_batch_size or batch_size)
    return base


def availability_for(systems: SystemsSettings, num_clients: int):
    if systems.availability == "duty_cycle" and systems.duty_cycle < 1:
        return DutyCycle(systems.duty_cycle, systems.period_s, num_clients)
    if systems.availability == "trace":
        require(systems.availability_trace is not None, "systems.availability_trace", None,
                "a file (availability=trace reads it)")
        return TraceAvailability(read_availability_trace(systems.availability_trace))
    return AlwaysOnline()


def clock_for(settings: RunSettings, algorithm, problem, client_bytes: tuple[int, int]) -> SystemsClock | None:
    """The run's SystemsClock (None: systems off, every client the network's), checked against the sizes of what
    each client sends (`client_bytes`: down, up)."""
    systems, alg, num_clients = settings.systems, settings.algorithm, problem.num_clients
    if not systems.on:
        return None
    keep = None
    if systems.over_selection != 1:
        check_over_selection(systems, settings, algorithm, num_clients)
        keep = int(alg.clients_per_round)
    speeds = speeds_for(systems, settings.network, int(alg.batch_size), num_clients)
    if systems.deadline_s is not None:
        check_deadline(systems.deadline_s, speeds, client_bytes)
    return SystemsClock(speeds, availability_for(systems, num_clients), systems.deadline_s, keep,
                        systems.late_work == "partial", systems.retry_s)


def concurrency(settings: RunSettings) -> int:
    """C: systems.concurrency, or algorithm.clients_per_round where it is null."""
    chosen = settings.systems.concurrency
    return int(settings.algorithm.clients_per_round if chosen is None else chosen)


def buffer_size(settings: RunSettings) -> int:
    """M: systems.buffer; null: 1 for fedasync, algorithm.clients_per_round for fedbuff."""
    chosen = settings.systems.buffer
    if chosen is not None:
        return int(chosen)
    return 1 if settings.systems.mode == "fedasync" else int(settings.algorithm.clients_per_round)


def cadence_for(settings: RunSettings, algorithm, problem, stages: Stages | None = None) -> Cadence:
    """The run's cadence (contracts.Cadence): synchronous rounds, or FedBuff / FedAsync, refused (ConfigError
    naming the key) where it cannot hold."""
    if settings.systems.mode == "sync":
        return Synchronous()
    return async_rule(settings, algorithm, problem, stages or Stages())


def async_rule(settings: RunSettings, algorithm, problem, stages: Stages) -> FedBuff:
    """The run's FedBuff / FedAsync, refused (ConfigError naming the key) where it cannot hold."""
    s, C, M = settings.systems, concurrency(settings), buffer_size(settings)
    require(C <= problem.num_clients, "systems.concurrency", C, f"at most the {problem.num_clients} clients")
    require(M <= C, "systems.buffer", M, f"at most systems.concurrency ({C}): a step waits for M of the C in flight")
    require(s.mode == "fedbuff" or M == 1, "systems.buffer", s.buffer, "1 or null with mode=fedasync (one "
            "arrival a server step)")
    check_async_parts(settings, algorithm, stages)
    held = C * problem.dim * 8 * settings.replicas  # the updates in flight, float64, in the driver
    budget = problem.memory_budget
    require(budget is None or held <= budget, "systems.concurrency", C, f"at most what memory_budget_gb holds: "
            f"C x dim x 8 bytes x replicas in flight = {held / 1e9:.3g} GB > {(budget or 0) / 1e9:.3g} GB")
    staleness = {"constant": ConstantStaleness(), "poly": PolyStaleness(float(s.staleness_exponent)),
                 "hinge": HingeStaleness(float(s.staleness_exponent), int(s.staleness_cutoff))}[s.staleness]
    if s.mode == "fedasync":
        return FedAsync(C, M, s.max_staleness, staleness, s.refill, float(s.alpha))
    return FedBuff(C, M, s.max_staleness, staleness, s.refill)


def check_async_parts(settings: RunSettings, algorithm, stages: Stages) -> None:
    """What asynchronous aggregation does not combine with (yet): deadlines and over-selection (the staleness
    limit replaces them), samplers that cannot skip the clients in flight, dropout, update stages beyond the shards
    (privacy, attacks), aggregators that see the updates, a solver with server state (SCAFFOLD); fedasync mixes
    models, so only fedavg weights them."""
    s, alg = settings.systems, settings.algorithm
    why = f"with mode={s.mode}"
    require(s.deadline_s is None, "systems.deadline_s", s.deadline_s, f"null {why} (max_staleness bounds lateness)")
    require(s.over_selection == 1, "systems.over_selection", s.over_selection, f"1 {why}")
    require(not algorithm.sampler.with_replacement and alg.sampler not in ("full", "poisson")
            and takes_online(algorithm.sampler), "algorithm.sampler", alg.sampler,
            f"a sampler without replacement that skips the clients in flight {why}: scheme_ii, "
            "scheme_ii_transformed, original or yang_s2")
    require(float(alg.dropout or 0) == 0, "algorithm.dropout", alg.dropout, f"0 {why} (use systems.availability)")
    driver_side = [type(st).__name__ for st in stages.stages if not acts_in_shards_only(st)]
    require(not driver_side, "stages", driver_side, f"only stages that act on each update in the shards alone "
            f"(compression) {why}: privacy and attacks act on a round's updates or aggregate")
    require(not isinstance(algorithm.aggregator, UpdateAggregator), "algorithm.aggregator", alg.aggregator,
            f"fedavg or fednova {why}")
    require(s.mode == "fedbuff" or alg.aggregator == "fedavg", "algorithm.aggregator", alg.aggregator,
            "fedavg with mode=fedasync (it mixes models: x <- (1 - a) x + a x_k)")
    require(algorithm.solver.comm_factor == 1, "algorithm.solver", alg.solver, f"a solver without server state {why}")


def acts_in_shards_only(stage: UpdateStage) -> bool:
    """Whether the stage only changes each client's update in its shard (compression): no per-replica state, no
    work on a round's updates or aggregate, no capability needed. Such a stage means the same whichever server
    step an update joins."""
    kind = type(stage)
    return (not stage.needs and kind.init_counters is UpdateStage.init_counters
            and kind.on_updates is UpdateStage.on_updates and kind.on_aggregate is UpdateStage.on_aggregate)


def sampled_per_round(settings: RunSettings) -> int:
    """K, ceil(over_selection K) with over-selection, C with asynchronous aggregation: how many clients the
    sampler is built to draw."""
    K = int(settings.algorithm.clients_per_round)
    if settings.systems.mode != "sync":  # the sampler draws C a version, and the free slots take the first
        return concurrency(settings)
    return math.ceil(settings.systems.over_selection * K - 1e-9) if settings.systems.over_selection != 1 else K


def check_over_selection(systems: SystemsSettings, settings: RunSettings, algorithm, num_clients: int) -> None:
    sampler = settings.algorithm.sampler
    require(not algorithm.sampler.with_replacement and sampler not in ("full", "poisson"),
            "systems.over_selection", systems.over_selection, f"1 with sampler={sampler}: over-selection samples "
            "ceil(over_selection K) distinct clients, a sampler of K without replacement")
    require(float(settings.algorithm.dropout or 0) == 0, "systems.over_selection", systems.over_selection,
            "1 with algorithm.dropout > 0 (dropout re-points dropped draws; use systems.availability)")
    require(sampled_per_round(settings) <= num_clients, "systems.over_selection", systems.over_selection,
            f"at most N / K: ceil(over_selection K) of the {num_clients} clients")


def check_deadline(deadline_s: float, speeds: Speeds, client_bytes: tuple[int, int]) -> None:
    """ConfigError naming systems.deadline_s when no client's transfer fits in it: decided where the links are
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
    require(deadline_s > fastest_s, "systems.deadline_s", deadline_s, f"more than the fastest client's transfer "
            f"time, {fastest_s:.6g} s ({client_bytes[0]} bytes down and {client_bytes[1]} up)")
