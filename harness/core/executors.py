"""Executors: where the sampled clients train. `inline` runs ClientShards in the driver process.

A ClientShard owns a fixed set of clients and their state: the slots parts declare (SCAFFOLD's c_i, FedBN's
buffers, error feedback's residual) in its ClientStore (core/client_store.py), which it checkpoints, restores,
re-keys and evaluates with itself, so the driver never holds them. It trains all its sampled clients of all replicas as one batched
computation and returns, per replica, exact partial sums (sum_k c_k Delta_k and
any control-variate sums; core/exact_sum.py), so traffic is O(shards x model), not O(clients x model), and the
round's result has the same bits for any split of the clients into shards. Only for an aggregator that
sees the updates (RoundPlan.send_updates) does a shard send each client's Delta_k instead, batch by batch as it
trains them within the memory budget (core/updates.py aggregates them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, runtime_checkable

import numpy as np
import torch

from fedharness.core.buffers import STATE_KEY as BUFFERS_KEY, buffer_dim, load_client_buffers, local_buffers, \
    take_buffers
from fedharness.core.client_store import ClientStore, declared_slots, decode_part, encode_part
from fedharness.core.exact_sum import ExactSum, FloatSum, Grids
from fedharness.core.personal import FineTune, finetuned, personal_models
from fedharness.contracts import (ClientKeys, ClientScores, ClientWork, LocalSolver, Problem, RoundPlan,
                                  SolverState, UpdateChunk)
from fedharness.errors import require


@dataclass
class Entries:
    """Distinct (replica, client) pairs a shard trains; duplicate draws' coefficients are summed."""

    replica: np.ndarray
    clients: np.ndarray
    coef: np.ndarray
    tau: np.ndarray
    lr_scale: np.ndarray

    def take(self, index) -> "Entries":
        """The entries at `index` (an index array or a slice), in that order."""
        return Entries(*(a[index] for a in (self.replica, self.clients, self.coef, self.tau, self.lr_scale)))


@dataclass
class ShardResult:
    """A round's client contributions: the weighted deltas sum_k c_k Delta_k under "delta" and a solver's
    per-client sums (SCAFFOLD's "control") under their names, each [R, dim]. With exact sums (the default;
    core/exact_sum.py) adding shards' results, in any grouping and order, gives the same bits, so a round does not
    depend on how the clients are split into shards; with float sums (`sums: float`) it does. `delta` and
    `extras` read the sums as float64. `grids` is where the exact sums' grids come from (x and the server's
    tensors): every side builds them, so `reply()`, what a Ray shard sends, carries the sums' words only."""

    shape: tuple[int, int]  # [R, dim]
    device: torch.device | str = "cpu"
    sums: dict[str, ExactSum | FloatSum] = field(default_factory=dict)
    updates: list[UpdateChunk] = field(default_factory=list)  # plan.send_updates: every entry's Delta_k
    grids: Grids | None = None  # None: float sums, or a reply (added into a result that has them)
    exact: bool = True
    counts: dict[str, np.ndarray] = field(default_factory=dict)  # [R] int64 each: the stages' client-side counts
    # plan.sq_norms: (replica [m], client [m], c_k ||Delta_k||^2 [m] float64) of each trained batch of entries
    sq_norms: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)

    @classmethod
    def zeros(cls, x: torch.Tensor, plan: RoundPlan, exact: bool = True) -> "ShardResult":
        grids = Grids(x, plan.server_ctx, plan.clients.shape[1]) if exact else None
        return cls((x.shape[0], x.shape[1]), x.device, grids=grids, exact=exact)

    def add_rows(self, name: str, index: torch.Tensor, terms: torch.Tensor) -> None:
        """terms[j] (float64) into replica index[j] of sum `name`."""
        if name not in self.sums:
            self.sums[name] = (ExactSum if self.exact else FloatSum).zeros(self.shape, terms.device)
        self.sums[name].add_rows(index, terms, self.grids[name] if self.exact else None)

    def add(self, other: "ShardResult") -> "ShardResult":
        for name, part in other.sums.items():
            self.sums[name] = self.sums[name].add(part) if name in self.sums else part
        self.updates.extend(other.updates)
        self.sq_norms.extend(other.sq_norms)
        for name, count in other.counts.items():  # integer counts: exact in any order
            self.add_counts(name, count)
        return self

    def add_counts(self, name: str, count: np.ndarray) -> None:
        self.counts[name] = count if name not in self.counts else self.counts[name] + count

    def reply(self) -> "ShardResult":
        """What a shard sends: the sums' words on the CPU and the updates, without the grids."""
        return ShardResult(self.shape, "cpu", {name: part.to("cpu") for name, part in self.sums.items()},
                           self.updates, None, self.exact, self.counts, self.sq_norms)

    def to(self, device: torch.device | str) -> "ShardResult":
        return ShardResult(self.shape, device, {name: part.to(device) for name, part in self.sums.items()},
                           self.updates, None if self.grids is None else self.grids.to(device), self.exact,
                           self.counts, self.sq_norms)

    def weighted_sq_norms(self) -> np.ndarray:
        """[R] sum_k c_k ||Delta_k||^2 of every replica's trained clients, added in (replica, client) order, so the
        same bits come out of any split into shards."""
        if not self.sq_norms:
            return np.zeros(self.shape[0])
        replica, clients, values = (np.concatenate(parts) for parts in zip(*self.sq_norms))
        order = np.lexsort((clients, replica))
        return np.bincount(replica[order], weights=values[order], minlength=self.shape[0])

    def _value(self, name: str) -> torch.Tensor:
        return self.sums[name].value(self.grids[name] if self.exact else None)

    @property
    def delta(self) -> torch.Tensor:
        if "delta" not in self.sums:  # no client contributed (or the updates were sent instead)
            return torch.zeros(self.shape, dtype=torch.float64, device=self.device)
        return self._value("delta")

    @property
    def extras(self) -> dict[str, torch.Tensor]:
        return {name: self._value(name) for name in self.sums if name != "delta"}

    @property
    def nbytes(self) -> int:
        """What the sums weigh on the wire (a Ray shard's reply, besides any updates)."""
        return sum(part.nbytes for part in self.sums.values())


PARAM_COPIES = 5  # w, w0, the gradient and two temporaries of the update, per client copy
DELTA_BYTES = 16  # per parameter: the float64 delta and its weighted copy


def entry_bytes(problem: Problem, solver: LocalSolver, steps: int) -> int:
    """Estimated bytes of one client copy in a batched local step of a round of `steps` steps."""
    w = torch.zeros(1, problem.dim, dtype=problem.dtype)
    state = solver.init_state(w)  # the solver's per-copy tensors (momentum buffer, control variates)
    state_bytes = sum(v.numel() * v.element_size() for k, v in state.items()
                      if isinstance(v, torch.Tensor) and k != "w0")
    return problem.dim * (PARAM_COPIES * w.element_size() + DELTA_BYTES) + state_bytes + problem.entry_bytes(steps)


def require_fits_budget(problem: Problem, solver: LocalSolver) -> None:
    """ConfigError naming memory_budget_gb unless one client copy fits the problem's memory budget."""
    budget = problem.memory_budget
    if budget is not None:
        need = entry_bytes(problem, solver, 1)
        require(need <= budget, "memory_budget_gb", budget / 1e9,
                f"too small to train even one client copy (about {need / 1e9:.3g} GB)")


class ClientShard:
    """A fixed set of clients and their training; the unit an executor places on a worker.

    The clients of a round are trained in batches of at most `chunk_entries` copies, so that one batched
    step fits the problem's `memory_budget` (bytes; None: all at once). Chunks are contiguous runs of the
    sorted entries and their sums are added in entry order, so chunking does not change the result.
    """

    def __init__(self, problem: Problem, solver: LocalSolver, owned: tuple[int, int], exact_sums: bool = True,
                 on_disk: bool = False):
        self.problem, self.solver, self.exact_sums = problem, solver, exact_sums  # sums: exact | float
        self.lo, self.hi = owned  # clients lo..hi-1 are this shard's: O(1) whatever N is
        # (replica, client) -> the declared slots (SCAFFOLD's c_i, FedBN's buffers); a stage's are declared by it
        self.store = ClientStore(declared_slots(problem, [solver]), on_disk)
        self.budget = problem.memory_budget
        self._views: dict[str, Problem] = {}  # the stages' data views by name (label flipping's), built once
        self._entry_bytes: dict[int, int] = {}  # steps -> entry_bytes

    def chunk_entries(self, steps: int, entries: int) -> int:
        """Client copies per batched computation: all `entries`, or as many as the budget holds beside the slots
        kept in memory once every entry holds one (>= 1; the run's check made sure one copy fits)."""
        if self.budget is None:
            return entries
        if steps not in self._entry_bytes:  # a function of the round's length alone: worked out once per length
            self._entry_bytes[steps] = entry_bytes(self.problem, self.solver, steps)
        room = self.budget - self.store.held_bytes(entries)
        return int(max(1, min(entries, room // self._entry_bytes[steps])))

    def entries(self, plan: RoundPlan) -> Entries:
        R, K = plan.clients.shape
        rep = np.repeat(np.arange(R), K)
        flat = plan.clients.reshape(-1)
        mine = (flat >= self.lo) & (flat < self.hi) & (plan.coef.reshape(-1) != 0)  # coef 0: dropped out
        pairs = rep[mine] * self.problem.num_clients + flat[mine]
        uniq, first, inverse = np.unique(pairs, return_index=True, return_inverse=True)
        coef = np.bincount(inverse, weights=plan.coef.reshape(-1)[mine], minlength=len(uniq))
        pick = np.flatnonzero(mine)[first]
        return Entries(rep[pick], flat[pick], coef, plan.tau.reshape(-1)[pick], plan.lr_scale.reshape(-1)[pick])

    def train(self, x: torch.Tensor, plan: RoundPlan) -> ShardResult:
        """This shard's sampled clients, all at once (one batched computation per local step); those a stage chose
        to train on a view of the data (label flipping) as one more batch per view."""
        entries = self.entries(plan)
        groups = self.view_groups(plan, entries)
        if not groups:
            return self.train_entries(x, plan, entries, self.problem.grad)
        rest = ~np.any([chosen for chosen, _ in groups], axis=0)
        result = self.train_entries(x, plan, entries.take(rest), self.problem.grad)
        for chosen, view in groups:
            result.add(self.train_entries(x, plan, entries.take(chosen), view.grad))
        return result

    def view_groups(self, plan: RoundPlan, e: Entries) -> list[tuple[np.ndarray, Problem]]:
        """[(chosen [len(e)] bool, the problem they train on)] for each stage with chosen entries; an entry two
        stages choose trains on the first one's view."""
        groups, taken = [], np.zeros(len(e.clients), dtype=bool)
        for work in plan.stages:
            if work.view is None:
                continue
            chosen = work.chosen(e.replica, e.clients) & ~taken
            if chosen.any():
                groups.append((chosen, self.view(work)))
                taken |= chosen
        return groups

    def view(self, work: ClientWork) -> Problem:
        """A stage's view of the problem (built on first use, kept)."""
        if work.view not in self._views:
            self._views[work.view] = work.view_of(self.problem)
        return self._views[work.view]

    def train_entries(self, x: torch.Tensor, plan: RoundPlan, e: Entries, grad_fn) -> ShardResult:
        result = ShardResult.zeros(x, plan, self.exact_sums)
        if len(e.clients) == 0:
            return result
        # longest first: the clients still training at any step are a prefix, trained as one smaller batch
        e = e.take(np.argsort(-e.tau, kind="stable"))
        size = self.chunk_entries(int(e.tau[0]), len(e.tau))
        for start in range(0, len(e.tau), size):
            self._train_batch(x, plan, e.take(slice(start, start + size)), grad_fn, result)
        return result

    def _train_batch(self, x: torch.Tensor, plan: RoundPlan, e: Entries, grad_fn, result: ShardResult) -> None:
        """Entries sorted by tau descending; at step t only the first n_t = #{tau_k > t} train, so the work is
        sum_k tau_k gradient rows, not M max_k tau_k. Adds their c_k Delta_k (and extras) into `result`."""
        problem, solver, dev = self.problem, self.solver, x.device
        w0 = x[e.replica]
        index = torch.as_tensor(e.replica, device=dev)
        if plan.grads_only or solver.round_gradient == "after":  # Mime's exchange ahead of training; MimeLite's
            coef = torch.as_tensor(e.coef, dtype=torch.float64, device=dev)[:, None]
            result.add_rows("grad", index, problem.full_grads(w0, e.clients) * coef)
            if plan.grads_only:
                return
        w = w0.clone()
        ctx = {k: v[e.replica] for k, v in plan.server_ctx.items()}
        saved = self.store.read(e.replica, e.clients, w0, ctx) if self.store.tables \
            else [{} for _ in e.clients]  # a stateless solver's: no lookups
        b = buffer_dim(problem)  # trailing buffer entries (BatchNorm statistics): set by forward passes
        if local_buffers(problem):
            load_client_buffers(w, saved, b)
        state = solver.init_state(w0, ctx, saved)
        solver.begin(w, state)
        p = torch.as_tensor(problem.weights[e.clients], dtype=torch.float64, device=dev)
        state["p"] = p  # each copy's client weight p_k (FedDyn scales f_k by N p_k)
        state["tau"] = torch.as_tensor(e.tau, device=dev)  # each copy's local steps this round (FedRep's phases)
        steps = int(e.tau[0])
        seed = plan.seed if np.ndim(plan.seed) == 0 else plan.seed[e.replica]  # streams broadcast over seeds
        batches = problem.round_batches(ClientKeys(e.clients, plan.stream_replicas[e.replica], plan.round, seed,
                                                   e.tau), steps)
        scale = torch.as_tensor(e.lr_scale, dtype=x.dtype, device=dev)[:, None]
        per_replica = plan.step_lrs.ndim == 2  # a batch of slots: each copy's own step sizes [M, max tau]
        lr_rows = torch.as_tensor(plan.step_lrs[e.replica], dtype=x.dtype, device=dev) if per_replica else None
        active = np.searchsorted(-e.tau, -np.arange(steps), side="left")  # n_t: entries with tau > t
        n = -1
        for t in range(steps):
            if active[t] != n:  # views: updates of the prefix land in w and the state in place
                n = int(active[t])
                w_t, scale_t, state_t = w[:n], scale[:n], prefix_state(state, n)
                lr_t = lr_rows[:n] if per_replica else None
            g = grad_fn(w_t, batches, t)
            state_t.update(step_oracles(grad_fn, batches, t, b))
            new_buffers = take_buffers(g, b) if b else None
            solver.update(w_t, g, scale_t * (lr_t[:, t:t + 1] if per_replica else float(plan.step_lrs[t])), state_t)
            if new_buffers is not None:
                w_t[:, -b:] = new_buffers
        sums = np.cumsum(plan.step_lrs, axis=-1)
        sums = sums[e.replica, e.tau - 1] if per_replica else sums[e.tau - 1]
        lr_sum = scale[:, 0].double() * torch.as_tensor(sums, dtype=torch.float64, device=dev)  # each client's steps
        new_state, extras = solver.finish(w0, w, lr_sum, state, p)
        if local_buffers(problem):
            new_state = {**new_state, BUFFERS_KEY: w[:, -b:]}
        for name, values in new_state.items():  # the stages' slots of the client are kept beside the solver's
            self.store.write(name, e.replica, e.clients, values)
        index = torch.as_tensor(e.replica, device=dev)
        delta = self.transformed(plan, w - w0, e, result) if transforms(plan) else None
        if plan.send_updates:  # leaves the device batch by batch, so device memory stays within the budget
            sent = (w - w0) if delta is None else delta.to(w.dtype)
            result.updates.append(UpdateChunk(e.replica.copy(), e.clients.copy(), sent.cpu()))
        else:
            coef = torch.as_tensor(e.coef, dtype=torch.float64, device=dev)[:, None]
            delta = (w - w0).double() if delta is None else delta
            result.add_rows("delta", index, delta * coef)  # each product rounded on its own
            if plan.sq_norms:
                sq = (delta * delta).sum(1) * coef[:, 0]
                result.sq_norms.append((e.replica.copy(), e.clients.copy(), sq.cpu().numpy()))
        for name, per_client in extras.items():
            result.add_rows(name, index, per_client.double())

    def transformed(self, plan: RoundPlan, delta: torch.Tensor, e: Entries, result: ShardResult) -> torch.Tensor:
        """The entries' updates [m, dim] float64 through every stage's transform in order; their counts added to
        the result per replica. A work with per-client state (`kept`: its name) gets each entry's, None for a
        client it has not seen, and returns the new ones, kept with the client's state (checkpointed)."""
        out = delta.double()
        for work in plan.stages:
            if work.kept is None:
                out, counts = work.transform(out, e.replica, e.clients)
            else:
                before = self.store.get(work.kept, e.replica, e.clients)
                out, counts, after = work.transform(out, e.replica, e.clients, before)
                self.store.write(work.kept, e.replica, e.clients, after)
            for name, per_entry in counts.items():
                per_replica = np.bincount(e.replica, weights=per_entry, minlength=result.shape[0]).astype(np.int64)
                result.add_counts(name, per_replica)
        return out

    def checkpoint(self, results, prefix: str, rnd: int, reader: str = "checkpoint", every: bool = False) -> list[str]:
        """This shard's slots written since its last checkpoint (`reader` snapshot: since its last snapshot;
        `every`: all of them), as one file under `prefix` in the results store (harness/results/store.py); the keys
        written (none: nothing changed)."""
        changed = self.store.take_changed(reader, every)
        if not changed:
            return []
        key = f"{prefix}/round={rnd:08d}-clients={self.lo}-{self.hi}.pt"
        results.write(key, encode_part(changed))
        return [key]

    def restore(self, results, keys: list[str]) -> None:
        """This shard's clients' slots from the checkpoint files `keys` (every shard's, in order: later ones
        overwrite), whatever the split that wrote them."""
        for key in keys:
            data = results.read(key)
            if data is None:
                raise FileNotFoundError(f"{results.url}/{key}: a client-slot file of the checkpoint is missing")
            self.store.load(decode_part(data, f"{results.url}/{key}"), lambda k: (k >= self.lo) & (k < self.hi))
        self.store.settle()

    def keep_replicas(self, rows: np.ndarray) -> None:
        self.store.keep_replicas(rows)

    def client_scores(self, x: torch.Tensor, replicas: np.ndarray, clients: np.ndarray,
                      finetune: FineTune | None = None) -> ClientScores:
        """`clients` (this shard's) scored on their own held-out data by the models x [S, dim] of executor rows
        `replicas` [S]; FedBN's with their own buffers (a client that has not trained yet: the server's).
        `finetune`: each client scored with its fine-tuned model instead (core/personal.py)."""
        buffers = None
        if local_buffers(self.problem) and BUFFERS_KEY in self.store.tables:
            buffers = {}
            for j, r in enumerate(replicas):
                own = self.store.get(BUFFERS_KEY, np.full(len(clients), r), clients)
                buffers.update({(j, int(k)): v.to(x.device) for k, v in zip(clients, own) if v is not None})
        if finetune is None:
            return self.problem.client_scores(x, clients, buffers)
        return self.finetune_scores(x, replicas, clients, buffers or {}, finetune)

    def finetune_scores(self, x: torch.Tensor, replicas: np.ndarray, clients: np.ndarray,
                        buffers: Mapping[tuple[int, int], torch.Tensor], spec: FineTune) -> ClientScores:
        """`clients` scored with their models fine-tuned from each row of x (core/personal.py), a row at a time:
        a copy's bits then depend on neither the shard split nor the other rows of a batch of slots. Protocol
        personal: with their personal models (the solver's slot of executor row `replicas[j]`, where kept)."""
        loss, acc = np.zeros((len(x), len(clients))), np.zeros((len(x), len(clients)))
        n = np.zeros(len(clients), dtype=np.int64)
        b = buffer_dim(self.problem)
        chunk = self.chunk_entries(spec.steps, len(clients))
        for j in range(len(x)):
            w0 = x[j].expand(len(clients), -1).clone()
            for m, k in enumerate(clients.tolist() if buffers else []):  # FedBN: from the client's own buffers
                if (j, k) in buffers:
                    w0[m, -b:] = buffers[(j, k)]
            if spec.protocol == "personal":
                slot = self.solver.personal_slot
                kept = [None] * len(clients) if slot is None else \
                    self.store.get(slot, np.full(len(clients), replicas[j]), clients)
                w = personal_models(self.problem, self.solver, w0, kept, clients, spec, j, chunk)
            else:
                w = finetuned(self.problem, w0, clients, spec, j, chunk)
            n, loss[j], acc[j] = self.problem.copy_scores(w, clients)
        return ClientScores(np.asarray(clients, dtype=np.int64), n, loss, acc, self.problem.num_clients,
                            spec.protocol)

    def get_state(self) -> dict:
        """Every kept slot value by (replica, client): for inspection (tests); the engine never asks."""
        return self.store.values()

    def close(self) -> None:
        self.store.close()


def transforms(plan: RoundPlan) -> bool:
    """Whether a stage transforms the updates this round (one that only chooses a view does not)."""
    return any(type(work).transform is not ClientWork.transform for work in plan.stages)


def step_oracles(grad_fn, batches, t: int, b: int) -> SolverState:
    """Local step t's minibatch gradient at any points v [n, dim] of the copies (grad_at), one batched call; the
    last b entries (buffers: the forward pass's statistics, not gradients) come back 0."""
    def grad_at(v: torch.Tensor) -> torch.Tensor:
        g = grad_fn(v, batches, t)
        if b:
            g[:, -b:] = 0
        return g

    return {"grad_at": grad_at}


def prefix_state(state: SolverState, n: int) -> SolverState:
    """A solver's per-round state restricted to its first n client copies (every tensor has them on axis 0)."""
    return {k: v[:n] if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def merge_scores(clients: np.ndarray, ranges: list[tuple[int, int]], score) -> ClientScores:
    """The scores of `clients` (in their order) from `score(s, mine)`: shard s's scores of its own `mine`."""
    parts = []
    for s, (lo, hi) in enumerate(ranges):
        at = np.flatnonzero((clients >= lo) & (clients < hi))
        if len(at):
            parts.append((at, score(s, clients[at])))
    first = parts[0][1]
    n = np.zeros(len(clients), dtype=first.n.dtype)
    loss, acc = np.zeros((first.loss.shape[0], len(clients))), np.zeros((first.acc.shape[0], len(clients)))
    for at, part in parts:
        n[at], loss[:, at], acc[:, at] = part.n, part.loss, part.acc
    return ClientScores(np.asarray(clients, dtype=np.int64), n, loss, acc, first.population, first.protocol)


COST_GRID = 1 << 16  # clients at which a split reads the cost: every client up to this N, evenly spread above


def balanced_ranges(cost_of, num_clients: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous client ranges [lo, hi) of about equal cost, one per shard.

    `cost_of(clients)` gives each client's expected cost; it is read at up to COST_GRID evenly spread clients,
    each standing for the clients up to the next, so the split costs O(1) in N (exact per client up to
    COST_GRID clients).
    """
    starts = np.unique(np.linspace(0, num_clients, min(num_clients, COST_GRID), endpoint=False).astype(np.int64))
    ends = np.append(starts[1:], num_clients)
    cum = np.cumsum(np.asarray(cost_of(starts), dtype=np.float64) * (ends - starts))
    if cum[-1] <= 0:  # no cost anywhere: split by count
        cum = np.cumsum((ends - starts).astype(np.float64))
    cells = np.searchsorted(cum, cum[-1] * np.arange(1, num_shards) / num_shards, side="left") + 1
    bounds = np.concatenate([[0], np.append(starts, num_clients)[np.minimum(cells, len(starts))], [num_clients]])
    return [(int(bounds[s]), int(bounds[s + 1])) for s in range(num_shards)]


def shard_of(ranges: list[tuple[int, int]], client: int) -> int:
    """Which of `ranges` (balanced_ranges') owns `client`."""
    return int(np.searchsorted([hi for _, hi in ranges], client, side="right"))


@runtime_checkable
class Executor(Protocol):
    """Where the sampled clients train (the inline and loop executors here, harness/backends/ray_executor.py's Ray
    shards): the engine hands it a round's plan and reads exact sums back."""

    def local_updates(self, x: torch.Tensor, plan: RoundPlan) -> ShardResult:
        """Train the plan's clients from the server models x [R, dim]; the shards' reduced sums."""

    def checkpoint(self, results, prefix: str, rnd: int, every: bool = False) -> list[str]:
        """Each shard writes its clients' slots changed since its last checkpoint (`every`: all of them) under
        `prefix` in the results store; the keys written."""

    def restore(self, results, keys: list[str]) -> None:
        """Each shard loads its clients' slots from the checkpoint files `keys` (resuming a run)."""

    def keep_replicas(self, rows: np.ndarray) -> None:
        """Only the slots of executor rows `rows`, renumbered 0.. (slots of a batch left)."""

    def client_scores(self, x: torch.Tensor, replicas: np.ndarray, clients: np.ndarray,
                      finetune: FineTune | None = None) -> ClientScores:
        """`clients` scored in the shards that own them by the models x [S, dim] of executor rows `replicas` (with
        `finetune`: by each client's fine-tuned model, core/personal.py)."""

    def close(self) -> None:
        """Release the shards (Ray actors); the executor is not used again."""


class InlineExecutor:
    """Shards in the driver process: the embedded default."""

    def __init__(self, problem, solver, num_shards: int = 1, exact_sums: bool = True, on_disk: bool = False):
        # one process: the split only decides whose state is whose, so equal counts do
        self.shards = [ClientShard(problem, solver, owned, exact_sums, on_disk) for owned in
                       balanced_ranges(lambda k: np.ones(len(k)), problem.num_clients, num_shards)]

    def local_updates(self, x: torch.Tensor, plan: RoundPlan) -> ShardResult:
        total = self.shards[0].train(x, plan)
        for shard in self.shards[1:]:
            total.add(shard.train(x, plan))
        return total

    def checkpoint(self, results, prefix: str, rnd: int, every: bool = False) -> list[str]:
        return [key for shard in self.shards for key in shard.checkpoint(results, prefix, rnd, every=every)]

    def restore(self, results, keys: list[str]) -> None:
        for shard in self.shards:
            shard.restore(results, keys)

    def keep_replicas(self, rows: np.ndarray) -> None:
        for shard in self.shards:
            shard.keep_replicas(rows)

    def client_scores(self, x: torch.Tensor, replicas: np.ndarray, clients: np.ndarray,
                      finetune: FineTune | None = None) -> ClientScores:
        return merge_scores(clients, [(shard.lo, shard.hi) for shard in self.shards],
                            lambda s, mine: self.shards[s].client_scores(x, replicas, mine, finetune))

    def get_state(self) -> dict:
        """Every kept slot value by (replica, client): for inspection (tests); the engine never asks."""
        return {key: value for shard in self.shards for key, value in shard.get_state().items()}

    def close(self) -> None:
        for shard in self.shards:
            shard.close()


class LoopExecutor(InlineExecutor):
    """The slow path: one client at a time, gradients by plain autograd. Kept to check the fast path."""

    def __init__(self, problem, solver, num_shards: int = 1, exact_sums: bool = True, on_disk: bool = False):
        super().__init__(problem, solver, 1, exact_sums, on_disk)

    def local_updates(self, x: torch.Tensor, plan: RoundPlan) -> ShardResult:
        shard = self.shards[0]
        entries = shard.entries(plan)
        total = ShardResult.zeros(x, plan, shard.exact_sums)
        problem_of = np.full(len(entries.clients), None, dtype=object)
        for chosen, view in shard.view_groups(plan, entries):
            problem_of[chosen] = view
        for i in range(len(entries.clients)):
            problem = shard.problem if problem_of[i] is None else problem_of[i]
            total.add(shard.train_entries(x, plan, entries.take(slice(i, i + 1)), problem.loop_grad))
        return total
