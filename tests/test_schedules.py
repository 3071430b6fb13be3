"""Client learning-rate schedules: exact values, Li et al.'s theory defaults, and the smoothness estimates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedharness.algorithms import schedules
from fedharness.errors import ConfigError
from fedharness.problems.data import DataProblem
from fedharness.problems.objectives import LinearRegression, SoftmaxRegression
from fedharness.problems.quadratic import QuadraticProblem
from fedharness.runs.execute import prepare

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too


def test_constant_and_inverse_round_exact():
    np.testing.assert_array_equal(schedules.Constant(0.3).step_lrs(7, 4), [0.3] * 4)
    np.testing.assert_allclose(schedules.InverseRound(0.3).step_lrs(5, 3), [0.05] * 3, rtol=1e-15)


def test_inverse_step_counts_global_local_iterations():
    s = schedules.InverseStep(2.0, 10.0, period=4)
    np.testing.assert_allclose(s.step_lrs(0, 4), [2 / 10, 2 / 11, 2 / 12, 2 / 13], rtol=1e-15)
    np.testing.assert_allclose(s.step_lrs(3, 2), [2 / 22, 2 / 23], rtol=1e-15)  # t = 3 * 4 + step


def test_step_decay_at_fractions_of_the_rounds():
    s = schedules.StepDecay(0.1, [0.5, 0.75], 0.1, rounds=100)
    lrs = np.array([s.step_lrs(r, 1)[0] for r in (0, 49, 50, 74, 75, 99)])
    np.testing.assert_allclose(lrs, [0.1, 0.1, 0.01, 0.01, 0.001, 0.001], rtol=1e-12)
    odd = schedules.StepDecay(1.0, [0.3], 0.5, rounds=10)
    assert odd.step_lrs(2, 1)[0] == 1.0 and odd.step_lrs(3, 1)[0] == 0.5


def test_li_theory_on_a_quadratic_uses_exact_eigenvalues():
    rng = np.random.default_rng(0)
    A = np.stack([np.diag(rng.uniform(0.5, 4.0, 3)) for _ in range(5)])
    problem = QuadraticProblem(A, rng.normal(size=(5, 3)), dtype=torch.float64)
    L, mu = schedules.estimate_smoothness(problem)
    assert L == pytest.approx(A.max()) and mu == pytest.approx(A[:, np.arange(3), np.arange(3)].min())
    s = schedules.li_theory(problem, local_steps=5)
    gamma = max(8 * L / mu, 5)
    np.testing.assert_allclose(s.step_lrs(2, 3), 2 / (mu * (gamma + np.array([10, 11, 12]))), rtol=1e-12)
    # when E dominates, gamma = E
    flat = QuadraticProblem(np.broadcast_to(np.eye(2), (3, 2, 2)).copy(), np.zeros((3, 2)), dtype=torch.float64)
    assert schedules.li_theory(flat, local_steps=20).gamma == 20.0


def _data_problem(objective_cls, l2: float) -> DataProblem:
    rng = np.random.default_rng(1)
    sizes = [30, 55, 12, 80]
    x = rng.normal(size=(sum(sizes), 4)) * np.array([1.0, 2.0, 0.5, 3.0])
    y = rng.integers(0, 3, sum(sizes))
    index = np.split(np.arange(sum(sizes)), np.cumsum(sizes)[:-1])
    return DataProblem(objective_cls((4,), 3, l2), x, y, index, None, None, 8, torch.float64)


@pytest.mark.parametrize("objective_cls,curvature", [(SoftmaxRegression, 1 / 3), (LinearRegression, 1.0)])
def test_smoothness_of_linear_models_matches_the_closed_form_at_zero(objective_cls, curvature):
    """At w = 0 the softmax Hessian is (X^T X / n) kron (I - 11^T/C)/C: top eigenvalue lambda_max(X^T X/n)/C;
    least squares: lambda_max(X^T X / n). Both plus 2 l2; the estimate is the largest over the clients."""
    problem = _data_problem(objective_cls, 0.01)
    L, mu = schedules.estimate_smoothness(problem)
    xb = problem.x.numpy()  # with the bias column
    per_client = [np.linalg.eigvalsh(xb[o:o + n].T @ xb[o:o + n] / n).max()
                  for o, n in zip(problem.offsets, problem.sizes)]
    assert L == pytest.approx(curvature * max(per_client) + 0.02, rel=1e-5)
    assert mu == pytest.approx(0.02)


def test_li_theory_needs_strong_convexity(run_config):
    with pytest.raises(ConfigError) as err:
        schedules.estimate_smoothness(_data_problem(SoftmaxRegression, 0.0))
    assert err.value.key == "algorithm.lr_schedule"
    with pytest.raises(ConfigError) as err:
        prepare(run_config("dataset=digits", "model=2nn", "algorithm.lr_schedule=li_theory"))
    assert err.value.key == "algorithm.lr_schedule"


def test_li_theory_through_the_config(run_config):
    cfg = run_config("dataset=quadratic", "dataset.curvature=diagonal", "dataset.mu=0.5", "dataset.L=2.0",
                     "algorithm.lr_schedule=li_theory", "algorithm.local_steps=5")
    problem, algorithm, _ = prepare(cfg)
    L, mu = schedules.estimate_smoothness(problem)
    assert 0.5 <= mu < L <= 2.0
    assert algorithm.schedule.step_lrs(0, 1)[0] == pytest.approx(2 / (mu * max(8 * L / mu, 5)))


def test_step_decay_through_the_config_knows_the_rounds(run_config):
    cfg = run_config("dataset=quadratic", "algorithm.lr_schedule=step_decay", "algorithm.client_lr=0.2",
                     "rounds=40", "algorithm.decay_at=[0.25]", "algorithm.decay_factor=0.5")
    _, algorithm, _ = prepare(cfg)
    assert algorithm.schedule.step_lrs(9, 1)[0] == 0.2 and algorithm.schedule.step_lrs(10, 1)[0] == 0.1


@pytest.mark.parametrize("overrides,key", [
    (("algorithm.lr_schedule=inverse_step", "algorithm.lr_beta=0"), "algorithm.lr_beta"),
    (("algorithm.lr_schedule=inverse_step", "algorithm.lr_gamma=-1"), "algorithm.lr_gamma"),
    (("algorithm.lr_schedule=inverse_step", "algorithm.lr_gamma=big"), "algorithm.lr_gamma"),
    (("algorithm.lr_schedule=step_decay", "algorithm.decay_at=[0.75,0.5]"), "algorithm.decay_at"),
    (("algorithm.lr_schedule=step_decay", "algorithm.decay_at=[1.5]"), "algorithm.decay_at"),
    (("algorithm.lr_schedule=step_decay", "algorithm.decay_at=[]"), "algorithm.decay_at"),
    (("algorithm.lr_schedule=step_decay", "algorithm.decay_at=0.5"), "algorithm.decay_at"),
    (("algorithm.lr_schedule=step_decay", "algorithm.decay_factor=0"), "algorithm.decay_factor"),
    (("algorithm.lr_schedule=step_decay", "algorithm.decay_factor=2"), "algorithm.decay_factor"),
    (("algorithm.client_lr=0",), "algorithm.client_lr"),
    (("algorithm.lr_schedule=cosine",), "algorithm.lr_schedule"),
])
def test_bad_schedule_values_name_the_key(overrides, key, run_config):
    with pytest.raises(ConfigError) as err:
        prepare(run_config("dataset=quadratic", *overrides))
    assert err.value.key == key
