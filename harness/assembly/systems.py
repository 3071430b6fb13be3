"""The run's systems clock (harness/core/clock.py) from its `systems` and `network` sections, and the checks that
need the model's size: a deadline no client can meet, over-selection a sampler cannot do."""

from __future__ import annotations

import math

import numpy as np

from fedharness.algorithms.systems import (AlwaysOnline, DutyCycle, EqualSpeeds, LognormalSpeeds, SlowTailSpeeds,
                                           TraceAvailability, TraceSpeeds)
from fedharness.contracts import Speeds
from fedharness.core.clock import SystemsClock, transfer_s
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


def clock_for(settings: RunSettings, algorithm, num_clients: int,
              client_bytes: tuple[int, int]) -> SystemsClock | None:
    """The run's SystemsClock (None: systems off, every client the network's), checked against the sizes of what
    each client sends (`client_bytes`: down, up)."""
    systems, alg = settings.systems, settings.algorithm
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


def sampled_per_round(settings: RunSettings) -> int:
    """K, or ceil(over_selection K) with over-selection: how many clients the sampler is built to draw."""
    K = int(settings.algorithm.clients_per_round)
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
