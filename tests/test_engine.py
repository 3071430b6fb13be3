"""The engine: the vectorized path equals the per-client reference loop; FedAvg reaches closed forms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from closeness import assert_close_to_scale
from fakes import fake_mnist
from ray_support import trajectory
from fedharness.core.executors import InlineExecutor, LoopExecutor
from fedharness.references.solve import _newton_cg, solve_reference
from fedharness.runs.execute import prepare

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too


def _trajectory(cfg, executor_cls, rounds: int, num_shards: int = 1) -> torch.Tensor:
    problem, algorithm, _ = prepare(cfg)
    return trajectory(cfg, executor_cls(problem, algorithm.solver, num_shards), rounds, problem, algorithm)[0]


@pytest.mark.parametrize("model,lr", [("logreg", 0.1), ("linreg", 0.02)])  # logreg 0.3 diverges on this data
def test_vectorized_linear_models_equal_per_client_loop(run_config, model, lr):
    cfg = run_config("dataset.num_clients=12", f"model={model}", "model.l2=0.01", f"algorithm.client_lr={lr}", "algorithm.clients_per_round=5", "algorithm.local_steps=7",
                     "algorithm.batch_size=8", "replicas=3", "rounds=4")
    fast = _trajectory(cfg, InlineExecutor, 4)
    slow = _trajectory(cfg, LoopExecutor, 4)
    assert (fast[-1] - fast[0]).abs().max() > 0.05  # the model actually moved
    assert_close_to_scale(fast, slow, rtol=1e-5)  # float32: per-client loop and batch reassociate sums


def test_vectorized_logreg_independent_of_shard_count(run_config):
    cfg = run_config("dataset.num_clients=12", "algorithm.sampler=scheme_ii", "algorithm.clients_per_round=6",
                     "algorithm.local_steps=5", "replicas=2", "dtype=float64", "rounds=3")
    one = _trajectory(cfg, InlineExecutor, 3, num_shards=1)
    three = _trajectory(cfg, InlineExecutor, 3, num_shards=3)
    assert torch.allclose(one, three, atol=1e-12, rtol=1e-10)


def test_vectorized_cnn_equals_per_client_loop(run_config, tmp_path):
    fake_mnist(tmp_path / "mnist" / "MNIST" / "raw", 120, 20, gz=False)
    cfg = run_config("dataset=mnist", f"dataset.data_dir={tmp_path / 'mnist'}", "dataset.num_clients=6",
                     "model=cnn", "algorithm.clients_per_round=3", "algorithm.local_steps=2",
                     "algorithm.batch_size=4", "algorithm.client_lr=0.05", "replicas=2", "rounds=2")
    fast = _trajectory(cfg, InlineExecutor, 2)
    slow = _trajectory(cfg, LoopExecutor, 2)
    assert (fast[-1] - fast[0]).abs().max() > 1e-3
    assert_close_to_scale(fast, slow, rtol=1e-5)  # float32: per-client loop and batch reassociate sums


def test_full_participation_one_local_step_reaches_quadratic_optimum(run_config):
    # E = 1 with full participation is gradient descent on F: its fixed point is w* exactly.
    cfg = run_config("dataset=quadratic", "dataset.curvature=random", "dataset.mu=0.5", "dataset.L=2.0",
                     "dataset.spread=3.0", "algorithm.sampler=full", "algorithm.local_steps=1",
                     "algorithm.client_lr=0.5", "dtype=float64", "rounds=300")
    problem, _, reference = prepare(cfg)
    x = _trajectory(cfg, InlineExecutor, 300)[-1, 0].numpy()
    assert np.linalg.norm(problem.optimum()) > 1.0
    assert np.abs(x - problem.optimum()).max() < 1e-10
    assert np.abs(reference.w_star - problem.optimum()).max() < 1e-12


def test_multiple_local_steps_do_not_reach_heterogeneous_optimum(run_config):
    # With E > 1 and heterogeneous curvature the constant-step fixed point is biased (Li et al., Thm 4).
    cfg = run_config("dataset=quadratic", "dataset.curvature=random", "dataset.mu=0.5", "dataset.L=2.0",
                     "dataset.spread=3.0", "algorithm.sampler=full", "algorithm.local_steps=5",
                     "algorithm.client_lr=0.2", "dtype=float64", "rounds=300")
    problem, _, _ = prepare(cfg)
    x = _trajectory(cfg, InlineExecutor, 300)[-1, 0].numpy()
    assert np.linalg.norm(x - problem.optimum()) > 1e-3


def test_newton_cg_matches_least_squares_closed_form(run_config):
    cfg = run_config("model=linreg", "model.l2=0.01", "dataset.num_clients=5", "dtype=float64")
    problem, _, reference = prepare(cfg)
    X = problem.x.numpy()
    Y = np.eye(problem.objective.num_classes)[problem.y.numpy()]  # the classes the 5 clients hold
    n, lam = len(X), 0.01
    # F = 1/(2n) ||X W^T - Y||^2 + lam ||W||^2  =>  W^T = (X^T X / n + 2 lam I)^-1 X^T Y / n
    Wt = np.linalg.solve(X.T @ X / n + 2 * lam * np.eye(X.shape[1]), X.T @ Y / n)
    assert reference.grad_norm < 1e-9
    assert np.abs(reference.w_star - Wt.T.reshape(-1)).max() < 1e-8


def test_newton_cg_matches_quadratic_closed_form(run_config):
    cfg = run_config("dataset=quadratic", "dataset.curvature=random", "dataset.mu=0.1", "dataset.L=3.0",
                     "dtype=float64")
    problem, _, _ = prepare(cfg)
    w = _newton_cg(problem.with_dtype(torch.float64), torch.zeros(1, problem.dim, dtype=torch.float64), 1e-11, 50)
    assert np.abs(w[0].numpy() - problem.optimum()).max() < 1e-9


def test_logreg_reference_is_stationary(run_config):
    cfg = run_config("dataset.num_clients=8")
    problem, _, reference = prepare(cfg)
    assert reference.grad_norm < 1e-9
    # F* is a minimum: a small step away in any of a few random directions increases F.
    p64 = problem.with_dtype(torch.float64)
    w = torch.as_tensor(reference.w_star)[None]
    dirs = torch.randn(4, problem.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    values = p64.objective_value(w + 1e-2 * dirs / dirs.norm(dim=1, keepdim=True))
    assert (values > reference.f_star).all()
