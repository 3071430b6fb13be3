"""eval.samples: the training loss, grad_norm_sq and the test metrics of stored data on a fixed sample of samples
(harness/problems/data.py evaluate_sample, harness/problems/estimate.py), exact where the data are small."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedharness import cli
from fedharness.errors import ConfigError
from fedharness.problems.data import DataProblem, eval_sample_size
from fedharness.problems.estimate import (AUTO_EXACT_SAMPLES, AUTO_SAMPLES, GRAD_GROUPS, mean_estimate, sample_rows,
                                          squared_norm_estimate)
from fedharness.problems.objectives import NetObjective, SoftmaxRegression

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too

N, CLASSES, FEATURES = 3000, 4, 6
SEEDS = np.arange(400)


def _data(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, FEATURES))
    y = (x[:, 0] > 0).astype(np.int64) + 2 * (rng.random(N) < 0.3)  # learnable, with label noise
    return x, y


def _logreg_problem(samples: int | None = None, seed: int = 0) -> DataProblem:
    x, y = _data()
    objective = SoftmaxRegression((FEATURES,), CLASSES, l2=0.01)
    return DataProblem(objective, x, y, np.array_split(np.arange(N), 5), x[:500], y[:500], batch_size=4,
                       dtype=torch.float64, eval_samples=samples, eval_seed=seed)


def _weights(problem: DataProblem) -> torch.Tensor:
    return torch.as_tensor(np.random.default_rng(1).normal(size=(2, problem.dim)), dtype=problem.dtype)


def _per_sample_losses(problem: DataProblem, w: torch.Tensor) -> np.ndarray:
    """Each training sample's data loss per replica [R, n], from the model's own per-sample terms."""
    with torch.no_grad():
        return problem.objective.sample_terms(w, problem._model_input(problem.x), problem.y)[0].numpy()


def test_the_training_loss_estimate_is_right_in_distribution_over_400_sample_seeds():
    """z = (estimate - F) / se over 400 seeds of the sample (vectorized: one per-sample loss pass, then every
    seed's draws): mean near 0 and spread near 1, for two models (replicas) at once."""
    exact = _logreg_problem()
    w = _weights(exact)
    full = exact.evaluate(w, grad_norm=False)
    assert full.train_loss_se is None  # every sample: exact
    count = 200
    draws = sample_rows(SEEDS, count, N)  # [seeds, S]: the rows each seed's evaluation reads
    losses = _per_sample_losses(exact, w)  # [R, n]
    estimate, se = mean_estimate(losses[:, draws])  # [R, seeds]
    estimate = estimate + exact.objective.regularizer(w).numpy()[:, None]
    z = (estimate - full.train_loss[:, None]) / se
    assert np.abs(z.mean(1)).max() < 0.2, z.mean(1)
    assert ((z.std(1) > 0.85) & (z.std(1) < 1.15)).all(), z.std(1)
    # the problem's own evaluation is this estimate for its seed
    for seed in (0, 7):
        ev = _logreg_problem(count, seed).evaluate(w, grad_norm=False)
        np.testing.assert_allclose(ev.train_loss, estimate[:, seed], rtol=1e-12)
        np.testing.assert_allclose(ev.train_loss_se, se[:, seed], rtol=1e-9)


def test_the_gradient_norm_estimate_is_unbiased_where_the_plain_one_is_not():
    """Over 400 seeds, the mean of grad_norm_sq's estimate is ||grad F||^2 within 3 of its standard errors; the
    plain ||mean gradient||^2 of the same draws sits above it by about tr(Cov)/S, which the test would catch."""
    exact = _logreg_problem()
    w = _weights(exact)[:1]
    truth = exact.evaluate(w).grad_norm_sq[0]
    x, y = exact._model_input(exact.x), exact.y
    per_sample = torch.stack([exact.objective.loss_and_grad(w, x[i:i + 1], y[i:i + 1])[1][0] for i in range(N)])
    per_sample = per_sample.numpy() + 2 * exact.objective.l2 * w.numpy()  # each draw's gradient, l2 term included
    count = 64
    draws = sample_rows(SEEDS, count, N)
    groups = np.array_split(draws, GRAD_GROUPS, axis=1)  # as the problem groups its draws
    unbiased = squared_norm_estimate([per_sample[g].sum(1) for g in groups], [g.shape[1] for g in groups])
    plain = (per_sample[draws].mean(1) ** 2).sum(-1)
    sem = unbiased.std(ddof=1) / np.sqrt(len(SEEDS))
    assert abs(unbiased.mean() - truth) < 3 * sem, (unbiased.mean(), truth, sem)
    assert plain.mean() - truth > 6 * sem, (plain.mean(), truth, sem)
    ev = _logreg_problem(count, 5).evaluate(w)
    np.testing.assert_allclose(ev.grad_norm_sq[0], unbiased[5], rtol=1e-9)


def test_the_test_metrics_are_on_a_sample_where_the_test_set_is_larger():
    x, y = _data()
    objective = SoftmaxRegression((FEATURES,), CLASSES, l2=0.0)
    w = torch.as_tensor(np.random.default_rng(1).normal(size=(1, objective.dim)), dtype=torch.float64)
    index = np.array_split(np.arange(2000), 4)

    def test_loss(samples):
        problem = DataProblem(objective, x[:2000], y[:2000], index, x[2000:], y[2000:], 4, torch.float64,
                              eval_samples=samples)
        return problem.evaluate(w, grad_norm=False).test_loss[0]

    every, sampled = test_loss(None), test_loss(100)
    assert test_loss(1000) == every  # the 1,000 test samples are no more than the sample: all of them
    assert sampled != every and abs(sampled - every) < 0.2 * every  # 100 of them: near, not equal


def _tiny_net_problem(samples: int | None) -> DataProblem:
    net = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES))
    x, y = _data()
    return DataProblem(NetObjective(net, "tiny", 0.01, (FEATURES,)), x[:600], y[:600],
                       np.array_split(np.arange(600), 3), x[:300], y[:300], batch_size=4, eval_samples=samples)


@pytest.mark.parametrize("samples", [None, 200])
def test_an_evaluation_without_the_gradient_keeps_no_autograd_state(samples):
    problem = _tiny_net_problem(samples)
    w = problem.init_params(2, seed=0)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        ev = problem.evaluate(w, grad_norm=False)
    assert saved == [] and ev.grad_norm_sq is None
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        ev = problem.evaluate(w)
    assert saved and np.isfinite(ev.grad_norm_sq).all()  # the gradient needs a graph: the hook sees it
    assert (ev.train_loss_se is None) == (samples is None)


def test_the_default_is_exact_on_small_data_and_a_sample_above():
    assert eval_sample_size(None, AUTO_EXACT_SAMPLES) is None
    assert eval_sample_size(None, AUTO_EXACT_SAMPLES + 1) == AUTO_SAMPLES
    assert eval_sample_size("all", 10 ** 7) is None
    assert eval_sample_size(50, 50) == 50
    with pytest.raises(ConfigError, match=r"'eval.samples': 51 \(at most the 50 training samples"):
        eval_sample_size(51, 50)


def test_a_small_data_sets_run_stays_exact(run_config):
    from fedharness.assembly.build import build_parts

    problem, _ = build_parts(run_config("dataset=digits", "reference=off", "heterogeneity=false"))
    w = problem.init_params(1, seed=0) + 0.01
    assert problem.eval_groups is None and problem.evaluate(w).train_loss_se is None


@pytest.mark.parametrize("value, expected", [(10 ** 6, "at most the 1,438 training samples"),
                                             (1, "an integer >= 2"), ("some", "all, or an integer")])
def test_a_bad_sample_size_is_one_line_and_nothing_is_written(tmp_path, capsys, value, expected):
    results = tmp_path / "results"
    assert cli.main(["run", "dataset=digits", f"results_dir={results}", "progress=false",
                     f"eval.samples={value}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'eval.samples': " in err[0] and expected in err[0], err
    assert not results.exists()
