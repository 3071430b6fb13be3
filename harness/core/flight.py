"""Asynchronous aggregation on the simulated clock: FedBuff and FedAsync as start and wait rules of the one round
loop (harness/core/engine.py; docs/async.md).

Each engine step is one server version v. At its start, at the replica's clock t (sim_s), the free slots of the C
in flight are filled: the sampler, keyed by v, draws with `online` = online at t and not in flight (Busy), and the
first of its draws that may start do. A client's update is fixed when it starts (the model x_v, its data, its
streams keyed by v), so the starters train at once, as one batch, and their updates wait in the driver until they
arrive, at t + their systems round time (transfer + tau step_s, core/clock.py). The step then takes arrivals in
(time, client id) order: an update more than max_staleness versions old is dropped, and the step aggregates the
first M others (FedAsync: M = 1); the server's clock moves to the last one taken. A freed slot is refilled at the
next version's start, so C = M = K with equal profiles is the synchronous round.

What is in flight is one dict of arrays per run (RunState.in_flight), [R, C] per slot and the updates [R, C, dim]
float64: C x dim x 8 bytes per replica, checkpointed with the run, so a resume continues with the same queue.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedharness.contracts import Online, WeightStats

EMPTY = -1  # the client id of a free slot


@dataclass(frozen=True)
class AsyncRule:
    """The `systems` keys of an asynchronous run: fedbuff or fedasync, C, M, the staleness limit and weight."""

    mode: str  # fedbuff | fedasync
    concurrency: int  # C
    buffer: int  # M
    max_staleness: int | None
    alpha: float  # fedasync's a
    staleness: str  # constant | poly | hinge
    exponent: float
    cutoff: int

    def weight(self, tau: np.ndarray) -> np.ndarray:
        """s(tau) of updates tau versions stale (FedAsync's constant, polynomial and hinge functions)."""
        tau = np.asarray(tau, dtype=np.float64)
        if self.staleness == "poly":
            return (1.0 + tau) ** -self.exponent
        if self.staleness == "hinge":
            return 1.0 / (self.exponent * np.maximum(tau - self.cutoff, 0.0) + 1.0)  # 1 up to the cutoff
        return np.ones_like(tau)


@dataclass(frozen=True)
class Busy(Online):
    """Who may start: online at each row's t and not in flight in that row (`flying` [R, C], EMPTY: a free slot)."""

    flying: np.ndarray = None  # [R, C]; given always (a default only because Online's fields have none)

    def mask(self, clients: np.ndarray) -> np.ndarray:
        free = np.stack([~np.isin(c, f) for c, f in zip(clients, self.flying)])
        return super().mask(clients) & free

    def rows(self, index) -> "Busy":
        return Busy(self.availability, self.seeds[index], self.replicas[index], self.t[index], self.flying[index])


SLOT_FIELDS = {"client": np.int64, "version": np.int64, "tau": np.int64, "arrival": np.float64,
               "weight": np.float64, "l1": np.float64, "l2sq": np.float64, "last": np.float64, "scale": np.float64}


def empty_flight(replicas: int, concurrency: int, dim: int, device) -> dict:
    """Nobody in flight: every slot free."""
    flight = {name: np.zeros((replicas, concurrency), dtype=dtype) for name, dtype in SLOT_FIELDS.items()}
    flight["client"][:] = EMPTY
    flight["update"] = torch.zeros(replicas, concurrency, dim, dtype=torch.float64, device=device)
    return flight


def flight_rows(flight: dict, rows: np.ndarray) -> dict:
    """The flight of replica rows `rows` only (a batch whose slots left)."""
    index = torch.as_tensor(rows, device=flight["update"].device)
    return {k: v[index] if isinstance(v, torch.Tensor) else v[rows] for k, v in flight.items()}


def starters(online: Busy, clients: np.ndarray, free: np.ndarray) -> np.ndarray:
    """[R, W] bool: of each row's draws, the first `free[r]` that may start (online, not in flight)."""
    ok = online.mask(clients)
    return ok & (np.cumsum(ok, axis=1) <= free[:, None])


def board(flight: dict, start: np.ndarray, clients: np.ndarray, values: dict[str, np.ndarray]) -> np.ndarray:
    """Put the starting entries (start [R, W]) into their rows' free slots, in draw order; [R, W] each entry's slot
    (-1: not starting). `values`: [R, W] per slot field besides client."""
    slot = np.full(start.shape, -1, dtype=np.int64)
    for r in range(len(start)):
        cols = np.flatnonzero(start[r])
        slot[r, cols] = np.flatnonzero(flight["client"][r] == EMPTY)[:len(cols)]
    rows, cols = np.nonzero(start)
    flight["client"][rows, slot[rows, cols]] = clients[rows, cols]
    for name, v in values.items():
        flight[name][rows, slot[rows, cols]] = v[rows, cols]
    return slot


def arrivals(flight: dict, version: int, rule: AsyncRule) -> tuple[np.ndarray, np.ndarray]:
    """([R, C] bool arrived this step, [R, C] bool taken into the aggregate): each row's slots in (arrival, client)
    order; a stale one arrives and is dropped; the step ends with the M-th taken, or when nobody is left."""
    arrived = np.zeros(flight["client"].shape, dtype=bool)
    taken = np.zeros_like(arrived)
    for r in range(len(arrived)):
        order = np.lexsort((flight["client"][r], flight["arrival"][r]))
        n = 0
        for j in order[flight["client"][r][order] != EMPTY]:
            arrived[r, j] = True
            stale = version - flight["version"][r, j]
            if rule.max_staleness is not None and stale > rule.max_staleness:
                continue  # dropped: sent, never aggregated
            taken[r, j] = True
            n += 1
            if n == rule.buffer:
                break
    return arrived, taken


def step_time(flight: dict, arrived: np.ndarray, t: np.ndarray, retry_s: float) -> np.ndarray:
    """[R] the server's clock at the step: its last arrival; t + retry_s where nothing was in flight."""
    last = np.max(np.where(arrived, flight["arrival"], -np.inf), axis=1)
    return np.where(arrived.any(axis=1), last, t + retry_s)


def packed(taken: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The taken slots as [R, W] columns (W: the most any row took, at least 1): (slot index, valid, row ids)."""
    width = max(1, int(taken.sum(axis=1).max()))
    index = np.zeros((len(taken), width), dtype=np.int64)
    valid = np.zeros((len(taken), width), dtype=bool)
    for r, row in enumerate(taken):
        js = np.flatnonzero(row)
        index[r, :len(js)], valid[r, :len(js)] = js, True
    return index, valid, np.repeat(np.arange(len(taken)), width).reshape(len(taken), width)


def taken_stats(flight: dict, index: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, WeightStats, np.ndarray]:
    """The taken entries' sampler weights (0 on padding), weight stats and local steps, [R, W] each."""
    def get(name: str, pad: float) -> np.ndarray:
        return np.where(valid, np.take_along_axis(flight[name], index, axis=1), pad)

    stats = WeightStats(get("l1", 1.0), get("l2sq", 1.0), get("last", 1.0), get("scale", 1.0))
    return get("weight", 0.0), stats, get("tau", 1).astype(np.int64)


def release(flight: dict, arrived: np.ndarray) -> None:
    """Free the slots whose clients arrived (their update no longer held)."""
    flight["client"][arrived] = EMPTY
