"""Per-sample losses of a model over flat parameters, batched over many client copies.

`batch_grad` is the hot path: one call computes the minibatch gradient of M
client copies at once. Linear models use their closed-form gradient (two bmm
calls and a softmax); neural networks use torch.func.vmap over grad.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from fedharness.contracts import Model
from fedharness.errors import ConfigError
from fedharness.keys import number

L2 = number("l2 weight: + l2 ||w||^2", lo=0)  # `model.l2`, the key of every model but the quadratic's


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
        self._minus_ones: dict[tuple, torch.Tensor] = {}

    def prepare(self, x: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        flat = torch.as_tensor(x.reshape(len(x), -1), dtype=dtype)
        return torch.cat([flat, torch.ones(len(x), 1, dtype=dtype)], 1).to(device)

    def prepare_chunk(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Minibatches [M, T, b, d] of T steps; the transposed view costs less than a transposed copy."""
        return x, x.transpose(-1, -2), y.unsqueeze(2)

    def init(self, replicas: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(replicas, self.dim, dtype=dtype)  # w_0 = 0 as in Li et al.

    def _matrix(self, w: torch.Tensor) -> torch.Tensor:
        return w.view(*w.shape[:-1], self.num_classes, self.d)

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
        g = torch.bmm(resid, x).view(w.shape[0], -1)
        return g.add_(w, alpha=2.0 * self.l2) if self.l2 else g

    def batch_grad(self, w: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, xt, y = batch
        resid = self._scaled_softmax(torch.bmm(self._matrix(w), xt))  # [M, C, b]
        resid.scatter_add_(1, y, self._minus(y, resid))  # (softmax - onehot) / b
        return self._gradient(w, resid, x)

    def logits(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self._matrix(w).transpose(-1, -2))  # [R, n, C]

    def loss_terms(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed data loss and number of correct predictions, per replica: ([R], [R])."""
        logits = self.logits(w, x)
        logp = torch.log_softmax(logits, dim=-1)
        nll = -logp.gather(2, y.expand(w.shape[0], -1).unsqueeze(-1)).squeeze(-1)
        return nll.sum(-1), (logits.argmax(-1) == y).sum(-1)

    def regularizer(self, w: torch.Tensor) -> torch.Tensor:
        return self.l2 * (w * w).sum(-1)

    def activation_bytes(self, batch: int, itemsize: int) -> int:
        """Bytes one client copy's minibatch gradient holds besides parameters and features: the logits."""
        return 2 * batch * self.num_classes * itemsize


class LinearRegression(SoftmaxRegression):
    """Least squares 1/2 ||W x - onehot(y)||^2 + l2 ||w||^2: convex, closed-form gradient."""

    name = "linreg"

    def batch_grad(self, w: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, xt, y = batch
        resid = torch.bmm(self._matrix(w), xt).div_(x.shape[1])
        resid.scatter_add_(1, y, self._minus(y, resid))  # (W x - onehot) / b
        return self._gradient(w, resid, x)

    def loss_terms(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pred = self.logits(w, x)
        target = torch.nn.functional.one_hot(y, self.num_classes).to(pred.dtype)
        loss = 0.5 * ((pred - target) ** 2).sum((-1, -2))
        return loss, (pred.argmax(-1) == y).sum(-1)


ACTIVATION_FACTOR = 3  # a layer's output, kept for backward, its gradient, and workspace


class NetObjective(Model):
    """Cross-entropy of a torch module (+ l2 ||w||^2), vectorized over client copies with vmap.

    `autocast` (precision=bf16): the training forward/backward runs under torch.autocast in that dtype;
    parameters, gradients and the loss stay in the parameters' dtype. Evaluation runs in full precision.
    `kernel` (vmap | loop | loop_channels_last, harness/core/kernels.py): how `batch_grad` computes the copies'
    gradients; all give the same gradients up to rounding.
    """

    convex = False

    def __init__(self, net: nn.Module, name: str, l2: float, in_shape: tuple[int, ...],
                 autocast: torch.dtype | None = None, kernel: str = "vmap"):
        for buffer, _ in net.named_buffers():
            raise ConfigError("model", name, f"the module holds a buffer '{buffer}'; the engine trains a model as a "
                              "pure function of its parameters (vmapped over clients), so it cannot keep state such "
                              "as BatchNorm's running statistics: use GroupNorm or LayerNorm, and keep constants as "
                              "plain tensor attributes")
        self.net, self.name, self.l2 = net, name, l2
        self.in_shape, self.autocast, self.kernel = in_shape, autocast, kernel
        self._sample_activations: int | None = None
        self.names = [n for n, _ in net.named_parameters()]
        self.shapes = [p.shape for _, p in net.named_parameters()]
        self.numels = [p.numel() for _, p in net.named_parameters()]
        self.dim = sum(self.numels)
        self._grad = vmap(grad(self._loss))
        self._client_grad = {"loop": grad(self._loss), "loop_channels_last": grad(self._loss_channels_last)}

    def prepare(self, x: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.as_tensor(x, dtype=dtype).to(device)

    def init(self, replicas: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
        """Each replica gets its own default (Kaiming) initialisation, seeded by (seed, replica)."""
        rows = []
        for r in range(replicas):
            torch.manual_seed(hash((seed, r)) % (2**31))
            for m in self.net.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
            rows.append(torch.cat([p.detach().reshape(-1) for p in self.net.parameters()]))
        return torch.stack(rows).to(dtype)

    def _params(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        lead = w.shape[:-1]
        parts = torch.split(w, self.numels, dim=-1)
        return {n: p.reshape(*lead, *s) for n, p, s in zip(self.names, parts, self.shapes)}

    def _loss(self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            logits = functional_call(self.net, params, (x,))
        loss = torch.nn.functional.cross_entropy(logits.to(x.dtype), y)
        if self.l2:
            loss = loss + self.l2 * sum((p * p).sum() for p in params.values())
        return loss

    def _loss_channels_last(self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        cl = torch.channels_last
        params = {n: p.contiguous(memory_format=cl) if p.dim() == 4 else p for n, p in params.items()}
        return self._loss(params, x.contiguous(memory_format=cl) if x.dim() == 4 else x, y)

    def prepare_chunk(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x, y

    def batch_grad(self, w: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        if self.kernel == "vmap":
            grads = self._grad(self._params(w), x, y)
            return torch.cat([grads[n].reshape(w.shape[0], -1) for n in self.names], dim=1)
        client_grad = self._client_grad[self.kernel]
        out = torch.empty_like(w)
        for m in range(w.shape[0]):
            grads = client_grad(self._params(w[m]), x[m], y[m])
            torch.cat([grads[n].reshape(-1) for n in self.names], out=out[m])
        return out

    def loss_terms(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        losses, correct = [], []
        for r in range(w.shape[0]):
            logits = functional_call(self.net, self._params(w[r]), (x,))
            losses.append(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
            correct.append((logits.argmax(-1) == y).sum())
        return torch.stack(losses), torch.stack(correct)

    def regularizer(self, w: torch.Tensor) -> torch.Tensor:
        return self.l2 * (w * w).sum(-1)

    def activation_bytes(self, batch: int, itemsize: int) -> int:
        """Bytes of one client copy's forward/backward over `batch` samples, from the layer outputs of a
        probe forward pass on one sample (measured once)."""
        if self._sample_activations is None:
            found = []
            hooks = [m.register_forward_hook(lambda m, i, out: found.append(out.numel()))
                     for m in self.net.modules() if not list(m.children())]
            try:
                with torch.no_grad():
                    self.net(torch.zeros(1, *self.in_shape))
            finally:
                for h in hooks:
                    h.remove()
            self._sample_activations = sum(found)
        return ACTIVATION_FACTOR * batch * self._sample_activations * itemsize
