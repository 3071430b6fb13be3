"""Synthetic(alpha, beta) of Li et al. / Sahu et al., from counter-based streams: any client, any sample alone.

Client k's size and parameters come from streams keyed by (data seed, k), and its sample i from one keyed by
(data seed, k, i) (harness/base/streams.py), so `dataset=synthetic` (all clients stored) and
`dataset=synthetic_lazy` (only the rows a round reads generated) are one data set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedharness.base import streams
from fedharness.keys import Key, integer, number
from fedharness.problems.pooled import PooledData
from fedharness.registry.groups import DATASETS

FEATURES, CLASSES = 60, 10
TRAIN_FRACTION = 0.9
KEYS: dict[str, Key] = {  # dataset=synthetic's, besides num_clients and data_seed
    "alpha": number("how much the clients' models differ (Li et al.'s alpha)", lo=0),
    "beta": number("how much the clients' inputs differ (Li et al.'s beta)", lo=0),
    "samples_per_client": integer("samples per client", lo=2, null="n_k ~ lognormal(4, 2) + 50"),
}


def client_sizes(seed: int, clients) -> np.ndarray:
    """n_k ~ lognormal(4, 2) + 50 of each client (all its samples, train and test), from its own stream.

    One hash per client and Box-Muller with a float32 cosine (numpy's float64 cosine is 20 times slower, and
    n_k needs no more precision), so the sizes of 10^8 clients take seconds (problems/population.py)."""
    radius, angle = streams.uniform_pair(seed, streams.DATA_SIZE, clients)
    np.log(radius, out=radius)
    radius *= -2.0
    np.sqrt(radius, out=radius)
    angle *= 2.0 * np.pi
    radius *= np.cos(angle.astype(np.float32))  # now z ~ N(0, 1)
    radius *= 2.0
    radius += 4.0
    np.exp(radius, out=radius)
    np.floor(radius, out=radius)
    return radius.astype(np.int64) + 50


def client_size(seed: int, client: int) -> int:
    return int(client_sizes(seed, client))


def train_sizes(seed: int, clients, size: int | None = None) -> np.ndarray:
    """Training samples of each client (the first 90% of its samples), vectorized."""
    total = client_sizes(seed, clients) if size is None else np.full(np.shape(clients), size, dtype=np.int64)
    return (TRAIN_FRACTION * total).astype(np.int64)  # truncation, as split_train_test's int()


@dataclass(frozen=True)
class ClientParams:
    """What makes client k's distribution its own: its model (W_k, b_k) and its feature mean v_k."""

    W: np.ndarray  # [features, classes]
    b: np.ndarray  # [classes]
    v: np.ndarray  # [features]


def client_params(seed: int, client: int, alpha: float, beta: float, features: int = FEATURES,
                  classes: int = CLASSES) -> ClientParams:
    """u_k ~ N(0, alpha) shifts the client's model (W_k, b_k ~ N(u_k, 1)); B_k ~ N(0, beta) shifts its feature
    mean (v_k ~ N(B_k, 1)). alpha and beta are standard deviations."""
    z = streams.normal(streams.stream_key(seed, streams.DATA_CLIENT, 0, 0, client), 2 + classes * (features + 1)
                       + features)
    u_k, B_k = alpha * z[0], beta * z[1]
    W = u_k + z[2:2 + features * classes].reshape(features, classes)
    b = u_k + z[2 + features * classes:2 + (features + 1) * classes]
    v = B_k + z[2 + (features + 1) * classes:]
    return ClientParams(W, b, v)


def client_rows(seed: int, client: int, index: np.ndarray, params: ClientParams) -> tuple[np.ndarray, np.ndarray]:
    """Samples `index` of one client: x ~ N(v_k, diag(j^-1.2)), y = argmax(W_k x + b_k).

    Sample i of client k comes from its own stream, keyed by (seed, k, i): a client's data are the same read
    in slices or whole, and reading E x b rows of a client with 10^6 samples costs what it costs for 100.
    """
    features = len(params.v)
    index = np.asarray(index, dtype=np.int64)
    u = streams.uniform(streams.stream_key(seed, streams.DATA_ROW, 0, client, index), features + features % 2)
    # Box-Muller: each pair of uniforms gives two normals (cos and sin). In float32, which numpy vectorizes
    # (its float64 cos and sin are 20 times slower) and which the features are stored in anyway.
    half = u.shape[-1] // 2
    radius = (1.0 - u[..., :half]).astype(np.float32)  # in (0, 1]: the log is finite
    np.log(radius, out=radius)
    radius *= -2.0
    np.sqrt(radius, out=radius)
    angle = u[..., half:].astype(np.float32)
    angle *= np.float32(2.0 * np.pi)
    z = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)], axis=-1)[..., :features]
    std = np.arange(1, features + 1, dtype=np.float64) ** (-1.2 / 2)
    x = params.v + z * std
    y = np.argmax(x @ params.W + params.b, axis=-1)
    return x.astype(np.float32), y.astype(np.int64)


def client_data(seed: int, client: int, alpha: float, beta: float, size: int | None = None,
                features: int = FEATURES, classes: int = CLASSES) -> tuple[np.ndarray, np.ndarray]:
    """All samples (train and test) of one client: its rows 0..n_k-1."""
    n = client_size(seed, client) if size is None else size
    return client_rows(seed, client, np.arange(n), client_params(seed, client, alpha, beta, features, classes))


def split_train_test(n: int, train_fraction: float = TRAIN_FRACTION) -> int:
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


@DATASETS.register("synthetic", KEYS)
def pooled(num_clients: int, alpha: float, beta: float, samples_per_client: int | None, seed: int) -> PooledData:
    """`dataset=synthetic`: every client's samples generated and stored, each sample's owner kept."""
    x, y, owner, x_test, y_test = generate(num_clients, alpha, beta, seed, samples_per_client)
    # each test sample's owner: a client's test samples are its own last 10% (per-client evaluation's held-out data)
    clients = np.arange(num_clients)
    totals = client_sizes(seed, clients) if samples_per_client is None else np.full(num_clients, samples_per_client)
    test_sizes = totals - np.bincount(owner, minlength=num_clients)
    return PooledData(x, y, x_test, y_test, owner, np.repeat(np.arange(num_clients), test_sizes))
