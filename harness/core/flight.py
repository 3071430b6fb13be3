"""Asynchronous aggregation on the simulated clock: FedBuff and FedAsync as start and wait rules of the one round
loop (harness/core/engine.py; docs/async.md).

Each engine step is one server version v, run as events on each replica's clock t (sim_s), one arrival a pass
(Nguyen et al.'s Algorithm 1):

1. Refill. Free slots start clients from x_v: the sampler, keyed by (v, pass), draws with `online` = online at
   t, not in flight and not started from v yet (Busy), and the first of its draws that may start do, to arrive at
   t + their systems round time (transfer + tau step_s, core/clock.py). refill=arrival: whenever the row has
   free slots and no arrival is due at t. refill=step (FedScale's): at the version's start only (pass 0), before
   the arrivals due then: the step that ended v - 1 starts clients in the slots its arrivals freed, and arrivals
   tied with that step are taken into v, their slots refilled at v's step.
2. Arrival. The next arrival in (time, client id) order moves t to it and frees its slot; an update more than
   max_staleness versions old is dropped, the others are taken; the version ends with the M-th taken
   (FedAsync: M = 1), or when nothing is in flight and nobody can start (a version nothing arrived to lasts
   retry_s).

So under refill=arrival a slot is refilled the moment its client arrives, from the version current then, and
arrivals at one instant are all taken before the slots they free are refilled. Either way C = M = K with equal
profiles is the synchronous round (each step takes all K, so no arrival is left due at the next start). The
order of arrivals needs only the profiles, not the updates: a client's update is fixed when it starts (x_v, its
data, its streams keyed by v), so the engine trains all who started from v as one batch when the version ends.

What is in flight is one dict of arrays per run (RunState.in_flight), [R, C] per slot and the updates [R, C, dim]
float64: C x dim x 8 bytes per replica, checkpointed with the run, so a resume continues with the same queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from fedharness.contracts import Online, Selection, WeightStats

EMPTY = -1  # the client id of a free slot
PASS_SHIFT = 32  # a refill's sampler key: v + pass << 32 (pass 0: v, the synchronous round's key)
BROADCAST_MAX = 1 << 14  # Busy.mask compares candidates with those in flight at once up to this many pairs a row


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
    refill: str = "arrival"  # arrival: a freed slot starts a client at once | step: at the next version's start

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
    """Who may start: online at each row's t and not in flight in that row (`flying` [R, C'], EMPTY: none)."""

    flying: np.ndarray = None  # [R, C']; given always (a default only because Online's fields have none)

    def mask(self, clients: np.ndarray) -> np.ndarray:
        if clients.shape[1] * self.flying.shape[1] <= BROADCAST_MAX:  # small: one comparison, no per-row loop
            free = ~(clients[:, :, None] == self.flying[:, None, :]).any(axis=2)
        else:
            free = np.stack([~np.isin(c, f) for c, f in zip(clients, self.flying)])
        return super().mask(clients) & free

    def rows(self, index) -> "Busy":
        return Busy(self.availability, self.seeds[index], self.replicas[index], self.t[index], self.flying[index])


@dataclass(frozen=True)
class Draw:
    """The clients a refill starts [R, W] (padded where a row starts fewer): their sampler weight, local steps, lr
    scale, weight statistics and time from start to arrival."""

    clients: np.ndarray
    weights: np.ndarray
    tau: np.ndarray
    lr_scale: np.ndarray
    stats: WeightStats
    finish_s: np.ndarray


# what a slot holds besides its update; "seq": the order it started in among its version's starters
SLOT_FIELDS = {"client": np.int64, "version": np.int64, "seq": np.int64, "tau": np.int64, "arrival": np.float64,
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


@dataclass
class Version:
    """What one server version's events did, per row r: `started[r]` (client, tau, lr scale) of those that started
    from v, in order; `taken[r]` the taken entries' slot fields (their `slot`: where the update is held, -1 for a
    starter of v, whose update is trained at the version's end); `arrived` [R] how many arrived (dropped ones too);
    `t` [R] the clock at the step; `events[r]` (client, start version, staleness) in the order they arrived."""

    started: list[list[tuple[int, int, float]]]
    taken: list[list[dict]]
    arrived: np.ndarray
    t: np.ndarray
    events: list[list[tuple[int, int, int]]]


def run_version(flight: dict, v: int, t: np.ndarray, rule: AsyncRule, online: Callable[[np.ndarray, np.ndarray], Busy],
                select: Callable[[int, Busy], Selection], prepare: Callable[[int, np.ndarray, np.ndarray, np.ndarray],
                                                                            Draw], retry_s: float) -> Version:
    """Version v's events on each row (module docstring): refill and take arrivals until the M-th is taken.
    `online(t, flying)`: who may start at each row's t; `select(key, busy)`: the sampler's candidates;
    `prepare(key, clients, weights, lr_scale)`: the Draw of the clients that start."""
    R = len(t)
    out = Version([[] for _ in range(R)], [[] for _ in range(R)], np.zeros(R, dtype=np.int64),
                  np.array(t, dtype=np.float64), [[] for _ in range(R)])
    active, p = np.ones(R, dtype=bool), 0
    while active.any():  # one arrival a pass (so a row's pass p is its own p-th event); each row until its M-th
        _refill(flight, v, p, rule, out, active, online, select, prepare)
        for r in np.flatnonzero(active):
            active[r] = _take_next(flight, v, r, rule, out, retry_s)
        p += 1
    return out


def _next_arrival(flight: dict) -> np.ndarray:
    """[R] each row's earliest arrival in flight (inf: nobody)."""
    return np.min(np.where(flight["client"] != EMPTY, flight["arrival"], np.inf), axis=1)


def _refill(flight: dict, v: int, p: int, rule: AsyncRule, out: Version, active: np.ndarray, online, select,
            prepare) -> None:
    """Start clients from v in the free slots of the active rows: refill=arrival where no arrival is due at their
    t, refill=step at pass 0 only, whatever is due (module docstring)."""
    if rule.refill == "step" and p > 0:  # FedScale's: only at the version's start, before the arrivals due then
        return
    free = (flight["client"] == EMPTY).sum(axis=1)
    need = active & (free > 0)
    if rule.refill == "arrival":
        need &= _next_arrival(flight) > out.t
    if not need.any():
        return
    width = max(len(s) for s in out.started)
    started = np.full((len(need), width), EMPTY, dtype=np.int64)
    for r, s in enumerate(out.started):
        started[r, :len(s)] = [k for k, _, _ in s]
    busy = online(out.t, np.concatenate([flight["client"], started], axis=1))
    key = v + (p << PASS_SHIFT)
    sel = select(key, busy)
    ok = busy.mask(sel.clients) & need[:, None]
    start = ok & (np.cumsum(ok, axis=1) <= free[:, None])
    n = start.sum(axis=1)
    if not n.any():
        return
    order = np.argsort(~start, axis=1, kind="stable")[:, :n.max()]  # each row's starters first, in draw order
    d = prepare(key, *(np.take_along_axis(a, order, axis=1) for a in (sel.clients, sel.weights, sel.lr_scale)))
    scale = np.ones(d.tau.shape) if d.stats.scale is None else d.stats.scale
    values = {"version": np.full(d.tau.shape, v), "tau": d.tau, "arrival": out.t[:, None] + d.finish_s,
              "weight": d.weights, "l1": d.stats.l1, "l2sq": d.stats.l2sq, "last": d.stats.last, "scale": scale}
    for r in np.flatnonzero(n):
        cols = np.arange(n[r])
        slots = np.flatnonzero(flight["client"][r] == EMPTY)[:n[r]]
        flight["client"][r, slots] = d.clients[r, cols]
        flight["seq"][r, slots] = len(out.started[r]) + cols
        for name, value in values.items():
            flight[name][r, slots] = value[r, cols]
        out.started[r].extend(zip(d.clients[r, cols].tolist(), d.tau[r, cols].tolist(),
                                  d.lr_scale[r, cols].tolist()))


def _take_next(flight: dict, v: int, r: int, rule: AsyncRule, out: Version, retry_s: float) -> bool:
    """Row r's next arrival: free its slot, take it or drop it; whether the row's version goes on."""
    flying = np.flatnonzero(flight["client"][r] != EMPTY)
    if not len(flying):  # nothing in flight and nobody could start
        if not out.arrived[r]:
            out.t[r] += retry_s
        return False
    j = flying[np.lexsort((flight["client"][r, flying], flight["arrival"][r, flying]))[0]]
    entry = {name: flight[name][r, j] for name in SLOT_FIELDS}
    stale = v - int(entry["version"])
    out.t[r], out.arrived[r] = entry["arrival"], out.arrived[r] + 1
    out.events[r].append((int(entry["client"]), int(entry["version"]), stale))
    flight["client"][r, j] = EMPTY
    if rule.max_staleness is not None and stale > rule.max_staleness:
        return True  # dropped: sent, never aggregated
    entry["slot"] = j if stale else -1  # a starter of v: its update is not trained yet
    out.taken[r].append(entry)
    return len(out.taken[r]) < rule.buffer


def packed(taken: list[list[dict]]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The taken entries as [R, W] columns (each slot field and `slot`) in the order they started (version, then
    seq), the order a synchronous round's draws are in (W: the most any row took, at least 1); (columns, valid)."""
    fields = (*SLOT_FIELDS, "slot")
    width = max(1, max(len(row) for row in taken))
    valid = np.zeros((len(taken), width), dtype=bool)
    cols = {name: np.zeros((len(taken), width), dtype=SLOT_FIELDS.get(name, np.int64)) for name in fields}
    for r, row in enumerate(taken):
        for w, entry in enumerate(sorted(row, key=lambda e: (int(e["version"]), int(e["seq"])))):
            valid[r, w] = True
            for name in fields:
                cols[name][r, w] = entry[name]
    return cols, valid
