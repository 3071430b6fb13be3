"""A population of quadratic clients generated on demand, with w*, F* and F(w) exact at any N: `dataset=quadratic_lazy`.

Client k: F_k(x) = 1/2 (x - b_k)^T A_k (x - b_k), A_k diagonal. Its A_k and b_k are drawn when asked for, from
counter-based streams keyed by (data seed, k // 4): nothing per client is stored, so N = 10^8 costs what N = 10
does. Every client has n_k = 1 sample, so p_k = 1/N.

Clients come in antithetic quadruples g = k // 4, j = k % 4 (v_g uniform in [-1, 1]^d, u_g, u'_g uniform on
the unit sphere, m a fixed spectrum from L down to mu, s = curvature_spread, rho = spread sqrt(d)):

    j = 0, 1:  A = diag(m (1 + s v_g)),  b = c +/- rho A^{-1/2} u_g
    j = 2, 3:  A = diag(m (1 - s v_g)),  b = c +/- rho A^{-1/2} u'_g

The N mod 4 clients of an incomplete last quadruple have A = diag(m), b = c. Within a quadruple the A_k sum to
4 diag(m) and the A_k (b_k - c) to 0, and every (b_k - c)^T A_k (b_k - c) = rho^2. So, for any N and seed:

    sum_k p_k A_k = diag(m),   w* = c,   F* = rho^2 / 2 (1 - (N mod 4) / N),
    F(w) = F* + 1/2 (w - c)^T diag(m) (w - c)     (every F_k* = 0, so Gamma = F*).

Set-up is O(1), subopt and dist_to_opt are exact. Stochastic gradients add Gaussian noise from the client's own
stream (seed, replica, round, client), as dataset=quadratic does. The train loss is F(w) while N <= eval.clients;
above, it is estimated on eval.clients clients drawn uniformly (problems/estimate.py), with its standard error,
so the estimator can be checked against the exact F (= F* + subopt) at any scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedharness.contracts import ClientKeys, ClosedForm, Evaluation, Problem
from fedharness.base import streams
from fedharness.keys import Key, integer, number
from fedharness.problems.estimate import sample_clients, weighted_sum_estimate
from fedharness.problems.population import ClientSizes, ClientWeights
from fedharness.registry.groups import DATASETS

KEYS: dict[str, Key] = {  # dataset=quadratic_lazy's, besides num_clients and data_seed (harness/config/schema.py: mu <= L)
    "dim": integer("dimension d", lo=1),
    "spread": number("every client's optimum b_k lies at distance spread * sqrt(d) from w* in its A_k-norm", lo=0),
    "mu": number("smallest eigenvalue of sum p_k A_k", lo=0, lo_open=True),
    "L": number("largest eigenvalue of sum p_k A_k", lo=0, lo_open=True),
    "curvature_spread": number("s: client k's curvatures are m_i (1 +/- s v_i), v_i uniform in [-1, 1]",
                               lo=0, hi=1, hi_open=True),
    "noise": number("std of additive Gaussian gradient noise", lo=0),
}
DEFAULT_EVAL_CLIENTS = 10_000  # eval.clients=null: train_loss exact while num_clients <= this, else on this many

_CURVATURE, _DIRECTION, _CENTER = 0, 1, 2  # the population stream's slots (its 'replica' field)


@dataclass
class PopulationBatches:
    """The sampled clients' curvatures a [M, d] and optima b [M, d], and their gradient noise [M, steps, d]."""

    a: torch.Tensor
    b: torch.Tensor
    noise: torch.Tensor | None


class QuadraticPopulation(Problem, ClosedForm):
    convex = True

    def __init__(self, num_clients: int, dim: int, spread: float, mu: float, L: float, curvature_spread: float,
                 noise: float, seed: int, eval_seed: int, eval_clients: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", memory_budget: int | None = None):
        self.memory_budget = memory_budget  # bytes; the executor splits its batches to fit (None: no bound)
        self.num_clients, self.dim = num_clients, dim
        self.spread, self.mu, self.L, self.curvature_spread = spread, mu, L, curvature_spread
        self.noise, self.seed, self.eval_seed, self.eval_clients = noise, seed, eval_seed, eval_clients
        self.dtype, self.device = dtype, torch.device(device)
        self.sizes = ClientSizes(num_clients, constant=1)  # closed forms: nothing stored per client
        self.weights = ClientWeights(self.sizes)
        self.spectrum = np.geomspace(L, mu, dim)  # m: the eigenvalues of sum_k p_k A_k
        self.center = streams.normal(streams.stream_key(seed, streams.POPULATION, _CENTER, 0, 0), dim)  # c = w*
        self.complete = 4 * (num_clients // 4)  # clients in complete quadruples

    def with_dtype(self, dtype: torch.dtype) -> "QuadraticPopulation":
        return QuadraticPopulation(self.num_clients, self.dim, self.spread, self.mu, self.L, self.curvature_spread,
                                   self.noise, self.seed, self.eval_seed, self.eval_clients, dtype, self.device,
                                   self.memory_budget)

    # ------------------------------------------------------------ clients on demand

    def clients(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Curvatures a [M, d] (A_k = diag(a_k)) and optima b [M, d] of clients `ids`, float64."""
        ids = np.asarray(ids, dtype=np.int64)
        group, j = ids // 4, ids % 4
        d = self.dim
        v = 2 * streams.uniform(streams.stream_key(self.seed, streams.POPULATION, _CURVATURE, 0, group), d) - 1
        sign = np.where(j < 2, 1.0, -1.0)[:, None]  # j = 0, 1: m (1 + s v); j = 2, 3: m (1 - s v)
        a = self.spectrum * (1 + sign * self.curvature_spread * v)
        z = streams.normal(streams.stream_key(self.seed, streams.POPULATION, _DIRECTION, 0, group), 2 * d)
        u = np.where(j[:, None] < 2, z[:, :d], z[:, d:])
        u = u / np.linalg.norm(u, axis=1, keepdims=True)
        rho = self.spread * np.sqrt(d)
        delta = np.where(j[:, None] % 2 == 0, 1.0, -1.0) * rho * u / np.sqrt(a)
        tail = ids >= self.complete
        a[tail], delta[tail] = self.spectrum, 0.0
        return a, self.center + delta

    def client_losses(self, w: torch.Tensor, ids: np.ndarray) -> np.ndarray:
        """F_k(w) of clients `ids` for each replica's w [R, d]: [R, M] float64."""
        a, b = self.clients(ids)
        diff = w.detach().double().cpu().numpy()[:, None, :] - b
        return 0.5 * (a * diff * diff).sum(-1)

    def init_params(self, replicas: int, seed: int) -> torch.Tensor:
        return torch.zeros(replicas, self.dim, dtype=self.dtype, device=self.device)

    def round_batches(self, keys: ClientKeys, steps: int) -> PopulationBatches:
        a, b = self.clients(keys.clients)
        noise = None
        if self.noise:
            key = streams.stream_key(keys.seed, streams.NOISE, keys.replicas, keys.round, keys.clients)
            z = streams.step_normals(key, keys.tau, steps, self.dim)
            noise = torch.as_tensor(self.noise * z, dtype=self.dtype, device=self.device)
        as_tensor = lambda x: torch.as_tensor(x, dtype=self.dtype, device=self.device)  # noqa: E731
        return PopulationBatches(as_tensor(a), as_tensor(b), noise)

    def grad(self, w: torch.Tensor, batches: PopulationBatches, step: int) -> torch.Tensor:
        """Gradients A_k (w - b_k) (+ noise) of the first len(w) clients of `batches` (the executor trains a prefix)."""
        m = len(w)
        g = batches.a[:m] * (w - batches.b[:m])
        return g if batches.noise is None else g + batches.noise[:m, step]

    loop_grad = grad

    def entry_bytes(self, steps: int) -> int:
        """Bytes one client copy of a batched step needs besides its parameters: a_k, b_k and its noise."""
        item = torch.empty((), dtype=self.dtype).element_size()
        return (2 * self.dim + (steps * self.dim if self.noise else 0)) * item

    # ------------------------------------------------------------ the population in closed form

    def f_star(self) -> float:
        """F* = rho^2 / 2 times the weight of the complete quadruples (the others sit at w*)."""
        return 0.5 * self.spread ** 2 * self.dim * self.complete / self.num_clients

    def optimum(self) -> np.ndarray:
        """w* = (sum p_k A_k)^-1 sum p_k A_k b_k = c."""
        return self.center.copy()

    def hessian_sum(self) -> np.ndarray:
        """sum_k p_k A_k = diag(m)."""
        return np.diag(self.spectrum)

    def objective_value(self, w: torch.Tensor) -> torch.Tensor:
        return self.objective_and_grad(w)[0]

    def objective_and_grad(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """F(w) = F* + 1/2 (w - c)^T diag(m) (w - c) and its gradient diag(m) (w - c), float64."""
        m = torch.as_tensor(self.spectrum, dtype=torch.float64, device=w.device)
        diff = w.double() - torch.as_tensor(self.center, dtype=torch.float64, device=w.device)
        return self.f_star() + 0.5 * (m * diff * diff).sum(-1), m * diff

    def evaluate(self, w: torch.Tensor, grad_norm: bool = True) -> Evaluation:
        value, g = self.objective_and_grad(w)  # closed forms: the gradient costs next to nothing
        value, grad_norm_sq = value.cpu().numpy(), (g ** 2).sum(-1).cpu().numpy() if grad_norm else None
        if self.num_clients <= self.eval_clients:
            return Evaluation(train_loss=value, grad_norm_sq=grad_norm_sq)
        ids = sample_clients(self.eval_seed, self.num_clients, self.eval_clients)
        estimate, se = weighted_sum_estimate(self.weights[ids], self.client_losses(w, ids), self.num_clients)
        return Evaluation(train_loss=estimate, grad_norm_sq=grad_norm_sq, train_loss_se=se, exact_train_loss=value)



@DATASETS.register("quadratic_lazy", KEYS)
def population(num_clients: int, dim: int, spread: float, mu: float, L: float, curvature_spread: float, noise: float,
               eval_clients: int | None, seed: int, run_seed: int, dtype: torch.dtype, device: str,
               memory_budget: int | None) -> QuadraticPopulation:
    """`dataset=quadratic_lazy`: clients generated when sampled; metrics estimated on `eval_clients` (eval.clients,
    null: DEFAULT_EVAL_CLIENTS) clients drawn by the run's seed."""
    eval_clients = DEFAULT_EVAL_CLIENTS if eval_clients is None else eval_clients
    return QuadraticPopulation(num_clients, dim, spread, mu, L, curvature_spread, noise, seed, run_seed, eval_clients,
                               dtype, device, memory_budget)
