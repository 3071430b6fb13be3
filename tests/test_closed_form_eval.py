"""The linear models' evaluation in closed form (contracts.ClosedFormTerms): the autograd path's numbers up to
rounding, a replica's numbers whatever is evaluated beside it, and a large logit kept finite."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from closeness import assert_close_to_scale
from fedharness.contracts import ClosedFormTerms
from fedharness.problems import data
from fedharness.problems.data import DataProblem
from fedharness.problems.objectives import LinearRegression, SoftmaxRegression

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too

FEATURES, CLASSES, TRAIN, TEST = 7, 4, 300, 120
MODELS = {"logreg": SoftmaxRegression, "linreg": LinearRegression}


def _problem(model: str, l2: float, dtype: torch.dtype, with_test: bool) -> DataProblem:
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(TRAIN, FEATURES)), rng.integers(0, CLASSES, TRAIN)
    xt, yt = rng.normal(size=(TEST, FEATURES)), rng.integers(0, CLASSES, TEST)
    objective = MODELS[model]((FEATURES,), CLASSES, l2)
    return DataProblem(objective, x, y, np.array_split(np.arange(TRAIN), 5), xt if with_test else None,
                       yt if with_test else None, batch_size=8, dtype=dtype)


def _weights(problem: DataProblem, scale: float = 1.0) -> torch.Tensor:
    """Three replicas: w = 0 (every logit ties: the prediction is class 0, as argmax's), and two random models."""
    w = torch.randn(3, problem.dim, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * scale
    w[0] = 0
    return w.to(problem.dtype)


def _autograd_reference(problem: DataProblem, w: torch.Tensor) -> dict[str, np.ndarray]:
    """The model's differentiable loss_terms over every sample at once, differentiated by autograd."""
    wg = w.detach().clone().requires_grad_(True)
    loss, _ = problem.objective.loss_terms(wg, problem.x, problem.y)
    value = loss / len(problem.y) + problem.objective.regularizer(wg)
    (g,) = torch.autograd.grad(value.sum(), wg)
    out = {"train_loss": value.detach().double().numpy(), "grad_norm_sq": (g.double() ** 2).sum(-1).numpy()}
    if problem.x_test is not None:
        with torch.no_grad():
            test_loss, correct = problem.objective.loss_terms(w, problem.x_test, problem.y_test)
        out["test_loss"] = test_loss.double().numpy() / TEST
        out["test_acc"] = correct.double().numpy() / TEST
    return out


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("with_test", [True, False])
@pytest.mark.parametrize("l2", [0.0, 0.01])
@pytest.mark.parametrize("model", ["logreg", "linreg"])
def test_closed_form_evaluation_equals_autograd(monkeypatch, model, l2, with_test, dtype, rtol):
    monkeypatch.setattr(data, "CLOSED_FORM_CHUNK", 64)  # 300 training samples in 5 chunks, the last one short
    problem = _problem(model, l2, dtype, with_test)
    assert isinstance(problem.objective, ClosedFormTerms)
    w = _weights(problem)
    got, want = problem.evaluate(w), _autograd_reference(problem, w)
    for name in ("train_loss", "grad_norm_sq"):
        assert_close_to_scale(getattr(got, name), want[name], rtol)
    if with_test:
        assert_close_to_scale(got.test_loss, want["test_loss"], rtol)
        np.testing.assert_array_equal(got.test_acc, want["test_acc"])  # the same predictions, counted exactly
        assert 0 < got.test_acc.min() < got.test_acc.max() < 1
    else:
        assert got.test_loss is None and got.test_acc is None
    _, g = problem.objective_and_grad(w)
    wg = w.clone().requires_grad_(True)
    (want_g,) = torch.autograd.grad(problem.objective_value(wg).sum(), wg)
    assert g.dtype == w.dtype
    assert_close_to_scale(g, want_g.to(w.dtype), rtol)


def _chunked(monkeypatch, model: str, dtype: torch.dtype) -> tuple[DataProblem, torch.Tensor]:
    """A problem with a test set whose 300 training samples are evaluated in 5 chunks (the last one short), and
    _weights' three replicas."""
    monkeypatch.setattr(data, "CLOSED_FORM_CHUNK", 64)
    problem = _problem(model, 0.01, dtype, with_test=True)
    return problem, _weights(problem)


@pytest.mark.parametrize("model", ["logreg", "linreg"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_replicas_numbers_do_not_depend_on_the_replicas_beside_it(monkeypatch, model, dtype):
    problem, w = _chunked(monkeypatch, model, dtype)
    together = problem.evaluate(w)
    for r in range(len(w)):
        alone = problem.evaluate(w[r:r + 1])
        for name in ("train_loss", "grad_norm_sq", "test_loss", "test_acc"):
            assert getattr(alone, name)[0] == getattr(together, name)[r], (name, r)


def test_a_large_logit_stays_finite_in_float32():
    """Logits of several hundred: exp overflows float32 unless shifted by the largest logit first."""
    problem = _problem("logreg", 0.0, torch.float32, with_test=True)
    w = _weights(problem, scale=200.0)
    got, want = problem.evaluate(w), _autograd_reference(problem, w)
    assert np.isfinite(got.train_loss).all() and got.train_loss.max() > 100
    assert_close_to_scale(got.train_loss, want["train_loss"], 1e-6)
    assert_close_to_scale(got.test_loss, want["test_loss"], 1e-6)
    assert_close_to_scale(got.grad_norm_sq, want["grad_norm_sq"], 1e-5)


@pytest.mark.parametrize("model", ["logreg", "linreg"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_loss_alone_is_the_same_bits_as_with_its_gradient(monkeypatch, model, dtype):
    """eval.grad_norm=false: summed_loss is loss_and_grad's loss, so train_loss (and all else) keeps its bits."""
    problem, w = _chunked(monkeypatch, model, dtype)
    x, y = problem.x[:64], problem.y[:64]
    assert torch.equal(problem.objective.summed_loss(w, x, y), problem.objective.loss_and_grad(w, x, y)[0])
    full, alone = problem.evaluate(w), problem.evaluate(w, grad_norm=False)
    assert alone.grad_norm_sq is None and (full.grad_norm_sq > 0).all()
    for name in ("train_loss", "test_loss", "test_acc"):
        np.testing.assert_array_equal(getattr(alone, name), getattr(full, name))
