"""The over-parameterized least squares of Jhunjhunwala et al. (FedExP, ICLR 2023, Section 6 and the authors'
linear_regression notebook): 20 clients of 30 samples in d = 1,000, F_i(w) = 1/2 ||A_i w - b_i||^2, every
row of A_i and every b_i scaled to unit norm; 600 equations in 1,000 unknowns, so F* = 0 (interpolation)."""

from __future__ import annotations

import numpy as np
import torch

from fedharness.contracts import ClientKeys, Evaluation, Problem


def paper_data(seed: int, clients: int = 20, samples: int = 30, dim: int = 1000, alpha: float = 0.1,
               beta: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """A [N, n, d], b [N, n]: Li et al.'s Synthetic(alpha, beta) regression as the authors draw it
    (x ~ N(B_i 1, I), B_i ~ N(0, beta); y = x W_i, W_i ~ N(u_i, 1), u_i ~ N(0, alpha)), then normalized."""
    rng = np.random.default_rng(seed)
    u, B = rng.normal(0, alpha, clients), rng.normal(0, beta, clients)
    A, b = np.empty((clients, samples, dim)), np.empty((clients, samples))
    for i in range(clients):
        x = rng.normal(rng.normal(B[i], 1, dim), 1, (samples, dim))
        y = x @ rng.normal(u[i], 1, dim)
        A[i] = x / np.linalg.norm(x, axis=1, keepdims=True)
        b[i] = y / np.linalg.norm(y)
    return A, b


class LeastSquares(Problem):
    """Deterministic local gradients A_i^T (A_i w - b_i) (full-batch local GD), float64, F = (1/N) sum_i F_i."""

    convex = True
    memory_budget = None
    objective = None

    def __init__(self, A: np.ndarray, b: np.ndarray):
        self.A, self.b = torch.as_tensor(A), torch.as_tensor(b)
        self.num_clients, _, self.dim = A.shape
        self.weights = np.full(self.num_clients, 1 / self.num_clients)
        self.sizes = np.ones(self.num_clients, dtype=np.int64)
        self.dtype, self.device = torch.float64, torch.device("cpu")

    def init_params(self, replicas: int, seed: int) -> torch.Tensor:
        return torch.zeros(replicas, self.dim, dtype=torch.float64)

    def round_batches(self, keys: ClientKeys, steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The round's clients' A_i, A_i^T (contiguous: a faster bmm) and b_i, gathered once a round."""
        A = self.A[keys.clients]
        return A, A.transpose(1, 2).contiguous(), self.b[keys.clients]

    def grad(self, w: torch.Tensor, batches, step: int) -> torch.Tensor:
        m = len(w)  # the executor trains a prefix of the round's clients
        A, At, b = (t[:m] for t in batches)
        resid = torch.bmm(A, w.unsqueeze(-1)).squeeze(-1) - b
        return torch.bmm(At, resid.unsqueeze(-1)).squeeze(-1)

    loop_grad = grad

    def entry_bytes(self, steps: int) -> int:
        return self.A[0].numel() * 8

    def objective_value(self, w: torch.Tensor) -> torch.Tensor:
        resid = torch.einsum("nsd,rd->rns", self.A, w.double()) - self.b
        return 0.5 * (resid ** 2).sum((1, 2)) / self.num_clients

    def evaluate(self, w: torch.Tensor, grad_norm: bool = True) -> Evaluation:
        return Evaluation(train_loss=self.objective_value(w).numpy(), grad_norm_sq=None)
