"""A client's minibatch gradient has the same bits wherever it sits in a shard's batch and whoever shares it: a
client trained alone (a shard of one) and the same client at position k of a batch of six agree exactly. The bits
of a batched product used to depend on both: MKL's small GEMM sums in an order set by its operands' addresses
modulo 16 bytes (a client's block lies k * C * d floats into the batch: C * d = 610 for Synthetic's softmax
regression, so odd positions sat 8 bytes off), and bmm runs a batch of one as a plain GEMM or matrix-vector
product, threaded within it. FedAvg on Synthetic with batch 8 then gave other rows on 1 and 3 shards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedharness.contracts import ClientKeys
from fedharness.problems.data import DataProblem
from fedharness.problems.nets import build_net
from fedharness.problems.objectives import NetObjective, SoftmaxRegression, LinearRegression
from fedharness.problems.quadratic import make_quadratic

pytestmark = pytest.mark.numeric  # compares numbers across kernels: `make test-kernels` too

FEATURES, CLASSES, STEPS = 60, 10, 2  # Synthetic's shape: d + 1 = 61 columns, C * (d + 1) = 610 parameters
SIZES = [3, 7, 20, 40, 11, 30]  # unequal n_k, some below the batch size


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Torch's intra-op threads for the test (a run sets them from `threads`), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def objective(model: str):
    if model == "logreg":
        return SoftmaxRegression((FEATURES,), CLASSES, 1e-4)
    if model == "linreg":
        return LinearRegression((FEATURES,), CLASSES, 1e-4)
    return NetObjective(build_net(model, (FEATURES,), CLASSES), model, 1e-4, (FEATURES,))


def gradients(problem, w: torch.Tensor, clients: np.ndarray) -> list[torch.Tensor]:
    """Each step's minibatch gradients [len(clients), dim] of those clients trained as one batch at w."""
    keys = ClientKeys(clients, np.zeros(len(clients), dtype=np.int64), 3, 0)
    batches = problem.round_batches(keys, STEPS)
    return [problem.grad(w, batches, step) for step in range(STEPS)]


def assert_alone_as_in_the_batch(problem, w: torch.Tensor) -> None:
    clients = np.arange(len(w))
    together = gradients(problem, w, clients)
    for k in clients:
        alone = gradients(problem, w[k:k + 1].clone(), clients[k:k + 1])  # a shard of one: a fresh, aligned row
        for step in range(STEPS):
            assert torch.equal(alone[step][0], together[step][k]), (k, step)


@pytest.mark.parametrize("model,batch", [("logreg", 8), ("logreg", 5), ("logreg", 24), ("linreg", 8), ("2nn", 8)])
def test_a_clients_gradient_does_not_depend_on_the_clients_beside_it(threads, model, batch):
    rng = np.random.default_rng(0)
    n = sum(SIZES)
    problem = DataProblem(objective(model), rng.normal(size=(n, FEATURES)).astype(np.float32),
                          rng.integers(0, CLASSES, n), np.split(np.arange(n), np.cumsum(SIZES)[:-1]), None, None,
                          batch_size=batch)
    w = torch.randn(len(SIZES), problem.dim, generator=torch.Generator().manual_seed(1)) * 0.1
    assert_alone_as_in_the_batch(problem, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_quadratic_clients_gradient_does_not_depend_on_the_clients_beside_it(threads, dtype):
    problem = make_quadratic(6, 30, 1.0, "random", 0.1, 1.0, 0.0, 0, dtype, "cpu")
    w = torch.randn(6, 30, generator=torch.Generator().manual_seed(1), dtype=dtype)
    assert_alone_as_in_the_batch(problem, w)
