"""Exact references: the closed forms agree with each other and with direct recurrences; per-client
minima and Li et al.'s heterogeneity Gamma = F* - sum p_k F_k* land in the run row."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from fedharness.references import closed_forms as cf
from fedharness.problems.li_toy import LiToyProblem
from fedharness.runs.execute import execute, prepare

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too


def _random_quadratic(seed: int = 0, n: int = 4, d: int = 3):
    rng = np.random.default_rng(seed)
    Q = [np.linalg.qr(rng.normal(size=(d, d)))[0] for _ in range(n)]
    A = np.stack([(q * rng.uniform(0.5, 2.0, d)) @ q.T for q in Q])
    return A, rng.normal(size=(n, d)), rng.dirichlet(np.ones(n))


def _local_gd(A_i, e_i, x, lr, tau, mu):
    """Proximal gradient descent from x on 1/2 (w - e)^T A (w - e) + mu/2 ||w - x||^2, step by step."""
    w = x.copy()
    for _ in range(tau):
        w = w - lr * (A_i @ (w - e_i) + mu * (w - x))
    return w


@pytest.mark.parametrize("mu", [0.0, 1.5])
def test_local_operator_matches_the_recurrence(mu):
    A, e, _ = _random_quadratic()
    x = np.array([0.3, -1.0, 2.0])
    for i, tau in enumerate((1, 4, 9, 2)):
        K = cf.local_gd_operator(A[i], 0.1, tau, mu)
        np.testing.assert_allclose(_local_gd(A[i], e[i], x, 0.1, tau, mu) - x, -K @ (x - e[i]), atol=1e-13)


def test_fixed_point_is_a_fixed_point_of_the_round_map():
    A, e, p = _random_quadratic(1)
    tau, lr, mu = np.array([1, 3, 7, 2]), 0.15, 0.5
    for coef, closed in ((p, cf.fedavg_fixed_point(A, e, p, tau, lr, mu)),
                         (p / cf.prox_l1(tau, lr, mu), cf.fednova_fixed_point(A, e, p, tau, lr, mu))):
        delta = sum(c * (_local_gd(A[i], e[i], closed, lr, tau[i], mu) - closed) for i, c in enumerate(coef))
        np.testing.assert_allclose(delta, 0, atol=1e-13)


def test_mangold_stationary_mean_equals_fedavg_fixed_point_and_first_order_expansion():
    A, e, _ = _random_quadratic(2, n=6)
    theta = cf.optimum(A, e)
    equal = np.full(6, 1 / 6)
    for lr in (0.05, 0.01):
        mean = cf.mangold_stationary_mean(A, e, lr, 5)
        np.testing.assert_allclose(mean, cf.fedavg_fixed_point(A, e, equal, 5, lr), atol=1e-13)
    # the bias and its first-order term (gamma (H-1)/2) b_h agree to O(gamma^2)
    err = [np.linalg.norm(cf.mangold_stationary_mean(A, e, lr, 5) - theta - cf.first_order_bias(A, e, None, lr, 5))
           for lr in (0.02, 0.01)]
    assert err[0] / err[1] == pytest.approx(4.0, rel=0.15)
    # the sign the paper printed (theta* - theta_c* inside the sum) would give the mirror image
    n, I = 6, np.eye(3)
    Gc = np.stack([np.linalg.matrix_power(I - 0.01 * A[c], 5) for c in range(n)])
    printed = theta + np.linalg.solve(I - Gc.mean(0), np.einsum("nde,ne->d", I - Gc, theta - e) / n)
    assert np.linalg.norm(printed - cf.mangold_stationary_mean(A, e, 0.01, 5)) > 1e-3


def test_richardson_romberg_weights():
    assert cf.rr_coefficients("gamma", 10) == (2.0, -1.0)
    a, b = cf.rr_coefficients("H", 10)
    assert a + b == pytest.approx(1.0) and a * 9 + b * 19 == pytest.approx(0.0)  # bias ~ c (H - 1) cancels


def test_quadratic_heterogeneity(run_config):
    problem, _, reference = prepare(run_config("dataset=quadratic", "dataset.curvature=random", "dataset.mu=0.5",
                                               "dataset.L=2.0", "dtype=float64"))
    np.testing.assert_array_equal(cf.client_minima(problem), 0.0)  # each client reaches 0 at its own e_k
    assert cf.heterogeneity(problem, reference.f_star) == pytest.approx(reference.f_star) and reference.f_star > 0.1
    homogeneous, _, ref0 = prepare(run_config("dataset=quadratic", "dataset.spread=0.0", "dtype=float64"))
    assert cf.heterogeneity(homogeneous, ref0.f_star) == pytest.approx(0.0, abs=1e-15)


def test_li_toy_client_minima():
    problem = LiToyProblem(3, 2, 0.05, dtype=torch.float64)
    minima = cf.client_minima(problem)
    for k in range(3):  # F_k at its own minimiser e_k, from the paper's formula
        A_k, b_k, e_k = problem.A_np[k], problem.b_np[k], problem.e_np[k]
        np.testing.assert_allclose(minima[k], 0.5 * e_k @ A_k @ e_k - b_k @ e_k, atol=1e-14)
    w_star = problem.optimum()
    f_star = float(problem.objective_value(torch.as_tensor(w_star)[None])[0])
    gamma = cf.heterogeneity(problem, f_star, minima)
    assert gamma > 0.01  # the clients disagree: F* is well above the mean of their own minima


def test_data_problem_client_minima(run_config):
    cfg = run_config("dataset.num_clients=4", "dataset.samples_per_client=40", "model.l2=0.01", "dtype=float64")
    problem, _, reference = prepare(cfg)
    minima = cf.client_minima(problem)
    w_star = torch.as_tensor(reference.w_star)[None]
    for k, (lo, n) in enumerate(zip(problem.offsets, problem.sizes)):
        obj = problem.objective
        x, y = problem.x[lo:lo + n], problem.y[lo:lo + n]
        f_k_at_w_star = float(obj.loss_terms(w_star, x, y)[0][0] / n + obj.regularizer(w_star)[0])
        assert minima[k] < f_k_at_w_star  # each client does better on its own
    # F* = sum p_k F_k(w*) >= sum p_k F_k*, strictly for heterogeneous clients
    assert cf.heterogeneity(problem, reference.f_star, minima) > 1e-3


def test_run_row_records_f_star_and_heterogeneity(run_config, tmp_path):
    cfg = run_config("dataset=quadratic", "dataset.curvature=random", "dataset.mu=0.5", "dataset.L=2.0",
                     "dtype=float64", "rounds=2")
    execute(cfg)
    row = pd.read_parquet(tmp_path / "results" / "runs").iloc[0]
    _, _, reference = prepare(cfg)
    assert row["f_star"] == pytest.approx(reference.f_star, rel=1e-12)
    assert row["gamma_heterogeneity"] == pytest.approx(reference.f_star, rel=1e-12)  # F_k* = 0 for these
    nonconvex = run_config("dataset.num_clients=4", "dataset.samples_per_client=20", "model=2nn", "rounds=1",
                           "results_dir=" + str(tmp_path / "nc"))
    execute(nonconvex)
    row = pd.read_parquet(tmp_path / "nc" / "runs").iloc[0]
    assert pd.isna(row["f_star"]) and pd.isna(row["gamma_heterogeneity"])  # null, not a made-up number
