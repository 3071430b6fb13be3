"""Synthetic(alpha, beta) with clients generated on demand: `dataset=synthetic_lazy`, N up to 10^8.

Nothing exists per client: sizes n_k and weights p_k are pure functions of k (problems/population.py; the
block sums that scheme I's draws by n_k need are 3 MB at N = 10^8), and a round generates only the rows its
minibatches read (K x steps x b), each sample from its own stream (synthetic.client_rows), so a client with
10^6 samples costs no more to train than one with 100. Client parameters (W_k, b_k, v_k: about 5 kB a client)
are kept in a least-recently-used cache of `dataset.cache_mb`. Minibatch indices are drawn exactly as
DataProblem draws them (same streams), and the rows are the same numbers `dataset=synthetic` stores, so with the
same seed the lazy problem trains on the same trajectory as `dataset=synthetic` with the natural partition.

The global objective over all N clients is never materialised. While N <= eval.clients (null: 100) every
metric is exact (over all N clients). Above, the metrics are measured on a fixed sample of eval.clients clients
drawn uniformly with replacement, once, from the data seed (problems/estimate.py): train_loss is the unbiased
estimate of F from the sample, with its standard error in train_loss_se; grad_norm_sq, test_loss and test_acc
are those of the sampled clients' data pooled (weights n_k renormalised over the distinct sampled clients), and
are named so in docs/results.md. There is no exact reference (subopt and dist_to_opt are null).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from fedharness.contracts import ClientKeys, Evaluation, Model, Problem
from fedharness.keys import Key, number
from fedharness.problems import synthetic
from fedharness.problems.client_eval import client_scores
from fedharness.problems.estimate import sample_clients, weighted_sum_estimate
from fedharness.problems.data import DataProblem, RoundBatches, batches_from_index, minibatch_samples
from fedharness.problems.population import ClientSizes, ClientWeights
from fedharness.registry.groups import DATASETS

PARAMS_BYTES = 8 * (synthetic.FEATURES * (synthetic.CLASSES + 1) + synthetic.CLASSES)  # one ClientParams
KEYS: dict[str, Key] = {  # dataset=synthetic_lazy's, besides synthetic's
    **synthetic.KEYS,
    "cache_mb": number("generated client parameters kept per process (MB); least recently used dropped", lo=0),
}
DEFAULT_EVAL_CLIENTS = 100  # eval.clients=null: metrics exact while num_clients <= this, else on this many


@dataclass
class RoundData:
    """The rows a round's minibatches read, entry after entry, in the shape DataProblem's batching code reads.

    DataProblem.grad / loop_grad run on it unchanged (they read only these fields), so lazy clients are
    batched exactly as stored ones are.
    """

    objective: Model
    x: torch.Tensor
    y: torch.Tensor

    @property
    def sample_numel(self) -> int:
        return self.x[0].numel()

    def _model_input(self, x: torch.Tensor) -> torch.Tensor:
        """Rows as the model takes them: generated rows are made so (DataProblem's keeps compact ones compact)."""
        return x


@dataclass
class LazyBatches:
    data: RoundData
    batches: RoundBatches


class LazySyntheticProblem(Problem):
    convex = True
    exact_reference = False  # F over N lazily generated clients is never built: it is no ExactSolve
    sample_numel = synthetic.FEATURES + 1  # features plus the linear models' bias column

    def __init__(self, objective: Model, num_clients: int, alpha: float, beta: float, seed: int, size: int | None,
                 batch_size: int, dtype: torch.dtype, device: str | torch.device, cache_mb: float,
                 eval_clients: int, memory_budget: int | None = None):
        self.memory_budget = memory_budget  # bytes; evaluation and executors fit within it (None: no bound)
        self.objective, self.alpha, self.beta, self.seed, self.size = objective, alpha, beta, seed, size
        self.num_clients, self.dim, self.batch_size = num_clients, objective.dim, batch_size
        self.dtype, self.device = dtype, torch.device(device)
        self.sizes = (ClientSizes(num_clients, constant=synthetic.split_train_test(size)) if size is not None else
                      ClientSizes(num_clients, lambda k: synthetic.train_sizes(seed, k)))
        self.weights = ClientWeights(self.sizes)
        self.cache_limit_bytes = int(cache_mb * 2**20)
        self.eval_clients = min(eval_clients, num_clients)
        exact = num_clients <= eval_clients  # else a fixed uniform sample, with replacement, by the data seed
        self.eval_draws = np.arange(num_clients) if exact else sample_clients(seed, num_clients, eval_clients)
        self.eval_ids, self.eval_inverse = np.unique(self.eval_draws, return_inverse=True)
        self._cache: OrderedDict[int, synthetic.ClientParams] = OrderedDict()
        self.cached_bytes = 0
        self._eval: DataProblem | None = None
        self.generated = 0  # client parameters built so far (cache misses), for benchmarks

    # ------------------------------------------------------------ clients on demand

    def _params(self, k: int) -> synthetic.ClientParams:
        hit = self._cache.get(k)
        if hit is not None:
            self._cache.move_to_end(k)
            return hit
        params = synthetic.client_params(self.seed, k, self.alpha, self.beta)
        self.generated += 1
        self._cache[k] = params
        self.cached_bytes += PARAMS_BYTES
        while self.cached_bytes > self.cache_limit_bytes and self._cache:
            self._cache.popitem(last=False)
            self.cached_bytes -= PARAMS_BYTES
        return params

    def rows(self, k: int, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Training samples `index` of client k (features as generated, labels)."""
        return synthetic.client_rows(self.seed, k, index, self._params(k))

    def round_batches(self, keys: ClientKeys, steps: int) -> LazyBatches:
        local = minibatch_samples(keys, steps, self.batch_size, self.sizes[keys.clients])
        parts = [self.rows(int(k), idx) for k, idx in zip(keys.clients, local)]
        data = RoundData(self.objective, self.objective.prepare(np.concatenate([p[0] for p in parts]), self.dtype,
                                                                self.device),
                         torch.as_tensor(np.concatenate([p[1] for p in parts]), device=self.device))
        index = np.arange(local.size, dtype=np.int64).reshape(local.shape)
        return LazyBatches(data, batches_from_index(self.objective, keys, index, steps, self.batch_size,
                                                    data.sample_numel, self.device))

    def entry_bytes(self, steps: int) -> int:
        """DataProblem's, plus the round's generated rows of the copy (steps x b samples)."""
        item = torch.empty((), dtype=self.dtype).element_size()
        return DataProblem.entry_bytes(self, steps) + steps * self.batch_size * self.sample_numel * item

    def grad(self, w: torch.Tensor, batches: LazyBatches, step: int) -> torch.Tensor:
        return DataProblem.grad(batches.data, w, batches.batches, step)

    def loop_grad(self, w: torch.Tensor, batches: LazyBatches, step: int) -> torch.Tensor:
        return DataProblem.loop_grad(batches.data, w, batches.batches, step)

    # ------------------------------------------------------------ evaluation on every client or a sample of them

    def eval_problem(self) -> DataProblem:
        """The evaluated clients (all, or the distinct sampled ones) as an ordinary DataProblem (built on first use;
        shards never need it)."""
        if self._eval is None:
            xs, ys, xts, yts = [], [], [], []
            for k in self.eval_ids:
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

    def evaluate(self, w: torch.Tensor, grad_norm: bool = True) -> Evaluation:
        """Exact metrics while N <= eval_clients; above, train_loss estimated from the sample, with its standard
        error (the other metrics: the sampled clients' data pooled)."""
        ev = self.eval_problem().evaluate(w, grad_norm)
        if len(self.eval_draws) < self.num_clients:
            ev.train_loss, ev.train_loss_se = weighted_sum_estimate(
                self.weights[self.eval_draws], self.client_train_losses(w)[:, self.eval_inverse], self.num_clients)
        return ev

    def client_train_losses(self, w: torch.Tensor) -> np.ndarray:
        """F_k(w) of the distinct evaluated clients (their mean training loss plus the regularizer), [R, U]."""
        p = self.eval_problem()
        index = [np.arange(o, o + n) for o, n in zip(p.offsets, p.sizes)]
        scores = client_scores(self.objective, p.x, p.y, index, w, np.arange(len(index)), p.eval_chunk(w.shape[0]))
        return scores.loss + self.objective.regularizer(w).double().cpu().numpy()[:, None]


@DATASETS.register("synthetic_lazy", KEYS)
def build_lazy_synthetic(model: Callable[[tuple[int, ...], int], Model], num_clients: int, alpha: float, beta: float,
                         samples_per_client: int | None, cache_mb: float, eval_clients: int | None, seed: int,
                         batch_size: int, dtype: torch.dtype, device: str,
                         memory_budget: int | None) -> LazySyntheticProblem:
    """`dataset=synthetic_lazy`: `dataset=synthetic`'s clients, generated when sampled; `model(in_shape,
    num_classes)` builds the model the config names (problems.build_problem's)."""
    eval_clients = DEFAULT_EVAL_CLIENTS if eval_clients is None else eval_clients  # eval.clients
    return LazySyntheticProblem(model((synthetic.FEATURES,), synthetic.CLASSES), num_clients, alpha, beta, seed,
                                samples_per_client, batch_size, dtype, device, cache_mb, eval_clients, memory_budget)
