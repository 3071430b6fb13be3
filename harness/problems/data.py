"""A federated problem over data: clients' samples stored back to back, minibatches drawn by key."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from typing import Mapping

from fedharness.contracts import (ClientKeys, ClientScores, ClosedFormTerms, Evaluation, ExactSolve, Model, Problem,
                                  SampleTerms)
from fedharness.base import streams
from fedharness.problems.client_eval import client_scores, copy_scores
from fedharness.problems.estimate import (AUTO_EXACT_SAMPLES, AUTO_SAMPLES, GRAD_GROUPS, TEST_ROWS, mean_estimate,
                                          sample_rows, squared_norm_estimate)
from fedharness.errors import require

EVAL_CHUNK = 16384  # samples per evaluation chunk: bounds memory for large data sets
# Samples per chunk of a closed-form evaluation (contracts.ClosedFormTerms): small enough that a few replicas'
# logits stay in cache, large enough that the per-chunk calls cost little at one replica. It does not depend
# on the replica count (only eval_chunk's memory cap may lower it), so neither does a replica's chunked sum.
CLOSED_FORM_CHUNK = 2048
GATHER_ELEMENTS = 1 << 20  # floats gathered at once when prefetching a round's minibatches


@dataclass
class RoundBatches:
    """A round's minibatch indices [M, steps, b]; the features are gathered a chunk of steps at a time."""

    index: torch.Tensor
    chunk_steps: int = 1
    chunk_start: int = -1
    chunk: tuple[torch.Tensor, ...] = ()
    seeds: np.ndarray | None = None  # [M, steps] int64 of a stochastic model (dropout), from the DROPOUT streams
    rows: torch.Tensor | None = None  # the gathered samples of a chunk, reused by the next chunk of the round

    def gather(self, x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """x's rows `flat` into the round's buffer: a chunk of a large batch is megabytes, and allocating it
        anew each step makes the allocator hand pages back and fault them in again (a tenth of a 64-replica
        step's time)."""
        if self.rows is None or len(self.rows) < len(flat) or self.rows.dtype != x.dtype:
            self.rows = torch.empty(len(flat), *x.shape[1:], dtype=x.dtype, device=x.device)
        return torch.index_select(x, 0, flat, out=self.rows[:len(flat)])


def minibatch_samples(keys: ClientKeys, steps: int, batch_size: int, sizes: np.ndarray) -> np.ndarray:
    """[M, steps * b] int64: which of its own samples (0..n_k-1) each client copy reads at each local step,
    from the BATCH streams keyed by (seed, replica, round, client); `sizes` are the copies' n_k."""
    key = streams.stream_key(keys.seed, streams.BATCH, keys.replicas, keys.round, keys.clients)
    return streams.integers(key, steps * batch_size, sizes)


def batches_from_index(objective: Model, keys: ClientKeys, index: np.ndarray, steps: int, batch_size: int,
                       sample_numel: int, device: torch.device) -> RoundBatches:
    """RoundBatches over rows `index` [M, steps * b] of a training array (and the dropout seeds of a
    stochastic model, keyed like the minibatches)."""
    per_step = len(keys.clients) * batch_size * sample_numel
    chunk = max(1, min(steps, GATHER_ELEMENTS // max(per_step, 1)))
    seeds = None
    if objective.stochastic:  # one seed per copy and step, keyed like the minibatches
        seeds = streams.seeds(streams.stream_key(keys.seed, streams.DROPOUT, keys.replicas, keys.round,
                                                 keys.clients), steps)
    return RoundBatches(torch.from_numpy(index.reshape(len(keys.clients), steps, batch_size)).to(device),
                        chunk_steps=chunk, seeds=seeds)


def _rows(x: np.ndarray, order: np.ndarray) -> np.ndarray:
    """x's rows in `order`; x itself where that is every row in place (a memory-mapped cache stays unread)."""
    if len(order) == len(x) and np.array_equal(order, np.arange(len(x))):
        return x
    return x[order]


class DataProblem(Problem, ExactSolve):
    """Clients own contiguous slices of one training array; the test set is pooled.

    `memory_budget` (bytes, None: no limit; build_problem passes memory_budget_gb's) bounds the
    samples evaluated at once, besides the EVAL_CHUNK cap. `client_test` (eval.per_client): each client's held-out
    samples as indices into x_test (problems/client_eval.py). `eval_samples` (eval.samples, resolved by
    eval_sample_size; None: every sample): evaluation reads a fixed sample of that many training samples, drawn
    uniformly with replacement by `eval_seed`, and as many test samples where the test set has more
    (evaluate_sample). `training_clients` (dataset.unseen_clients; None: all): the first clients are the training
    population, the rest unseen (problems/unseen.py): the weights, the objective and its evaluation are the
    training clients' alone.
    """

    def __init__(self, objective: Model, x_train: np.ndarray, y_train: np.ndarray, client_index: list[np.ndarray],
                 x_test: np.ndarray | None, y_test: np.ndarray | None, batch_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 memory_budget: int | None = None, client_test: list[np.ndarray] | None = None,
                 x_scale: float | None = None, eval_samples: int | None = None, eval_seed: int = 0,
                 training_clients: int | None = None):
        self.objective, self.memory_budget, self.client_test = objective, memory_budget, client_test
        self.training_clients = training_clients
        self.eval_samples, self.eval_seed = eval_samples, eval_seed
        self.dtype, self.device = dtype, torch.device(device)
        self.num_clients = len(client_index)
        self.dim = objective.dim
        self.convex = objective.convex
        self.batch_size = batch_size
        self.sizes = np.array([len(ix) for ix in client_index], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        trains = np.arange(self.num_clients) < (training_clients or self.num_clients)
        self.weights = np.where(trains, self.sizes, 0) / self.sizes[trains].sum()
        order = np.concatenate(client_index)
        # Compact samples (uint8 pixel codes, integer token ids) stay compact and are made what the model takes
        # one minibatch or evaluation chunk at a time: FEMNIST's 800k images are 0.6 GB so, 2.5 GB as float32.
        self.x_scale, self.compact = x_scale, not np.issubdtype(x_train.dtype, np.floating)
        x_ordered = _rows(x_train, order)
        self._raw = (x_ordered, y_train[order], x_test, y_test)
        self.x = self._store(x_ordered)
        self.y = torch.as_tensor(y_train[order], dtype=torch.int64, device=self.device)
        self.x_test = None if x_test is None else self._store(x_test)
        self.y_test = None if y_test is None else torch.as_tensor(y_test, dtype=torch.int64, device=self.device)
        self.sample_numel = self.x[0].numel()
        rows = int(self.sizes[trains].sum())  # the training clients' samples: a prefix (they are numbered first)
        self.train_x, self.train_y = self.x[:rows], self.y[:rows]
        self.eval_groups = self.eval_test_rows = None  # evaluation over every sample
        if eval_samples is not None:  # GRAD_GROUPS groups of consecutive draws, each read in storage order
            draws = sample_rows(eval_seed, eval_samples, len(self.train_y))
            self.eval_groups = [torch.as_tensor(np.sort(g), device=self.device)
                                for g in np.array_split(draws, GRAD_GROUPS)]
            if self.y_test is not None and len(self.y_test) > eval_samples:
                self.eval_test_rows = torch.as_tensor(
                    np.sort(sample_rows(eval_seed, eval_samples, len(self.y_test), TEST_ROWS)), device=self.device)

    def _store(self, x: np.ndarray) -> torch.Tensor:
        """Samples as kept: compact ones as they are, others as the model takes them."""
        if self.compact:
            return torch.from_numpy(x).to(self.device)
        return self.objective.prepare(x, self.dtype, self.device)

    def _model_input(self, x: torch.Tensor) -> torch.Tensor:
        """Stored rows [m, ...] as the model takes them (compact: scaled pixels in the run's dtype, or token ids
        as int64)."""
        if not self.compact:
            return x
        if self.x_scale is not None:
            return self.objective.prepare(x.to(self.dtype).mul_(self.x_scale), self.dtype, self.device)
        return self.objective.prepare(x.to(torch.int64), self.dtype, self.device)

    def with_dtype(self, dtype: torch.dtype) -> "DataProblem":
        """The same problem with tensors in another dtype (the reference solver runs in float64)."""
        x, y, xt, yt = self._raw
        index = [np.arange(o, o + n) for o, n in zip(self.offsets, self.sizes)]
        return DataProblem(self.objective, x, y, index, xt, yt, self.batch_size, dtype, self.device, self.memory_budget,
                           self.client_test, self.x_scale, self.eval_samples, self.eval_seed,
                           self.training_clients)

    def init_params(self, replicas: int, seed: int) -> torch.Tensor:
        return self.objective.init(replicas, seed, self.dtype).to(self.device)

    def labels_flipped(self) -> "DataProblem":
        """This problem with each training label y read as C - 1 - y, C = the largest label + 1 (attack=label_flip:
        what a Byzantine client trains on); x and everything else shared."""
        view = copy.copy(self)
        classes = int(max(self.y.max(), -1 if self.y_test is None else self.y_test.max())) + 1
        view.y = classes - 1 - self.y
        return view

    def round_batches(self, keys: ClientKeys, steps: int) -> RoundBatches:
        local = minibatch_samples(keys, steps, self.batch_size, self.sizes[keys.clients])
        return batches_from_index(self.objective, keys, local + self.offsets[keys.clients][:, None], steps,
                                  self.batch_size, self.sample_numel, self.device)

    def grad(self, w: torch.Tensor, batches: RoundBatches, step: int) -> torch.Tensor:
        """Minibatch gradients of the first len(w) clients of `batches` (the executor trains a prefix that
        shrinks as clients finish, so a chunk gathered for more rows serves the later, smaller prefixes)."""
        t, m = step - batches.chunk_start, len(w)
        if not 0 <= t < batches.chunk_steps or not batches.chunk:
            idx = batches.index[:m, step:step + batches.chunk_steps]
            flat = idx.reshape(-1)  # index_select is about twice as fast as advanced indexing here
            rows = self._model_input(batches.gather(self.x, flat))
            x = rows.view(*idx.shape, *rows.shape[1:])
            batches.chunk = self.objective.prepare_chunk(x, self.y.index_select(0, flat).view(idx.shape))
            batches.chunk_start, t = step, 0
        if batches.seeds is not None:
            return self.objective.batch_grad(w, tuple(part[:m, t] for part in batches.chunk),
                                             seeds=batches.seeds[:m, step])
        if m < len(batches.chunk[0]):  # slicing costs microseconds a step: only when clients have finished
            return self.objective.batch_grad(w, tuple(part[:m, t] for part in batches.chunk))
        return self.objective.batch_grad(w, tuple(part[:, t] for part in batches.chunk))

    def loop_grad(self, w: torch.Tensor, batches: RoundBatches, step: int) -> torch.Tensor:
        """The same minibatch gradient by plain autograd on the loss, one client at a time (slow path)."""
        require(not (self.objective.buffer_dim or self.objective.stochastic), "executor", "loop",
                f"inline | ray: model {self.objective.name} has buffers or dropout, which the loop executor's "
                "eval-mode loss does not train")
        idx = batches.index[0, step]
        w = w.detach().requires_grad_(True)
        loss, _ = self.objective.loss_terms(w, self._model_input(self.x[idx]), self.y[idx])
        (g,) = torch.autograd.grad(loss.sum() / len(idx) + self.objective.regularizer(w).sum(), w)
        return g

    def full_grads(self, w: torch.Tensor, clients: np.ndarray) -> torch.Tensor:
        """Each client's full-batch gradient (its mean loss over all its samples plus the regularizer): the model's
        own batched gradient with the client's samples as one minibatch, one client at a time (Mime and MimeLite:
        once a round per sampled client; the kernels the local steps take, so the same bits in every process)."""
        out = torch.empty(w.shape, dtype=torch.float64, device=w.device)
        for m, k in enumerate(np.asarray(clients).tolist()):
            rows = torch.arange(int(self.offsets[k]), int(self.offsets[k] + self.sizes[k]), device=self.device)
            x = self._model_input(self.x.index_select(0, rows))
            chunk = self.objective.prepare_chunk(x[None, None], self.y.index_select(0, rows)[None, None])
            out[m] = self.objective.batch_grad(w[m:m + 1], tuple(part[:, 0] for part in chunk))[0].double()
        return out

    def entry_bytes(self, steps: int) -> int:
        """Bytes one client copy of a batched local step needs besides its parameter vectors: its minibatch
        indices for the round, one step's gathered features, and the model's activations."""
        item = torch.empty((), dtype=self.dtype).element_size()
        b = self.batch_size
        return steps * b * 8 + 2 * b * self.sample_numel * item + self.objective.activation_bytes(b, item)

    def eval_chunk(self, replicas: int) -> int:
        """Samples evaluated at once: EVAL_CHUNK, fewer if `replicas` models' activations would not fit."""
        if self.memory_budget is None:
            return EVAL_CHUNK
        item = torch.empty((), dtype=self.dtype).element_size()
        per_sample = replicas * (self.sample_numel * item + self.objective.activation_bytes(1, item))
        return int(max(1, min(EVAL_CHUNK, self.memory_budget // per_sample)))

    def _mean_loss(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, terms=None,
                   chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean loss and accuracy per replica, one chunk of samples at a time, summed in float64. `terms`: the
        model's per-chunk (summed loss, correct count) function (default loss_terms), `chunk` its chunk size."""
        terms = terms or self.objective.loss_terms
        loss = torch.zeros(w.shape[0], dtype=torch.float64, device=w.device)
        correct = torch.zeros(w.shape[0], dtype=torch.float64, device=w.device)
        chunk = chunk or self.eval_chunk(w.shape[0])
        for start in range(0, len(y), chunk):
            l, c = terms(w, self._model_input(x[start:start + chunk]), y[start:start + chunk])
            loss, correct = loss + l.double(), correct + c.double()
        return loss / len(y), correct / len(y)

    def objective_value(self, w: torch.Tensor) -> torch.Tensor:
        """F(w) = sum_k p_k F_k(w) per replica, differentiable (p_k = n_k / n, so a mean over all samples)."""
        return self._mean_loss(w, self.train_x, self.train_y)[0] + self.objective.regularizer(w).double()

    def _closed_form_chunk(self, replicas: int) -> int:
        return min(CLOSED_FORM_CHUNK, self.eval_chunk(replicas))

    def _data_sums(self, w: torch.Tensor, grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The summed training loss [R] and, if `grad`, its gradient [R, dim] (else None), both accumulated in
        float64, one chunk of samples at a time: in closed form where the model has one (no graph, no argmax),
        else by autograd, each chunk's graph freed before the next. Without `grad`, no graph is kept: the
        closed form's summed_loss (the same bits), or the forward pass under torch.no_grad (the same bits where
        the model's layers take the same kernels without a graph; a recurrent layer's may differ in the last
        bits)."""
        value = torch.zeros(w.shape[0], dtype=torch.float64, device=w.device)
        total = torch.zeros(w.shape, dtype=torch.float64, device=w.device) if grad else None
        closed_form = isinstance(self.objective, ClosedFormTerms)
        chunk = self._closed_form_chunk(w.shape[0]) if closed_form else self.eval_chunk(w.shape[0])
        for start in range(0, len(self.train_y), chunk):
            x, y = self._model_input(self.train_x[start:start + chunk]), self.train_y[start:start + chunk]
            if closed_form and total is None:
                value.add_(self.objective.summed_loss(w, x, y))
            elif total is None:  # no gradient: no graph kept
                with torch.no_grad():
                    value = value + self.objective.loss_terms(w, x, y)[0].double()
            elif closed_form:
                loss, g = self.objective.loss_and_grad(w, x, y)
                value, total = value.add_(loss), total.add_(g)
            else:
                wg = w.clone().requires_grad_(True)
                loss, _ = self.objective.loss_terms(wg, x, y)
                value = value + loss.detach().double()
                (g,) = torch.autograd.grad(loss.sum(), wg)
                total = total + g.double()
        return value, total

    def _objective(self, w: torch.Tensor, grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """F [R] (float64) and, if `grad`, its gradient [R, dim] in w's dtype (else None); the data terms' sums
        accumulate in float64 (_data_sums)."""
        w = w.detach()
        value, data_grad = self._data_sums(w, grad)
        n = len(self.train_y)
        if data_grad is None:
            return value / n + self.objective.regularizer(w).double(), None
        wg = w.clone().requires_grad_(True)
        reg = self.objective.regularizer(wg)
        (g,) = torch.autograd.grad(reg.sum(), wg)
        return value / n + reg.detach().double(), (data_grad / n + g.double()).to(w.dtype)

    def objective_and_grad(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """F and its gradient; the data terms' sums accumulate in float64 (_data_sums)."""
        return self._objective(w, grad=True)

    def _test_metrics(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean test loss and accuracy per replica, without a graph (in closed form where the model has one), over
        the test set or its fixed sample (eval_test_rows)."""
        x, y = self.x_test, self.y_test
        if self.eval_test_rows is not None:
            x, y = x.index_select(0, self.eval_test_rows), y.index_select(0, self.eval_test_rows)
        if not isinstance(self.objective, ClosedFormTerms):
            with torch.no_grad():
                return self._mean_loss(w, x, y)
        return self._mean_loss(w, x, y, self.objective.loss_and_correct, self._closed_form_chunk(w.shape[0]))

    def data_split(self, split: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        if split == "train":
            return self._model_input(self.train_x), self.train_y
        return None if self.x_test is None else (self._model_input(self.x_test), self.y_test)

    def _sample_losses(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Each sample's data loss per replica [R, n] (contracts.SampleTerms; a model without it: one sample at a
        time by loss_terms)."""
        if isinstance(self.objective, SampleTerms):
            return self.objective.sample_terms(w, x, y)[0]
        return torch.stack([self.objective.loss_terms(w, x[i:i + 1], y[i:i + 1])[0] for i in range(len(y))], 1)

    def _group_terms(self, w: torch.Tensor, rows: torch.Tensor,
                     grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampled rows' data losses [R, m] (float64) and, if `grad`, their gradients' sum [R, dim] (float64),
        a chunk at a time; a graph only where a gradient is taken, freed with its chunk."""
        losses, total = [], torch.zeros(w.shape, dtype=torch.float64, device=w.device) if grad else None
        closed_form = isinstance(self.objective, ClosedFormTerms)
        chunk = self._closed_form_chunk(w.shape[0]) if closed_form else self.eval_chunk(w.shape[0])
        for start in range(0, len(rows), chunk):
            take = rows[start:start + chunk]
            x, y = self._model_input(self.train_x.index_select(0, take)), self.train_y.index_select(0, take)
            if grad and not closed_form:
                wg = w.clone().requires_grad_(True)
                loss = self._sample_losses(wg, x, y)
                (g,) = torch.autograd.grad(loss.sum(), wg)
                losses.append(loss.detach().double())
                total.add_(g.double())
                continue
            with torch.no_grad():
                losses.append(self._sample_losses(w, x, y).double())
            if grad:
                total.add_(self.objective.loss_and_grad(w, x, y)[1].double())
        return torch.cat(losses, 1), total

    def evaluate_sample(self, w: torch.Tensor, grad_norm: bool) -> Evaluation:
        """train_loss and grad_norm_sq from the fixed sample (problems/estimate.py): F's estimate, the mean loss
        of the S draws plus the regularizer, with its standard error std(ddof=1) / sqrt(S); ||grad F||^2's
        unbiased estimate from the gradient sums of GRAD_GROUPS groups of the draws (squared_norm_estimate)."""
        w = w.detach()
        parts = [self._group_terms(w, rows, grad_norm) for rows in self.eval_groups]
        estimate, se = mean_estimate(torch.cat([p[0] for p in parts], 1).cpu().numpy())
        with torch.no_grad():
            reg = self.objective.regularizer(w).double().cpu().numpy()
        out = Evaluation(train_loss=estimate + reg, grad_norm_sq=None, train_loss_se=se)
        if grad_norm:  # each draw's gradient is its data term's plus the regularizer's
            wg = w.clone().requires_grad_(True)
            (reg_grad,) = torch.autograd.grad(self.objective.regularizer(wg).sum(), wg)
            sums = [(g + len(rows) * reg_grad.double()).cpu().numpy() for (_, g), rows in zip(parts, self.eval_groups)]
            out.grad_norm_sq = squared_norm_estimate(sums, [len(rows) for rows in self.eval_groups])
        return out

    def evaluate(self, w: torch.Tensor, grad_norm: bool = True) -> Evaluation:
        if self.eval_groups is not None:
            out = self.evaluate_sample(w, grad_norm)
        else:
            train_loss, g = self._objective(w, grad=grad_norm)
            out = Evaluation(train_loss=train_loss.cpu().numpy(),
                             grad_norm_sq=None if g is None else (g.double() ** 2).sum(-1).cpu().numpy())
        if self.x_test is not None:
            loss, acc = self._test_metrics(w.detach())
            out.test_loss, out.test_acc = loss.cpu().numpy(), acc.cpu().numpy()
        return out

    def client_scores(self, w: torch.Tensor, clients: np.ndarray,
                      buffers: Mapping[tuple[int, int], torch.Tensor] | None = None) -> ClientScores:
        """Each of `clients` on its own held-out samples (contracts.ClientEvaluation; problems/client_eval.py)."""
        require(self.client_test is not None and self.x_test is not None, "eval.per_client", True,
                "a data set with a test set, built with eval.per_client=true")
        # compact samples (uint8 pixels, token ids) as the model takes them: one pass over the test set
        x_test = self._model_input(self.x_test)
        return client_scores(self.objective, x_test, self.y_test, self.client_test, w, clients,
                             self.eval_chunk(w.shape[0]), buffers)


    def copy_scores(self, w: torch.Tensor, clients: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Model w[m] on client clients[m]'s held-out samples (contracts.CopyEvaluation; problems/client_eval.py)."""
        require(self.client_test is not None and self.x_test is not None, "eval.per_client", True,
                "a data set with a test set, built with eval.per_client=true")
        return copy_scores(self.objective, self._model_input(self.x_test), self.y_test, self.client_test, w,
                           clients, self.eval_chunk(1))


def eval_sample_size(setting: int | str | None, train_samples: int) -> int | None:
    """eval.samples as DataProblem takes it: None (every sample) for `all`, and for null while the training set
    has at most AUTO_EXACT_SAMPLES samples; else how many samples evaluation draws (null: AUTO_SAMPLES)."""
    if setting == "all" or (setting is None and train_samples <= AUTO_EXACT_SAMPLES):
        return None
    if setting is None:
        return AUTO_SAMPLES
    require(setting <= train_samples, "eval.samples", setting,
            f"at most the {train_samples:,} training samples (all: every one, exactly; null: the default)")
    return int(setting)
