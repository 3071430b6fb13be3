"""Synthetic(alpha, beta) of Li et al. / Sahu et al.: one generator per client, so any client can be built alone."""

from __future__ import annotations

import numpy as np

from fedharness.keys import Key, integer, number

FEATURES, CLASSES = 60, 10
KEYS: dict[str, Key] = {  # dataset=synthetic's, besides num_clients and data_seed
    "alpha": number("how much the clients' models differ (Li et al.'s alpha)", lo=0),
    "beta": number("how much the clients' inputs differ (Li et al.'s beta)", lo=0),
    "samples_per_client": integer("samples per client", lo=2, null="n_k ~ lognormal(4, 2) + 50"),
}


def client_size(seed: int, client: int) -> int:
    """n_k ~ lognormal(4, 2) + 50, drawn from the client's own generator."""
    rng = np.random.default_rng([seed, client, 0])
    return int(rng.lognormal(4, 2)) + 50


def client_data(seed: int, client: int, alpha: float, beta: float, size: int | None = None,
                features: int = FEATURES, classes: int = CLASSES) -> tuple[np.ndarray, np.ndarray]:
    """All samples (train and test) of one client: x ~ N(v_k, diag(j^-1.2)), y = argmax(W_k x + b_k).

    alpha and beta are standard deviations: u_k ~ N(0, alpha) shifts the client's model,
    B_k ~ N(0, beta) shifts its feature mean.
    """
    n = client_size(seed, client) if size is None else size
    rng = np.random.default_rng([seed, client, 1])
    u_k = rng.normal(0, alpha)
    W = rng.normal(u_k, 1, (features, classes))
    b = rng.normal(u_k, 1, classes)
    B_k = rng.normal(0, beta)
    v = rng.normal(B_k, 1, features)
    std = np.arange(1, features + 1, dtype=np.float64) ** (-1.2 / 2)
    x = v + rng.standard_normal((n, features)) * std
    y = np.argmax(x @ W + b, axis=1)
    return x.astype(np.float32), y.astype(np.int64)


def split_train_test(n: int, train_fraction: float = 0.9) -> int:
    """Number of training samples of a client with n samples (the first 90%, as in the FedProx code)."""
    return int(train_fraction * n)


def generate(num_clients: int, alpha: float, beta: float, seed: int, size: int | None = None):
    """Pooled train/test arrays plus each training sample's owner (for the `natural` partition)."""
    xs, ys, owners, xts, yts = [], [], [], [], []
    for k in range(num_clients):
        x, y = client_data(seed, k, alpha, beta, size)
        n_train = split_train_test(len(x))
        xs.append(x[:n_train]), ys.append(y[:n_train]), owners.append(np.full(n_train, k))
        xts.append(x[n_train:]), yts.append(y[n_train:])
    return (np.concatenate(xs), np.concatenate(ys), np.concatenate(owners),
            np.concatenate(xts), np.concatenate(yts))
