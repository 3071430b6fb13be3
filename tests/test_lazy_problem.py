"""dataset=synthetic_lazy: clients built when sampled, the same trajectory as the eager Synthetic(alpha, beta)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedharness.core.executors import InlineExecutor
from fedharness.assembly.build import build_parts
from ray_support import trajectory

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too

COMMON = ["dataset.num_clients=15", "dataset.alpha=0.5", "dataset.beta=0.5", "algorithm.clients_per_round=4",
          "algorithm.local_steps=5", "algorithm.batch_size=8", "algorithm.client_lr=0.1", "dtype=float64",
          "replicas=2", "rounds=6"]


def test_lazy_clients_train_and_evaluate_like_the_eager_dataset(run_config):
    eager_cfg = run_config("dataset=synthetic", *COMMON)
    lazy_cfg = run_config("dataset=synthetic_lazy", *COMMON, "eval.clients=15", "dataset.cache_mb=0.02")
    eager, eager_alg = build_parts(eager_cfg)
    lazy, lazy_alg = build_parts(lazy_cfg)
    assert lazy.dim == eager.dim and np.array_equal(lazy.sizes, eager.sizes)
    want, _ = trajectory(eager_cfg, InlineExecutor(eager, eager_alg.solver, 2), 6, eager, eager_alg)
    got, _ = trajectory(lazy_cfg, InlineExecutor(lazy, lazy_alg.solver, 2), 6, lazy, lazy_alg)
    assert (want[-1] - want[0]).norm() > 0.1
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    ev_lazy, ev_eager = lazy.evaluate(got[-1]), eager.evaluate(want[-1])
    for name in ("train_loss", "grad_norm_sq", "test_loss", "test_acc"):
        assert np.allclose(getattr(ev_lazy, name), getattr(ev_eager, name), rtol=1e-9), name
    # a 20 kB cache holds the parameters of 3 clients (5.3 kB each): clients were dropped and built again
    assert lazy.cached_bytes <= 0.02 * 2**20 and lazy.generated > 15


def test_lazy_problem_builds_only_sampled_clients(run_config):
    cfg = run_config("dataset=synthetic_lazy", "dataset.num_clients=100000", "dataset.samples_per_client=50",
                     "algorithm.clients_per_round=10", "algorithm.local_steps=2", "rounds=2")
    problem, algorithm = build_parts(cfg)
    assert problem.num_clients == 100000 and problem.generated == 0
    trajectory(cfg, InlineExecutor(problem, algorithm.solver, 1), 2, problem, algorithm)
    assert 0 < problem.generated <= 20  # 2 rounds x K = 10 draws


def test_lazy_train_loss_above_eval_clients_is_an_estimate_with_its_standard_error(run_config):
    common = ["dataset.num_clients=60", "dataset.alpha=0.5", "dataset.beta=0.5", "dtype=float64", "replicas=3"]
    eager, _ = build_parts(run_config("dataset=synthetic", *common))
    lazy, _ = build_parts(run_config("dataset=synthetic_lazy", *common, "eval.clients=25"))
    w = 0.2 * torch.randn(3, lazy.dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ev = lazy.evaluate(w)
    assert ev.train_loss_se is not None and np.all(ev.train_loss_se > 0)
    # the estimator by hand: mean over the 25 draws of N p_k F_k(w), each F_k from the eager problem's rows of k
    draws = lazy.eval_draws
    assert len(draws) == 25 and np.array_equal(draws, lazy.eval_draws)  # one fixed sample per run
    terms = np.zeros((3, 25))
    with torch.no_grad():
        for j, k in enumerate(draws):
            lo, n = eager.offsets[k], eager.sizes[k]
            loss, _ = eager.objective.loss_terms(w, eager.x[lo:lo + n], eager.y[lo:lo + n])
            f_k = loss.numpy() / n + eager.objective.regularizer(w).numpy()
            terms[:, j] = 60 * eager.weights[k] * f_k
    assert np.allclose(ev.train_loss, terms.mean(1), rtol=1e-10)
    assert np.allclose(ev.train_loss_se, terms.std(1, ddof=1) / 5, rtol=1e-10)
    exact = eager.evaluate(w).train_loss  # F over all 60 clients: within a few standard errors of the estimate
    assert np.all(np.abs(ev.train_loss - exact) < 4 * ev.train_loss_se)
    assert not np.allclose(ev.train_loss, exact, rtol=1e-6)  # an estimate, not F itself


def test_one_eval_client_is_refused_and_the_old_key_names_the_new_one(run_config):
    from fedharness.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'eval.clients': 1 \(null .* or an integer >= 2\)"):
        build_parts(run_config("dataset=synthetic_lazy", "dataset.num_clients=5", "eval.clients=1"))
    with pytest.raises(ConfigError, match=r"'dataset.eval_clients': '?5'? \(no such key: it is now eval.clients"):
        run_config("dataset=synthetic_lazy", "dataset.eval_clients=5")
