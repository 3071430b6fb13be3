"""Li et al.'s Theorem 4/5 counterexample (ICLR 2020, Appendix C): FedAvg with a constant step stalls.

A distributed ridge regression on R^(Np+1): F(w) = 1/(2N) [w^T A w - 2 b^T w] + mu/2 ||w||^2,
A tridiagonal (2 on the diagonal, -1 beside it), b = e_1. Client k holds
F_k(w) = 1/2 [w^T A_k w - 2 b_k^T w + mu ||w||^2], where A_k is the path Laplacian B_k on
the block I_k = {(k-1)p, ..., kp} (0-based; neighbouring blocks share one coordinate), plus
E_11 for the first client and E_dd for the last; b_1 = e_1, b_k = 0 otherwise. So
sum A_k = A and F = (1/N) sum F_k, w* = (A + N mu I)^-1 b.

As a QuadraticProblem: A'_k = A_k + mu I, e_k = A'_k^+ b_k (b_k lies in A'_k's range, also for
mu = 0), and F_k(w) = 1/2 (w - e_k)^T A'_k (w - e_k) - 1/2 b_k^T e_k, so objective values,
F* and F_k* are the paper's.
"""

from __future__ import annotations

import numpy as np
import torch

from fedharness.keys import Key, integer, number
from fedharness.problems.quadratic import QuadraticProblem
from fedharness.registry.groups import DATASETS

KEYS: dict[str, Key] = {  # dataset=li_toy's
    "num_clients": integer("N, the number of clients", lo=2),
    "block": integer("p: each client's features live on p coordinates", lo=1),
    "mu": number("ridge term mu/2 ||w||^2", lo=0),
    "noise": number("std of additive Gaussian gradient noise", lo=0),
    "data_seed": integer("not used: the construction is deterministic", lo=0, null="the run's seed"),
}


def li_toy_matrices(num_clients: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """A_k [N, d, d] and b_k [N, d] of the construction, d = N * block + 1."""
    N, p = num_clients, block
    d = N * p + 1
    A = np.zeros((N, d, d))
    b = np.zeros((N, d))
    for k in range(N):
        for i in range(k * p, (k + 1) * p):  # the p edges of the path on block I_k
            A[k, i, i] += 1
            A[k, i + 1, i + 1] += 1
            A[k, i, i + 1] -= 1
            A[k, i + 1, i] -= 1
    A[0, 0, 0] += 1
    A[N - 1, d - 1, d - 1] += 1
    b[0, 0] = 1.0
    return A, b


@DATASETS.register("li_toy", KEYS)
class LiToyProblem(QuadraticProblem):
    def __init__(self, num_clients: int = 5, block: int = 4, mu: float = 2e-4, noise: float = 0.0,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 memory_budget: int | None = None):
        self.block, self.mu = block, float(mu)
        A, b = li_toy_matrices(num_clients, block)
        A_mu = A + mu * np.eye(A.shape[1])
        e = np.stack([np.linalg.pinv(A_mu[k]) @ b[k] for k in range(num_clients)])
        self.b_np = b
        self.offsets = -0.5 * np.einsum("nd,nd->n", b, e)  # F_k(w) = quadratic form + offset_k
        super().__init__(A_mu, e, None, noise, dtype, device, memory_budget)

    def with_dtype(self, dtype: torch.dtype) -> "LiToyProblem":
        return LiToyProblem(self.num_clients, self.block, self.mu, self.noise, dtype, self.device, self.memory_budget)

    def objective_value(self, w: torch.Tensor) -> torch.Tensor:
        return super().objective_value(w) + float(np.dot(self.weights, self.offsets))

    def client_minima(self) -> np.ndarray:
        """F_k* = offset_k (the quadratic form's minimum is 0, at e_k)."""
        return self.offsets.copy()
