"""Synthetic(alpha, beta) with clients generated on demand: `dataset=synthetic_lazy`, N up to 10^5 and more.

Every client of Synthetic(alpha, beta) has its own generator (synthetic.client_data), so
a shard can build a client's samples the first time the client is sampled and forget
them later: memory follows the sampled clients (a least-recently-used cache of
`dataset.cache_mb`), not N. Only the client sizes n_k (8 bytes per client) exist for
all N. Minibatches are drawn exactly as DataProblem draws them (same streams, same
per-client sample order), so with the same seed the lazy problem trains on the same
trajectory as `dataset=synthetic` with the natural partition.

The global objective over all N clients is never materialised: train_loss, test_loss
and test_acc are measured on clients 0..eval_clients-1 (weights n_k renormalised over
them; exactly F when eval_clients >= N), and there is no exact reference (subopt and
dist_to_opt are null).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedharness.contracts import ClientKeys, Evaluation, Model, Problem
from fedharness.keys import Key, integer, number
from fedharness.problems import synthetic
from fedharness.problems.data import DataProblem, RoundBatches

KEYS: dict[str, Key] = {  # dataset=synthetic_lazy's, besides synthetic's
    **synthetic.KEYS,
    "cache_mb": number("generated clients kept per process (MB); least recently used dropped", lo=0),
    "eval_clients": integer("metrics over clients 0..eval_clients-1", lo=1),
}


@dataclass
class RoundData:
    """The round's sampled clients' samples back to back, in the shape DataProblem's batching code reads.

    DataProblem.round_batches / grad / reference_grad run on it unchanged (they read only these
    fields), so lazy clients are batched exactly as stored ones are.
    """

    objective: Model
    x: torch.Tensor
    y: torch.Tensor
    sizes: np.ndarray  # [N] n_k of every client
    offsets: np.ndarray  # [N] where each sampled client starts in x (0 for the others)
    batch_size: int
    device: torch.device

    @property
    def sample_numel(self) -> int:
        return self.x[0].numel()


@dataclass
class LazyBatches:
    data: RoundData
    batches: RoundBatches


class LazySyntheticProblem(Problem):
    convex = True
    exact_reference = False  # F over N lazily generated clients is never built
    sample_numel = synthetic.FEATURES + 1  # features plus the linear models' bias column
    entry_bytes = DataProblem.entry_bytes

    def __init__(self, objective: Model, num_clients: int, alpha: float, beta: float, seed: int, size: int | None,
                 batch_size: int, dtype: torch.dtype, device: str | torch.device, cache_mb: float,
                 eval_clients: int, memory_budget: int | None = None):
        self.memory_budget = memory_budget  # bytes; evaluation and executors fit within it (None: no bound)
        self.objective, self.alpha, self.beta, self.seed, self.size = objective, alpha, beta, seed, size
        self.num_clients, self.dim, self.batch_size = num_clients, objective.dim, batch_size
        self.dtype, self.device = dtype, torch.device(device)
        totals = (np.full(num_clients, size, dtype=np.int64) if size is not None else
                  np.array([synthetic.client_size(seed, k) for k in range(num_clients)], dtype=np.int64))
        self.sizes = np.array([synthetic.split_train_test(int(n)) for n in totals], dtype=np.int64)
        self.weights = self.sizes / self.sizes.sum()
        self.cache_limit_bytes = int(cache_mb * 2**20)
        self.eval_clients = min(eval_clients, num_clients)
        self._cache: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.cached_bytes = 0
        self._eval: DataProblem | None = None
        self.generated = 0  # clients built so far (cache misses), for benchmarks

    # ------------------------------------------------------------ clients on demand

    def _client(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        hit = self._cache.get(k)
        if hit is not None:
            self._cache.move_to_end(k)
            return hit
        x, y = synthetic.client_data(self.seed, k, self.alpha, self.beta, self.size)
        n = synthetic.split_train_test(len(x))
        entry = (self.objective.prepare(x[:n], self.dtype, self.device),
                 torch.as_tensor(y[:n], dtype=torch.int64, device=self.device))
        self.generated += 1
        self._cache[k] = entry
        self.cached_bytes += _nbytes(entry)
        while self.cached_bytes > self.cache_limit_bytes and self._cache:
            _, old = self._cache.popitem(last=False)
            self.cached_bytes -= _nbytes(old)
        return entry

    def round_batches(self, keys: ClientKeys, steps: int) -> LazyBatches:
        uniq = np.unique(keys.clients)
        parts = [self._client(int(k)) for k in uniq]
        offsets = np.zeros(self.num_clients, dtype=np.int64)
        offsets[uniq] = np.concatenate([[0], np.cumsum(self.sizes[uniq])[:-1]])
        data = RoundData(self.objective, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                         self.sizes, offsets, self.batch_size, self.device)
        return LazyBatches(data, DataProblem.round_batches(data, keys, steps))

    def grad(self, w: torch.Tensor, batches: LazyBatches, step: int) -> torch.Tensor:
        return DataProblem.grad(batches.data, w, batches.batches, step)

    def reference_grad(self, w: torch.Tensor, batches: LazyBatches, step: int) -> torch.Tensor:
        return DataProblem.reference_grad(batches.data, w, batches.batches, step)

    # ------------------------------------------------------------ evaluation on the first eval_clients

    def eval_problem(self) -> DataProblem:
        """Clients 0..eval_clients-1 as an ordinary DataProblem (built on first use; shards never need it)."""
        if self._eval is None:
            xs, ys, xts, yts = [], [], [], []
            for k in range(self.eval_clients):
                x, y = synthetic.client_data(self.seed, k, self.alpha, self.beta, self.size)
                n = synthetic.split_train_test(len(x))
                xs.append(x[:n]), ys.append(y[:n]), xts.append(x[n:]), yts.append(y[n:])
            index = np.split(np.arange(sum(len(y) for y in ys)), np.cumsum([len(y) for y in ys])[:-1])
            self._eval = DataProblem(self.objective, np.concatenate(xs), np.concatenate(ys), index,
                                     np.concatenate(xts), np.concatenate(yts), self.batch_size, self.dtype,
                                     self.device, self.memory_budget)
        return self._eval

    def init_params(self, replicas: int, seed: int) -> torch.Tensor:
        return self.objective.init(replicas, seed, self.dtype).to(self.device)

    def objective_value(self, w: torch.Tensor) -> torch.Tensor:
        return self.eval_problem().objective_value(w)

    def objective_and_grad(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.eval_problem().objective_and_grad(w)

    def evaluate(self, w: torch.Tensor) -> Evaluation:
        return self.eval_problem().evaluate(w)


def _nbytes(entry: tuple[torch.Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in entry)


def build_lazy_synthetic(cfg: dict[str, Any], batch_size: int, make_objective, data_seed: int,
                         dtype: torch.dtype, memory_budget: int | None = None) -> LazySyntheticProblem:
    """`make_objective(in_shape, num_classes)` is the model the config names (problems.build_problem's); the
    schema has checked the keys (and that the partition is auto or natural)."""
    dcfg = cfg["dataset"]
    objective = make_objective((synthetic.FEATURES,), synthetic.CLASSES)
    return LazySyntheticProblem(objective, dcfg["num_clients"], dcfg["alpha"], dcfg["beta"], data_seed,
                                dcfg["samples_per_client"], batch_size, dtype, cfg["device"], dcfg["cache_mb"],
                                dcfg["eval_clients"], memory_budget)
