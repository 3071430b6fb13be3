"""dataset=quadratic_lazy: a population of quadratic clients drawn on demand whose w*, F* and F(w) have closed
forms at any N (checked against dense float64 sums over every client), and the train loss estimated on a uniform
sample of clients above eval_clients, with its standard error in `train_loss_se` (null where exact)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fedharness
from fedharness.problems.estimate import sample_clients, weighted_sum_estimate
from fedharness.problems.quadratic_lazy import QuadraticPopulation

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too


def _population(n: int, eval_clients: int = 10**9, eval_seed: int = 0, dim: int = 6) -> QuadraticPopulation:
    return QuadraticPopulation(n, dim, spread=0.7, mu=0.5, L=8.0, curvature_spread=0.6, noise=0.0, seed=3,
                               eval_seed=eval_seed, eval_clients=eval_clients, dtype=torch.float64)


def _dense(problem: QuadraticPopulation) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every client's p_k, a_k (A_k = diag(a_k)) and b_k, the obvious way: one client at a time."""
    n = problem.num_clients
    ab = [problem.clients(np.array([k])) for k in range(n)]
    return np.asarray(problem.weights), np.concatenate([a for a, _ in ab]), np.concatenate([b for _, b in ab])


@pytest.mark.parametrize("n", [1, 6, 37, 400, 1003])
def test_closed_form_optimum_and_f_star_equal_a_brute_force_solve(n):
    """w* = (sum p_k A_k)^-1 sum p_k A_k b_k solved densely, F* = F(w*) summed over every client, and F and its
    gradient at another point all equal the closed forms (float64, relative 1e-10), for every N mod 4."""
    problem = _population(n)
    p, a, b = _dense(problem)
    hessian = np.diag(np.einsum("n,nd->d", p, a))
    w_star = np.linalg.solve(hessian, np.einsum("n,nd,nd->d", p, a, b))
    np.testing.assert_allclose(problem.optimum(), w_star, rtol=1e-10, atol=0)
    np.testing.assert_allclose(problem.hessian_sum(), hessian, rtol=1e-10, atol=1e-14)
    f_star = 0.5 * np.einsum("n,nd->", p, a * (w_star - b) ** 2)
    np.testing.assert_allclose(problem.f_star(), f_star, rtol=1e-10, atol=1e-300 if n > 3 else 1e-15)
    w = np.random.default_rng(0).normal(size=(2, problem.dim))
    value, grad = problem.objective_and_grad(torch.as_tensor(w))
    np.testing.assert_allclose(value.numpy(), 0.5 * np.einsum("n,rnd->r", p, a * (w[:, None] - b) ** 2), rtol=1e-10)
    np.testing.assert_allclose(grad.numpy(), np.einsum("n,nd,rnd->rd", p, a, w[:, None] - b), rtol=1e-10)
    if n >= 4:  # the clients really differ: optima and curvatures are not all alike
        assert np.ptp(b, axis=0).min() > 0.1 and np.ptp(a, axis=0).min() > 0.1


def test_a_client_is_the_same_however_it_is_asked_for():
    """Clients come from counter-based streams: asked for alone, in any order or with repeats, each is the same."""
    problem = _population(10**8)
    ids = np.array([99_999_999, 5, 4, 6, 7, 5, 123_456_789 % 10**8])
    a, b = problem.clients(ids)
    for i, k in enumerate(ids):
        a1, b1 = problem.clients(np.array([k]))
        assert np.array_equal(a1[0], a[i]) and np.array_equal(b1[0], b[i])
    assert not np.array_equal(b[1], b[2])


def test_the_estimate_is_unbiased_and_its_standard_error_is_right():
    """Over many sample seeds the estimates average to the exact F (within 4 standard errors of that mean, from
    the reported se) and their spread equals the reported standard error (within 15%)."""
    n, count, seeds = 5000, 200, 400
    w = torch.as_tensor(np.random.default_rng(1).normal(size=(2, 6)))
    exact = _population(n).objective_value(w).numpy()
    runs = [_population(n, eval_clients=count, eval_seed=s).evaluate(w) for s in range(seeds)]
    estimates = np.array([ev.train_loss for ev in runs])  # [seeds, 2 replicas]
    se = np.array([ev.train_loss_se for ev in runs])
    assert np.all(np.abs(estimates.mean(0) - exact) < 4 * se.mean(0) / np.sqrt(seeds))
    np.testing.assert_allclose(estimates.std(0, ddof=1), se.mean(0), rtol=0.15)
    np.testing.assert_array_equal(runs[0].exact_train_loss, exact)


def test_the_estimator_weighs_unequal_clients_by_p_k():
    """weighted_sum_estimate on a population with unequal p_k: unbiased for sum p_k F_k over many samples (F_k
    grows with k, so a sample that favoured some indices would show)."""
    rng = np.random.default_rng(2)
    n, count, seeds = 3000, 300, 400
    p = rng.lognormal(0, 1, n)
    p /= p.sum()
    values = np.sort(rng.gamma(2.0, 1.0, n))
    draws = [sample_clients(s, n, count) for s in range(seeds)]
    out = [weighted_sum_estimate(p[ids], values[ids][None], n) for ids in draws]
    estimates, se = np.array([e[0] for e, _ in out]), np.array([s[0] for _, s in out])
    assert abs(estimates.mean() - p @ values) < 4 * se.mean() / np.sqrt(seeds)
    assert np.array_equal(sample_clients(7, n, count), sample_clients(7, n, count))  # fixed per (seed, N, S)


def test_runs_below_the_threshold_are_exact_with_a_null_standard_error(tmp_path):
    """Exact runs (dataset=quadratic, and quadratic_lazy with N <= eval_clients) record train_loss_se as null,
    and quadratic_lazy's train_loss is F = F* + subopt."""
    for dataset in ("quadratic", "quadratic_lazy"):
        r = fedharness.run([f"dataset={dataset}", "dataset.num_clients=40", "rounds=4", "eval_every=2",
                            "algorithm.clients_per_round=5", "dtype=float64", f"results_dir={tmp_path}"],
                           progress=False)
        rounds = r.rounds
        assert len(rounds) == 3 and rounds.train_loss_se.isna().all()
        if dataset == "quadratic_lazy":
            np.testing.assert_allclose(rounds.train_loss, rounds.subopt + r.runs.f_star.iloc[0], rtol=1e-12)


class _Models(fedharness.Callback):
    name = "models"

    def __init__(self):
        self.x = {}

    def on_round_end(self, context):
        return False

    def on_evaluation(self, context):
        self.x[context.round] = context.x.double().clone()


def test_a_run_of_10_to_the_8_clients_records_exact_subopt_and_an_estimated_train_loss(tmp_path):
    """N = 10^8: subopt and dist_to_opt are the closed forms at the models the run evaluated (relative 1e-12),
    train_loss is an estimate with a positive standard error, within 5 of them of the exact F."""
    n = 10**8
    models = _Models()
    r = fedharness.run(["dataset=quadratic_lazy", f"dataset.num_clients={n}", "eval.clients=2000",
                        "rounds=4", "eval_every=2", "algorithm.clients_per_round=20", "algorithm.local_steps=5",
                        "dtype=float64", "threads=1", f"results_dir={tmp_path}"], callbacks=[models], progress=False)
    rounds = r.rounds
    problem = QuadraticPopulation(n, 10, 1.0, 1.0, 10.0, 0.5, 0.0, seed=0, eval_seed=0, eval_clients=2000)
    f_star = problem.f_star()
    assert r.runs.f_star.iloc[0] == pytest.approx(f_star, rel=1e-12)
    for _, row in rounds.iterrows():
        x = models.x.get(row["round"], torch.zeros(1, 10, dtype=torch.float64))  # round 0: the start, w = 0
        exact = problem.objective_value(x).numpy()[0]
        assert row.subopt == pytest.approx(exact - f_star, rel=1e-12)
        assert row.dist_to_opt == pytest.approx(float((x[0] - torch.as_tensor(problem.center)).norm()), rel=1e-12)
        assert row.train_loss_se > 0 and abs(row.train_loss - exact) < 5 * row.train_loss_se
