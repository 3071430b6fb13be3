"""eval.personal's `finetune` protocol: each evaluated client fine-tunes the global model on its own data, in the
shard that owns it, and is scored with the result (docs/results.md, Personalized evaluation).

Fine-tuning is `steps` steps of plain SGD (w <- w - lr g: no momentum, prox term, control variate or decay) on
minibatches of the problem's batch size, from each replica's global model (FedBN's clients with their own buffers,
as training left them). Every (replica, client) pair is one copy of a batched computation, the training step's
(problem.round_batches and problem.grad), in chunks that fit the memory budget. The minibatches come from the
training streams of the seed stream_key(seed, FINETUNE): a stream of fine-tuning's own, keyed by (seed, replica,
evaluated round, client), so training's draws are untouched and a copy's draws do not depend on which shard or
chunk it is in. Nothing is written to the client store: fine-tuning never changes the training trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedharness.base import streams
from fedharness.contracts import ClientKeys, Problem
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

    def finetune_due(self, rnd: int, last: np.ndarray) -> np.ndarray:
        """[S] whether rows whose slots end at rounds `last` [S] fine-tune at evaluated round `rnd`."""
        if "finetune" not in self.protocols:
            return np.zeros(len(last), dtype=bool)
        return (last == rnd) | (self.every is not None and rnd % self.every == 0)


@dataclass(frozen=True)
class FineTune:
    """One evaluation's fine-tuning: `steps` SGD steps at `lrs` [S], for the models of executor rows whose streams
    are `stream_replicas` [S] and `seeds` [S] (the run's seed on every row of a run alone), at evaluated round
    `round`; `evaluated`: every client the evaluation scores, ascending (where a shard's clients rank)."""

    steps: int
    lrs: np.ndarray
    round: int
    seeds: np.ndarray
    stream_replicas: np.ndarray
    evaluated: np.ndarray


def finetune_seeds(seeds: np.ndarray) -> np.ndarray:
    """Fine-tuning's seed of each run seed: its streams are the training streams of this seed."""
    return streams.stream_key(np.asarray(seeds), streams.FINETUNE, 0, 0, 0).view(np.int64)


def finetuned(problem: Problem, w0: torch.Tensor, clients: np.ndarray, spec: FineTune, row: int,
              chunk: int) -> torch.Tensor:
    """Copies w0 [m, dim] of `clients` (consecutive among spec.evaluated: a shard's), all of executor row `row`,
    after spec.steps plain SGD steps on each client's own minibatches, `chunk` copies at a time; a new tensor.
    A copy's bits do not depend on its batch or its place in it: the problems' batched gradients see to that
    (problems/objectives.py aligned_blocks, a lone copy batched as two; tests/test_batch_position.py)."""
    seed = int(finetune_seeds(spec.seeds[row]))
    b, lr = buffer_dim(problem), float(spec.lrs[row])
    out = w0.clone()
    size = max(chunk, 1)
    for start in range(0, len(clients), size):
        at = np.arange(start, min(start + size, len(clients)))
        keys = ClientKeys(clients[at], np.full(len(at), spec.stream_replicas[row]), spec.round, seed)
        batches = problem.round_batches(keys, spec.steps)
        w = out[start:start + size]  # a view: trained in place
        for t in range(spec.steps):
            g = problem.grad(w, batches, t)
            new_buffers = take_buffers(g, b) if b else None
            w.sub_(g, alpha=lr)
            if new_buffers is not None:
                w[:, -b:] = new_buffers
    return out
