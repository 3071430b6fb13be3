"""Clients' systems profiles: how long a client's local step takes, how fast its links are, when it is online.

A profile is a pure function of (seed, replica stream, client) on the counter-based streams (base/streams.py, tag
SYSTEMS), so a population of 10^8 clients costs nothing to set up, holds no per-client array, and a client has the
same profile in any shard, batch of seeds or resume. Replicas are independent worlds: each draws its own
population (coupled Richardson-Romberg replicas share a stream, hence a world).

Speeds (the `speed` group, speed=NAME speed.KEY=V), relative to the `network` section's step time and bandwidth:
  equal      every client the network section's
  lognormal  step time and bandwidth each times exp(sigma z), z standard normal per client (FedScale's fallback
             when it has no device trace): the network section's values are the medians
  slow_tail  a share slow_fraction of the clients (a uniform per client below it) take slow_factor times longer
             per step; bandwidth unchanged
  trace      FedScale's device trace: step = ms per sample x samples per step / 1000, both links its kbit/s / 8000
             (MB/s; FedScale's one "communication" number serves both ways). FedScale also multiplies compute by
             an augmentation factor of 3; this does not.
Availability (the `availability` group):
  always     online at every time
  duty_cycle online a share d of every period P: at t iff (t + phase) mod P < d P, phase uniform on [0, P) per client
  trace      FedScale's behaviour trace: online during its [active, inactive] intervals, repeating every
             finish_time (problems/device_traces.py)
A run's client k reads trace entry floor(u M) of the trace's M entries in their sorted order, u a uniform of the
stream (seed, SYSTEMS, replica, DEVICE_ENTRY or AVAILABILITY_ENTRY, k): clients map onto entries at random with
replacement, independently for the two traces, the same map for the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from fedharness.base import streams
from fedharness.contracts import Availability, Links, Speeds
from fedharness.errors import require
from fedharness.keys import integer, number, text
from fedharness.problems.device_traces import read_availability_trace, read_device_trace
from fedharness.registry.groups import AVAILABILITIES, SPEEDS, STALENESS

# The `round` slot of a client's SYSTEMS stream: one sub-stream per purpose, so no two share numbers.
SPEED, PHASE, DEVICE_ENTRY, AVAILABILITY_ENTRY = 0, 1, 2, 3


def _key(seeds: np.ndarray, replicas: np.ndarray, purpose: int, clients: np.ndarray) -> np.ndarray:
    """Each (row, client)'s stream key: seeds and replicas [R], clients [R, K]."""
    return streams.stream_key(np.asarray(seeds)[:, None], streams.SYSTEMS, np.asarray(replicas)[:, None], purpose,
                              clients)


# Up to this many clients a profile's draws are tabled once per (seed, replica) over all of them, so a round's
# lookup is a gather of the same numbers; above it every lookup draws (10^8 clients: nothing is stored).
TABLE_MAX_CLIENTS = 1 << 20


class ClientDraws:
    """A per-client draw of one purpose's stream, `draw(keys) -> [..., count]`: for clients [R, K] of rows with
    seeds and replicas [R], the values [R, K, count]. Tabled per (seed, replica) when the population is small."""

    def __init__(self, purpose: int, draw: Callable[[np.ndarray], np.ndarray], num_clients: int | None = None):
        self.purpose, self.draw, self.num_clients = purpose, draw, num_clients
        self.tables: dict[tuple[int, int], np.ndarray] = {}

    def __call__(self, seeds: np.ndarray, replicas: np.ndarray, clients: np.ndarray) -> np.ndarray:
        if self.num_clients is None or self.num_clients > TABLE_MAX_CLIENTS:
            return self.draw(_key(seeds, replicas, self.purpose, clients))
        pairs = zip(np.asarray(seeds).tolist(), np.asarray(replicas).tolist())  # [R] each: one (seed, replica) a row
        return np.stack([self._table(s, r)[row] for (s, r), row in zip(pairs, clients)])

    def _table(self, seed: int, replica: int) -> np.ndarray:
        if (seed, replica) not in self.tables:
            everyone = np.arange(self.num_clients)[None, :]
            self.tables[(seed, replica)] = self.draw(_key(np.array([seed]), np.array([replica]), self.purpose,
                                                          everyone))[0]
        return self.tables[(seed, replica)]


def _normals(count: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda keys: streams.normal(keys, count)


def _uniforms(keys: np.ndarray) -> np.ndarray:
    return streams.uniform(keys, 1)


@dataclass(frozen=True)
class EqualSpeeds:
    """Every client the network section's step time and links."""

    step_s: float
    down_MB_per_s: float
    up_MB_per_s: float | None = None  # None: one link both ways

    def scaled(self, clients: np.ndarray, step: np.ndarray | float = 1.0, link: np.ndarray | float = 1.0) -> Links:
        """The links of `clients` [R, K], each client's step time and bandwidths the base's times its factors."""
        shape = np.shape(clients)

        def full(value) -> np.ndarray:  # a factor [R, K] already has the shape: no broadcast view to build
            return value if np.shape(value) == shape else np.full(shape, value, dtype=np.float64)

        down = full(self.down_MB_per_s * link)
        up = down if self.up_MB_per_s is None else full(self.up_MB_per_s * link)
        return Links(full(self.step_s * step), down, up, self.up_MB_per_s is None)

    def links(self, seeds: np.ndarray, replicas: np.ndarray, clients: np.ndarray) -> Links:
        return self.scaled(clients)


@dataclass(frozen=True)
class LognormalSpeeds:
    """Step time and bandwidth each the base's times exp(sigma z), z standard normal per client."""

    base: EqualSpeeds
    speed_sigma: float
    bandwidth_sigma: float
    num_clients: int | None = None  # the population's size: small ones are tabled (ClientDraws)
    z: ClientDraws = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "z", ClientDraws(SPEED, _normals(2), self.num_clients))

    def links(self, seeds: np.ndarray, replicas: np.ndarray, clients: np.ndarray) -> Links:
        z = self.z(seeds, replicas, clients)
        return self.base.scaled(clients, np.exp(self.speed_sigma * z[..., 0]), np.exp(self.bandwidth_sigma * z[..., 1]))


@dataclass(frozen=True)
class SlowTailSpeeds:
    """A share `slow_fraction` of the clients take `slow_factor` times longer per step."""

    base: EqualSpeeds
    slow_fraction: float
    slow_factor: float
    num_clients: int | None = None
    u: ClientDraws = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "u", ClientDraws(SPEED, _uniforms, self.num_clients))

    def links(self, seeds: np.ndarray, replicas: np.ndarray, clients: np.ndarray) -> Links:
        slow = self.u(seeds, replicas, clients)[..., 0] < self.slow_fraction
        return self.base.scaled(clients, np.where(slow, self.slow_factor, 1.0))


def trace_entry(seeds: np.ndarray, replicas: np.ndarray, purpose: int, clients: np.ndarray, entries: int) -> np.ndarray:
    """[R, K] the trace entry (0..entries-1, in the trace's sorted order) each client maps onto."""
    u = streams.uniform(_key(seeds, replicas, purpose, clients), 1)[..., 0]
    return np.minimum((u * entries).astype(np.int64), entries - 1)


@dataclass(frozen=True)
class TraceSpeeds:
    """FedScale's device trace: ms per sample and kbit/s per entry (problems/device_traces.py DeviceTrace)."""

    ms_per_sample: np.ndarray
    kbit_per_s: np.ndarray
    samples_per_step: int

    def links(self, seeds: np.ndarray, replicas: np.ndarray, clients: np.ndarray) -> Links:
        entry = trace_entry(seeds, replicas, DEVICE_ENTRY, clients, len(self.ms_per_sample))
        bandwidth = self.kbit_per_s[entry] / 8000.0  # kbit/s -> MB/s (10^6 bytes)
        return Links(self.ms_per_sample[entry] * self.samples_per_step / 1000.0, bandwidth, bandwidth)


class AlwaysOnline(Availability):
    always = True  # the clock asks nobody (harness/core/clock.py)

    def online(self, seeds: np.ndarray, replicas: np.ndarray, t: np.ndarray, clients: np.ndarray) -> np.ndarray:
        return np.ones(np.shape(clients), dtype=bool)


@dataclass(frozen=True)
class DutyCycle(Availability):
    """Online a share `duty_cycle` of every `period_s`, from the client's own phase."""

    duty_cycle: float
    period_s: float
    num_clients: int | None = None
    u: ClientDraws = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "u", ClientDraws(PHASE, _uniforms, self.num_clients))

    def online(self, seeds: np.ndarray, replicas: np.ndarray, t: np.ndarray, clients: np.ndarray) -> np.ndarray:
        phase = self.u(seeds, replicas, clients)[..., 0] * self.period_s
        return np.mod(np.asarray(t, dtype=np.float64)[:, None] + phase, self.period_s) < self.duty_cycle * self.period_s


@dataclass(frozen=True)
class TraceAvailability(Availability):
    """FedScale's behaviour trace (problems/device_traces.py AvailabilityTrace): each client maps onto an entry."""

    trace: object  # AvailabilityTrace: len() and online(entry, t)

    def online(self, seeds: np.ndarray, replicas: np.ndarray, t: np.ndarray, clients: np.ndarray) -> np.ndarray:
        entry = trace_entry(seeds, replicas, AVAILABILITY_ENTRY, clients, len(self.trace))
        return self.trace.online(entry, np.asarray(t, dtype=np.float64)[:, None])


# --- staleness functions (the `staleness` group): s(tau) of an update tau server versions stale -----------------


@STALENESS.register("constant", keys={})
@dataclass(frozen=True)
class ConstantStaleness:
    """s(tau) = 1."""

    def weight(self, tau: np.ndarray) -> np.ndarray:
        return np.ones_like(np.asarray(tau, dtype=np.float64))


@STALENESS.register("poly", keys={"exponent": number("a in s(tau) = (1 + tau)^-a (0.5: FedBuff's 1/sqrt(1 + tau))",
                                                  lo=0)})
@dataclass(frozen=True)
class PolyStaleness:
    """s(tau) = (1 + tau)^-exponent (0.5: FedBuff's 1 / sqrt(1 + tau))."""

    exponent: float = 0.5

    def weight(self, tau: np.ndarray) -> np.ndarray:
        return (1.0 + np.asarray(tau, dtype=np.float64)) ** -self.exponent


@STALENESS.register("hinge", keys={"slope": number("a: past the cutoff, s(tau) = 1 / (a (tau - b) + 1)", lo=0),
                                   "cutoff": integer("b, the staleness up to which s(tau) = 1", lo=0)})
@dataclass(frozen=True)
class HingeStaleness:
    """s(tau) = 1 up to the cutoff b, then 1 / (slope (tau - b) + 1) (FedAsync's hinge, a = slope)."""

    slope: float = 0.5
    cutoff: int = 4

    def weight(self, tau: np.ndarray) -> np.ndarray:
        tau = np.asarray(tau, dtype=np.float64)
        return 1.0 / (self.slope * np.maximum(tau - self.cutoff, 0.0) + 1.0)


# --- the built-in speeds and availabilities as the groups build them: each factory takes its own keys, and the
# context it asks for by name (network: the network section; num_clients; batch_size: algorithm.batch_size) ------


@SPEEDS.register("equal", keys={})
def equal_speeds(network) -> Speeds:
    """Every client the network section's step time and links."""
    return EqualSpeeds(network.compute_s_per_step, network.bandwidth_MB_per_s, network.upload_MB_per_s)


@SPEEDS.register("lognormal", keys={
    "step_sigma": number("sigma of a client's log step time (median: network.compute_s_per_step)", lo=0),
    "bandwidth_sigma": number("sigma of a client's log bandwidth (median: network.bandwidth_MB_per_s)", lo=0)})
def lognormal_speeds(network, num_clients: int, step_sigma: float = 0.5, bandwidth_sigma: float = 0.5) -> Speeds:
    """Step time and bandwidth each the network section's times exp(sigma z), z standard normal per client."""
    return LognormalSpeeds(equal_speeds(network), step_sigma, bandwidth_sigma, num_clients)


@SPEEDS.register("slow_tail", keys={"fraction": number("the share of clients that are slow", lo=0, hi=1),
                                    "factor": number("how many times longer a slow client's step takes", lo=1)})
def slow_tail_speeds(network, num_clients: int, fraction: float = 0.1, factor: float = 10.0) -> Speeds:
    """A share `fraction` of the clients take `factor` times longer per step than the network section's."""
    return SlowTailSpeeds(equal_speeds(network), fraction, factor, num_clients)


@SPEEDS.register("trace", keys={
    "file": text("FedScale's client_device_capacity (a pickle, read without running code, or its JSON form)",
                 null="none"),
    "samples_per_step": integer("samples per local step, for the trace's ms per sample", lo=1,
                                null="algorithm.batch_size")})
def trace_speeds(batch_size: int, file: str | None = None, samples_per_step: int | None = None) -> Speeds:
    """FedScale's device trace: each client's step time and links from a trace entry."""
    require(file is not None, "speed.file", None, "a file (speed=trace reads it)")
    trace = read_device_trace(file)
    return TraceSpeeds(trace.ms_per_sample, trace.kbit_per_s, samples_per_step or batch_size)


@AVAILABILITIES.register("always", keys={})
def always_online() -> Availability:
    """Every client online at every time."""
    return AlwaysOnline()


@AVAILABILITIES.register("duty_cycle", keys={
    "duty_cycle": number("the share of each period a client is online", lo=0, hi=1, lo_open=True),
    "period_s": number("the period of a client's on/off cycle (s)", lo=0, lo_open=True)})
def duty_cycle(num_clients: int, duty_cycle: float = 0.5, period_s: float = 86400.0) -> Availability:
    """Online a share duty_cycle of every period_s, from the client's own phase."""
    return DutyCycle(duty_cycle, period_s, num_clients) if duty_cycle < 1 else AlwaysOnline()


@AVAILABILITIES.register("trace", keys={
    "file": text("FedScale's client_behave_trace (a pickle, read without running code, or its JSON form)",
                 null="none")})
def trace_availability(file: str | None = None) -> Availability:
    """FedScale's behaviour trace: online during a trace entry's intervals."""
    require(file is not None, "availability.file", None, "a file (availability=trace reads it)")
    return TraceAvailability(read_availability_trace(file))
