"""A batch of slots: runs that differ only in batchable keys (step sizes, E, mu, momenta, schedules, seed, rounds),
trained as one on the replica axis (harness/core/engine.py runs them; harness/runs/execute.py records them). A solo
run is a batch of one slot, which keeps its own parts (the composites below are for two slots or more).

Each slot keeps its own parts, built from its own settings, for everything the driver plans per round: the composite
parts below call each slot's sampler, local work, schedule, solver statistics, aggregator and server optimizer on
the slot's rows and put the results side by side, so each slot's plan is the one its solo run makes (adjacent
slots whose parts are alike, as every trial of a study over step sizes and E, in one call over their rows: a
row-wise part gives each slot the rows of its own call). Only local training is shared: the executor trains every
slot's clients in one batched computation, with each replica's own seed (RoundPlan.seed [R]), step sizes
(RoundPlan.step_lrs [R, T]) and solver values (mu, momentum: sent per replica in the server context). A slot that diverges, finishes its rounds, or whose recording raises leaves the batch: its
rows are cut out of every per-replica array, and the others go on as before.
"""

from __future__ import annotations

import inspect

from dataclasses import dataclass

import numpy as np
import torch

from fedharness.contracts import (Aggregator, Online, Algorithm, Coefficients, LocalSolver, LocalWork, ReplicaLayout,
                                  Sampler, Schedule, Selection, ServerOptimizer, UpdateAggregator, WeightStats)


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

    @classmethod
    def solo(cls, algorithm: Algorithm, seed: int, replicas: int, rounds: int, eval_every: int) -> "SlotSet":
        """One run alone: a batch of one slot."""
        return cls([0], [algorithm], np.array([seed]), np.array([replicas]), np.array([rounds]),
                   np.array([eval_every]), {})

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


def _widened(sel: Selection, width: int) -> Selection:
    """The selection padded to `width` columns with weight-0 entries, which nobody trains: the slots' samples differ
    in size where the sampler's does (poisson), and the batch's plan is one [R, K] array."""
    extra = width - sel.clients.shape[1]
    if extra == 0:
        return sel

    def pad(a: np.ndarray, value: float) -> np.ndarray:
        return np.pad(a, ((0, 0), (0, extra)), constant_values=value)

    return Selection(pad(sel.clients, 0), pad(sel.weights, 0.0), pad(sel.lr_scale, 1.0), sel.active)


def _same_part(a, b) -> bool:
    """Whether two parts are of one class with equal attributes (numpy arrays by value, a part held by a part, such
    as the sampler a Dropout wraps, alike); False when that cannot be told (no __dict__, a comparison that is not a
    truth value), so such parts are never shared."""
    try:
        if a is b:
            return True
        if type(a) is not type(b) or vars(a).keys() != vars(b).keys():
            return False
        return all(_same_value(x, y) for x, y in zip(vars(a).values(), vars(b).values()))
    except (TypeError, ValueError, RuntimeError):
        return False


def _same_value(x, y) -> bool:
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return np.array_equal(x, y)
    if isinstance(x, (bool, int, float, str, type(None))):  # before the Sampler check, a Protocol's: slow
        return bool(x == y)
    if isinstance(x, Sampler) and isinstance(y, Sampler):
        return _same_part(x, y)
    return bool(x == y)


def _sharing_groups(slots: SlotSet) -> list[list[int]]:
    """The slots (positions) whose samplers draw alike: equal seed and equal sampler. Their draws are one call:
    a sampler's draw for a replica depends on (seed, replica, round) only (counter-based streams), as a solo run
    of many replicas relies on, so one call over their stacked replica ids gives each the rows its own call does."""
    groups: list[list[int]] = []
    for i, a in enumerate(slots.algorithms):
        for group in groups:
            j = group[0]
            if slots.seeds[j] == slots.seeds[i] and _same_part(slots.algorithms[j].sampler, a.sampler):
                group.append(i)
                break
        else:
            groups.append([i])
    return groups


def _selection_rows(sel: Selection, rows: slice) -> Selection:
    return Selection(sel.clients[rows], sel.weights[rows], sel.lr_scale[rows],
                     None if sel.active is None else sel.active[rows])


def takes_online(sampler: Sampler) -> bool:
    """Whether the sampler's select takes `online` (contracts.Sampler): it can prefer the online clients."""
    return "online" in inspect.signature(sampler.select).parameters


def _online(online: Online | None) -> dict:
    return {} if online is None else {"online": online}


class SlotSampler(Sampler):
    """Each slot's sampler on its rows; slots that draw alike (_sharing_groups) in one call, since a call costs
    about the same for one replica as for a hundred."""

    def __init__(self, slots: SlotSet):
        self.slots = slots
        self.with_replacement = slots.algorithms[0].sampler.with_replacement
        self.groups = _sharing_groups(slots)
        self.takes_online = all(takes_online(a.sampler) for a in slots.algorithms)

    def select(self, seed: int, replicas: np.ndarray, rnd: int, p: np.ndarray,
               online: Online | None = None) -> Selection:
        s = self.slots
        online = online if self.takes_online else None
        if len(self.groups) == 1:  # every slot draws alike (a study's trials): their rows are the one call's
            return s.algorithms[0].sampler.select(int(s.seeds[0]), replicas, rnd, p, **_online(online))
        sels: list[Selection | None] = [None] * len(s.algorithms)
        for group in self.groups:
            first = s.algorithms[group[0]].sampler
            rows = np.concatenate([np.arange(len(replicas))[s.rows(i)] for i in group])
            drawn = first.select(int(s.seeds[group[0]]), replicas[rows], rnd, p,
                                 **_online(None if online is None else online.rows(rows)))
            start = 0
            for i in group:
                sels[i] = _selection_rows(drawn, slice(start, start + int(s.replicas[i])))
                start += int(s.replicas[i])
        width = max(sel.clients.shape[1] for sel in sels)
        sels = [_widened(sel, width) for sel in sels]
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
        self.comm_factor, self.extra_down = trainer.comm_factor, trainer.extra_down
        self.round_gradient, self.grads_per_step = trainer.round_gradient, trainer.grads_per_step
        self.private_dim = trainer.private_dim
        self.runs: list[tuple[LocalSolver, slice]] = []  # alike solvers taking each row's step sizes: one call
        for solver, run in _alike_positions([a.solver for a in slots.algorithms]):
            if solver.rows_of_step_sizes:
                self.runs.append((solver, slice(slots.rows(run.start).start, slots.rows(run[-1]).stop)))
            else:
                self.runs.extend((solver, slots.rows(i)) for i in run)

    def step_lrs(self, base_lrs: np.ndarray) -> np.ndarray:
        """[R, T]: each row's solver on its slot's step sizes (base_lrs [R, T]: equal rows within a slot)."""
        return _cat(solver.step_lrs(base_lrs[rows]) if solver.rows_of_step_sizes
                    else np.repeat(solver.step_lrs(base_lrs[rows.start])[None], rows.stop - rows.start, axis=0)
                    for solver, rows in self.runs)

    def weight_stats(self, tau: np.ndarray, step_lrs: np.ndarray, lr_scale: np.ndarray | None = None) -> WeightStats:
        parts = []
        for solver, rows in self.runs:
            scale = None if lr_scale is None else lr_scale[rows]
            if solver.rows_of_step_sizes:
                parts.append(solver.weight_stats(tau[rows], step_lrs[rows], scale))
                continue
            steps = int(tau[rows].max())  # the solo run's step sizes are as long as its own longest round
            parts.append(solver.weight_stats(tau[rows], step_lrs[rows.start][:steps], scale))
        scale = None if any(p.scale is None for p in parts) else np.concatenate([p.scale for p in parts])
        return WeightStats(_cat(p.l1 for p in parts), _cat(p.l2sq for p in parts), _cat(p.last for p in parts), scale)

    def init_state(self, w0, server_ctx=None, saved=None):
        return self.trainer.init_state(w0, server_ctx, saved)

    def update(self, w, g, lr, state):
        return self.trainer.update(w, g, lr, state)

    def begin(self, w, state):
        self.trainer.begin(w, state)

    def finish(self, w0, w, lr_sum, state, p):
        return self.trainer.finish(w0, w, lr_sum, state, p)

    def init_server_ctx(self, x: torch.Tensor) -> dict:
        per_copy = {name: torch.as_tensor(self.slots.per_row(v), dtype=torch.float64, device=x.device)[:, None]
                    for name, v in self.slots.per_copy.items()}
        return {**self.trainer.init_server_ctx(x), **per_copy}

    def update_server_ctx(self, ctx, extras):
        return self.trainer.update_server_ctx(ctx, extras)


def _alike_positions(parts: list) -> list[tuple[object, range]]:
    """(part, slot positions) of each run of adjacent slots whose parts are alike (_same_part)."""
    runs: list[tuple[object, range]] = []
    for i, part in enumerate(parts):
        if runs and _same_part(runs[-1][0], part):
            runs[-1] = (runs[-1][0], range(runs[-1][1].start, i + 1))
        else:
            runs.append((part, range(i, i + 1)))
    return runs


def _alike_runs(slots: SlotSet, parts: list) -> list[tuple[object, slice]]:
    """(part, rows) of each run of adjacent slots whose parts are alike (_same_part): one call of a row-wise part
    on the run's rows, which are contiguous, gives each slot the rows of its own call, as a solo run's replicas
    rely on."""
    return [(part, slice(slots.rows(run.start).start, slots.rows(run[-1]).stop))
            for part, run in _alike_positions(parts)]


class SlotAggregator(Aggregator):
    """Each slot's aggregator on its rows (coefficients are row-wise); adjacent slots with alike aggregators (every
    slot of a study over step sizes and E) in one call."""

    def __init__(self, slots: SlotSet):
        self.slots = slots
        self.runs = _alike_runs(slots, [a.aggregator for a in slots.algorithms])

    def coefficients(self, q: np.ndarray, stats: WeightStats, tau: np.ndarray) -> Coefficients:
        parts = [aggregator.coefficients(q[rows], _stats_rows(stats, rows), tau[rows]) for aggregator, rows in self.runs]
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
        self.runs = _alike_runs(slots, [a.server for a in slots.algorithms])  # a server step is row-wise
        self.reads_sq_norms = any(server.reads_sq_norms for server, _ in self.runs)

    def init_state(self, x: torch.Tensor) -> dict:
        s = self.slots
        states = [a.server.init_state(x[s.rows(i)]) for i, a in enumerate(s.algorithms)]
        return {name: torch.cat([st[name] for st in states]) for name in states[0]}

    def step(self, x: torch.Tensor, delta: torch.Tensor, state, lr=None, sq_norms=None) -> torch.Tensor:
        """Each run of adjacent alike optimizers (every slot of a study over client step sizes and E) in one call,
        on views of the state, so in-place updates land in it."""
        steps = [server.step(x[rows], delta[rows], {k: v[rows] for k, v in state.items()},
                             None if lr is None else lr[rows],
                             **({"sq_norms": sq_norms[rows]} if server.reads_sq_norms else {}))
                 for server, rows in self.runs]
        return steps[0] if len(steps) == 1 else torch.cat(steps)

    def step_sizes(self, state) -> np.ndarray | None:
        """Each row's adaptive eta_g (NaN in a slot whose optimizer has a constant one); None: none adapts."""
        parts = [server.step_sizes({k: v[rows] for k, v in state.items()}) for server, rows in self.runs]
        if all(p is None for p in parts):
            return None
        return np.concatenate([np.full(rows.stop - rows.start, np.nan) if p is None else p
                               for p, (_, rows) in zip(parts, self.runs)])


def slot_algorithm(slots: SlotSet, trainer: LocalSolver) -> Algorithm:
    first = slots.algorithms[0]
    aggregator = SlotUpdateAggregator if isinstance(first.aggregator, UpdateAggregator) else SlotAggregator
    return Algorithm(first.name, SlotSampler(slots), SlotLocalWork(slots), SlotSchedule(slots),
                     SlotSolver(slots, trainer), aggregator(slots), SlotServer(slots), first.batch_size)
