"""A round's plan and its accounting, the engine's primitives that every cadence (contracts.Cadence) uses: which
clients train with which steps, step sizes and coefficients (the algorithm's parts, settled on the systems clock),
the counters a trained plan adds, and the simulated seconds of the uniform network (NetworkModel)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedharness.contracts import Coefficients, LocalSolver, Problem, RoundPlan, RunState, Selection
from fedharness.core.clock import link_seconds, rescaled
from fedharness.core.exact_sum import Grids
from fedharness.core.executors import ShardResult
from fedharness.core.stages import Stages


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


class Planning:
    """The engine's plan and count primitives (core/engine.py Engine holds the parts they read: alg, problem,
    layout, clock, network, stages)."""

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
                                    *self.transfer_bytes)
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

    @staticmethod
    def exact_sum(x: torch.Tensor, replica: torch.Tensor, rows: torch.Tensor, most: int) -> torch.Tensor:
        """[R, dim] float64: row i of `rows` [n, dim] float64 added to replica replica[i]'s sum, exactly as a
        round's shards sum (core/exact_sum.py: the same bits in any order or split); `most`: the most rows a
        replica adds."""
        total = ShardResult(tuple(x.shape), x.device, grids=Grids(x, {}, most))
        if len(replica):
            total.add_rows("delta", replica, rows)
        return total.delta

    def count(self, state: RunState, plan: RoundPlan) -> None:
        """Add a trained round's plan to the counters (what Parquet's rounds/ records; the tuning budget replays
        it without training)."""
        c = state.counters
        distinct, work = trained_clients(plan.clients, plan.coef, plan.tau)
        c["local_steps"] += np.where(distinct > 0, np.where(plan.coef != 0, plan.tau, 0).max(1), 0)
        solver = self.alg.solver
        c["grad_evals"] += work * self.alg.batch_size * solver.grads_per_step
        if solver.round_gradient != "none":  # one pass over each trained client's samples
            c["grad_evals"] += self._full_batch_samples(plan)
        down, up = self.transfer_bytes
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
