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
from dataclasses import replace
from typing import Callable, Sequence

import numpy as np
import torch

from fedharness.contracts import (Algorithm, Cadence, Callback, ClientGradients, ClientScores, Coefficients,
                                  LocalSolver, Metric, Problem, ReplicaLayout, RoundContext, RoundPlan, RunOutcome,
                                  RunState, SeriesHook, UpdateAggregator, training_clients)
from fedharness.base.interrupts import atomic
from fedharness.errors import require
from fedharness.core.buffers import average_into, buffer_dim, local_buffers
from fedharness.core.clock import SystemsClock
from fedharness.core.personal import FineTune, Personal
from fedharness.core.planning import NetworkModel, Planning
from fedharness.core.slots import SlotSet, slot_algorithm, takes_online
from fedharness.core.stages import Stages
from fedharness.core.updates import aggregate_updates


class _Rounds(Cadence):
    """Synchronous rounds: the contract's own step (a run built without a cadence: tests, the tuning replay)."""


SYNCHRONOUS = _Rounds()


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


class Engine(Planning):
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
               personal: Personal | None = None, cadence: Cadence | None = None) -> None:
        """`cadence` (the cadence group): the shape of a server step (None: synchronous rounds). `clock`
        (core/clock.py, the speed and availability groups): clients' speeds and availability, deadlines and
        over-selection on each replica's sim_s; None: every client the `network`'s, always online, no deadline.
        `stages`: what happens to the updates between training and the server optimizer (core/stages.py).
        `client_eval` (eval.per_client): the clients each evaluation scores on their own held-out data (the problem
        is a contracts.ClientEvaluation); None: none. `personal` (eval.personal): the protocols they are scored
        with (None: global). `grad_norm` (eval.grad_norm): whether evaluations compute grad_norm_sq (else null)."""
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
        self.cadence = cadence or SYNCHRONOUS
        self._sampler_online = clock is not None and not clock.always_online and takes_online(algorithm.sampler)
        self._sim_seconds: np.ndarray | None = None  # the planned round's length [R] on the systems clock
        self._downloads: np.ndarray | None = None  # [R] the clients the model reached (the clock: even if dropped)
        self.metrics, self.end_status = tuple(metrics), end_status  # metrics: a user's extra columns
        self.hooks = dict(zip(slots.ids, hooks))
        self.round_hooks = {i: [h for h in hs if _acts_at_round_end(h)] for i, hs in self.hooks.items()}
        self.bytes_per_param = torch.finfo(problem.dtype).bits // 8
        self.transfer_bytes = self.client_bytes()
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
        return RunState(0, x, self.alg.server.init_state(x), zeros, ctx, [h.init_state(x) for h in self.series],
                        in_flight=self.cadence.init_flight(len(x), x.shape[1], x.device))

    def row_seeds(self) -> np.ndarray:
        """[R] each replica's seed (a run alone: its seed on every replica)."""
        return np.full(len(self.layout), self.seed)

    def step(self, state: RunState) -> RunState:
        """One server version, as the run's cadence (contracts.Cadence) shapes it."""
        return self.cadence.step(self, state)

    def train_round(self, state: RunState, plan: RoundPlan) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        """Train a round's plan from state.x: the stages, the aggregator's sum and the solver's server side; the
        aggregated Delta [R, dim] and what a server that reads_sq_norms takes."""
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
        return delta, ({"sq_norms": result.weighted_sq_norms()} if plan.sq_norms else {})

    def advance(self, state: RunState, delta: torch.Tensor, first: np.ndarray, coefs: Coefficients,
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

    def plan_seed(self) -> int | np.ndarray:
        """The seed a plan carries: the run's (a batch of slots: each replica's)."""
        return self.seed

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
        state.in_flight = {k: v[index] if isinstance(v, torch.Tensor) else v[rows] for k, v in state.in_flight.items()}
        self._last_lr = self._last_lr[rows]
        if self._last_diag is not None:
            d = self._last_diag
            self._last_diag = replace(d, coef=d.coef[rows], tau_eff=d.tau_eff[rows], chi2=d.chi2[rows],
                                      slowdown=d.slowdown[rows])
        self.executor.keep_replicas(rows)  # the slots (SCAFFOLD's c_i, FedBN's buffers) follow their replica



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
