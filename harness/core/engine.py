"""The round loop: sample, train locally (on an executor), aggregate, step the server, evaluate, tell the hooks.

One loop for every run: a batch of slots (harness/core/slots.py) on the replica axis, a solo run being a batch of
one slot with its own parts. Each slot has its hooks (harness/contracts.py Callback: the sinks, the progress bar,
the checkpointer, the Optuna reporter, a user's callbacks). A slot that diverges, finishes its rounds, is stopped
by a hook or whose hook raises leaves the batch: its rows are cut out of every per-replica array, its hooks are
told its RunOutcome, and the others go on as before. Series (averages, Richardson-Romberg's coupled replicas) and
checkpoints are a solo run's (harness/runs/batch.py check_batch refuses them in a batch of several)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np
import torch

from fedharness.contracts import (Algorithm, Callback, ClientGradients, ClientScores, Coefficients, LocalSolver,
                                  Metric, Problem,
                                  ReplicaLayout, RoundContext, RoundPlan, RunOutcome, RunState, SeriesHook,
                                  Selection, UpdateAggregator, WeightStats, training_clients)
from fedharness.base.interrupts import atomic
from fedharness.errors import require
from fedharness.core.buffers import average_into, buffer_dim, local_buffers
from fedharness.core.clock import SystemsClock, link_seconds, rescaled
from fedharness.core.exact_sum import Grids
from fedharness.core.executors import ShardResult
from fedharness.core.personal import FineTune, Personal
from fedharness.core.flight import EMPTY, Busy, Draw, empty_flight, flight_rows, packed, run_version
from fedharness.core.slots import SlotSet, slot_algorithm, takes_online
from fedharness.core.stages import Stages
from fedharness.core.updates import aggregate_updates


@dataclass(frozen=True)
class NetworkModel:
    """Simulated wall-clock of a round (Yang et al.'s Table 2): every sampled client downloads and uploads the
    model (and any control variates) over its own link, then trains; the round lasts as long as its slowest client.

    sim_s per round = (bytes_down + bytes_up of one client) / bandwidth + max_k tau_k * compute_s_per_step, or
    with an uplink of its own bytes_down / bandwidth + bytes_up / upload. MB means 10^6 bytes.
    """

    bandwidth_MB_per_s: float = 20.0
    compute_s_per_step: float = 0.0
    upload_MB_per_s: float | None = None  # None: one link both ways

    @classmethod
    def of(cls, network) -> "NetworkModel":
        """The model of the run's `network` settings (harness/settings.py's NetworkSettings)."""
        return cls(network.bandwidth_MB_per_s, network.compute_s_per_step, network.upload_MB_per_s)

    def round_seconds(self, down_bytes: float, up_bytes: float, max_tau: np.ndarray) -> np.ndarray:
        transfer = link_seconds(down_bytes, up_bytes, self.bandwidth_MB_per_s, self.upload_MB_per_s)
        return transfer + max_tau * self.compute_s_per_step


def _failed(err: BaseException) -> str:
    return "failed"


def _acts_at_round_end(hook: Callback) -> bool:
    """Whether the hook does something after a round (Callback's own member does nothing): a slot whose hooks do
    not is spared building its RoundContext every round."""
    return type(hook).on_round_end is not Callback.on_round_end


def _round_end(hook: Callback, context: RoundContext) -> bool | None:
    return hook.on_round_end(context)


def _evaluation(hook: Callback, context: RoundContext) -> bool | None:
    return hook.on_evaluation(context)


class Engine:
    """The round loop, over a batch of slots: Engine itself is a run alone (a batch of one slot), BatchedEngine a
    batch of several. `end_status(err)`: the status of a slot that an exception ended."""

    def __init__(self, problem: Problem, algorithm: Algorithm, executor, *, rounds: int, seed: int, replicas: int,
                 eval_every: int, layout: ReplicaLayout | None = None, series: list[SeriesHook] | None = None,
                 hooks: Sequence[Callback] = (), **options):
        """A solo run: one slot with `algorithm`'s own parts, its replica `layout` (Richardson-Romberg couples
        replicas) and `series` (extra recorded iterates: Polyak averages, RR extrapolation). `options`:
        reference, network, clock, metrics, end_status, stages, client_eval, grad_norm."""
        layout = layout or ReplicaLayout.seeds(replicas)
        slots = SlotSet.solo(algorithm, seed, len(layout), rounds, eval_every)
        self._start(problem, slots, algorithm, executor, layout, series or [], [list(hooks)], **options)

    def _start(self, problem: Problem, slots: SlotSet, algorithm: Algorithm, executor, layout: ReplicaLayout,
               series: list[SeriesHook], hooks: list[list[Callback]], *, trainer: LocalSolver | None = None,
               reference=None, network: NetworkModel | None = None, clock: SystemsClock | None = None,
               metrics: Sequence[Metric] = (), end_status: Callable[[BaseException], str] = _failed,
               stages: Stages | None = None, client_eval: np.ndarray | None = None, grad_norm: bool = True,
               personal: Personal | None = None) -> None:
        """`clock` (the systems section, core/clock.py): clients' own speeds and availability, deadlines and
        over-selection on each replica's sim_s; None: every client the `network`'s, always online, no deadline.
        `stages` (the `stages` key): what happens to the updates between training and the server optimizer
        (core/stages.py). `client_eval` (eval.per_client): the clients each evaluation scores on their own
        held-out data (the problem is a contracts.ClientEvaluation); None: none. `personal` (eval.personal): the
        protocols they are scored with (None: global). `grad_norm` (eval.grad_norm): whether evaluations compute
        grad_norm_sq (else null)."""
        self.problem, self.alg, self.executor, self.reference = problem, algorithm, executor, reference
        require(algorithm.solver.round_gradient == "none" or isinstance(problem, ClientGradients), "algorithm.solver",
                algorithm.name, "a problem that gives each client's full-batch gradient (quadratic, the data sets)")
        # an UpdateAggregator is a runtime Protocol: isinstance reads its members, too slow to ask every round
        self.send_updates = isinstance(algorithm.aggregator, UpdateAggregator)
        self.slots, self.trainer = slots, trainer
        self.stages = stages or Stages()
        self.layout, self.stream_replicas, self.series = layout, layout.stream_ids, series
        self.rounds, self.seed = int(slots.rounds.max()), int(slots.seeds[0])
        self.network = network or NetworkModel()
        self.clock = clock
        self.rule = None if clock is None else clock.asynchronous  # fedbuff / fedasync: core/flight.py
        self._sampler_online = clock is not None and not clock.always_online and takes_online(algorithm.sampler)
        self._sim_seconds: np.ndarray | None = None  # the planned round's length [R] on the systems clock
        self._downloads: np.ndarray | None = None  # [R] the clients the model reached (the clock: even if dropped)
        self.metrics, self.end_status = tuple(metrics), end_status  # metrics: a user's extra columns
        self.hooks = dict(zip(slots.ids, hooks))
        self.round_hooks = {i: [h for h in hs if _acts_at_round_end(h)] for i, hs in self.hooks.items()}
        self.bytes_per_param = torch.finfo(problem.dtype).bits // 8
        self._client_bytes = self.client_bytes()
        self._last_lr = np.full(len(layout), np.nan)
        self._last_diag: Coefficients | None = None
        self.rows: dict[int, list[dict]] = {i: [] for i in slots.ids}  # each slot's evaluated rows
        self.outcomes: dict[int, RunOutcome] = {}
        self.client_eval = client_eval
        self.personal = personal or Personal(("global",), 0, None, None)
        self.grad_norm = grad_norm
        self._scores: tuple[np.ndarray, ClientScores] | None = None  # the last evaluation's, with its replica ids
        self._tuned: tuple[np.ndarray, ClientScores] | None = None  # its fine-tuned scores (eval.personal), likewise
        self._own: tuple[np.ndarray, ClientScores] | None = None  # its personal models' scores, likewise
        self.rounds_done = 0  # the last completed round, also when an exception ends the run

    def initial_state(self) -> RunState:
        init_ids = self.layout.init_ids  # coupled replicas (Richardson-Romberg) start from the same point
        x = self.problem.init_params(int(init_ids.max()) + 1, self.seed)[torch.as_tensor(init_ids)]
        return self._state_at_start(x)

    def _state_at_start(self, x: torch.Tensor) -> RunState:
        zeros = {k: np.zeros(len(x), dtype=np.int64)
                 for k in ("local_steps", "grad_evals", "bytes_up", "bytes_down", "participants")}
        zeros["sim_s"] = np.zeros(len(x))  # simulated seconds (NetworkModel), float
        zeros.update(self.stages.init_counters(len(x)))  # the stages' per-replica state (DP's clip norm)
        ctx = self.alg.solver.init_server_ctx(x)
        flight = {} if self.rule is None else empty_flight(len(x), self.rule.concurrency, x.shape[1], x.device)
        return RunState(0, x, self.alg.server.init_state(x), zeros, ctx, [h.init_state(x) for h in self.series],
                        in_flight=flight)

    def row_seeds(self) -> np.ndarray:
        """[R] each replica's seed (a run alone: its seed on every replica)."""
        return np.full(len(self.layout), self.seed)

    def plan_round(self, rnd: int, clock: np.ndarray | None = None) -> tuple[RoundPlan, Coefficients]:
        """Round `rnd`'s plan; `clock` [R]: each replica's sim_s at its start (the systems clock; None: 0)."""
        alg, p = self.alg, self.problem
        online = {}
        if self._sampler_online:  # the sampler prefers the clients online at the round's start
            online["online"] = self.clock.online(self.row_seeds(), self.stream_replicas, self._start_times(clock))
        sel = alg.sampler.select(self.seed, self.stream_replicas, rnd, p.weights, **online)
        tau = alg.local_work.steps(self.seed, self.stream_replicas, rnd, sel.clients, p.sizes, alg.batch_size)
        tau = tau * self.layout.tau_factor[:, None]
        if self.clock is not None:
            sel, tau = self._settle(sel, tau, self._start_times(clock))
        lrs = alg.solver.step_lrs(alg.schedule.step_lrs(rnd, int(tau.max())))
        lr_scale = sel.lr_scale * self.layout.lr_factor[:, None]
        coefs = alg.aggregator.coefficients(sel.weights, alg.solver.weight_stats(tau, lrs, lr_scale), tau)
        if sel.active is not None and not sel.active.all():
            coefs.idle(~sel.active)  # replicas none of whose sampled clients returned (dropout): Delta = 0
        plan = RoundPlan(rnd, self.seed, self.stream_replicas, sel.clients, coefs.coef, tau, lr_scale, lrs,
                         send_updates=self.send_updates)  # else shards reduce in place
        return plan, coefs

    def _start_times(self, clock: np.ndarray | None) -> np.ndarray:
        return np.zeros(len(self.layout)) if clock is None else np.asarray(clock, dtype=np.float64)

    def _settle(self, sel: Selection, tau: np.ndarray, t: np.ndarray) -> tuple[Selection, np.ndarray]:
        """The selection and local steps after the systems clock's round (who is online, in time, first to
        finish); the round's length goes to _sim_seconds."""
        trains = sel.weights != 0
        if sel.active is not None:
            trains &= sel.active[:, None]
        settled = self.clock.settle(self.row_seeds(), self.stream_replicas, t, sel.clients, trains, tau,
                                    *self._client_bytes)
        self._sim_seconds = settled.seconds
        if np.array_equal(settled.returned, trains):  # everyone on time: the selection as it was
            self._downloads = None
            return sel, settled.tau
        same = np.array_equal(settled.reached, settled.returned)  # else some got the model and were then dropped
        self._downloads = None if same else trained_clients(sel.clients, settled.reached.astype(np.float64), tau)[0]
        active = settled.returned.any(axis=1)
        return Selection(sel.clients, rescaled(sel.weights, settled.returned), sel.lr_scale, active), settled.tau

    def client_bytes(self) -> tuple[int, int]:
        return client_bytes(self.problem, self.alg.solver, self.stages)

    def _count(self, state: RunState, plan: RoundPlan) -> None:
        c = state.counters
        distinct, work = trained_clients(plan.clients, plan.coef, plan.tau)
        c["local_steps"] += np.where(distinct > 0, np.where(plan.coef != 0, plan.tau, 0).max(1), 0)
        solver = self.alg.solver
        c["grad_evals"] += work * self.alg.batch_size * solver.grads_per_step
        if solver.round_gradient != "none":  # one pass over each trained client's samples
            c["grad_evals"] += self._full_batch_samples(plan)
        down, up = self._client_bytes
        c["bytes_down"] += distinct * down if self._downloads is None else self._downloads * down
        c["bytes_up"] += distinct * up
        if self.clock is None:
            c["sim_s"] += self.network.round_seconds(down, up, plan.tau.max(1))
        else:
            c["sim_s"] += self._sim_seconds
        c["participants"] = distinct  # the clients that took part in the round just done (not cumulative)

    def _full_batch_samples(self, plan: RoundPlan) -> np.ndarray:
        """[R] the samples of each row's distinct trained clients (a full-batch gradient's sample gradients)."""
        trains = np.where(plan.coef != 0, plan.clients, -1)
        return np.array([int(np.sum(self.problem.sizes[np.unique(row[row >= 0])])) for row in trains], dtype=np.int64)

    def step(self, state: RunState) -> RunState:
        """One server version: a synchronous round, or (systems.mode fedbuff, fedasync) the clients that start from
        it and the arrivals its step aggregates."""
        if self.rule is not None:
            return self._flight_step(state)
        plan, coefs = self.plan_round(state.round, state.counters["sim_s"])
        plan.server_ctx = state.server_ctx
        plan.stages = self.stages.client_work(plan, state.counters)
        plan.sq_norms = self.alg.server.reads_sq_norms
        ahead = {}
        if self.alg.solver.round_gradient == "before":  # an exchange of its own: c, before the local steps (Mime)
            ahead = self.executor.local_updates(state.x, replace(plan, grads_only=True, stages=())).extras
            plan.server_ctx = {**state.server_ctx, **ahead}
        result = self.executor.local_updates(state.x, plan)
        if plan.send_updates:
            chunks = self.stages.on_updates(plan, result.updates)
            delta = aggregate_updates(self.alg.aggregator, plan, chunks, state.x, self.problem.memory_budget)
        else:
            delta = result.delta
        delta = self.stages.on_aggregate(plan, delta, result.counts, state.counters)
        extras = {**ahead, **result.extras}
        if extras:
            state.server_ctx = self.alg.solver.update_server_ctx(state.server_ctx, extras)
        self._count(state, plan)
        sq_norms = {"sq_norms": result.weighted_sq_norms()} if plan.sq_norms else {}
        return self._advance(state, delta, plan.step_lrs[..., 0], coefs, **sq_norms)

    def _advance(self, state: RunState, delta: torch.Tensor, first: np.ndarray, coefs: Coefficients,
                 **sq_norms: np.ndarray) -> RunState:
        """The server's step with the aggregated `delta` to the next version; `first`: the version's first client
        step size ([] or, in a batch of slots, [R]); `sq_norms`: what a server that reads_sq_norms takes."""
        x = self.alg.server.step(state.x, delta, state.server_state, first * self.layout.lr_factor, **sq_norms)
        if buffer_dim(self.problem):  # running statistics: the aggregated average, no server optimizer step
            x = average_into(x, state.x, delta, buffer_dim(self.problem))
        for hook, hs in zip(self.series, state.series_state):
            hook.observe(hs, x, state.round + 1, self.rounds)
        self._last_lr = first * self.layout.lr_factor
        self._last_diag = coefs
        state.x, state.round = x, state.round + 1
        return state

    # --- asynchronous aggregation (core/flight.py) ---------------------------------------------------------------

    def plan_seed(self) -> int | np.ndarray:
        """The seed a plan carries: the run's (a batch of slots: each replica's)."""
        return self.seed

    def _flight_step(self, state: RunState) -> RunState:
        """Version v's events (core/flight.py run_version: refills and arrivals on each replica's clock), then its
        starters trained as one batch and the server's step with what it took."""
        f, v = state.in_flight, state.round
        seeds, replicas = self.row_seeds(), self.stream_replicas

        def online(t: np.ndarray, flying: np.ndarray) -> Busy:
            return Busy(self.clock.availability, seeds, replicas, t, flying)

        version = run_version(f, v, state.counters["sim_s"], self.rule, online, self._refill_select,
                              self._refill_prepare(v), self.clock.retry_s)
        cols, valid = packed(version.taken)
        held = self._held(f, cols, valid)  # before the starters' updates fill the slots their arrivals freed
        first, starts, work = self._train_starters(state, version.started, cols, valid, held)
        coefs, delta = self._flight_delta(state, cols, valid, held)
        c = state.counters
        down, up = self._client_bytes
        c["local_steps"] += np.where(valid, cols["tau"], 0).max(axis=1)
        c["grad_evals"] += work * self.alg.batch_size
        c["bytes_down"] += starts * down
        c["bytes_up"] += version.arrived * up  # a stale update was sent, then dropped
        c["sim_s"] = version.t
        c["participants"] = valid.sum(axis=1)
        return self._advance(state, delta, first, coefs)

    def _refill_select(self, key: int, busy: Busy) -> Selection:
        """A refill's candidates: the sampler keyed by the refill's key, preferring who may start."""
        return self.alg.sampler.select(self.seed, self.stream_replicas, key, self.problem.weights, online=busy)

    def _refill_prepare(self, v: int) -> Callable[[int, np.ndarray, np.ndarray, np.ndarray], Draw]:
        """The Draw of the clients a refill starts from version v: their local work keyed by the refill's key, v's
        step sizes, each one's time from start to arrival on its own profile."""
        alg, p = self.alg, self.problem

        def prepare(key: int, clients: np.ndarray, weights: np.ndarray, lr_scale: np.ndarray) -> Draw:
            tau = alg.local_work.steps(self.seed, self.stream_replicas, key, clients, p.sizes, alg.batch_size)
            tau = tau * self.layout.tau_factor[:, None]
            lrs = alg.solver.step_lrs(alg.schedule.step_lrs(v, int(tau.max())))
            lr_scale = lr_scale * self.layout.lr_factor[:, None]
            finish = self.clock.finish_s(self.row_seeds(), self.stream_replicas, clients, tau, *self._client_bytes)
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

    def _train_starters(self, state: RunState, started: list[list[tuple]], cols: dict[str, np.ndarray],
                        valid: np.ndarray, held: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Train the clients that started from v as one batch; a taken one's update goes to `held`, the others'
        to their slots (FedBuff's Delta_k, FedAsync's model x_v + Delta_k: it mixes models). (The version's first
        step size, starters [R], their local steps [R].)"""
        alg, v = self.alg, state.round
        width = max(1, max(len(s) for s in started))
        clients, on = np.zeros((len(started), width), dtype=np.int64), np.zeros((len(started), width), dtype=bool)
        tau, lr_scale = np.ones(clients.shape, dtype=np.int64), np.ones(clients.shape)
        for r, s in enumerate(started):
            if s:
                clients[r, :len(s)], tau[r, :len(s)], lr_scale[r, :len(s)] = zip(*s)
                on[r, :len(s)] = True
        lrs = alg.solver.step_lrs(alg.schedule.step_lrs(v, int(tau.max())))
        if on.any():
            plan = RoundPlan(v, self.plan_seed(), self.stream_replicas, clients, on.astype(np.float64), tau,
                             lr_scale, lrs, server_ctx=state.server_ctx, send_updates=True)
            plan.stages = self.stages.client_work(plan, state.counters)  # compression: in the shards, per client
            self._hold(state, plan, cols, valid, held)
        return lrs[..., 0], on.sum(axis=1), np.where(on, tau, 0).sum(axis=1)

    def _hold(self, state: RunState, plan: RoundPlan, cols: dict[str, np.ndarray], valid: np.ndarray,
              held: torch.Tensor) -> None:
        f, v = state.in_flight, state.round
        rs, js = np.nonzero((f["client"] != EMPTY) & (f["version"] == v))  # still in flight
        dest = {(r, k): (True, j) for r, j, k in zip(rs.tolist(), js.tolist(), f["client"][rs, js].tolist())}
        rs, ws = np.nonzero(valid & (cols["slot"] < 0))  # arrived and taken within the version
        dest.update({(r, k): (False, w) for r, w, k in zip(rs.tolist(), ws.tolist(), cols["client"][rs, ws].tolist())})
        for chunk in self.executor.local_updates(state.x, plan).updates:
            # np.array copies: a Ray shard's reply is read-only memory, which torch will not wrap
            rows = torch.as_tensor(np.array(chunk.replica, dtype=np.int64), device=state.x.device)
            to = [dest[(int(r), int(k))] for r, k in zip(chunk.replica, chunk.clients)]
            in_slot = torch.as_tensor([s for s, _ in to], dtype=torch.bool, device=state.x.device)
            at = torch.as_tensor([i for _, i in to], dtype=torch.long, device=state.x.device)
            update = chunk.delta.to(device=state.x.device, dtype=torch.float64)
            if self.rule.mode == "fedasync":
                update = update + state.x[rows].double()
            f["update"][rows[in_slot], at[in_slot]] = update[in_slot]
            held[rows[~in_slot], at[~in_slot]] = update[~in_slot]

    def _flight_delta(self, state: RunState, cols: dict[str, np.ndarray], valid: np.ndarray,
                      held: torch.Tensor) -> tuple[Coefficients, torch.Tensor]:
        """The step's coefficients and Delta [R, dim] float64 from the taken updates, each weighted by s(tau).
        FedBuff: the aggregator's coefficients of q_k (C / M) s(tau_k), summed exactly as a round's shards sum
        (core/exact_sum.py), so C = M = K is a synchronous round's bits (s(0) = C / M = 1). FedAsync: _mixed."""
        rule, x = self.rule, state.x
        s = np.where(valid, rule.weight(state.round - cols["version"]), 0.0)
        rs, ws = np.nonzero(valid)
        replica = torch.as_tensor(rs, device=x.device)
        taken = held[replica, torch.as_tensor(ws, device=x.device)]  # [n, dim]
        if rule.mode == "fedasync":
            return self._mixed(x, rule.alpha * s, valid, replica, taken)
        stats = WeightStats(*(np.where(valid, cols[name], 1.0) for name in ("l1", "l2sq", "last", "scale")))
        q = np.where(valid, cols["weight"], 0.0)
        coefs = self.alg.aggregator.coefficients(q * (rule.concurrency / rule.buffer) * s, stats,
                                                 np.where(valid, cols["tau"], 1))
        if not valid.all():
            coefs.idle(~valid.any(axis=1))
        total = ShardResult(tuple(x.shape), x.device, grids=Grids(x, {}, rule.buffer))
        if len(replica):
            weight = torch.as_tensor(coefs.coef[valid], dtype=torch.float64, device=x.device)[:, None]
            total.add_rows("delta", replica, taken * weight)
        return coefs, total.delta

    @staticmethod
    def _mixed(x: torch.Tensor, a: np.ndarray, valid: np.ndarray, replica: torch.Tensor,
               models: torch.Tensor) -> tuple[Coefficients, torch.Tensor]:
        """FedAsync's Delta = a (x_k - x) of each replica's one arrival x_k, so the server's sgd step (server_lr 1)
        gives x <- (1 - a) x + a x_k; a = alpha s(tau) [R, 1] (0 on a replica nothing arrived to)."""
        nan = np.full(len(a), np.nan)
        weight = torch.as_tensor(a[valid], dtype=torch.float64, device=x.device)[:, None]
        delta = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
        return (Coefficients(a, nan, nan.copy(), nan.copy()),
                delta.index_add_(0, replica, weight * (models - x[replica].double())))

    def evaluate(self, state: RunState) -> list[dict]:
        rows = self._evaluate_series(state, state.x, "iterate", np.arange(len(self.layout)))
        for hook, hs in zip(self.series, state.series_state):
            for name, (x, replica_ids) in hook.series(hs).items():
                rows.extend(self._evaluate_series(state, x, name, replica_ids))
        return rows

    def _client_scores(self, x: torch.Tensor, replica_ids: np.ndarray) -> ClientScores:
        """The iterate's per-client scores (eval.per_client); FedBN's clients (model.buffers=local) scored in the
        shards that keep their own buffers, as they ended their last round (a client that has not trained yet: the
        server's)."""
        if local_buffers(self.problem):
            scores = self.executor.client_scores(x, np.asarray(replica_ids), self.client_eval)
        else:
            scores = self.problem.client_scores(x, self.client_eval)
        self._scores = (np.asarray(replica_ids), scores)
        return scores

    def _client_columns(self, scores: ClientScores, i: int, protocol: str) -> dict[str, float | None]:
        """Row i's columns of a protocol's scores: the training clients' (client_*) and, with
        dataset.unseen_clients, the unseen ones' (unseen_client_*) apart."""
        training = training_clients(self.problem)
        if training == self.problem.num_clients:
            return scores.columns(i, protocol)
        return {**scores.part(training, False).columns(i, protocol),
                **scores.part(training, True).columns(i, protocol, unseen=True)}

    def _finetune_scores(self, rnd: int, x: torch.Tensor, replica_ids: np.ndarray,
                         protocol: str = "finetune") -> tuple[dict[int, int], ClientScores] | None:
        """eval.personal's finetune (or personal) at this evaluation (core/personal.py), of the rows due (each
        slot's last round, and multiples of finetune_every): {position in replica_ids: row of the scores}, the
        scores; None: none due."""
        spec = self.personal
        due = np.flatnonzero(spec.finetune_due(rnd, self.slots.per_row(self.slots.rounds)[replica_ids], protocol))
        if not len(due):
            return None
        ids = replica_ids[due]
        lrs = self.slots.per_row([a.schedule.client_lr if spec.lr is None else spec.lr
                                  for a in self.slots.algorithms])
        plan = FineTune(spec.steps, lrs[ids], rnd, self.row_seeds()[ids], self.stream_replicas[ids],
                        self.client_eval, protocol)
        scores = self.executor.client_scores(x[torch.as_tensor(due, device=x.device)], ids, self.client_eval, plan)
        if protocol == "finetune":
            self._tuned = (ids, scores)
        else:
            self._own = (ids, scores)
        return {int(i): j for j, i in enumerate(due)}, scores

    def _evaluate_series(self, state: RunState, x: torch.Tensor, series: str, replica_ids: np.ndarray) -> list[dict]:
        ev = self.problem.evaluate(x) if self.grad_norm else self.problem.evaluate(x, grad_norm=False)
        ev.extra.update({m.name: m.values(self.problem, x) for m in self.metrics})
        scores = tuned = own = None
        if series == "iterate" and self.client_eval is not None:
            if "global" in self.personal.protocols:
                scores = self._client_scores(x, replica_ids)
            tuned = self._finetune_scores(state.round, x, np.asarray(replica_ids))
            own = self._finetune_scores(state.round, x, np.asarray(replica_ids), "personal")
        subopt = dist = None
        if self.reference is not None:  # exact F where train_loss is an estimate yet F has a closed form
            subopt = (ev.train_loss if ev.exact_train_loss is None else ev.exact_train_loss) - self.reference.f_star
            w_star = torch.as_tensor(self.reference.w_star, dtype=torch.float64, device=x.device)
            dist = (x.double() - w_star).norm(dim=-1).cpu().numpy()
        staged = {"epsilon": None, **self.stages.row_values(state.round)}
        src = np.minimum(np.asarray(replica_ids, dtype=np.int64), len(self.layout) - 1)
        # each column once as plain Python values (tolist: int64 -> int, float64 -> float, as .item() and float()
        # give), then one dict per replica: a run of many replicas evaluated often builds many rows
        n, server_lr = len(src), self.alg.server.server_lr
        step_sizes = self.alg.server.step_sizes(state.server_state)  # per replica where eta_g adapts (FedExP)
        server_lrs = [server_lr] * n if step_sizes is None else _column(step_sizes[src], n)
        train_loss, grad_norm_sq = _column(ev.train_loss, n), _column(ev.grad_norm_sq, n)
        lr = [None if math.isnan(v) else v for v in self._last_lr[src].tolist()]
        columns = {k: v[src].tolist() for k, v in state.counters.items()}
        for name, values in (("train_loss_se", ev.train_loss_se), ("subopt", subopt), ("dist_to_opt", dist),
                             ("test_loss", ev.test_loss), ("test_acc", ev.test_acc), *ev.extra.items()):
            columns[name] = [None if v is None else float(v) for v in _column(values, n)]
        if self._last_diag is not None:
            diag = self._last_diag
            columns.update({name: np.asarray(values, dtype=np.float64)[src].tolist() for name, values in
                            (("tau_eff", diag.tau_eff), ("chi2", diag.chi2), ("slowdown", diag.slowdown))})
        rows = []
        for i, r in enumerate(replica_ids):
            row = {"replica": int(r), "series": series, "round": state.round, "wall_s": state.wall_s,
                   "train_loss": train_loss[i], "grad_norm_sq": grad_norm_sq[i], "server_lr": server_lrs[i],
                   "lr": lr[i], **staged}
            row.update({name: values[i] for name, values in columns.items()})
            if scores is not None:
                row.update(self._client_columns(scores, i, "global"))
            if tuned is not None and i in tuned[0]:
                row.update(self._client_columns(tuned[1], tuned[0][i], "finetune"))
            if own is not None and i in own[0]:
                row.update(self._client_columns(own[1], own[0][i], "personal"))
            rows.append({k: _finite_or_none(v) for k, v in row.items()})
        return rows


    def evaluate_replicas(self, state: RunState, replicas: np.ndarray) -> list[dict]:
        """evaluate's rows of these replicas (a run alone: all of them)."""
        return self.evaluate(state)

    def run(self, state: RunState | None = None) -> RunOutcome:
        """Train until every slot has ended, each one's RunOutcome told to its hooks (on_end). Returns the first
        slot's (a solo run's); `outcomes` holds every slot's."""
        state = state or self.initial_state()
        self.rounds_done = state.round
        start = time.perf_counter() - state.wall_s
        if state.round == 0:
            self._leave(state, self._evaluated(state, list(range(len(self.slots.ids))), set()))
        while self.slots.ids:
            state = self.step(state)
            state.wall_s = time.perf_counter() - start
            self._leave(state, self._round_ends(state))
            self.rounds_done = state.round
        return self.outcomes[0]

    def _round_ends(self, state: RunState) -> dict[int, RunOutcome]:
        """Tell the hooks the round ended, evaluate the slots due; which slots end and how (by position)."""
        s, rnd = self.slots, state.round
        finite = self._finite(state.x)
        ends: dict[int, RunOutcome] = {}
        due, stops = [], set()
        for i in range(len(s.ids)):
            if not finite[i]:
                ends[i] = self._outcome(state, i, "diverged", rnd - 1)
                continue
            stop, err = self._tell(state, i, _round_end, [], self.round_hooks)
            if err is not None:
                ends[i] = self._outcome(state, i, self.end_status(err), rnd - 1, err)
            elif stop or rnd % s.eval_every[i] == 0 or rnd == s.rounds[i]:
                due.append(i)  # a stopping round is evaluated, so the run ends recorded
                if stop:
                    stops.add(i)
        ends.update(self._evaluated(state, due, stops))
        return ends

    def _finite(self, x: torch.Tensor) -> list[bool]:
        """Whether each slot's models are all finite."""
        return [bool(torch.isfinite(x).all())]

    def _evaluated(self, state: RunState, due: list[int], stops: set[int]) -> dict[int, RunOutcome]:
        """Evaluate the due slots in one pass and hand each its rows; which of them end and how."""
        if not due:
            return {}
        self._scores = self._tuned = self._own = None
        rows = self.evaluate_replicas(state, self.slots.kept_rows(due))
        with atomic():  # a signal waits until every hook has the rows: the round done is the round recorded
            return self._hand_rows(state, due, stops, rows)

    def _hand_rows(self, state: RunState, due: list[int], stops: set[int], rows: list[dict]) -> dict[int, RunOutcome]:
        """The round is done: each due slot's hooks get its rows; which slots end and how."""
        s, rnd = self.slots, state.round
        self.rounds_done = rnd
        ends = {}
        for i in due:
            mine = self.slot_rows(rows, i)
            self.rows[s.ids[i]].extend(mine)
            stop, err = self._tell(state, i, _evaluation, mine, self.hooks, *(self.slot_scores(i, protocol)
                                   for protocol in ("global", "finetune", "personal")))
            if err is not None:  # a hook's failure or an Optuna prune ends this slot only
                ends[i] = self._outcome(state, i, self.end_status(err), rnd, err)
            elif rnd > 0 and any(r["train_loss"] is None for r in mine if r["series"] == "iterate"):
                ends[i] = self._outcome(state, i, "diverged", rnd - 1)  # finite weights, overflowing loss; rows kept
            elif stop or i in stops:
                ends[i] = self._outcome(state, i, "stopped", rnd)
            elif rnd == s.rounds[i]:
                ends[i] = self._outcome(state, i, "ok", rnd)
        return ends

    def _tell(self, state: RunState, i: int, event: Callable[[Callback, RoundContext], bool | None],
              rows: list[dict], hooks: dict[int, list[Callback]],
              clients: ClientScores | None = None, tuned: ClientScores | None = None,
              own: ClientScores | None = None) -> tuple[bool, Exception | None]:
        """Call `event` on slot i's hooks (every one, also after one asked to stop): whether one asked to stop,
        or the exception that ends the slot."""
        listeners = hooks[self.slots.ids[i]]
        if not listeners:
            return False, None
        mine = self.slot_state(state, i)  # the slot's models only, replicas numbered as in its solo run
        context = RoundContext(state.round, int(self.slots.rounds[i]), mine.x, rows, mine, clients, tuned, own)
        try:
            return any([bool(event(hook, context)) for hook in listeners]), None
        except Exception as err:
            return False, err

    def _outcome(self, state: RunState, i: int, status: str, rounds_done: int,
                 error: BaseException | None = None) -> RunOutcome:
        slot = self.slots.ids[i]
        return RunOutcome(status, rounds_done, self.rows[slot], self.slot_state(state, i), error)

    def slot_rows(self, rows: list[dict], i: int) -> list[dict]:
        """Slot i's rows (a run alone: all)."""
        return rows

    def slot_state(self, state: RunState, i: int) -> RunState:
        """Slot i's state (a run alone: the whole)."""
        return state

    def held_scores(self, protocol: str) -> tuple[np.ndarray, ClientScores] | None:
        """This evaluation's per-client scores under `protocol` (global, finetune, personal), with their replica
        ids; None where it did not score them."""
        return {"global": self._scores, "finetune": self._tuned, "personal": self._own}[protocol]

    def slot_scores(self, i: int, protocol: str = "global") -> ClientScores | None:
        """Slot i's per-client scores of this evaluation (a run alone: all; None: eval.per_client is off) under
        `protocol` (None: not scored so at this evaluation)."""
        held = self.held_scores(protocol)
        return None if held is None else held[1]

    def _end(self, slot: int, outcome: RunOutcome) -> None:
        self.outcomes[slot] = outcome
        for hook in self.hooks[slot]:
            hook.on_end(outcome)

    def abort(self, err: BaseException) -> None:
        """End every slot still in the batch: an exception (or a signal) stopped the loop after rounds_done."""
        for slot in self.slots.ids:
            if slot not in self.outcomes:
                self._end(slot, RunOutcome(self.end_status(err), self.rounds_done, self.rows[slot], None, err))

    def _leave(self, state: RunState, ends: dict[int, RunOutcome]) -> None:
        """Tell each ended slot's hooks its outcome; the others go on."""
        if not ends:
            return
        for i, outcome in ends.items():
            self._end(self.slots.ids[i], outcome)
        self._keep(state, [i for i in range(len(self.slots.ids)) if i not in ends])

    def _keep(self, state: RunState, kept: list[int]) -> None:
        self.slots = self.slots.keep(kept)


class BatchedEngine(Engine):
    """The engine's loop over several slots: each slot's own parts plan its rows (harness/core/slots.py), the
    executor trains them all with `trainer` (the slots' solver at each per-copy key's largest value). A slot that
    leaves has its rows cut out of every per-replica array. `hooks[i]`: slot i's."""

    def __init__(self, problem: Problem, slots: SlotSet, trainer: LocalSolver, executor, *,
                 hooks: Sequence[Sequence[Callback]], **options):
        self._start(problem, slots, slot_algorithm(slots, trainer), executor, slots.layout(), [],
                    [list(h) for h in hooks], trainer=trainer, **options)

    def initial_state(self) -> RunState:
        s = self.slots
        return self._state_at_start(torch.cat([self.problem.init_params(int(r), int(seed))
                                               for r, seed in zip(s.replicas, s.seeds)]))

    def row_seeds(self) -> np.ndarray:
        return self.slots.per_row(self.slots.seeds)

    def plan_round(self, rnd: int, clock: np.ndarray | None = None) -> tuple[RoundPlan, Coefficients]:
        plan, coefs = super().plan_round(rnd, clock)
        plan.seed = self.plan_seed()
        return plan, coefs

    def plan_seed(self) -> np.ndarray:
        return self.slots.per_row(self.slots.seeds)  # each replica's own streams

    def evaluate_replicas(self, state: RunState, replicas: np.ndarray) -> list[dict]:
        """evaluate's rows of these replicas only (those of the slots due this round), with one problem.evaluate
        over their stacked models: slots with different eval_every seldom fall due together, and a replica's
        evaluation does not depend on the others' rows."""
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

    def _finite(self, x: torch.Tensor) -> list[bool]:
        finite = torch.isfinite(x).all(dim=1).cpu().numpy()
        starts = [self.slots.rows(i).start for i in range(len(self.slots.ids))]  # every slot has a replica
        return np.logical_and.reduceat(finite, starts).tolist()

    def slot_rows(self, rows: list[dict], i: int) -> list[dict]:
        """Slot i's rows of the batch's, its replicas renumbered from 0 and its own server lr."""
        rng, server_lr = self.slots.rows(i), self.slots.algorithms[i].server.server_lr
        own = {} if server_lr is None else {"server_lr": server_lr}  # None: the row's own (an adaptive eta_g)
        return [{**r, "replica": r["replica"] - rng.start, **own} for r in rows if rng.start <= r["replica"] < rng.stop]

    def slot_scores(self, i: int, protocol: str = "global") -> ClientScores | None:
        """Slot i's replica rows of this evaluation's per-client scores under `protocol`, in its replicas' order;
        None where it has none."""
        held = self.held_scores(protocol)
        if held is None:
            return None
        replica_ids, scores = held
        rng = self.slots.rows(i)
        mine = np.flatnonzero((replica_ids >= rng.start) & (replica_ids < rng.stop))
        return scores.rows(mine) if len(mine) else None

    def slot_state(self, state: RunState, i: int) -> RunState:
        rows = self.slots.rows(i)
        return RunState(state.round, state.x[rows], {k: v[rows] for k, v in state.server_state.items()},
                        {k: v[rows] for k, v in state.counters.items()}, wall_s=state.wall_s)

    def _keep(self, state: RunState, kept: list[int]) -> None:
        rows = self.slots.kept_rows(kept) if kept else None
        super()._keep(state, kept)
        if kept:
            self._keep_rows(state, rows)

    def _keep_rows(self, state: RunState, rows: np.ndarray) -> None:
        """The remaining slots' rows of every per-replica array (state, plan parts, executor's client state)."""
        index = torch.as_tensor(rows, device=state.x.device)
        self.alg = slot_algorithm(self.slots, self.trainer)
        self.send_updates = isinstance(self.alg.aggregator, UpdateAggregator)
        self.layout = self.slots.layout()
        self.stream_replicas = self.layout.stream_ids
        state.x = state.x[index]
        state.server_state = {k: v[index] for k, v in state.server_state.items()}
        state.server_ctx = {k: v[index] for k, v in state.server_ctx.items()}
        state.counters = {k: v[rows] for k, v in state.counters.items()}
        if state.in_flight:
            state.in_flight = flight_rows(state.in_flight, rows)
        self._last_lr = self._last_lr[rows]
        if self._last_diag is not None:
            d = self._last_diag
            self._last_diag = replace(d, coef=d.coef[rows], tau_eff=d.tau_eff[rows], chi2=d.chi2[rows],
                                      slowdown=d.slowdown[rows])
        self.executor.keep_replicas(rows)  # the slots (SCAFFOLD's c_i, FedBN's buffers) follow their replica



def client_bytes(problem: Problem, solver: LocalSolver, stages: Stages) -> tuple[int, int]:
    """(bytes down, bytes up) of one sampled client a round: the model (and a solver's control variates,
    comm_factor, and extra_down's) down; the update as its stages encode it (a compressor's size) and the rest
    dense, up."""
    bytes_per_param = torch.finfo(problem.dtype).bits // 8
    shared = problem.dim - solver.private_dim  # FedRep's and FedBABU's heads stay on the clients
    dense = shared * bytes_per_param
    extra = dense * (solver.comm_factor - 1)
    return dense + extra + dense * solver.extra_down, stages.upload_bytes(shared, bytes_per_param) + extra


def trained_clients(clients: np.ndarray, coef: np.ndarray, tau: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of a round's plan [R, K]: how many distinct clients train and the sum of their local steps. A client
    drawn twice trains once, with its first draw's tau; coefficient-0 entries (dropped out) do not train. One sort
    of every row at once (stable, so a client's first draw leads its equal keys), not np.unique row by row."""
    key = np.where(coef != 0, clients, -1)  # client ids are >= 0: -1 marks an entry that does not train
    order = np.argsort(key, axis=1, kind="stable")
    sorted_key = np.take_along_axis(key, order, axis=1)
    first = np.ones(key.shape, dtype=bool)
    first[:, 1:] = sorted_key[:, 1:] != sorted_key[:, :-1]
    first &= sorted_key >= 0
    return first.sum(axis=1), (np.take_along_axis(tau, order, axis=1) * first).sum(axis=1)


def _finite_or_none(v):
    """Metrics are stored as plain floats; NaN/inf mean 'not a number we can record'."""
    if isinstance(v, (float, np.floating)):
        return float(v) if math.isfinite(v) else None
    return v


def _column(values, n: int) -> list:
    """A per-replica column as a list of n Python values (None: n Nones): a numpy array's own tolist, anything
    else (a torch tensor, a list: a user's metric) element by element."""
    if values is None:
        return [None] * n
    if isinstance(values, np.ndarray):
        return values.tolist()
    return [v.item() if isinstance(v, (np.generic, torch.Tensor)) else v for v in values]
