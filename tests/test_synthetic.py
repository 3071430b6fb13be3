"""Synthetic(alpha, beta) as Li et al. / Sahu et al. specify it."""

from __future__ import annotations

import numpy as np

from fedharness.problems import synthetic


def test_shapes_sizes_and_split():
    x, y, owner, xt, yt = synthetic.generate(30, 1.0, 1.0, seed=3)
    assert x.shape[1] == 60 and xt.shape[1] == 60
    assert set(np.unique(owner)) == set(range(30))
    for k in range(30):
        n = synthetic.client_size(3, k)
        assert n >= 50
        assert (owner == k).sum() == int(0.9 * n)
    assert len(x) + len(xt) == sum(synthetic.client_size(3, k) for k in range(30))
    assert y.min() >= 0 and y.max() <= 9 and len(np.unique(y)) >= 5


def test_sizes_follow_lognormal_4_2_plus_50():
    sizes = np.array([synthetic.client_size(0, k) for k in range(4000)]) - 50
    logs = np.log(sizes[sizes > 0] + 0.5)
    # int() truncation shifts the log slightly; mean 4 and std 2 within sampling error.
    assert abs(np.median(logs) - 4.0) < 0.15
    assert abs(np.std(logs) - 2.0) < 0.15


def test_same_seed_same_data_and_clients_are_independent_of_n():
    a = synthetic.client_data(5, 7, 1.0, 1.0)
    b = synthetic.client_data(5, 7, 1.0, 1.0)
    c = synthetic.client_data(6, 7, 1.0, 1.0)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(a[0][:10], c[0][:10])
    x10 = synthetic.generate(10, 1.0, 1.0, seed=5)[0]
    x20 = synthetic.generate(20, 1.0, 1.0, seed=5)[0]
    assert np.array_equal(x10, x20[: len(x10)])  # client k's data does not depend on N


def test_feature_covariance_is_diag_j_pow_minus_1_2():
    x, _ = synthetic.client_data(0, 0, 0.0, 0.0, size=40000)
    var = x.var(axis=0)
    expected = np.arange(1, 61) ** -1.2
    assert np.allclose(var, expected, rtol=0.05)


def test_alpha_and_beta_spread_clients():
    # beta shifts the feature mean of each client by B_k ~ N(0, beta): client means spread with beta.
    means0 = [synthetic.client_data(1, k, 0.0, 0.0, size=500)[0].mean() for k in range(40)]
    means5 = [synthetic.client_data(1, k, 0.0, 5.0, size=500)[0].mean() for k in range(40)]
    assert np.std(means5) > 3 * np.std(means0)
    assert 3.0 < np.std(means5) < 7.5
