"""The round loop: sample, train locally (on an executor), aggregate, step the server, evaluate, record."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from fedharness.contracts import (Algorithm, Callback, Coefficients, Metric, Problem, ReplicaLayout, RoundContext,
                                  SeriesHook, ServerContext, ServerState, UpdateAggregator)
from fedharness.core.buffers import average_into, buffer_dim
from fedharness.core.executors import RoundPlan
from fedharness.core.updates import aggregate_updates


@dataclass(frozen=True)
class NetworkModel:
    """Simulated wall-clock of a round (Yang et al.'s Table 2): every sampled client downloads and uploads the
    model (and any control variates) over its own link, then trains; the round lasts as long as its slowest client.

    sim_s per round = (bytes_down + bytes_up of one client) / bandwidth + max_k tau_k * compute_s_per_step.
    MB means 10^6 bytes.
    """

    bandwidth_MB_per_s: float = 20.0
    compute_s_per_step: float = 0.0

    @classmethod
    def of(cls, network) -> "NetworkModel":
        """The model of the run's `network` settings (harness/settings.py's NetworkSettings)."""
        return cls(network.bandwidth_MB_per_s, network.compute_s_per_step)

    def round_seconds(self, bytes_per_client: float, max_tau: np.ndarray) -> np.ndarray:
        return bytes_per_client / (self.bandwidth_MB_per_s * 1e6) + max_tau * self.compute_s_per_step


@dataclass
class RunState:
    """Everything needed to continue a run: server model and state, counters (streams are keyed by round)."""

    round: int
    x: torch.Tensor
    server_state: ServerState  # the server optimizer's (harness/contracts.py: MomentumState, AdamState, ...)
    counters: dict[str, np.ndarray]
    server_ctx: ServerContext = field(default_factory=dict)  # the solver's server side (SCAFFOLD's c)
    series_state: list = field(default_factory=list)  # one AverageState per series hook
    wall_s: float = 0.0


@dataclass
class RunOutcome:
    status: str
    rounds_done: int
    rows: list[dict] = field(default_factory=list)
    state: RunState | None = None


class Engine:
    def __init__(self, problem: Problem, algorithm: Algorithm, executor, *, rounds: int, seed: int, replicas: int,
                 eval_every: int, reference=None, on_rows=None, progress=None, layout: ReplicaLayout | None = None,
                 series: list[SeriesHook] | None = None, network: NetworkModel | None = None, checkpoint=None,
                 checkpoint_every: int = 0, metrics: Sequence[Metric] = (), callbacks: Sequence[Callback] = ()):
        self.problem, self.alg, self.executor = problem, algorithm, executor
        self.checkpoint, self.checkpoint_every = checkpoint, checkpoint_every  # checkpoint(state) after such rounds
        self.network = network or NetworkModel()
        self.rounds, self.seed, self.eval_every = rounds, seed, eval_every
        self.layout = layout or ReplicaLayout.seeds(replicas)
        self.stream_replicas = self.layout.stream_ids
        replicas = len(self.layout)
        self.series = series or []  # extra recorded iterates, e.g. Polyak averages, RR extrapolation
        self.reference = reference
        self.metrics, self.callbacks = tuple(metrics), tuple(callbacks)  # a user's extra columns; hooks
        self.on_rows = on_rows or (lambda rows, state: None)
        self.progress = progress
        self.bytes_per_param = torch.finfo(problem.dtype).bits // 8
        self._last_lr = np.full(replicas, np.nan)
        self._last_diag: Coefficients | None = None
        self.rounds_done = 0  # the last completed round, also when an exception ends the run

    def initial_state(self) -> RunState:
        init_ids = self.layout.init_ids  # coupled replicas (Richardson-Romberg) start from the same point
        x = self.problem.init_params(int(init_ids.max()) + 1, self.seed)[torch.as_tensor(init_ids)]
        zeros = {k: np.zeros(len(self.stream_replicas), dtype=np.int64)
                 for k in ("local_steps", "grad_evals", "bytes_up", "bytes_down")}
        zeros["sim_s"] = np.zeros(len(self.stream_replicas))  # simulated seconds (NetworkModel), float
        ctx = self.alg.solver.init_server_ctx(x)
        return RunState(0, x, self.alg.server.init_state(x), zeros, ctx, [h.init_state(x) for h in self.series])

    def plan_round(self, rnd: int) -> tuple[RoundPlan, Coefficients]:
        alg, p = self.alg, self.problem
        sel = alg.sampler.select(self.seed, self.stream_replicas, rnd, p.weights)
        tau = alg.local_work.steps(self.seed, self.stream_replicas, rnd, sel.clients, p.sizes, alg.batch_size)
        tau = tau * self.layout.tau_factor[:, None]
        lrs = alg.solver.step_lrs(alg.schedule.step_lrs(rnd, int(tau.max())))
        lr_scale = sel.lr_scale * self.layout.lr_factor[:, None]
        coefs = alg.aggregator.coefficients(sel.weights, alg.solver.weight_stats(tau, lrs, lr_scale), tau)
        if sel.active is not None and not sel.active.all():
            coefs.idle(~sel.active)  # replicas none of whose sampled clients returned (dropout): Delta = 0
        plan = RoundPlan(rnd, self.seed, self.stream_replicas, sel.clients, coefs.coef, tau, lr_scale, lrs,
                         send_updates=isinstance(alg.aggregator, UpdateAggregator))  # else shards reduce in place
        return plan, coefs

    def _count(self, state: RunState, plan: RoundPlan) -> None:
        c = state.counters
        # a client drawn twice trains once; coefficient-0 entries (dropped out) do not train
        trained = [np.unique(row[cf != 0], return_index=True) for row, cf in zip(plan.clients, plan.coef)]
        distinct = np.array([len(ids) for ids, _ in trained])
        work = np.array([tau[cf != 0][first].sum() for (_, first), tau, cf in zip(trained, plan.tau, plan.coef)])
        c["local_steps"] += np.where(distinct > 0, plan.tau.max(1), 0)
        c["grad_evals"] += work * self.alg.batch_size
        model_bytes = self.problem.dim * self.bytes_per_param * self.alg.solver.comm_factor
        c["bytes_down"] += distinct * model_bytes
        c["bytes_up"] += distinct * model_bytes
        c["sim_s"] += self.network.round_seconds(2 * model_bytes, plan.tau.max(1))

    def step(self, state: RunState) -> RunState:
        plan, coefs = self.plan_round(state.round)
        plan.server_ctx = state.server_ctx
        result = self.executor.local_updates(state.x, plan)
        if plan.send_updates:
            delta = aggregate_updates(self.alg.aggregator, plan, result.updates, state.x,
                                      self.problem.memory_budget)
        else:
            delta = result.delta
        first = plan.step_lrs[..., 0]  # the round's first step size: [] or, in a batch of slots, [R]
        x = self.alg.server.step(state.x, delta, state.server_state, first * self.layout.lr_factor)
        if buffer_dim(self.problem):  # running statistics: the aggregated average, no server optimizer step
            x = average_into(x, state.x, delta, buffer_dim(self.problem))
        extras = result.extras
        if extras:
            state.server_ctx = self.alg.solver.update_server_ctx(state.server_ctx, extras)
        for hook, hs in zip(self.series, state.series_state):
            hook.observe(hs, x, state.round + 1, self.rounds)
        self._count(state, plan)
        self._last_lr = first * self.layout.lr_factor
        self._last_diag = coefs
        state.x, state.round = x, state.round + 1
        return state

    def evaluate(self, state: RunState) -> list[dict]:
        rows = self._evaluate_series(state, state.x, "iterate", np.arange(len(self.layout)))
        for hook, hs in zip(self.series, state.series_state):
            for name, (x, replica_ids) in hook.series(hs).items():
                rows.extend(self._evaluate_series(state, x, name, replica_ids))
        return rows

    def _evaluate_series(self, state: RunState, x: torch.Tensor, series: str, replica_ids: np.ndarray) -> list[dict]:
        ev = self.problem.evaluate(x)
        ev.extra.update({m.name: m.values(self.problem, x) for m in self.metrics})
        subopt = dist = None
        if self.reference is not None:  # exact F where train_loss is an estimate yet F has a closed form
            subopt = (ev.train_loss if ev.exact_train_loss is None else ev.exact_train_loss) - self.reference.f_star
            w_star = torch.as_tensor(self.reference.w_star, dtype=torch.float64, device=x.device)
            dist = (x.double() - w_star).norm(dim=-1).cpu().numpy()
        rows = []
        for i, r in enumerate(replica_ids):
            src = min(int(r), len(self.layout) - 1)
            row = {"replica": int(r), "series": series, "round": state.round, "wall_s": state.wall_s,
                   "train_loss": ev.train_loss[i], "grad_norm_sq": ev.grad_norm_sq[i],
                   "server_lr": self.alg.server.server_lr,
                   "lr": None if np.isnan(self._last_lr[src]) else self._last_lr[src]}
            row.update({k: v[src].item() for k, v in state.counters.items()})  # int64 -> int, sim_s -> float
            for name, values in (("train_loss_se", ev.train_loss_se), ("subopt", subopt), ("dist_to_opt", dist),
                                 ("test_loss", ev.test_loss),
                                 ("test_acc", ev.test_acc), *ev.extra.items()):
                row[name] = None if values is None else float(values[i])
            if self._last_diag is not None:
                diag = self._last_diag
                row.update(tau_eff=float(diag.tau_eff[src]), chi2=float(diag.chi2[src]),
                           slowdown=float(diag.slowdown[src]))
            rows.append({k: _finite_or_none(v) for k, v in row.items()})
        return rows

    def run(self, state: RunState | None = None) -> RunOutcome:
        state = state or self.initial_state()
        self.rounds_done = state.round
        start = time.perf_counter() - state.wall_s
        rows: list[dict] = []
        if state.round == 0:
            rows = self.evaluate(state)
            self.on_rows(rows, state)
        status = "ok"
        while state.round < self.rounds:
            state = self.step(state)
            state.wall_s = time.perf_counter() - start
            diverged = not bool(torch.isfinite(state.x).all())
            context = RoundContext(state.round, self.rounds, state.x, [])
            stop = any([bool(cb.on_round_end(context)) for cb in self.callbacks]) and not diverged
            if diverged or stop or state.round % self.eval_every == 0 or state.round == self.rounds:
                if diverged:
                    status = "diverged"
                    break
                new = self.evaluate(state)
                self.rounds_done = state.round  # set just before its rows go out, so the two agree
                rows.extend(new)
                self.on_rows(new, state)
                if self.progress:
                    self.progress(state.round, new)
                if any(r["train_loss"] is None for r in new if r["series"] == "iterate"):
                    status = "diverged"  # finite weights but an overflowing loss: stop here, rows kept
                    break
                context = RoundContext(state.round, self.rounds, state.x, new)
                stop = any([bool(cb.on_evaluation(context)) for cb in self.callbacks]) or stop  # all are called
            else:
                self.rounds_done = state.round
            if stop:
                status = "stopped"  # by a callback, after this round's rows (evaluated, so the run ends recorded)
                break
            if self.checkpoint is not None and self.checkpoint_every and state.round < self.rounds \
                    and state.round % self.checkpoint_every == 0:
                self.checkpoint(state)  # after the round's rows, so they land in the part it closes
        return RunOutcome(status, state.round - 1 if status == "diverged" else state.round, rows, state)


def _finite_or_none(v):
    """Metrics are stored as plain floats; NaN/inf mean 'not a number we can record'."""
    if isinstance(v, (float, np.floating)):
        return float(v) if np.isfinite(v) else None
    return v
