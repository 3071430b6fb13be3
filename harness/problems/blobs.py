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

from fedharness.errors import require

VARIANTS = ("noisy", "heterogeneous")
DEFAULT_STD = {"noisy": 2.0, "heterogeneous": 0.3}


def _blobs(rng: np.random.Generator, n: int, centre: np.ndarray, std: float) -> tuple[np.ndarray, np.ndarray]:
    y = rng.integers(0, 2, n)
    x = np.where(y[:, None] == 1, centre, -centre) + std * rng.standard_normal((n, len(centre)))
    return x, y


def generate(num_clients: int, variant: str, dim: int, samples_per_client: int, std: float | None,
             shift: float, seed: int):
    """Pooled (x, y, owner, x_test, y_test); the test set is drawn like the training set."""
    require(variant in VARIANTS, "dataset.variant", variant, "one of: " + ", ".join(VARIANTS))
    require(isinstance(dim, int) and dim >= 1, "dataset.dim", dim, "an integer >= 1")
    require(isinstance(samples_per_client, int) and samples_per_client >= 2, "dataset.samples_per_client",
            samples_per_client, "an integer >= 2")
    std = DEFAULT_STD[variant] if std is None else std
    require(isinstance(std, (int, float)) and std > 0, "dataset.std", std, "a number > 0 (null: the variant's)")
    require(isinstance(shift, (int, float)) and shift >= 0, "dataset.shift", shift, "a number >= 0")
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
