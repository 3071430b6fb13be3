"""A batch of slots: runs that differ only in batchable keys (step sizes, E, mu, momenta, schedules, seed, rounds),
trained as one on the replica axis (harness/runs/batch.py records them).

Each slot keeps its own parts, built from its own settings, for everything the driver plans per round: the composite
parts below call each slot's sampler, local work, schedule, solver statistics, aggregator and server optimizer on
the slot's rows and put the results side by side, so each slot's plan is the one its solo run makes. Only local
training is shared: the executor trains every slot's clients in one batched computation, with each replica's own
seed (RoundPlan.seed [R]), step sizes (RoundPlan.step_lrs [R, T]) and solver values (mu, momentum: sent per replica
in the server context). A slot that diverges, finishes its rounds, or whose recording raises leaves the batch: its
rows are cut out of every per-replica array, and the others go on as before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from fedharness.contracts import (Aggregator, Algorithm, Coefficients, LocalSolver, LocalWork, ReplicaLayout,
                                  Sampler, Schedule, Selection, ServerOptimizer, UpdateAggregator, WeightStats)
from fedharness.core.engine import Engine, RunState


def _cat(arrays) -> np.ndarray:
    """The slots' arrays one after another on the replica axis."""
    return np.concatenate(list(arrays))


@dataclass
class SlotSet:
    """The slots of a batch as the engine sees them: each one's parts, seed, replicas, rounds and eval_every, and
    `per_copy` (solver key -> [slots] values that differ across slots, sent per replica to the shards)."""

    ids: list[int]  # each slot's index in the batch as it started (results are reported by it)
    algorithms: list[Algorithm]
    seeds: np.ndarray
    replicas: np.ndarray
    rounds: np.ndarray
    eval_every: np.ndarray
    per_copy: dict[str, np.ndarray]

    def __post_init__(self):
        ends = np.cumsum(self.replicas).tolist()
        self._rows = [slice(int(end - r), int(end)) for r, end in zip(self.replicas, ends)]  # asked for often

    def rows(self, i: int) -> slice:
        """Slot i's rows of the batch's replica axis."""
        return self._rows[i]

    def per_row(self, values) -> np.ndarray:
        """[slots] -> [R]: each slot's value on each of its replicas."""
        return np.repeat(np.asarray(values), self.replicas, axis=0)

    def layout(self) -> ReplicaLayout:
        """Each slot's replicas keep their solo stream ids 0..r-1 (their seeds tell slots apart)."""
        streams = np.concatenate([np.arange(r) for r in self.replicas])
        return ReplicaLayout(streams, np.ones(len(streams)), np.ones(len(streams), dtype=np.int64))

    def keep(self, kept: list[int]) -> "SlotSet":
        """The slots at positions `kept`, in order."""
        return SlotSet([self.ids[i] for i in kept], [self.algorithms[i] for i in kept], self.seeds[kept],
                       self.replicas[kept], self.rounds[kept], self.eval_every[kept],
                       {k: v[kept] for k, v in self.per_copy.items()})

    def kept_rows(self, kept: list[int]) -> np.ndarray:
        return np.concatenate([np.arange(self.rows(i).start, self.rows(i).stop) for i in kept]).astype(np.int64)


def _stats_rows(stats: WeightStats, rows: slice) -> WeightStats:
    return WeightStats(stats.l1[rows], stats.l2sq[rows], stats.last[rows],
                       None if stats.scale is None else stats.scale[rows])


class SlotSampler(Sampler):
    def __init__(self, slots: SlotSet):
        self.slots = slots
        self.with_replacement = slots.algorithms[0].sampler.with_replacement

    def select(self, seed: int, replicas: np.ndarray, rnd: int, p: np.ndarray) -> Selection:
        s = self.slots
        sels = [a.sampler.select(int(s.seeds[i]), replicas[s.rows(i)], rnd, p) for i, a in enumerate(s.algorithms)]
        active = None
        if any(sel.active is not None for sel in sels):
            active = np.concatenate([np.ones(len(sel.clients), bool) if sel.active is None else sel.active
                                     for sel in sels])
        return Selection(_cat(sel.clients for sel in sels), _cat(sel.weights for sel in sels),
                         _cat(sel.lr_scale for sel in sels), active)


class SlotLocalWork(LocalWork):
    def __init__(self, slots: SlotSet):
        self.slots = slots

    def steps(self, seed: int, replicas: np.ndarray, rnd: int, clients: np.ndarray, sizes: np.ndarray,
              batch_size: int) -> np.ndarray:
        s = self.slots
        return np.concatenate([a.local_work.steps(int(s.seeds[i]), replicas[s.rows(i)], rnd, clients[s.rows(i)],
                                                  sizes, batch_size) for i, a in enumerate(s.algorithms)])


class SlotSchedule(Schedule):
    def __init__(self, slots: SlotSet):
        self.slots = slots

    def step_lrs(self, rnd: int, steps: int) -> np.ndarray:
        """[R, steps]: each replica's slot's schedule (a pure function of round and step, so the first entries
        are the ones its solo run uses, whatever the batch's longest round)."""
        return self.slots.per_row(np.stack([a.schedule.step_lrs(rnd, steps) for a in self.slots.algorithms]))


class SlotSolver(LocalSolver):
    """The driver's side of the slots' solvers: each slot's step sizes and weight statistics from its own solver;
    training delegates to `trainer`, the solver built with each per-copy key's largest value (the shards' one)."""

    def __init__(self, slots: SlotSet, trainer: LocalSolver):
        self.slots, self.trainer = slots, trainer
        self.comm_factor = trainer.comm_factor

    def step_lrs(self, base_lrs: np.ndarray) -> np.ndarray:
        s = self.slots
        return s.per_row(np.stack([a.solver.step_lrs(base_lrs[s.rows(i).start])
                                   for i, a in enumerate(s.algorithms)]))

    def weight_stats(self, tau: np.ndarray, step_lrs: np.ndarray, lr_scale: np.ndarray | None = None) -> WeightStats:
        s, parts = self.slots, []
        for i, a in enumerate(s.algorithms):
            rows = s.rows(i)
            steps = int(tau[rows].max())  # the solo run's step sizes are as long as its own longest round
            parts.append(a.solver.weight_stats(tau[rows], step_lrs[rows.start][:steps],
                                               None if lr_scale is None else lr_scale[rows]))
        scale = None if any(p.scale is None for p in parts) else np.concatenate([p.scale for p in parts])
        return WeightStats(_cat(p.l1 for p in parts), _cat(p.l2sq for p in parts), _cat(p.last for p in parts), scale)

    def init_state(self, w0, server_ctx=None, saved=None):
        return self.trainer.init_state(w0, server_ctx, saved)

    def update(self, w, g, lr, state):
        return self.trainer.update(w, g, lr, state)

    def finish(self, w0, w, lr_sum, state, p):
        return self.trainer.finish(w0, w, lr_sum, state, p)

    def init_server_ctx(self, x: torch.Tensor) -> dict:
        per_copy = {name: torch.as_tensor(self.slots.per_row(v), dtype=torch.float64, device=x.device)[:, None]
                    for name, v in self.slots.per_copy.items()}
        return {**self.trainer.init_server_ctx(x), **per_copy}

    def update_server_ctx(self, ctx, extras):
        return self.trainer.update_server_ctx(ctx, extras)


class SlotAggregator(Aggregator):
    def __init__(self, slots: SlotSet):
        self.slots = slots

    def coefficients(self, q: np.ndarray, stats: WeightStats, tau: np.ndarray) -> Coefficients:
        s = self.slots
        parts = [a.aggregator.coefficients(q[s.rows(i)], _stats_rows(stats, s.rows(i)), tau[s.rows(i)])
                 for i, a in enumerate(s.algorithms)]
        return Coefficients(_cat(p.coef for p in parts), _cat(p.tau_eff for p in parts), _cat(p.chi2 for p in parts),
                            _cat(p.slowdown for p in parts))


class SlotUpdateAggregator(SlotAggregator, UpdateAggregator):
    """Slots of an aggregator that sees the updates: its parameters are the same in every slot (not batchable)."""

    def coefficients(self, q: np.ndarray, stats: WeightStats, tau: np.ndarray) -> Coefficients:
        return SlotAggregator.coefficients(self, q, stats, tau)

    def aggregate(self, updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.slots.algorithms[0].aggregator.aggregate(updates, weights)


class SlotServer(ServerOptimizer):
    """Each slot's server optimizer on its rows; the state holds every slot's rows, each slot steps on views."""

    server_lr = None  # per slot: the engine writes each slot's own into its rows

    def __init__(self, slots: SlotSet):
        self.slots = slots

    def init_state(self, x: torch.Tensor) -> dict:
        s = self.slots
        states = [a.server.init_state(x[s.rows(i)]) for i, a in enumerate(s.algorithms)]
        return {name: torch.cat([st[name] for st in states]) for name in states[0]}

    def step(self, x: torch.Tensor, delta: torch.Tensor, state, lr=None) -> torch.Tensor:
        s = self.slots
        return torch.cat([a.server.step(x[s.rows(i)], delta[s.rows(i)], {k: v[s.rows(i)] for k, v in state.items()},
                                        None if lr is None else lr[s.rows(i)])
                          for i, a in enumerate(s.algorithms)])


def slot_algorithm(slots: SlotSet, trainer: LocalSolver) -> Algorithm:
    first = slots.algorithms[0]
    aggregator = SlotUpdateAggregator if isinstance(first.aggregator, UpdateAggregator) else SlotAggregator
    return Algorithm(first.name, SlotSampler(slots), SlotLocalWork(slots), SlotSchedule(slots),
                     SlotSolver(slots, trainer), aggregator(slots), SlotServer(slots), first.batch_size)


@dataclass
class SlotEnd:
    """How a slot left the batch."""

    status: str  # ok | diverged | pruned | failed
    rounds_done: int
    error: BaseException | None = None


class BatchedEngine(Engine):
    """The engine's round over a SlotSet. `on_rows(slot_id, rows, state)` records a slot's evaluated rows (its
    replicas numbered 0..r-1, as in its solo run; an exception ends that slot only); `on_end(slot_id, SlotEnd)`
    is told when a slot leaves. The executor trains with `trainer` (the slots' solver at each per-copy key's
    largest value)."""

    def __init__(self, problem, slots: SlotSet, trainer: LocalSolver, executor, *, on_rows: Callable,
                 on_end: Callable, end_status: Callable[[BaseException], str], **engine_args):
        self.slots, self.trainer = slots, trainer
        self.on_slot_rows, self.on_end, self.end_status = on_rows, on_end, end_status
        super().__init__(problem, slot_algorithm(slots, trainer), executor, rounds=int(slots.rounds.max()),
                         seed=int(slots.seeds[0]), replicas=int(slots.replicas.sum()),
                         eval_every=int(slots.eval_every.min()), layout=slots.layout(), **engine_args)

    def initial_state(self) -> RunState:
        s = self.slots
        x = torch.cat([self.problem.init_params(int(r), int(seed)) for r, seed in zip(s.replicas, s.seeds)])
        R = len(x)
        counters = {k: np.zeros(R, dtype=np.int64) for k in ("local_steps", "grad_evals", "bytes_up", "bytes_down")}
        counters["sim_s"] = np.zeros(R)
        return RunState(0, x, self.alg.server.init_state(x), counters, self.alg.solver.init_server_ctx(x), [])

    def plan_round(self, rnd: int):
        plan, coefs = super().plan_round(rnd)
        plan.seed = self.slots.per_row(self.slots.seeds)  # each replica's own streams
        return plan, coefs

    def slot_rows(self, rows: list[dict], i: int) -> list[dict]:
        """Slot i's rows of the batch's, its replicas renumbered from 0 and its own server lr."""
        rng, server_lr = self.slots.rows(i), self.slots.algorithms[i].server.server_lr
        return [{**r, "replica": r["replica"] - rng.start, "server_lr": server_lr}
                for r in rows if rng.start <= r["replica"] < rng.stop]

    def slot_state(self, state: RunState, i: int) -> RunState:
        rows = self.slots.rows(i)
        return RunState(state.round, state.x[rows], {k: v[rows] for k, v in state.server_state.items()},
                        {k: v[rows] for k, v in state.counters.items()}, wall_s=state.wall_s)

    def _deliver(self, state: RunState, i: int, rows: list[dict]) -> SlotEnd | None:
        try:
            self.on_slot_rows(self.slots.ids[i], rows, self.slot_state(state, i))
        except Exception as err:  # an on_eval's prune or failure ends this slot only
            return SlotEnd(self.end_status(err), state.round, err)
        return None

    def run(self, state: RunState | None = None) -> None:
        """Train until every slot has left; each one's end goes to `on_end`."""
        state = state or self.initial_state()
        start = time.perf_counter()
        rows = self.evaluate(state)
        self._leave(state, {i: end for i in range(len(self.slots.ids))
                            if (end := self._deliver(state, i, self.slot_rows(rows, i))) is not None})
        while self.slots.ids:
            state = self.step(state)
            state.wall_s = time.perf_counter() - start
            self.rounds_done = state.round  # where the slots still in the batch stand if an error ends it
            self._leave(state, self._round_ends(state))

    def evaluate_replicas(self, state: RunState, replicas: np.ndarray) -> list[dict]:
        """Engine.evaluate's rows of these replicas only (those of the slots due this round), with one
        problem.evaluate over their stacked models: slots with different eval_every seldom fall due together, and
        a replica's evaluation does not depend on the others' rows."""
        if len(replicas) == len(state.x):
            return self.evaluate(state)
        rows = self._evaluate_series(state, state.x[torch.as_tensor(replicas, device=state.x.device)], "iterate",
                                     replicas)
        for hook, hs in zip(self.series, state.series_state):
            for name, (x, replica_ids) in hook.series(hs).items():
                keep = np.flatnonzero(np.isin(replica_ids, replicas))  # rows slot_rows would give a due slot
                if len(keep):
                    rows.extend(self._evaluate_series(state, x[torch.as_tensor(keep, device=x.device)], name,
                                                      np.asarray(replica_ids)[keep]))
        return rows

    def _round_ends(self, state: RunState) -> dict[int, SlotEnd]:
        """Record the slots evaluated after this round; which slots leave and how (as their solo runs would end)."""
        s, rnd = self.slots, state.round
        finite = torch.isfinite(state.x).all(dim=1).cpu().numpy()
        ends: dict[int, SlotEnd] = {}
        due = []
        for i in range(len(s.ids)):
            if not finite[s.rows(i)].all():
                ends[i] = SlotEnd("diverged", rnd - 1)
            elif rnd % s.eval_every[i] == 0 or rnd == s.rounds[i]:
                due.append(i)
        if due:
            rows = self.evaluate_replicas(state, s.kept_rows(due))
            if self.progress:
                self.progress(rnd, rows)
            for i in due:
                mine = self.slot_rows(rows, i)
                end = self._deliver(state, i, mine)
                if end is None and any(r["train_loss"] is None for r in mine if r["series"] == "iterate"):
                    end = SlotEnd("diverged", rnd - 1)  # finite weights but an overflowing loss, rows kept
                if end is None and rnd == s.rounds[i]:
                    end = SlotEnd("ok", rnd)
                if end is not None:
                    ends[i] = end
        return ends

    def _leave(self, state: RunState, ends: dict[int, SlotEnd]) -> None:
        """Tell each ended slot's end, then cut their rows out of the batch."""
        if not ends:
            return
        for i, end in ends.items():
            self.on_end(self.slots.ids[i], end)
        kept = [i for i in range(len(self.slots.ids)) if i not in ends]
        rows = self.slots.kept_rows(kept) if kept else np.zeros(0, dtype=np.int64)
        index = torch.as_tensor(rows, device=state.x.device)
        client_state = self.executor.get_state() if kept else {}
        self.slots = self.slots.keep(kept)
        if not kept:
            return
        self.alg = slot_algorithm(self.slots, self.trainer)
        self.layout = self.slots.layout()
        self.stream_replicas = self.layout.stream_ids
        state.x = state.x[index]
        state.server_state = {k: v[index] for k, v in state.server_state.items()}
        state.server_ctx = {k: v[index] for k, v in state.server_ctx.items()}
        state.counters = {k: v[rows] for k, v in state.counters.items()}
        self._last_lr = self._last_lr[rows]
        if self._last_diag is not None:
            d = self._last_diag
            self._last_diag = replace(d, coef=d.coef[rows], tau_eff=d.tau_eff[rows], chi2=d.chi2[rows],
                                      slowdown=d.slowdown[rows])
        if client_state:  # per (replica, client) state (SCAFFOLD's c_i, FedBN's buffers) follows its replica
            new_row = {int(old): new for new, old in enumerate(rows)}
            self.executor.set_state({(new_row[r], k): v for (r, k), v in client_state.items() if r in new_row})
