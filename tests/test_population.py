"""Cross-device populations: a set-up independent of N, rows generated per sample, draws by n_k at N = 10^7."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
import torch

from fedharness.algorithms.samplers import SchemeI, YangStrategy2
from fedharness.contracts import ClientKeys
from fedharness.core.executors import COST_GRID, InlineExecutor, balanced_ranges, shard_of
from fedharness.assembly.build import build_parts
from fedharness.problems import synthetic
from fedharness.problems.population import BLOCK, ClientSizes, ClientWeights

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too

SEED = 3


def lognormal_sizes(n: int) -> ClientSizes:
    return ClientSizes(n, lambda k: synthetic.train_sizes(SEED, k))


# ------------------------------------------------------------ rows, not clients


def test_a_clients_rows_are_the_same_read_in_slices_or_whole():
    whole_x, whole_y = synthetic.client_data(SEED, 41, 1.0, 1.0, size=300)
    params = synthetic.client_params(SEED, 41, 1.0, 1.0)
    order = np.random.default_rng(0).permutation(300)
    for part in np.array_split(order, 7):  # any rows, in any order, alone
        x, y = synthetic.client_rows(SEED, 41, part, params)
        assert np.array_equal(x, whole_x[part]) and np.array_equal(y, whole_y[part])
    # row 10^6 of a client costs what row 0 does: it is computed alone, never after the rows before it
    far = synthetic.client_rows(SEED, 41, np.array([10**6, 5]), params)
    assert np.array_equal(far[0][1], whole_x[5]) and far[0].shape == (2, synthetic.FEATURES)


def test_client_sizes_are_vectorized_and_lognormal():
    sizes = synthetic.client_sizes(SEED, np.arange(200_000))
    assert sizes.dtype == np.int64 and sizes.min() >= 50
    assert [synthetic.client_size(SEED, k) for k in (0, 7, 199_999)] == [sizes[0], sizes[7], sizes[199_999]]
    for t in (3, 55, 403, 20000):  # floor(exp(4 + 2z)) >= t exactly when z >= (ln t - 4) / 2
        want = 0.5 * math.erfc((math.log(t) - 4.0) / 2.0 / math.sqrt(2.0))
        std = math.sqrt(want * (1 - want) / len(sizes))
        assert abs(np.mean(sizes - 50 >= t) - want) <= 5 * std, t


def test_eager_and_lazy_data_sets_are_equal_on_the_same_clients(run_config):
    common = ["dataset.num_clients=20", "dataset.alpha=0.5", "dataset.beta=0.5", "dtype=float64",
              "algorithm.batch_size=7"]
    eager, _ = build_parts(run_config("dataset=synthetic", *common))
    lazy, _ = build_parts(run_config("dataset=synthetic_lazy", *common, "eval.clients=20"))
    assert np.array_equal(np.asarray(lazy.sizes), eager.sizes)
    for k in (0, 3, 19):  # every training row of the client
        x, y = lazy.rows(k, np.arange(eager.sizes[k]))
        lo, hi = eager.offsets[k], eager.offsets[k] + eager.sizes[k]
        assert torch.equal(lazy.objective.prepare(x, torch.float64, "cpu"), eager.x[lo:hi])
        assert torch.equal(torch.as_tensor(y), eager.y[lo:hi])
    # a round's minibatches: the lazy problem generates exactly the rows the eager one gathers
    keys = ClientKeys(np.array([3, 17, 3]), np.array([0, 0, 1]), 5, 11)
    want, got = eager.round_batches(keys, 4), lazy.round_batches(keys, 4)
    assert torch.equal(got.data.x[got.batches.index], eager.x[want.index])
    assert torch.equal(got.data.y[got.batches.index], eager.y[want.index])
    assert len(got.data.x) == 3 * 4 * 7  # K x steps x b rows, not the clients' n_k


# ------------------------------------------------------------ sizes, weights and draws without per-client arrays


def test_block_draws_equal_the_cumulative_sum_search():
    n = 100_003  # not a multiple of BLOCK: the last block is partial
    sizes = lognormal_sizes(n)
    full = np.asarray(sizes)
    assert sizes.total == full.sum() and sizes.nbytes() == 8 * -(-n // BLOCK)
    u = np.random.default_rng(1).random((4, 5000))
    cdf = np.cumsum(full)
    want = np.searchsorted(cdf, np.floor(u * cdf[-1]), side="right")
    assert np.array_equal(sizes.draw(u), want)  # exact: integer sizes sum exactly; u * total rounds once, as here
    weights = ClientWeights(sizes)
    assert np.allclose(weights[np.array([0, 5, n - 1])], full[[0, 5, n - 1]] / full.sum(), rtol=1e-15)
    fixed = ClientSizes(n, constant=7)
    assert fixed.total == 7 * n and np.array_equal(fixed.draw(u), np.floor(u * 7 * n).astype(np.int64) // 7)


@pytest.mark.slow
def test_scheme_i_frequencies_at_ten_million_clients_match_p_k():
    """Scheme I's draws by n_k at N = 10^7: counts per size class within 5 binomial standard deviations."""
    n, draws_per_round, rounds = 10**7, 1000, 200
    sizes = lognormal_sizes(n)
    full = np.asarray(sizes)
    sampler = SchemeI(n, draws_per_round)
    clients = np.concatenate([sampler.select(0, np.arange(2), r, ClientWeights(sizes)).clients.ravel()
                              for r in range(rounds)])
    edges = np.array([0, 60, 100, 300, 1000, 10**4, 10**5, 10**12])  # size classes: small to giant clients
    expected = np.array([full[(full >= lo) & (full < hi)].sum() for lo, hi in zip(edges[:-1], edges[1:])])
    expected = expected / sizes.total
    counts = np.bincount(np.searchsorted(edges, full[clients], side="right") - 1, minlength=len(expected))
    m = len(clients)
    std = np.sqrt(m * expected * (1 - expected))
    assert np.all(np.abs(counts - m * expected) <= 5 * std + 1), (counts, m * expected)
    # and against uniform draws: the largest class is far more frequent than its share of clients
    assert counts[-2:].sum() > 10 * m * ((full >= 10**4).mean())


@pytest.mark.slow
def test_uniform_without_replacement_at_ten_million_clients():
    n, k = 10**7, 100
    sampler = YangStrategy2(n, k)
    picks = np.stack([sampler.select(0, np.arange(3), r, None).clients for r in range(300)])  # [rounds, R, K]
    assert all(len(np.unique(row)) == k for row in picks.reshape(-1, k))
    counts = np.bincount(picks.ravel() * 10 // n, minlength=10)  # index deciles: each holds 1/10 of the mass
    m = picks.size
    assert np.all(np.abs(counts - m / 10) <= 5 * np.sqrt(m * 0.1 * 0.9))


def _array_bytes(obj) -> int:
    """Bytes of the numpy arrays and tensors an object holds (its attributes, one level of containers)."""
    total = 0
    for value in vars(obj).values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if isinstance(item, np.ndarray):
                total += item.nbytes
            elif isinstance(item, torch.Tensor):
                total += item.numel() * item.element_size()
            elif hasattr(item, "__dict__") and not isinstance(item, type):
                total += sum(v.nbytes for v in vars(item).values() if isinstance(v, np.ndarray))
    return total


def test_a_hundred_million_clients_of_fixed_size_build_in_o1_memory(run_config):
    cfg = run_config("dataset=synthetic_lazy", "dataset.num_clients=100000000", "dataset.samples_per_client=200",
                     "algorithm.clients_per_round=100", "algorithm.local_steps=2", "rounds=1")
    tracemalloc.start()
    problem, algorithm = build_parts(cfg)
    executor = InlineExecutor(problem, algorithm.solver, 3)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert problem.num_clients == 10**8 and problem.sizes.total == 10**8 * 180
    assert _array_bytes(problem) < 2**20 and problem.sizes.nbytes() == 0  # closed forms: no per-client array
    ranges = [(s.lo, s.hi) for s in executor.shards]  # index ranges, split at the cost grid's points
    assert ranges[0][0] == 0 and ranges[-1][1] == 10**8 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(abs((hi - lo) - 10**8 / 3) <= 10**8 / COST_GRID for lo, hi in ranges)
    assert peak < 64 * 2**20  # bytes allocated while building: nothing of size N (10^8 int64 would be 800 MB)


@pytest.mark.slow
def test_a_hundred_million_lognormal_clients_build_in_bounded_memory(run_config):
    cfg = run_config("dataset=synthetic_lazy", "dataset.num_clients=100000000", "algorithm.clients_per_round=100",
                     "algorithm.sampler=scheme_i", "algorithm.local_steps=2", "rounds=1")
    tracemalloc.start()
    problem, algorithm = build_parts(cfg)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert problem.sizes.nbytes() == 8 * 10**8 // BLOCK  # the block sums: 3.1 MB
    assert _array_bytes(problem) < 8 * 2**20
    assert peak < 64 * 2**20
    clients = algorithm.sampler.select(0, np.arange(1), 0, problem.weights).clients
    assert clients.shape == (1, 100) and clients.max() < 10**8


# ------------------------------------------------------------ shards own index ranges


def test_balanced_ranges_split_by_cost_and_read_it_at_a_bounded_grid():
    cost = np.array([5.0, 1, 1, 1, 1, 1, 5, 1, 1, 1])  # total 18: halves at 9
    assert balanced_ranges(lambda k: cost[k], 10, 2) == [(0, 5), (5, 10)]
    asked = []

    def count_cost(clients):
        asked.append(len(clients))
        return np.ones(len(clients))
    ranges = balanced_ranges(count_cost, 10**8, 4)
    assert sum(asked) <= COST_GRID  # O(1) in N: the cost is read at the grid only
    assert ranges[0][0] == 0 and ranges[-1][1] == 10**8
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(abs((hi - lo) - 25_000_000) <= 10**8 // COST_GRID for lo, hi in ranges)
    assert [shard_of(ranges, k) for k in (0, 24_999_999, 10**8 - 1)] == [0, shard_of(ranges, 24_999_999), 3]


@pytest.mark.slow
def test_ray_shards_own_index_ranges_of_a_hundred_million_clients(local_ray, run_config):
    """2 Ray shards at N = 10^8 (lognormal sizes, scheme I): the inline trajectory, shards owning [lo, hi)."""
    from fedharness.backends.ray_executor import RayExecutor
    from ray_support import trajectory

    cfg = run_config("dataset=synthetic_lazy", "dataset.num_clients=100000000", "algorithm.sampler=scheme_i",
                     "algorithm.clients_per_round=20", "algorithm.local_steps=3", "algorithm.batch_size=8",
                     "dtype=float64", "rounds=2", "executor=ray", "ray.num_shards=2")
    problem, algorithm = build_parts(cfg)
    want, _ = trajectory(cfg, InlineExecutor(problem, algorithm.solver, 1), 2, problem, algorithm)
    executor = RayExecutor(cfg, problem, algorithm.solver)
    try:
        got, _ = trajectory(cfg, executor, 2, problem, algorithm)
        owned = executor.owned
    finally:
        executor.close()
    assert owned[0][0] == 0 and owned[0][1] == owned[1][0] and owned[1][1] == 10**8
    assert (want[-1] - want[0]).norm() > 0
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
