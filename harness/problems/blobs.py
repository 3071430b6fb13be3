"""Mangold et al.'s (2025) two synthetic logistic-regression data sets, N clients, two Gaussian blobs.

Their Section 7 describes them in words only:

* `noisy`: "two blobs with large variance, split uniformly among clients" -- homogeneous clients
  (one pooled sample, dealt out at random), heavily overlapping classes, so the per-sample
  gradients at the optimum are large: the stochastic part of FedAvg's bias dominates.
* `heterogeneous`: "2 blobs with small variance. Half of the clients receive part of the
  observations directly, while the other half receive perturbed records with shuffled labels."
  We read "perturbed" as a per-client shift of the features, delta_k ~ N(0, shift^2 I), and
  "shuffled labels" as the two labels swapped on those clients, which keeps every client's data
  nearly noise-free while the clients disagree strongly: the heterogeneity part of the bias
  dominates. (Shuffling labels at random within a client would make those clients noisy, which
  the paper says this data set is not.)

Every client holds `samples_per_client` training samples plus 10% as many test samples; the
owner of each sample is returned so the `natural` partition keeps the construction.
"""

from __future__ import annotations

import numpy as np

from fedharness.keys import Key, choice, integer, number
from fedharness.problems.pooled import PooledData
from fedharness.registry.groups import DATASETS

DEFAULT_STD = {"noisy": 2.0, "heterogeneous": 0.3}
KEYS: dict[str, Key] = {  # dataset=blobs's, besides num_clients and data_seed
    "variant": choice("noisy | heterogeneous (Mangold et al.)", tuple(DEFAULT_STD)),
    "dim": integer("feature dimension", lo=1),
    "samples_per_client": integer("training samples per client", lo=2),
    "std": number("blob standard deviation", lo=0, lo_open=True, null="2.0 noisy, 0.3 heterogeneous"),
    "shift": number("heterogeneous: std of each perturbed client's feature shift", lo=0),
}


def _blobs(rng: np.random.Generator, n: int, centre: np.ndarray, std: float) -> tuple[np.ndarray, np.ndarray]:
    y = rng.integers(0, 2, n)
    x = np.where(y[:, None] == 1, centre, -centre) + std * rng.standard_normal((n, len(centre)))
    return x, y


def generate(num_clients: int, variant: str, dim: int, samples_per_client: int, std: float | None,
             shift: float, seed: int):
    """Pooled (x, y, owner, x_test, y_test); the test set is drawn like the training set (keys: KEYS, checked by
    harness/config/schema.py)."""
    std = DEFAULT_STD[variant] if std is None else std
    rng = np.random.default_rng([seed, 2025])
    centre = np.ones(dim) / np.sqrt(dim)  # the two blob centres are +-centre, at distance 2
    n_test = max(1, samples_per_client // 10)
    xs, ys, owners, xts, yts = [], [], [], [], []
    for k in range(num_clients):
        x, y = _blobs(rng, samples_per_client + n_test, centre, std)
        if variant == "heterogeneous" and k >= num_clients // 2:
            x = x + shift * rng.standard_normal(dim)  # the client's perturbation
            y = 1 - y  # labels swapped
        xs.append(x[:samples_per_client]), ys.append(y[:samples_per_client])
        xts.append(x[samples_per_client:]), yts.append(y[samples_per_client:])
        owners.append(np.full(samples_per_client, k))
    x, y = np.concatenate(xs), np.concatenate(ys)
    owner = np.concatenate(owners)
    if variant == "noisy":  # one pooled sample dealt out uniformly: homogeneous clients
        owner = rng.permutation(owner)
    return (x.astype(np.float32), y.astype(np.int64), owner, np.concatenate(xts).astype(np.float32),
            np.concatenate(yts).astype(np.int64))


@DATASETS.register("blobs", KEYS)
def pooled(num_clients: int, variant: str, dim: int, samples_per_client: int, shift: float, seed: int,
           std: float | None = None) -> PooledData:
    """`dataset=blobs`: Mangold et al.'s noisy / heterogeneous logistic-regression data."""
    x, y, owner, x_test, y_test = generate(num_clients, variant, dim, samples_per_client, std, shift, seed)
    n_test = len(y_test) // num_clients  # client k's test samples are drawn like its training samples
    return PooledData(x, y, x_test, y_test, owner, np.repeat(np.arange(num_clients), n_test))
