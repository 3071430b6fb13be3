"""eval.personal's `finetune` and `personal` protocols: each evaluated client is scored, in the shard that owns it,
with the global model fine-tuned on its own data (finetune) or with its personal model (personal: an algorithm's
that keeps one, contracts.PersonalSolver; docs/results.md, Personalized evaluation).

Fine-tuning is `steps` steps of plain SGD (w <- w - lr g: no momentum, prox term, control variate or decay) on
minibatches of the problem's batch size, from each replica's global model (FedBN's clients with their own buffers,
as training left them). Every (replica, client) pair is one copy of a batched computation, the training step's
(problem.round_batches and problem.grad), in chunks that fit the memory budget. The minibatches come from the
training streams of the seed stream_key(seed, FINETUNE): a stream of fine-tuning's own, keyed by (seed, replica,
evaluated round, client), so training's draws are untouched and a copy's draws do not depend on which shard or
chunk it is in. Nothing is written to the client store: fine-tuning never changes the training trajectory.

`personal`: a client that keeps the solver's personal slot is scored with personal_model(global, kept); any other
(not yet sampled; unseen) with the global model after `steps` of the solver's personal_step on the same
minibatches fine-tuning draws (Ditto: its personal objective; FedRep, FedBABU: the head on the frozen body). Every
(replica, client) pair is again one copy of a batched computation, so its bits depend on no shard or chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from fedharness.base import streams
from fedharness.contracts import ClientKeys, PersonalSolver, Problem
from fedharness.core.buffers import buffer_dim, take_buffers


@dataclass(frozen=True)
class Personal:
    """eval.personal's settings as the engine takes them: the protocols, and finetune's steps, step size (None:
    each slot's algorithm.client_lr) and the evaluated rounds it runs at (every: multiples of it and each slot's
    last round; None: the last only)."""

    protocols: tuple[str, ...]
    steps: int
    lr: float | None
    every: int | None

    def finetune_due(self, rnd: int, last: np.ndarray, protocol: str = "finetune") -> np.ndarray:
        """[S] whether rows whose slots end at rounds `last` [S] are scored under `protocol` (finetune, personal)
        at evaluated round `rnd`."""
        if protocol not in self.protocols:
            return np.zeros(len(last), dtype=bool)
        return (last == rnd) | (self.every is not None and rnd % self.every == 0)


@dataclass(frozen=True)
class FineTune:
    """One evaluation's fine-tuning: `steps` SGD steps at `lrs` [S], for the models of executor rows whose streams
    are `stream_replicas` [S] and `seeds` [S] (the run's seed on every row of a run alone), at evaluated round
    `round`; `evaluated`: every client the evaluation scores, ascending (where a shard's clients rank).
    `protocol`: finetune, or personal (the solver's personal models, started the same way where a client has none)."""

    steps: int
    lrs: np.ndarray
    round: int
    seeds: np.ndarray
    stream_replicas: np.ndarray
    evaluated: np.ndarray
    protocol: str = "finetune"


def finetune_seeds(seeds: np.ndarray) -> np.ndarray:
    """Fine-tuning's seed of each run seed: its streams are the training streams of this seed."""
    return streams.stream_key(np.asarray(seeds), streams.FINETUNE, 0, 0, 0).view(np.int64)


def finetuned(problem: Problem, w0: torch.Tensor, clients: np.ndarray, spec: FineTune, row: int,
              chunk: int, step: Callable[[torch.Tensor, torch.Tensor, float, torch.Tensor], None] | None = None
              ) -> torch.Tensor:
    """Copies w0 [m, dim] of `clients` (consecutive among spec.evaluated: a shard's), all of executor row `row`,
    after spec.steps plain SGD steps on each client's own minibatches, `chunk` copies at a time; a new tensor.
    A copy's bits do not depend on its batch or its place in it: the problems' batched gradients see to that
    (problems/objectives.py aligned_blocks, a lone copy batched as two; tests/test_batch_position.py).
    `step(w, g, lr, start)`: a step other than plain SGD, in place (a PersonalSolver's personal_step)."""
    seed = int(finetune_seeds(spec.seeds[row]))
    b, lr = buffer_dim(problem), float(spec.lrs[row])
    out = w0.clone()
    size = max(chunk, 1)
    for start in range(0, len(clients), size):
        at = np.arange(start, min(start + size, len(clients)))
        keys = ClientKeys(clients[at], np.full(len(at), spec.stream_replicas[row]), spec.round, seed)
        batches = problem.round_batches(keys, spec.steps)
        w = out[start:start + size]  # a view: trained in place
        first = w0[start:start + size]
        for t in range(spec.steps):
            g = problem.grad(w, batches, t)
            new_buffers = take_buffers(g, b) if b else None
            if step is None:
                w.sub_(g, alpha=lr)
            else:
                step(w, g, lr, first)
            if new_buffers is not None:
                w[:, -b:] = new_buffers
    return out


def personal_models(problem: Problem, solver: PersonalSolver, w0: torch.Tensor, kept: list[torch.Tensor | None],
                    clients: np.ndarray, spec: FineTune, row: int, chunk: int) -> torch.Tensor:
    """Each client's personal model [m, dim] from copies w0 [m, dim] of executor row `row`'s global model: from
    its kept slot value where it has one (`kept`: the store's, None where none), else after spec.steps personal
    steps from w0 (the solver's personal_steps where it fixes them). The clients without one are one batch
    (`chunk` copies at a time), in `clients`' order."""
    held = np.array([value is not None for value in kept], dtype=bool)
    out = torch.empty_like(w0)
    if held.any():
        at = torch.as_tensor(np.flatnonzero(held), device=w0.device)
        values = torch.stack([value for value in kept if value is not None]).to(w0.device)
        out[at] = solver.personal_model(w0[at], values).to(w0.dtype)
    if not held.all():
        fresh = np.flatnonzero(~held)
        at = torch.as_tensor(fresh, device=w0.device)
        steps = spec if solver.personal_steps is None else replace(spec, steps=solver.personal_steps)
        out[at] = finetuned(problem, w0[at], clients[fresh], steps, row, chunk, solver.personal_step)
    return out
