"""The cadences (contracts.Cadence, the `cadence` group): synchronous rounds, and FedBuff and FedAsync as start and
wait rules on the simulated clock, run by the one round loop (harness/core/engine.py; docs/async.md).

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

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from fedharness.contracts import (Cadence, Coefficients, Online, RoundPlan, RunState, Selection, Staleness,
                                  WeightStats)
from fedharness.keys import choice, integer, number
from fedharness.registry.groups import CADENCES

EMPTY = -1  # the client id of a free slot
PASS_SHIFT = 32  # a refill's sampler key: v + pass << 32 (pass 0: v, the synchronous round's key)
BROADCAST_MAX = 1 << 14  # Busy.mask compares candidates with those in flight at once up to this many pairs a row


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


def run_version(flight: dict, v: int, t: np.ndarray, rule: "FedBuff", online: Callable[[np.ndarray, np.ndarray], Busy],
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


def _refill(flight: dict, v: int, p: int, rule: "FedBuff", out: Version, active: np.ndarray, online, select,
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


def _take_next(flight: dict, v: int, r: int, rule: "FedBuff", out: Version, retry_s: float) -> bool:
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


# --- the cadences (contracts.Cadence) ------------------------------------------------------------------------


@CADENCES.register("sync", keys={
    "deadline_s": number("a round's deadline (s): a client not done by then is dropped (or, with late_work=partial, "
                         "sends the steps it finished)", lo=0, lo_open=True,
                         null="no deadline: the round waits for every kept client"),
    "over_selection": number("sample ceil(over_selection K) clients, keep the first K to finish", lo=1),
    "late_work": choice("a client the deadline cuts off: drop (its update is lost) | partial (it sends the local "
                        "steps it finished in time, as FedNova's tau_i)", ("drop", "partial"))})
@dataclass(frozen=True)
class Synchronous(Cadence):
    """Rounds: every sampled client starts from the server's model, and the server waits for the round's clients.

    On the systems clock those online, in time for the deadline, the first K to finish with over-selection
    (core/clock.py settles the plan). The contract's own step."""

    deadline_s: float | None = None
    over_selection: float = 1.0
    late_work: str = "drop"
    retry_s: float = 60.0

    def sampled(self, clients_per_round: int) -> int:
        """ceil(over_selection K) with over-selection (the first K to finish are kept), else K."""
        if self.over_selection == 1:
            return clients_per_round
        return math.ceil(self.over_selection * clients_per_round - 1e-9)


@dataclass(frozen=True)
class FedBuff(Cadence):
    """cadence=fedbuff (Nguyen et al.): C clients in flight, a server step after every M taken arrivals, each update
    weighted by s(tau) (the staleness part), one more than max_staleness versions old dropped; `refill`: arrival
    (a freed slot starts a client at once) | step (at the next server step, FedScale's)."""

    concurrency: int  # C
    buffer: int  # M
    max_staleness: int | None
    staleness: Staleness
    refill: str = "arrival"
    retry_s: float = 60.0

    spans_versions = True

    def sampled(self, clients_per_round: int) -> int:
        return self.concurrency  # the sampler draws C a version, and the free slots take the first

    def init_flight(self, replicas: int, dim: int, device) -> dict:
        return empty_flight(replicas, self.concurrency, dim, device)

    def held_update(self, update: torch.Tensor, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """What a slot holds of a trained client (`update` [n, dim] of replicas `rows` of the models x): FedBuff
        its Delta_k."""
        return update

    def step(self, e, state: RunState) -> RunState:
        """Version v's events (run_version: refills and arrivals on each replica's clock), then its starters
        trained as one batch and the server's step with what it took."""
        f, v = state.in_flight, state.round
        seeds, replicas = e.row_seeds(), e.stream_replicas

        def online(t: np.ndarray, flying: np.ndarray) -> Busy:
            return Busy(e.clock.availability, seeds, replicas, t, flying)

        def select(key: int, busy: Busy) -> Selection:  # a refill's candidates, preferring who may start
            return e.alg.sampler.select(e.seed, e.stream_replicas, key, e.problem.weights, online=busy)

        version = run_version(f, v, state.counters["sim_s"], self, online, select, self._refill_prepare(e, v),
                              self.retry_s)
        cols, valid = packed(version.taken)
        held = self._held(f, cols, valid)  # before the starters' updates fill the slots their arrivals freed
        first, starts, work = self._train_starters(e, state, version.started, cols, valid, held)
        coefs, delta = self.combine(e, state, cols, valid, held)
        c = state.counters
        down, up = e.transfer_bytes
        c["local_steps"] += np.where(valid, cols["tau"], 0).max(axis=1)
        c["grad_evals"] += work * e.alg.batch_size
        c["bytes_down"] += starts * down
        c["bytes_up"] += version.arrived * up  # a stale update was sent, then dropped
        c["sim_s"] = version.t
        c["participants"] = valid.sum(axis=1)
        return e.advance(state, delta, first, coefs)

    @staticmethod
    def _refill_prepare(e, v: int) -> Callable[[int, np.ndarray, np.ndarray, np.ndarray], Draw]:
        """The Draw of the clients a refill starts from version v: their local work keyed by the refill's key, v's
        step sizes, each one's time from start to arrival on its own profile."""
        alg, p = e.alg, e.problem

        def prepare(key: int, clients: np.ndarray, weights: np.ndarray, lr_scale: np.ndarray) -> Draw:
            tau = alg.local_work.steps(e.seed, e.stream_replicas, key, clients, p.sizes, alg.batch_size)
            tau = tau * e.layout.tau_factor[:, None]
            lrs = alg.solver.step_lrs(alg.schedule.step_lrs(v, int(tau.max())))
            lr_scale = lr_scale * e.layout.lr_factor[:, None]
            finish = e.clock.finish_s(e.row_seeds(), e.stream_replicas, clients, tau, *e.transfer_bytes)
            return Draw(clients, weights, tau, lr_scale, alg.solver.weight_stats(tau, lrs, lr_scale), finish)

        return prepare

    @staticmethod
    def _held(f: dict, cols: dict[str, np.ndarray], valid: np.ndarray) -> torch.Tensor:
        """[R, W, dim] the taken updates held in slots (zeros for the starters of v: trained next)."""
        update = f["update"]
        held = torch.zeros(*valid.shape, update.shape[2], dtype=torch.float64, device=update.device)
        rs, ws = np.nonzero(valid & (cols["slot"] >= 0))
        if len(rs):
            held[torch.as_tensor(rs), torch.as_tensor(ws)] = update[torch.as_tensor(rs),
                                                                    torch.as_tensor(cols["slot"][rs, ws])]
        return held

    def _train_starters(self, e, state: RunState, started: list[list[tuple]], cols: dict[str, np.ndarray],
                        valid: np.ndarray, held: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Train the clients that started from v as one batch; a taken one's update goes to `held`, the others'
        to their slots (held_update). (The version's first step size, starters [R], their local steps [R].)"""
        alg, v = e.alg, state.round
        width = max(1, max(len(s) for s in started))
        clients, on = np.zeros((len(started), width), dtype=np.int64), np.zeros((len(started), width), dtype=bool)
        tau, lr_scale = np.ones(clients.shape, dtype=np.int64), np.ones(clients.shape)
        for r, s in enumerate(started):
            if s:
                clients[r, :len(s)], tau[r, :len(s)], lr_scale[r, :len(s)] = zip(*s)
                on[r, :len(s)] = True
        lrs = alg.solver.step_lrs(alg.schedule.step_lrs(v, int(tau.max())))
        if on.any():
            plan = RoundPlan(v, e.plan_seed(), e.stream_replicas, clients, on.astype(np.float64), tau,
                             lr_scale, lrs, server_ctx=state.server_ctx, send_updates=True)
            plan.stages = e.stages.client_work(plan, state.counters)  # compression: in the shards, per client
            self._hold(e, state, plan, cols, valid, held)
        return lrs[..., 0], on.sum(axis=1), np.where(on, tau, 0).sum(axis=1)

    def _hold(self, e, state: RunState, plan: RoundPlan, cols: dict[str, np.ndarray], valid: np.ndarray,
              held: torch.Tensor) -> None:
        f, v = state.in_flight, state.round
        rs, js = np.nonzero((f["client"] != EMPTY) & (f["version"] == v))  # still in flight
        dest = {(r, k): (True, j) for r, j, k in zip(rs.tolist(), js.tolist(), f["client"][rs, js].tolist())}
        rs, ws = np.nonzero(valid & (cols["slot"] < 0))  # arrived and taken within the version
        dest.update({(r, k): (False, w) for r, w, k in zip(rs.tolist(), ws.tolist(), cols["client"][rs, ws].tolist())})
        for chunk in e.executor.local_updates(state.x, plan).updates:
            # np.array copies: a Ray shard's reply is read-only memory, which torch will not wrap
            rows = torch.as_tensor(np.array(chunk.replica, dtype=np.int64), device=state.x.device)
            to = [dest[(int(r), int(k))] for r, k in zip(chunk.replica, chunk.clients)]
            in_slot = torch.as_tensor([s for s, _ in to], dtype=torch.bool, device=state.x.device)
            at = torch.as_tensor([i for _, i in to], dtype=torch.long, device=state.x.device)
            update = self.held_update(chunk.delta.to(device=state.x.device, dtype=torch.float64), state.x, rows)
            f["update"][rows[in_slot], at[in_slot]] = update[in_slot]
            held[rows[~in_slot], at[~in_slot]] = update[~in_slot]

    def combine(self, e, state: RunState, cols: dict[str, np.ndarray], valid: np.ndarray,
                held: torch.Tensor) -> tuple[Coefficients, torch.Tensor]:
        """The step's coefficients and Delta [R, dim] float64 from the taken updates, each weighted by s(tau):
        the aggregator's coefficients of q_k (C / M) s(tau_k), summed exactly as a round's shards sum
        (core/exact_sum.py), so C = M = K is a synchronous round's bits (s(0) = C / M = 1)."""
        x = state.x
        s = np.where(valid, self.staleness.weight(state.round - cols["version"]), 0.0)
        rs, ws = np.nonzero(valid)
        replica = torch.as_tensor(rs, device=x.device)
        taken = held[replica, torch.as_tensor(ws, device=x.device)]  # [n, dim]
        stats = WeightStats(*(np.where(valid, cols[name], 1.0) for name in ("l1", "l2sq", "last", "scale")))
        q = np.where(valid, cols["weight"], 0.0)
        coefs = e.alg.aggregator.coefficients(q * (self.concurrency / self.buffer) * s, stats,
                                              np.where(valid, cols["tau"], 1))
        if not valid.all():
            coefs.idle(~valid.any(axis=1))
        weight = torch.as_tensor(coefs.coef[valid], dtype=torch.float64, device=x.device)[:, None]
        return coefs, e.exact_sum(x, replica, taken * weight, self.buffer)


@dataclass(frozen=True)
class FedAsync(FedBuff):
    """cadence=fedasync (Xie et al.): a server step per arrival (M = 1) that mixes models, x <- (1 - a) x + a x_k
    with a = alpha s(tau); a slot holds its client's model x_v + Delta_k."""

    alpha: float = 0.6

    def held_update(self, update: torch.Tensor, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return update + x[rows].double()

    def combine(self, e, state: RunState, cols: dict[str, np.ndarray], valid: np.ndarray,
                held: torch.Tensor) -> tuple[Coefficients, torch.Tensor]:
        """Delta = a (x_k - x) of each replica's one arrival x_k, so the server's sgd step (server_lr 1) gives
        x <- (1 - a) x + a x_k; a = alpha s(tau) [R, 1] (0 on a replica nothing arrived to)."""
        x = state.x
        a = self.alpha * np.where(valid, self.staleness.weight(state.round - cols["version"]), 0.0)
        rs, ws = np.nonzero(valid)
        replica = torch.as_tensor(rs, device=x.device)
        models = held[replica, torch.as_tensor(ws, device=x.device)]  # [n, dim]
        nan = np.full(len(a), np.nan)
        weight = torch.as_tensor(a[valid], dtype=torch.float64, device=x.device)[:, None]
        delta = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
        return (Coefficients(a, nan, nan.copy(), nan.copy()),
                delta.index_add_(0, replica, weight * (models - x[replica].double())))


# the keys of the asynchronous cadences (`cadence.KEY=V` with cadence=fedbuff or fedasync)
CONCURRENCY = integer("C, the clients in flight (at most N)", lo=1, null="algorithm.clients_per_round")
REFILL = choice("when a slot its client's arrival freed starts a new client: arrival (at once, from the version "
                "current then: Nguyen et al.'s Algorithm 1) | step (at the next server step: FedScale's)",
                ("arrival", "step"))
MAX_STALENESS = integer("an update more server versions stale than this is dropped", lo=0, null="no limit")


@CADENCES.register("fedbuff", keys={
    "concurrency": CONCURRENCY, "refill": REFILL, "max_staleness": MAX_STALENESS,
    "buffer": integer("M, the arrivals each server step aggregates (at most C)", lo=1,
                      null="algorithm.clients_per_round")})
def fedbuff(staleness: Staleness, clients_per_round: int, concurrency: int | None = None, buffer: int | None = None,
            refill: str = "arrival", max_staleness: int | None = None, retry_s: float = 60.0) -> FedBuff:
    """C clients in flight, a server step after every M arrivals, each update weighted by s(tau) (the staleness
    group)."""
    C = clients_per_round if concurrency is None else concurrency
    M = clients_per_round if buffer is None else buffer
    return FedBuff(int(C), int(M), max_staleness, staleness, refill, float(retry_s))


@CADENCES.register("fedasync", keys={
    "concurrency": CONCURRENCY, "refill": REFILL, "max_staleness": MAX_STALENESS,
    "alpha": number("the mixing weight a of x <- (1 - a s(tau)) x + a s(tau) x_k", lo=0, hi=1, lo_open=True)})
def fedasync(staleness: Staleness, clients_per_round: int, concurrency: int | None = None, refill: str = "arrival",
             max_staleness: int | None = None, alpha: float = 0.6, retry_s: float = 60.0) -> FedAsync:
    """C clients in flight, a server step per arrival that mixes models, x <- (1 - a) x + a x_k, a = alpha
    s(tau)."""
    C = clients_per_round if concurrency is None else concurrency
    return FedAsync(int(C), 1, max_staleness, staleness, refill, float(retry_s), float(alpha))
