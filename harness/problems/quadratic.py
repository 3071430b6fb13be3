"""Quadratic clients F_i(x) = 1/2 (x - e_i)^T A_i (x - e_i): every fixed point has a closed form."""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from fedharness.contracts import ClientKeys, ClientScores, ClosedForm, Evaluation, Problem
from fedharness.errors import ConfigError
from fedharness.registry.groups import DATASETS, MODELS
from fedharness.base import streams
from fedharness.keys import Key, choice, integer, number

KEYS: dict[str, Key] = {  # dataset=quadratic's, besides num_clients and data_seed (harness/config/schema.py: mu <= L)
    "dim": integer("dimension d", lo=1),
    "spread": number("e_i ~ N(0, spread^2 I)", lo=0),
    "curvature": choice("identity | diagonal | random (eigenvalues uniform in [mu, L])",
                        ("identity", "diagonal", "random")),
    "mu": number("smallest eigenvalue", lo=0, lo_open=True),
    "L": number("largest eigenvalue", lo=0, lo_open=True),
    "noise": number("std of additive Gaussian gradient noise", lo=0),
}


class QuadraticProblem(Problem, ClosedForm):
    convex = True

    def __init__(self, A: np.ndarray, e: np.ndarray, weights: np.ndarray | None = None, noise: float = 0.0,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 memory_budget: int | None = None):
        self.memory_budget = memory_budget  # bytes; the executor splits its batches to fit (None: no bound)
        self.num_clients, self.dim = e.shape
        self.A_np, self.e_np = np.asarray(A, np.float64), np.asarray(e, np.float64)
        self.weights = np.full(self.num_clients, 1 / self.num_clients) if weights is None else np.asarray(weights)
        self.sizes = np.ones(self.num_clients, dtype=np.int64)
        self.noise = noise
        self.dtype, self.device = dtype, torch.device(device)
        self.A = torch.as_tensor(self.A_np, dtype=dtype, device=self.device)
        self.e = torch.as_tensor(self.e_np, dtype=dtype, device=self.device)
        self._p = torch.as_tensor(self.weights, dtype=dtype, device=self.device)
        self.training_clients: int | None = None  # dataset.unseen_clients: the first ones train (unseen_last)

    def with_dtype(self, dtype: torch.dtype) -> "QuadraticProblem":
        made = QuadraticProblem(self.A_np, self.e_np, self.weights, self.noise, dtype, self.device, self.memory_budget)
        made.training_clients = self.training_clients
        return made

    def unseen_last(self, order: np.ndarray, training: int) -> "QuadraticProblem":
        """The clients renumbered by `order`, the first `training` the training population (dataset.unseen_clients,
        problems/unseen.py): the weights uniform over them and 0 on the rest, so F, w* and F* are theirs."""
        weights = np.where(np.arange(self.num_clients) < training, 1 / training, 0.0)
        made = QuadraticProblem(self.A_np[order], self.e_np[order], weights, self.noise, self.dtype, self.device,
                                self.memory_budget)
        made.training_clients = training
        return made

    def init_params(self, replicas: int, seed: int) -> torch.Tensor:
        return torch.zeros(replicas, self.dim, dtype=self.dtype, device=self.device)

    def round_batches(self, keys: ClientKeys, steps: int):
        if not self.noise:
            return keys.clients
        key = streams.stream_key(keys.seed, streams.NOISE, keys.replicas, keys.round, keys.clients)
        z = streams.step_normals(key, keys.tau, steps, self.dim)
        return keys.clients, torch.as_tensor(self.noise * z, dtype=self.dtype, device=self.device)

    def grad(self, w: torch.Tensor, batches, step: int) -> torch.Tensor:
        """Gradients of the first len(w) clients of `batches` (the executor trains a prefix)."""
        clients, z = (batches, None) if not self.noise else batches
        m = len(w)
        a, v = self.A[clients[:m]], (w - self.e[clients[:m]]).unsqueeze(-1)
        if m == 1:  # bmm runs a batch of one as a plain matrix-vector product, whose bits differ from a batch's
            a, v = a.repeat(2, 1, 1), v.repeat(2, 1, 1)
        g = torch.bmm(a, v)[:m].squeeze(-1)
        return g if z is None else g + z[:m, step]

    loop_grad = grad

    def full_grads(self, w: torch.Tensor, clients: np.ndarray) -> torch.Tensor:
        """A_k (w - e_k): the noise-free gradient, each client's whole objective."""
        idx = torch.as_tensor(clients, device=self.device)
        return torch.bmm(self.A[idx], (w - self.e[idx]).unsqueeze(-1)).squeeze(-1).double()

    def entry_bytes(self, steps: int) -> int:
        """Bytes one client copy of a batched step needs besides its parameters: A_k gathered, its noise."""
        item = torch.empty((), dtype=self.dtype).element_size()
        return (self.dim * self.dim + (steps * self.dim if self.noise else 0)) * item

    def objective_value(self, w: torch.Tensor) -> torch.Tensor:
        diff = w.unsqueeze(1) - self.e  # [R, N, d]
        per_client = 0.5 * torch.einsum("rnd,nde,rne->rn", diff, self.A, diff)
        return (per_client * self._p).sum(-1).double()

    def objective_and_grad(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        diff = w.unsqueeze(1) - self.e
        g = torch.einsum("n,nde,rne->rd", self._p, self.A, diff)
        return self.objective_value(w), g

    def evaluate(self, w: torch.Tensor, grad_norm: bool = True) -> Evaluation:
        value, g = self.objective_and_grad(w)  # closed forms: the gradient costs next to nothing
        return Evaluation(train_loss=value.cpu().numpy(),
                          grad_norm_sq=(g.double() ** 2).sum(-1).cpu().numpy() if grad_norm else None)

    def client_scores(self, w: torch.Tensor, clients: np.ndarray,
                      buffers: Mapping[tuple[int, int], torch.Tensor] | None = None) -> ClientScores:
        """Each client's own objective f_k(w_r) as its loss, [R, S] in float64 (contracts.ClientEvaluation); no
        accuracy (NaN), and n = 1: every client counts once."""
        w64 = w.detach().double().cpu().numpy()
        loss = np.stack([self._client_values(np.broadcast_to(row, (len(clients), self.dim)), clients)
                         for row in w64])
        return ClientScores(np.asarray(clients, dtype=np.int64), np.ones(len(clients), dtype=np.int64), loss,
                            np.full_like(loss, np.nan), self.num_clients)

    def copy_scores(self, w: torch.Tensor, clients: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """f_k of copy m's model for client k = clients[m] (contracts.CopyEvaluation), as client_scores."""
        loss = self._client_values(w.detach().double().cpu().numpy(), clients)
        return np.ones(len(clients), dtype=np.int64), loss, np.full_like(loss, np.nan)

    def _client_values(self, w: np.ndarray, clients: np.ndarray) -> np.ndarray:
        """f_k(w_m) = 1/2 (w_m - e_k)^T A_k (w_m - e_k) of k = clients[m], in float64 from the float64 A and e."""
        diff = w - self.e_np[clients]
        return 0.5 * np.einsum("md,mde,me->m", diff, self.A_np[clients], diff)

    def hessians(self) -> np.ndarray:
        return self.A_np

    def client_minima(self) -> np.ndarray:
        """1/2 (x - e)^T A (x - e) with A positive semi-definite: 0, at e."""
        return np.zeros(self.num_clients)

    def hessian_sum(self) -> np.ndarray:
        """sum_i p_i A_i, the Hessian of F."""
        return np.einsum("n,nde->de", self.weights, self.A_np)

    def optimum(self) -> np.ndarray:
        """w* = (sum p_i A_i)^-1 sum p_i A_i e_i."""
        return np.linalg.solve(self.hessian_sum(), np.einsum("n,nde,ne->d", self.weights, self.A_np, self.e_np))


@MODELS.register("quadratic", {})
def own_model(in_shape: tuple[int, ...], num_classes: int) -> None:
    """`model=quadratic`: the analytic data sets are their own model, so there is nothing to build."""
    raise ConfigError("model", "quadratic", "only for the analytic data sets, which build no model")


@DATASETS.register("quadratic", KEYS)
def make_quadratic(num_clients: int, dim: int, spread: float, curvature: str, mu: float, L: float,
                   noise: float, seed: int, dtype: torch.dtype, device: str,
                   memory_budget: int | None = None) -> QuadraticProblem:
    """Random heterogeneous quadratics: e_i ~ N(0, spread^2 I); A_i = I, or eigenvalues in [mu, L]."""
    rng = np.random.default_rng([seed, 7])
    e = rng.normal(0, spread, (num_clients, dim))
    if curvature == "identity":
        A = np.broadcast_to(np.eye(dim), (num_clients, dim, dim)).copy()
    elif curvature == "diagonal":
        A = np.stack([np.diag(rng.uniform(mu, L, dim)) for _ in range(num_clients)])
    else:  # "random": random rotation of eigenvalues in [mu, L]
        A = np.stack([_random_spd(rng, dim, mu, L) for _ in range(num_clients)])
    return QuadraticProblem(A, e, None, noise, dtype, device, memory_budget)


def _random_spd(rng: np.random.Generator, dim: int, mu: float, L: float) -> np.ndarray:
    Q, _ = np.linalg.qr(rng.standard_normal((dim, dim)))
    return (Q * rng.uniform(mu, L, dim)) @ Q.T
