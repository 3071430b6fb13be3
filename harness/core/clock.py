"""Synchronous rounds on the simulated clock: who is online when a round starts, who finishes in time, how long
the round lasts (the `speed` and `availability` groups and the sync cadence's deadline and over-selection,
docs/systems.md).

Each replica keeps its own clock, the rounds/ column sim_s. A round starts at the replica's clock t: the sampler
prefers the clients online at t (algorithms/samplers.py; a sampled client that is offline drops out). A kept
client's time is its transfer (the model and any control variates down, its update as its stages encode it up,
over its own links) plus tau_k of its own steps. With a deadline D, a client not done by D is dropped, or with
late_work=partial sends the largest number of steps n <= tau_k with transfer + n step <= D (at least one).
Over-selection keeps, of the clients still in, the first K to finish (ties: the earlier sampled). The round lasts
until its last kept client is done; a round nobody takes part in lasts D (the server waited), or retry_s without
a deadline. The survivors' weights are rescaled to sum to what the whole selection's did (Dropout's rule,
algorithms/samplers.py); a replica nobody returned to does not move.

Everything here is per (replica, client) arithmetic on [R, K] arrays: no loop over clients, and with every client
equal, always online and no deadline, the same numbers as the uniform NetworkModel (engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedharness.contracts import Availability, Links, Online, Speeds


@dataclass(frozen=True)
class Settled:
    """A round's outcome per (replica, entry) [R, K]: which entries take part, their local steps; its length [R]."""

    returned: np.ndarray
    tau: np.ndarray
    seconds: np.ndarray
    reached: np.ndarray  # [R, K] the entries the model reached (sampled, online): they downloaded it


def link_seconds(down_bytes: float, up_bytes: float, down_MB_per_s, up_MB_per_s=None):
    """Seconds to receive `down_bytes` and send `up_bytes`; up_MB_per_s None: one link both ways, (down + up) /
    bandwidth (the uniform NetworkModel's and every equal profile's: the same bits)."""
    if up_MB_per_s is None:
        return (down_bytes + up_bytes) / (down_MB_per_s * 1e6)
    return down_bytes / (down_MB_per_s * 1e6) + up_bytes / (up_MB_per_s * 1e6)


def transfer_s(links: Links, down_bytes: float, up_bytes: float) -> np.ndarray:
    """[R, K] seconds to receive the model and send the update."""
    return link_seconds(down_bytes, up_bytes, links.down_MB_per_s, None if links.same_links else links.up_MB_per_s)


def steps_in_time(budget_s: np.ndarray, step_s: np.ndarray) -> np.ndarray:
    """[R, K] the most steps n with n step_s <= budget_s, as floats compute it (0 where none fits; a huge number
    where a step takes no time). The division's floor is corrected by one either way, so n step_s <= budget_s
    holds exactly as the finishing times are computed."""
    with np.errstate(divide="ignore", invalid="ignore"):
        n = np.floor(np.where(step_s > 0, budget_s / step_s, np.inf))
    n = np.minimum(np.maximum(np.nan_to_num(n, posinf=2.0 ** 52), 0), 2.0 ** 52)
    n -= n * step_s > budget_s
    n += (n + 1) * step_s <= budget_s
    return np.maximum(n, 0).astype(np.int64)


def first_to_finish(finish: np.ndarray, candidates: np.ndarray, keep: int) -> np.ndarray:
    """[R, K] bool: of each row's candidates, the `keep` that finish first (ties: the earlier entry)."""
    order = np.argsort(np.where(candidates, finish, np.inf), axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(order.shape[1])[None, :], axis=1)
    return candidates & (rank < keep)


@dataclass(frozen=True)
class SystemsClock:
    """The round rule: clients' speeds and availability, a deadline, over-selection (keep), partial late work."""

    speeds: Speeds
    availability: Availability
    deadline_s: float | None = None
    keep: int | None = None  # over-selection: keep the first `keep` to finish; None: every client in time
    partial: bool = False  # late_work=partial: a client the deadline cuts off sends the steps it finished
    retry_s: float = 60.0

    @property
    def always_online(self) -> bool:
        """Every client online at every time: no availability to ask (algorithms/systems.py AlwaysOnline)."""
        return self.availability.always

    def online(self, seeds: np.ndarray, replicas: np.ndarray, t: np.ndarray) -> Online:
        return Online(self.availability, np.asarray(seeds), np.asarray(replicas), np.asarray(t, dtype=np.float64))

    def finish_s(self, seeds: np.ndarray, replicas: np.ndarray, clients: np.ndarray, tau: np.ndarray,
                 down_bytes: float, up_bytes: float) -> np.ndarray:
        """[R, K] each client's time from its start to its update's arrival: its transfer plus tau of its steps."""
        links = self.speeds.links(seeds, replicas, clients)
        return transfer_s(links, down_bytes, up_bytes) + tau * links.step_s

    def settle(self, seeds: np.ndarray, replicas: np.ndarray, t: np.ndarray, clients: np.ndarray,
               trains: np.ndarray, tau: np.ndarray, down_bytes: float, up_bytes: float) -> Settled:
        """The round of the sampled entries `clients` [R, K] (those with `trains` False were never going to train:
        padding, dropped out) with their local steps tau, started at each row's time t [R]."""
        links = self.speeds.links(seeds, replicas, clients)
        comm = transfer_s(links, down_bytes, up_bytes)
        returned = trains
        if not self.always_online:
            returned = trains & self.availability.online(seeds, replicas, np.asarray(t, dtype=np.float64), clients)
        planned, reached = tau, returned
        if self.partial and self.deadline_s is not None:
            tau = np.minimum(tau, steps_in_time(self.deadline_s - comm, links.step_s))
        finish = comm + tau * links.step_s
        returned = returned & (tau >= 1)
        if self.deadline_s is not None:
            returned = returned & (finish <= self.deadline_s)
        if self.keep is not None:
            returned = first_to_finish(finish, returned, self.keep)
        idle = self.retry_s if self.deadline_s is None else self.deadline_s
        last = np.max(np.where(returned, finish, -np.inf), axis=1)
        tau = np.where(returned, tau, planned)  # an entry that does not train keeps its planned steps (>= 1)
        return Settled(returned, tau, np.where(returned.any(axis=1), last, idle), reached)


def rescaled(weights: np.ndarray, returned: np.ndarray) -> np.ndarray:
    """The weights of the returned entries, rescaled per row to sum to what the row's weights summed to; 0 for
    the others (not trained). A row nobody returned to: all 0."""
    kept = np.where(returned, weights, 0.0)
    total, kept_total = weights.sum(axis=1, keepdims=True), kept.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        factor = np.where(kept_total > 0, total / kept_total, 0.0)
    return kept * factor
