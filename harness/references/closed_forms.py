"""Exact references: clients' minima and heterogeneity, and the closed-form limits of FedAvg-type methods.

Quadratic clients F_i(x) = 1/2 (x - e_i)^T A_i (x - e_i) make every limit of local
gradient descent an affine fixed point, so the biases the papers describe have exact
values to test against (all numpy float64):

* FedAvg with heterogeneous local steps tau_i and step sizes eta_i (Wang et al. Sec. 3;
  Li et al. Thm 4/5 eq. (28)): deterministic local GD from x ends at
  e_i + (I - eta_i A_i)^tau_i (x - e_i), so Delta_i = -K_i (x - e_i) with
  K_i = I - (I - eta_i A_i)^tau_i, and an aggregator Delta = sum c_i Delta_i has the fixed
  point solving sum c_i K_i (x - e_i) = 0 (the server step size does not move it).
  A proximal term mu makes K_i = (I - B_i^tau_i)(A_i + mu I)^-1 A_i, B_i = I - eta_i (A_i + mu I).
* FedNova: c_i = p_i / ||a_i||_1 (tau_eff only scales the step).
* Mangold et al. Prop. 5 (corrected sign): the stationary mean of FedAvg with H local
  steps, equal weights, full participation, theta* + (I - Gamma)^-1 (1/N) sum_c
  (I - Gamma_c)(theta_c* - theta*), Gamma_c = (I - gamma A_c)^H; unchanged by zero-mean
  gradient noise. Its first-order expansion is (gamma (H-1)/2) b_h.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from fedharness.algorithms.extrapolation import rr_coefficients  # the estimator's weights (a, b)
from fedharness.problems.data import DataProblem
from fedharness.references.solve import solve_reference


def _per_client(value, n: int) -> np.ndarray:
    return np.broadcast_to(np.asarray(value, dtype=np.float64), (n,)).copy()


def optimum(A: np.ndarray, e: np.ndarray, p: np.ndarray | None = None) -> np.ndarray:
    """w* = (sum p_i A_i)^-1 sum p_i A_i e_i (equal weights by default)."""
    p = np.full(len(e), 1 / len(e)) if p is None else np.asarray(p, np.float64)
    return np.linalg.solve(np.einsum("n,nde->de", p, A), np.einsum("n,nde,ne->d", p, A, e))


# ---- FedNova's ||a_i||_1 (Wang et al. Sec. 4.1), in units of the client's step size ----

def sgd_l1(tau) -> np.ndarray:
    return np.asarray(tau, np.float64)


def prox_l1(tau, lr, mu: float) -> np.ndarray:
    """Proximal SGD: a = [(1-alpha)^(tau-1), ..., 1], ||a||_1 = (1 - (1-alpha)^tau) / alpha, alpha = lr mu."""
    tau, alpha = np.asarray(tau, np.float64), np.asarray(lr, np.float64) * mu
    return tau if mu == 0 else (1 - (1 - alpha) ** tau) / alpha


def momentum_l1(tau, rho: float) -> np.ndarray:
    """Momentum rho, buffer reset each round: ||a||_1 = (tau - rho (1 - rho^tau) / (1 - rho)) / (1 - rho)."""
    tau = np.asarray(tau, np.float64)
    return (tau - rho * (1 - rho ** tau) / (1 - rho)) / (1 - rho)


def decay_l1(tau, gamma: float) -> np.ndarray:
    """Exponentially decayed local lr: a = [1, gamma, ..., gamma^(tau-1)], ||a||_1 = (1 - gamma^tau) / (1 - gamma)."""
    tau = np.asarray(tau, np.float64)
    return tau if gamma == 1 else (1 - gamma ** tau) / (1 - gamma)


# ---- fixed points of deterministic local GD on quadratics ----

def local_gd_operator(A_i: np.ndarray, lr: float, tau: int, mu: float = 0.0) -> np.ndarray:
    """K_i with Delta_i(x) = -K_i (x - e_i) after tau steps of (proximal) GD from x."""
    d = len(A_i)
    I = np.eye(d)
    B = I - lr * (A_i + mu * I)
    if mu == 0:
        return I - np.linalg.matrix_power(B, int(tau))
    return (I - np.linalg.matrix_power(B, int(tau))) @ np.linalg.solve(A_i + mu * I, A_i)


def aggregate_fixed_point(A: np.ndarray, e: np.ndarray, coef, tau, lr, mu: float = 0.0) -> np.ndarray:
    """The x with sum_i c_i K_i (x - e_i) = 0: the limit of Delta = sum c_i Delta_i with fixed tau_i, lr_i."""
    n = len(e)
    coef, tau, lr = _per_client(coef, n), _per_client(tau, n), _per_client(lr, n)
    K = np.stack([c * local_gd_operator(A[i], lr[i], int(tau[i]), mu) for i, c in enumerate(coef)])
    return np.linalg.solve(K.sum(0), np.einsum("nde,ne->d", K, e))


def fedavg_fixed_point(A: np.ndarray, e: np.ndarray, p, tau, lr, mu: float = 0.0) -> np.ndarray:
    """FedAvg (FedProx when mu > 0): c_i = p_i. Tends to (sum p tau A)^-1 sum p tau A e as lr -> 0."""
    return aggregate_fixed_point(A, e, p, tau, lr, mu)


def fednova_fixed_point(A: np.ndarray, e: np.ndarray, p, tau, lr, mu: float = 0.0) -> np.ndarray:
    """FedNova: c_i = p_i tau_eff / ||a_i||_1; the common factor tau_eff does not move the fixed point."""
    n = len(e)
    l1 = prox_l1(_per_client(tau, n), _per_client(lr, n), mu)
    return aggregate_fixed_point(A, e, _per_client(p, n) / l1, tau, lr, mu)


def small_step_limit(A: np.ndarray, e: np.ndarray, p, tau) -> np.ndarray:
    """lr -> 0 limit of FedAvg with heterogeneous tau: the optimum of the surrogate sum p_i tau_i F_i."""
    return optimum(A, e, _per_client(p, len(e)) * _per_client(tau, len(e)))


# ---- Mangold et al.: stationary mean, first-order bias, Richardson-Romberg ----

def mangold_stationary_mean(A: np.ndarray, e: np.ndarray, lr: float, H: int) -> np.ndarray:
    """theta* + (I - Gamma)^-1 (1/N) sum_c (I - Gamma_c)(theta_c* - theta*), Gamma_c = (I - lr A_c)^H."""
    n, d = e.shape
    I = np.eye(d)
    theta = optimum(A, e)
    Gc = np.stack([np.linalg.matrix_power(I - lr * A[c], H) for c in range(n)])
    rhs = np.einsum("nde,ne->d", I - Gc, e - theta) / n
    return theta + np.linalg.solve(I - Gc.mean(0), rhs)


def first_order_bias(A: np.ndarray, e: np.ndarray, p, lr: float, H: int) -> np.ndarray:
    """(lr (H-1)/2) b_h, b_h = H*^-1 sum_c p_c (A_c - H*) grad f_c(theta*), H* = sum p_c A_c (Mangold et al.)."""
    p = np.full(len(e), 1 / len(e)) if p is None else _per_client(p, len(e))
    theta = optimum(A, e, p)
    Hs = np.einsum("n,nde->de", p, A)
    grads = np.einsum("nde,ne->nd", A, theta - e)
    b_h = np.linalg.solve(Hs, np.einsum("n,nde,ne->d", p, A - Hs, grads))
    return lr * (H - 1) / 2 * b_h


def rr_stationary_mean(A: np.ndarray, e: np.ndarray, lr: float, H: int, kind: str = "gamma") -> np.ndarray:
    a, b = rr_coefficients(kind, H)
    if kind == "gamma":
        return a * mangold_stationary_mean(A, e, lr, H) + b * mangold_stationary_mean(A, e, 2 * lr, H)
    return a * mangold_stationary_mean(A, e, lr, H) + b * mangold_stationary_mean(A, e, lr, 2 * H)


# ---- per-client minima and heterogeneity Gamma = F* - sum p_k F_k* (Li et al.) ----

def client_minima(problem, solve: Callable | None = None) -> np.ndarray | None:
    """F_k* for every client of a convex problem, in float64; None if a client's minimum may not be attained.

    Problems with a closed form (`Problem.client_minima`: quadratics, li_toy) use it; data problems
    with a ridge term (model.l2 > 0) solve each client's own objective (its data and the
    regulariser) like the global one, with `solve(client_problem)` (default `solve_reference`).
    """
    closed = problem.client_minima()  # quadratics: 0 (at e_k); li_toy: its offsets
    if closed is not None:
        return np.asarray(closed, np.float64)
    if not isinstance(problem, DataProblem):  # no per-client objective to solve (e.g. lazily generated clients)
        return None
    if not problem.objective.l2 > 0:
        return None  # no ridge term: a client's minimum need not be attained (separable classes)
    solve = solve or solve_reference
    x, y, _, _ = problem._raw  # the clients' samples back to back, as DataProblem.with_dtype rebuilds them
    out = np.empty(problem.num_clients)
    for k, (start, n) in enumerate(zip(problem.offsets, problem.sizes)):
        sub = DataProblem(problem.objective, x[start:start + n], y[start:start + n], [np.arange(n)], None, None,
                          problem.batch_size, torch.float64, problem.device)
        out[k] = solve(sub).f_star  # strongly convex: a failure (SolveFailed) is the solver's, and propagates
    return out


def heterogeneity(problem, f_star: float, minima: np.ndarray | None = None) -> float | None:
    """Gamma = F* - sum_k p_k F_k* >= 0 (Li et al.): zero iff every client's minimum is the global one."""
    minima = client_minima(problem) if minima is None else minima
    return None if minima is None else float(f_star - np.dot(problem.weights, minima))
