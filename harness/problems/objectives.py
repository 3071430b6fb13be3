"""Per-sample losses of a model over flat parameters, batched over many client copies.

`batch_grad` is the hot path: one call computes the minibatch gradient of M
client copies at once. Linear models use their closed-form gradient (two bmm
calls and a softmax); neural networks use torch.func.vmap over grad.
"""

from __future__ import annotations

import contextlib
import logging
import math

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_leaves

from fedharness.contracts import Model
from fedharness.errors import ConfigError, require
from fedharness.keys import choice, number
from fedharness.problems.module_state import ModuleLayout, draw_masks, dropout_sites, masked_dropout
from fedharness.problems.pooled import PooledData
from fedharness.registry.groups import DATASETS, MODELS

L2 = number("l2 weight: + l2 ||w||^2", lo=0)  # `model.l2`, the key of every model but the quadratic's
BUFFERS = choice("a net's float buffers (BatchNorm statistics): average (weighted like the clients' updates) | "
                 "local (each client keeps its own between rounds, FedBN)", ("average", "local"))  # `model.buffers`

log = logging.getLogger(__name__)


class SoftmaxRegression(Model):
    """Multinomial logistic regression, cross-entropy + l2 * ||w||^2 (Li et al.; bias included).

    Parameters are stored class-major, W [C, d+1] per client, so that both batched
    products of a step take contiguous operands: logits^T = W X^T and grad = (P - Y)^T X.
    """

    name = "logreg"
    convex = True

    def __init__(self, in_shape: tuple[int, ...], num_classes: int, l2: float):
        self.d = math.prod(in_shape) + 1  # +1: bias, via a column of ones
        self.num_classes = num_classes
        self.l2 = l2
        self.dim = self.d * num_classes
        self.head = (0, self.dim)  # a linear model's last layer is all of it (FedRep: local training)
        self._minus_ones: dict[tuple, torch.Tensor] = {}
        self._aligned: dict[tuple, tuple] = {}  # (M, dtype, device) -> _aligned_matrix's buffer, flat and [M, C, d]

    def prepare(self, x: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        flat = torch.as_tensor(x.reshape(len(x), -1), dtype=dtype)
        return torch.cat([flat, torch.ones(len(x), 1, dtype=dtype)], 1).to(device)

    def prepare_chunk(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Minibatches [M, T, b, d] of T steps, each on an ALIGN_BYTES boundary (aligned_blocks); the transposed view
        costs less than a transposed copy."""
        x = aligned_blocks(x, 2)
        return x, x.transpose(-1, -2), y.unsqueeze(2)

    def init(self, replicas: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(replicas, self.dim, dtype=dtype)  # w_0 = 0 as in Li et al.

    def _matrix(self, w: torch.Tensor) -> torch.Tensor:
        return w.view(*w.shape[:-1], self.num_classes, self.d)

    def _aligned_matrix(self, w: torch.Tensor) -> torch.Tensor:
        """Each copy's W [C, d] on an ALIGN_BYTES boundary (aligned_blocks' why), copied into a buffer kept per shape
        with a flat view of it: a new buffer, or a view taken each step, cost more than the copy."""
        key = (w.shape[0], w.dtype, w.device)
        if key not in self._aligned:
            m = aligned_empty(torch.Size((w.shape[0], self.num_classes, self.d)), 1, w.dtype, w.device)
            self._aligned[key] = (m.as_strided(w.shape, (m.stride(0), 1)), m)
        rows, m = self._aligned[key]
        rows.copy_(w)
        return m

    def _minus(self, y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """-1/b at every label position (cached): subtracts onehot(y)/b from the scaled residual."""
        key = (tuple(y.shape), like.dtype, like.device)
        if key not in self._minus_ones:
            self._minus_ones[key] = torch.full(y.shape, -1.0 / y.shape[-1], dtype=like.dtype, device=like.device)
        return self._minus_ones[key]

    def _scaled_softmax(self, logits_t: torch.Tensor) -> torch.Tensor:
        """softmax over classes (dim 1) divided by the batch size, in place. Shifting by the mean, not the
        max, is exact and several times faster on small class counts; it overflows only if a logit exceeds
        the mean by ~88 (float32), which only a diverging run reaches, and that NaN is recorded as divergence."""
        logits_t.sub_(logits_t.mean(1, keepdim=True)).exp_()
        return logits_t.div_(logits_t.sum(1, keepdim=True).mul_(logits_t.shape[-1]))

    def _gradient(self, w: torch.Tensor, resid: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """resid [M, C, b] (already divided by b) times the minibatch, plus the l2 term."""
        g = torch.bmm(aligned_blocks(resid, 1), x).view(w.shape[0], -1)
        return g.add_(w, alpha=2.0 * self.l2) if self.l2 else g

    def batch_grad(self, w: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, xt, y = batch
        if len(w) == 1:  # bmm runs one matrix as a plain GEMM, threaded within it: other bits than in a batch
            x = aligned_blocks(x.repeat(2, 1, 1), 1)
            return self.batch_grad(w.repeat(2, 1), (x, x.transpose(-1, -2), y.repeat(2, 1, 1)))[:1]
        resid = self._scaled_scores(torch.bmm(self._aligned_matrix(w), xt))  # [M, C, b]
        resid.scatter_add_(1, y, self._minus(y, resid))  # (scores - onehot) / b
        return self._gradient(w, resid, x)

    def _scaled_scores(self, logits_t: torch.Tensor) -> torch.Tensor:
        """The scores whose residual from onehot(y) is the loss's gradient by logit, divided by the batch size."""
        return self._scaled_softmax(logits_t)

    def logits(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self._matrix(w).transpose(-1, -2))  # [R, n, C]

    def loss_terms(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed data loss and number of correct predictions, per replica: ([R], [R])."""
        logits = self.logits(w, x)
        logp = torch.log_softmax(logits, dim=-1)
        nll = -logp.gather(2, y.expand(w.shape[0], -1).unsqueeze(-1)).squeeze(-1)
        return nll.sum(-1), (logits.argmax(-1) == y).sum(-1)

    def sample_terms(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sample's cross-entropy and correctness per replica: ([R, n], [R, n]) (contracts.SampleTerms)."""
        logits = self.logits(w, x)
        nll = -torch.log_softmax(logits, dim=-1).gather(2, y.expand(w.shape[0], -1).unsqueeze(-1)).squeeze(-1)
        return nll, logits.argmax(-1) == y

    def regularizer(self, w: torch.Tensor) -> torch.Tensor:
        return self.l2 * (w * w).sum(-1)

    def activation_bytes(self, batch: int, itemsize: int) -> int:
        """Bytes one client copy's minibatch gradient holds besides parameters and features: the logits."""
        return 2 * batch * self.num_classes * itemsize

    # --- evaluation in closed form (contracts.ClosedFormTerms): no autograd, no train-set argmax ---------------

    def _logits_by_class(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[R, C, n]: each replica's own product W_r X^T (bmm over replicas, never one GEMM over all of them, so
        a replica's numbers do not depend on the replicas beside it); reductions over classes then run over
        dim 1, along contiguous rows of samples, the fastest layout for the loss and its gradient."""
        return torch.bmm(self._matrix(w), x.t().expand(w.shape[0], -1, -1))

    @staticmethod
    def _exp_shifted(logits: torch.Tensor, top: torch.Tensor, labels: torch.Tensor,
                     dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """In place: logits become exp(logits - top) (classes along `dim`). Returns them, their sum over classes
        and each replica's summed cross-entropy [R] in float64 (log-sum-exp minus the label's logit; shifting by
        the largest logit keeps a large logit finite)."""
        picked = logits.sub_(top).gather(dim, labels)
        exps = logits.exp_()
        total = exps.sum(dim, keepdim=True)
        return exps, total, (total.log() - picked).sum((1, 2), dtype=torch.float64)

    def _class_terms(self, w: torch.Tensor, x: torch.Tensor,
                     y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The labels [R, 1, n] and _exp_shifted's exps [R, C, n], their sums over classes and the summed
        cross-entropy [R] (float64), by class."""
        labels = y.view(1, 1, -1).expand(w.shape[0], 1, -1)
        logits = self._logits_by_class(w, x)
        return labels, *self._exp_shifted(logits, logits.amax(1, keepdim=True), labels, 1)

    def summed_loss(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """loss_and_grad's summed cross-entropy [R] (float64), the same bits: one product per chunk, not two."""
        return self._class_terms(w, x, y)[3]

    def loss_and_grad(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed cross-entropy [R] (float64) and its gradient sum_i (softmax_i - onehot(y_i)) x_i^T [R, dim]."""
        labels, exps, total, loss = self._class_terms(w, x, y)
        resid = _minus_onehot(exps.div_(total), labels, 1)
        return loss, _data_gradient(resid, x)

    def loss_and_correct(self, w: torch.Tensor, x: torch.Tensor,
                         y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """By sample ([R, n, C], loss_terms's logits): a sample's logits, and so which class wins a near-tie,
        do not depend on how many samples share its chunk (those of W X^T do)."""
        labels = y.view(1, -1, 1).expand(w.shape[0], -1, 1)
        logits = self.logits(w, x)
        top, predicted = logits.max(-1, keepdim=True)  # max's index is argmax's (the first maximum)
        _, _, loss = self._exp_shifted(logits, top, labels, -1)
        return loss, (predicted == labels).sum((1, 2))


# MKL's kernels (AVX-512 host, torch 2.14's MKL 2024.2) gave other bits for operands 4, 8 or 12 bytes off a 16-byte
# boundary and the same bits at offsets of 16, 32 and 48 bytes (float32 and float64, both operands, 1 and 2
# threads): 16 bytes keeps the minibatch chunk of common shapes (b * d a multiple of 4 floats) uncopied.
ALIGN_BYTES = 16


def aligned_blocks(t: torch.Tensor, lead: int) -> torch.Tensor:
    """t (contiguous) with each block t[i] (i over the first `lead` dims) starting on an ALIGN_BYTES boundary: t
    itself where its blocks already do, else a copy whose blocks' storage is padded (aligned_empty).
    Why: MKL's small GEMM (and bmm, which runs one per matrix) sums in an order that depends on its operands'
    addresses modulo 16 bytes, so a client's product packed at k * C * d floats into a batch gave other bits
    than the same client at position 0 (a shard of one): operands aligned alike give every client the same
    kernel wherever it sits."""
    step = ALIGN_BYTES // t.element_size()
    if math.prod(t.shape[lead:]) % step == 0 and t.is_contiguous() and t.data_ptr() % ALIGN_BYTES == 0:
        return t
    return aligned_empty(t.shape, lead, t.dtype, t.device).copy_(t)


def aligned_empty(shape: torch.Size, lead: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor of `shape` whose blocks (over the first `lead` dims) start on ALIGN_BYTES
    boundaries: each block's storage padded (torch's CPU and CUDA allocators align the base)."""
    n, step = math.prod(shape[lead:]), ALIGN_BYTES // dtype.itemsize
    buf = torch.empty(*shape[:lead], -(-n // step) * step, dtype=dtype, device=device)
    return buf[..., :n].view(shape)


def _minus_onehot(scores: torch.Tensor, labels: torch.Tensor, dim: int) -> torch.Tensor:
    """scores minus onehot(labels) along `dim` (labels: scores' shape with 1 there), in place."""
    return scores.scatter_add_(dim, labels, torch.full((), -1.0, dtype=scores.dtype, device=scores.device)
                               .expand(labels.shape))


def _data_gradient(resid: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """resid [R, C, n] times the samples x [n, d]: [R, C * d], each replica's own product."""
    return torch.bmm(resid, x.expand(resid.shape[0], -1, -1)).view(resid.shape[0], -1)


class LinearRegression(SoftmaxRegression):
    """Least squares 1/2 ||W x - onehot(y)||^2 + l2 ||w||^2: convex, closed-form gradient."""

    name = "linreg"

    def _scaled_scores(self, logits_t: torch.Tensor) -> torch.Tensor:
        """W x itself (the squared error's gradient by output is W x - onehot(y)), divided by the batch size."""
        return logits_t.div_(logits_t.shape[-1])

    def loss_terms(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pred = self.logits(w, x)
        target = torch.nn.functional.one_hot(y, self.num_classes).to(pred.dtype)
        loss = 0.5 * ((pred - target) ** 2).sum((-1, -2))
        return loss, (pred.argmax(-1) == y).sum(-1)

    def sample_terms(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sample's squared error and correctness per replica: ([R, n], [R, n]) (contracts.SampleTerms)."""
        pred = self.logits(w, x)
        target = torch.nn.functional.one_hot(y, self.num_classes).to(pred.dtype)
        return 0.5 * ((pred - target) ** 2).sum(-1), pred.argmax(-1) == y

    def _residual(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """W x_i - onehot(y_i) by class, [R, C, n]."""
        return _minus_onehot(self._logits_by_class(w, x), y.view(1, 1, -1).expand(w.shape[0], 1, -1), 1)

    def summed_loss(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """loss_and_grad's summed squared error [R] (float64), the same bits; the residual squared in place."""
        return 0.5 * self._residual(w, x, y).square_().sum((1, 2), dtype=torch.float64)

    def loss_and_grad(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed squared error [R] (float64) and its gradient sum_i (W x_i - onehot(y_i)) x_i^T [R, dim]."""
        resid = self._residual(w, x, y)
        return 0.5 * resid.square().sum((1, 2), dtype=torch.float64), _data_gradient(resid, x)

    def loss_and_correct(self, w: torch.Tensor, x: torch.Tensor,
                         y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """By sample, as SoftmaxRegression's."""
        labels = y.view(1, -1, 1).expand(w.shape[0], -1, 1)
        pred = self.logits(w, x)
        predicted = pred.max(-1, keepdim=True)[1]  # taken before the label is subtracted
        resid = _minus_onehot(pred, labels, -1)
        return 0.5 * resid.square().sum((1, 2), dtype=torch.float64), (predicted == labels).sum((1, 2))


# The linear models (`model=auto` is logreg for a data set; the analytic data sets are their own model; on
# natural-client data, auto_model's choice).
MODELS.add("auto", SoftmaxRegression, {"l2": L2})
MODELS.add("logreg", SoftmaxRegression, {"l2": L2})
MODELS.add("linreg", LinearRegression, {"l2": L2})

NATURAL_DATASETS = ("leaf", "tff", "hf")  # natural-client data sets whose samples name their own model


def auto_model(cfg: dict) -> str | None:
    """What `model=auto` is on the config's data where that is not logistic regression: on natural-client data
    (dataset=leaf, tff, hf with a path) the model the data set's papers train on its task (the reader's
    PooledData.model: char_lstm on character windows, sent_lstm or word_lstm on word ids, femnist_cnn on
    images), read from the data's cache (its first load writes it). None: logistic regression (synthetic data,
    digits, the torchvision sets, a user's data) or a model named."""
    dataset = cfg.get("dataset") or {}
    if (cfg.get("model") or {}).get("name") != "auto" or dataset.get("name") not in NATURAL_DATASETS \
            or dataset.get("path") in (None, ""):
        return None
    data_seed = dataset.get("data_seed")
    seed = cfg.get("seed", 0) if data_seed is None else data_seed
    params = {k: v for k, v in dataset.items() if k != "name"}
    pooled = DATASETS.build(dataset["name"], params, {"seed": seed, "run_seed": cfg.get("seed", 0)})
    return pooled.model if isinstance(pooled, PooledData) else None


def refuse_linear_on_tokens(model: Model, name: str) -> None:
    """Logistic or linear regression reads token ids as numbers (an id's size means nothing): refused."""
    require(not isinstance(model, SoftmaxRegression), "model", name,
            "a model that reads int64 token ids (char_lstm, word_lstm, sent_lstm; model=auto picks the data's own "
            f"on dataset={'/'.join(NATURAL_DATASETS)}): {name} would read the data's token ids as numbers")


ACTIVATION_FACTOR = 3  # a layer's output, kept for backward, its gradient, and workspace
# what the backward pass keeps, and the gradients it computes from it (char_lstm's peak over 2,000 samples: 1.9x)
SAVED_FACTOR = 2


class NetObjective(Model):
    """Cross-entropy of a torch module (+ l2 ||w||^2 over its parameters), vectorized over client copies with vmap.

    Any nn.Module: a copy's flat vector holds its parameters and then its float buffers (BatchNorm's running
    statistics; problems/module_state.py). `batch_grad` returns, per copy, the parameters' gradient followed by
    the buffers' values after the step's train-mode forward pass (the executor writes those in; they are no
    gradient). `buffers` (the `model.buffers` key): average | local, how the server and the clients share them
    (harness/core/buffers.py). Dropout modules take masks drawn from per-copy, per-step `seeds`.
    `autocast` (precision=bf16): the training forward/backward runs under torch.autocast in that dtype;
    parameters, gradients and the loss stay in the parameters' dtype. Evaluation runs in full precision, in eval
    mode (running statistics, no dropout).
    `kernel` (vmap | loop | loop_channels_last | fused, harness/core/kernels.py): how `batch_grad` computes the
    copies' gradients; all give the same gradients up to rounding. `fused` (offered where the net has modules with
    a `fused` switch: text_nets.LSTM) trains one copy at a time by plain autograd with those modules on torch's
    fused kernels; evaluation's per-replica passes use them too (they run outside torch.func). A module
    torch.func.vmap cannot run (a probe when vmap is first asked for says so, in one log line) trains one copy at a
    time: `vmap` then means `loop`. A run refused after building its problem (a compressor on a model with buffers,
    ...) pays no batched gradient.
    `tokens`: the samples are int64 token ids (a text model's embedding reads them), kept int64 by `prepare`;
    otherwise they are cast to the run's float dtype.
    """

    convex = False

    def __init__(self, net: nn.Module, name: str, l2: float, in_shape: tuple[int, ...],
                 autocast: torch.dtype | None = None, kernel: str = "vmap", buffers: str = "average",
                 tokens: bool = False, head: str | None = None):
        self.net, self.name, self.l2, self.tokens = net, name, l2, tokens
        require(buffers in ("average", "local"), "model.buffers", buffers, "average | local")
        self.in_shape, self.autocast, self.buffers = in_shape, autocast, buffers
        self.layout = ModuleLayout(net, name)
        self.names, self.shapes, self.numels = self.layout.names, self.layout.shapes, self.layout.numels
        self.param_dim, self.buffer_dim = self.layout.param_dim, self.layout.buffer_dim
        self.dim = self.param_dim + self.buffer_dim
        self.head = head_range(net, self.names, self.numels, head)
        self._check_forward()
        self.sites = dropout_sites(net, self.inputs(2), name)
        self._sample_activations: int | None = None
        self._fusable = [m for m in net.modules() if hasattr(m, "fused")]  # modules with a fused-kernel switch
        self._grad = vmap(grad(self._loss, has_aux=True))
        self._client_grad = {"loop": grad(self._loss, has_aux=True),
                             "loop_channels_last": grad(self._loss_channels_last, has_aux=True)}
        self._vmappable: bool | None = None  # probed at the first question (a text net's probe: seconds)
        self.kernel = kernel

    @property
    def vmappable(self) -> bool:
        """Whether torch.func.vmap runs the module's training step (probed once, when first asked)."""
        if self._vmappable is None:
            self._vmappable = self._probe_vmap()
        return self._vmappable

    @property
    def stochastic(self) -> bool:
        """Whether round_batches draws per-copy seeds: for dropout sites, and for a module vmap cannot run (it may
        draw randomness itself). kernel=fused asks no probe: it is offered for the text nets' LSTM, which draws
        none, and a net's nn.Dropout sites are counted either way."""
        return bool(self.sites) or (self._kernel != "fused" and not self.vmappable)

    @property
    def fusable(self) -> bool:
        """Whether the net offers kernel=fused (modules with a `fused` switch, text_nets.LSTM's)."""
        return bool(self._fusable)

    @contextlib.contextmanager
    def fused_modules(self):
        """The net's switchable modules on torch's fused kernels for the block (plain autograd only: never under
        torch.func, which would lose the fused backward, nor under vmap, which has no batching rule for it)."""
        for m in self._fusable:
            m.fused = True
        try:
            yield
        finally:
            for m in self._fusable:
                m.fused = False

    @property
    def kernel(self) -> str:
        """The formulation batch_grad uses: `vmap` for a module vmap cannot run reads `loop` (the probe runs here,
        when vmap is first asked for, not at construction)."""
        return "loop" if self._kernel == "vmap" and not self.vmappable else self._kernel

    @kernel.setter
    def kernel(self, value: str) -> None:
        self._kernel = value

    def inputs(self, *lead: int, dtype: torch.dtype = torch.float32,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Samples [*lead, *in_shape] of the kind the model takes, for probes and timings: token id 0 (an id of
        any vocabulary), else zeros, or standard normal values from `generator`."""
        if self.tokens:
            return torch.zeros(*lead, *self.in_shape, dtype=torch.int64)
        if generator is None:
            return torch.zeros(*lead, *self.in_shape, dtype=dtype)
        return torch.randn(*lead, *self.in_shape, generator=generator, dtype=dtype)

    def _check_forward(self) -> None:
        """A model that cannot read the data's samples is refused here, in one line, before any work."""
        try:
            self.net.eval()
            with torch.no_grad():
                self.net(self.inputs(2))
        except Exception as err:
            why = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            kind = "int64 token ids (the data set's samples are int64)" if self.tokens else "float samples"
            raise ConfigError("model", self.name, f"a model whose forward pass takes {kind} of shape "
                              f"{tuple(self.in_shape)}; it failed with: {why}") from None

    def _probe_vmap(self) -> bool:
        """Whether vmap runs the module's training step: one batched gradient of two copies on two zero samples."""
        params = {n: p.detach() for n, p in self.net.named_parameters()}
        buffers = {n: b.detach() for n, b in self.net.named_buffers() if n in self.layout.buffer_names}
        two = lambda t: t.expand(2, *t.shape).clone()  # noqa: E731
        device = next(self.net.parameters()).device  # the probe runs where the net lives (a CPU sample into CUDA
        masks = [torch.ones(2, 2, *s.shape, device=device) for s in self.sites]  # weights fails: "not vmappable")
        x, y = self.inputs(2, 2).to(device), torch.zeros(2, 2, dtype=torch.int64, device=device)
        training = self.net.training  # read lazily, maybe mid-evaluation: the module's mode is left as it was
        try:
            self.net.train()
            self._grad({n: two(p) for n, p in params.items()}, {n: two(b) for n, b in buffers.items()}, masks, x, y)
            return True
        except Exception as err:  # any op without a batching rule, random ops outside nn.Dropout, .item(), ...
            why = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            log.warning(f"model {self.name}: torch.func.vmap cannot run its training step ({why}); its clients "
                        "train one copy at a time (kernel=loop)")
            return False
        finally:
            self.net.train(training)

    def prepare(self, x: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.as_tensor(x, dtype=torch.int64 if self.tokens else dtype).to(device)

    def init(self, replicas: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
        """Each replica gets its own default (Kaiming) initialisation, seeded by (seed, replica); buffers start at
        their reset values (BatchNorm: mean 0, variance 1)."""
        rows = []
        buffers = dict(self.net.named_buffers())
        for r in range(replicas):
            torch.manual_seed(hash((seed, r)) % (2**31))
            for m in self.net.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
            flat = [p.detach().reshape(-1) for p in self.net.parameters()]
            flat += [buffers[n].detach().reshape(-1) for n in self.layout.buffer_names]
            rows.append(torch.cat(flat))
        return torch.stack(rows).to(dtype)

    def _params(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.layout.split(w)[0]

    def _loss(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], masks, x: torch.Tensor,
              y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The minibatch loss of one copy in train mode, and its buffers after the forward pass."""
        state = self.layout.module_state(params, buffers)
        with masked_dropout(self.sites, masks), torch.autocast(x.device.type, dtype=self.autocast or torch.bfloat16,
                                                               enabled=self.autocast is not None):
            logits = functional_call(self.net, state, (x,))
        float_dtype = next(iter(params.values())).dtype  # the samples' dtype, unless they are token ids
        loss = torch.nn.functional.cross_entropy(logits.to(float_dtype), y)
        if self.l2:
            loss = loss + self.l2 * sum((p * p).sum() for p in params.values())
        return loss, {n: state[n] for n in self.layout.buffer_names}

    def _loss_channels_last(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], masks,
                            x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cl = torch.channels_last
        params = {n: p.contiguous(memory_format=cl) if p.dim() == 4 else p for n, p in params.items()}
        return self._loss(params, buffers, masks, x.contiguous(memory_format=cl) if x.dim() == 4 else x, y)

    def prepare_chunk(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x, y

    def batch_grad(self, w: torch.Tensor, batch: tuple[torch.Tensor, ...],
                   seeds: np.ndarray | None = None) -> torch.Tensor:
        """[M, dim]: each copy's parameter gradient, then its buffers after the forward pass. `seeds` [M] (one per
        copy, for this step) drive dropout; None: dropout keeps every unit."""
        x, y = batch
        self.net.train()
        masks = []  # none: dropout keeps every unit (an empty list, which vmap maps over as well)
        if self.sites and seeds is not None:
            masks = draw_masks(self.sites, seeds, x.shape[1], w.dtype, w.device)
        if self.kernel == "vmap":
            if len(w) == 1:  # vmap runs one copy through unbatched kernels, whose bits differ: batch it as two
                return self.batch_grad(w.expand(2, -1), tuple(t.expand(2, *t.shape[1:]) for t in batch),
                                       None if seeds is None else np.repeat(seeds, 2))[:1]
            grads, new = self._grad(*self.layout.split(w), masks, x, y)
            flat = [grads[n].reshape(w.shape[0], -1) for n in self.names]
            return torch.cat(flat + self.layout.flat_buffers(new, w.shape[0]), dim=1)
        if self.kernel == "fused":
            return self._autograd_grads(w, masks, x, y, seeds)
        client_grad = self._client_grad[self.kernel]
        out = torch.empty_like(w)
        for m in range(w.shape[0]):
            with self._seeded(seeds, m, w.device):
                grads, new = client_grad(*self.layout.split(w[m]), [k[m] for k in masks], x[m], y[m])
            torch.cat([grads[n].reshape(-1) for n in self.names] + self.layout.flat_buffers(new, None), out=out[m])
        return out

    def _autograd_grads(self, w: torch.Tensor, masks: list, x: torch.Tensor, y: torch.Tensor,
                        seeds: np.ndarray | None) -> torch.Tensor:
        """batch_grad's result one copy at a time by plain autograd, the fused modules on (kernel=fused)."""
        out = torch.empty_like(w)
        with self.fused_modules():
            for m in range(w.shape[0]):
                params, buffers = self.layout.split(w[m].detach())
                params = {n: p.requires_grad_(True) for n, p in params.items()}
                with self._seeded(seeds, m, w.device):
                    loss, new = self._loss(params, buffers, [k[m] for k in masks], x[m], y[m])
                grads = torch.autograd.grad(loss, list(params.values()))
                torch.cat([g.reshape(-1) for g in grads] + self.layout.flat_buffers(
                    {n: b.detach() for n, b in new.items()}, None), out=out[m])
        return out

    @staticmethod
    def _seeded(seeds: np.ndarray | None, m: int, device: torch.device):
        """Torch's global generator seeded by copy m's seed, for randomness a module draws itself (F.dropout in
        its forward), which only the per-client path can run; restored afterwards."""
        if seeds is None:
            return contextlib.nullcontext()
        return _forked_seed(int(seeds[m]) ^ 1, device)

    def loss_terms(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed loss and correct predictions per replica, in eval mode (running statistics, no dropout); the
        buffers are constants here (no gradient reaches their entries)."""
        self.net.eval()
        losses, correct = [], []
        with self.fused_modules():
            for r in range(w.shape[0]):
                params, buffers = self.layout.split(w[r])
                state = self.layout.module_state(params, {n: b.detach() for n, b in buffers.items()})
                logits = functional_call(self.net, state, (x,))
                losses.append(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
                correct.append((logits.argmax(-1) == y).sum())
        return torch.stack(losses), torch.stack(correct)

    def sample_terms(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sample's cross-entropy and correctness per replica, ([R, n], [R, n]), in eval mode as loss_terms
        (contracts.SampleTerms)."""
        self.net.eval()
        with self.fused_modules():
            terms = [self._sample_terms_of_copy(*self.layout.split(w[r]), x, y) for r in range(w.shape[0])]
        return torch.stack([t[0] for t in terms]), torch.stack([t[1] for t in terms])

    def buffer_sample_terms(self, w: torch.Tensor, buffers: torch.Tensor, x: torch.Tensor,
                            y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model w [dim] with buffers[m] on its own samples x[m], y[m]: ([M, n], [M, n]) losses and correctness,
        in eval mode; the sets under vmap with the parameters shared, where the module allows it
        (contracts.BufferTerms)."""
        self.net.eval()
        params, _ = self.layout.split(w)
        shapes = self.layout.buffer_shapes
        parts = torch.split(buffers, [int(np.prod(s)) for s in shapes], dim=-1)
        sets = {n: p.reshape(len(buffers), *s) for n, p, s in zip(self.layout.buffer_names, parts, shapes)}
        if self.vmappable:
            return vmap(self._sample_terms_of_copy, in_dims=(None, 0, 0, 0))(params, sets, x, y)
        terms = [self._sample_terms_of_copy(params, {n: b[m] for n, b in sets.items()}, x[m], y[m])
                 for m in range(len(buffers))]
        return torch.stack([t[0] for t in terms]), torch.stack([t[1] for t in terms])

    def _sample_terms_of_copy(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                              x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = functional_call(self.net, self.layout.module_state(params, buffers), (x,))
        return torch.nn.functional.cross_entropy(logits, y, reduction="none"), logits.argmax(-1) == y

    def regularizer(self, w: torch.Tensor) -> torch.Tensor:
        if self.buffer_dim:
            w = w[..., :self.param_dim]
        return self.l2 * (w * w).sum(-1)

    def activation_bytes(self, batch: int, itemsize: int) -> int:
        """Bytes of one client copy's forward/backward over `batch` samples, from a probe forward pass on one
        sample (measured once, in eval mode: no running statistic moves): ACTIVATION_FACTOR times its layer
        outputs, or SAVED_FACTOR times what autograd keeps for the backward pass where that is more (a recurrent
        layer keeps its gates at every step, which its outputs do not show)."""
        if self._sample_activations is None:
            self.net.eval()
            sample = self.inputs(1).to(next(self.net.parameters()).device)  # the probe runs where the net lives
            self._sample_activations = max(ACTIVATION_FACTOR * _leaf_outputs(self.net, sample),
                                           SAVED_FACTOR * _saved_for_backward(self.net, sample))
        return batch * self._sample_activations * itemsize


def head_range(net: nn.Module, names: list[str], numels: list[int], head: str | None) -> tuple[int, int] | None:
    """Entries [lo, hi) of the flat vector holding the parameters of module `head` (model.head; a built-in net's
    head_module); None without one. A module's parameters are consecutive in named_parameters' order."""
    head = head if head is not None else getattr(net, "head_module", None)
    if head is None:
        return None
    modules = [n for n, m in net.named_modules() if n and any(True for _ in m.parameters())]
    shown = ", ".join(modules[:12]) + (f", ... ({len(modules)} in all)" if len(modules) > 12 else "")
    require(head in modules, "model.head", head, f"a module of the model with parameters: {shown}")
    starts = np.cumsum([0, *numels])
    at = [i for i, n in enumerate(names) if n.startswith(head + ".")]
    return int(starts[at[0]]), int(starts[at[-1] + 1])


def _leaf_outputs(net: nn.Module, sample: torch.Tensor) -> int:
    """Elements the leaf modules output on `sample` (a module may return several tensors: nn.LSTM's)."""
    found = []

    def record(module, args, out):
        found.extend(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))

    hooks = [m.register_forward_hook(record) for m in net.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            net(sample)
    finally:
        for h in hooks:
            h.remove()
    return sum(found)


def _saved_for_backward(net: nn.Module, sample: torch.Tensor) -> int:
    """Elements autograd keeps for the backward pass of `sample`'s forward, each storage once, parameters not."""
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes() // t.element_size()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        net(sample)
    return sum(storages.values())


@contextlib.contextmanager
def _forked_seed(seed: int, device: torch.device):
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed % (2**63))
        yield
