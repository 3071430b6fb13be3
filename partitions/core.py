"""Partitioners: split one pooled labelled dataset across clients.

Every partitioner has the signature

    fn(labels, num_clients, rng, **params) -> list[np.ndarray]

and returns `num_clients` int64 index arrays into `labels`, each sorted
ascending. All randomness comes from `rng` (a `np.random.Generator`), so the
same seed gives the same split. Callers normally go through
`fedharness.partitions.partition`, which validates the name, the labels, the number of
clients and the parameter names before calling one of these.

Each partitioner registers itself beside its definition (fedharness.registry.groups.PARTITIONERS), with its
parameters' config keys (`partition.KEY`) for the schema and the help. The partitioners are also called
directly (`partition(...)`), so they check their parameters themselves, with bounds that depend on the data. Parameter errors are `ConfigError`s keyed `partition.<param>`.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

import numpy as np

from fedharness.errors import ConfigError, require
from fedharness.keys import boolean, choice, integer, number
from fedharness.registry.groups import PARTITIONERS

# Resampling budget for `dirichlet`'s min_size constraint: enough for any
# reasonable setting, small enough that an infeasible one fails fast.
DIRICHLET_MAX_TRIES = 1000


# --------------------------------------------------------------------------
# helpers


def _finish(groups: list[np.ndarray]) -> list[np.ndarray]:
    """The output contract: int64, sorted ascending (downstream code slices by it)."""
    return [np.sort(np.asarray(g, dtype=np.int64)) for g in groups]


def _int_param(key: str, value: Any, lo: int, hi: int | None = None) -> int:
    """An integer config value in [lo, hi]; bools are rejected (True is not 1 client)."""
    allowed = f"must be an integer >= {lo}" if hi is None else f"must be an integer between {lo} and {hi}"
    ok = isinstance(value, Integral) and not isinstance(value, bool)
    require(ok and value >= lo and (hi is None or value <= hi), key, value, allowed)
    return int(value)


def _positive_float(key: str, value: Any) -> float:
    ok = isinstance(value, Real) and not isinstance(value, bool)
    require(ok and math.isfinite(value) and value > 0, key, value, "must be a finite number > 0")
    return float(value)


def _bool_param(key: str, value: Any) -> bool:
    require(isinstance(value, (bool, np.bool_)), key, value, "must be true or false")
    return bool(value)


def _indices_by_label(labels: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffled sample indices of each distinct label, in sorted label order."""
    _, inverse = np.unique(labels, return_inverse=True)
    inverse = inverse.reshape(-1)
    # Shuffling before a stable sort randomises the order within each label.
    perm = rng.permutation(len(labels))
    order = perm[np.argsort(inverse[perm], kind="stable")]
    counts = np.bincount(inverse)
    return np.split(order, np.cumsum(counts)[:-1])


def _label_sorted_order(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """All indices sorted by label, ties in random order."""
    return np.concatenate(_indices_by_label(labels, rng))


def _split_by_sizes(order: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    return np.split(order, np.cumsum(sizes)[:-1])


# --------------------------------------------------------------------------
# partitioners


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle, then cut into `num_clients` parts whose sizes differ by at most one."""
    perm = rng.permutation(len(labels))
    return _finish(np.array_split(perm, num_clients))


PARTITIONERS.add("iid", iid, {})


def classes_per_client(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, classes: int
) -> list[np.ndarray]:
    """Each client holds exactly `classes` distinct labels and all clients are the same size.

    Yang et al. (2021): "each worker holds p classes"; Li et al. (2020): MNIST over
    100 devices, two digits each, balanced (542 each).

    Labels are shuffled by a seeded permutation, then client i takes the labels
    in slots i*classes .. i*classes+classes-1 (mod C), so every label is held by
    the same number of clients, give or take one. Each client gets the same
    number q of samples from each of its labels, where q is the largest share
    every label can give every one of its holders: q = min over labels of
    floor(n_label / holders_label). So every client has exactly classes*q
    samples, its labels equally represented.

    This is the one partitioner that does NOT assign every sample: the
    remainder of each label beyond holders*q is dropped, as are all samples of
    labels that no client holds (when num_clients*classes < C). On MNIST with
    100 clients and classes=2 this gives q=271, i.e. 542 samples per client.
    """
    per_label = _indices_by_label(labels, rng)
    num_labels = len(per_label)
    classes = _int_param("partition.classes", classes, 1, num_labels)

    label_of_slot = rng.permutation(num_labels)
    # Consecutive slots mod C are distinct because classes <= C.
    held = [
        [int(label_of_slot[(i * classes + j) % num_labels]) for j in range(classes)]
        for i in range(num_clients)
    ]
    holders: list[list[int]] = [[] for _ in range(num_labels)]
    for client, client_labels in enumerate(held):
        for label in client_labels:
            holders[label].append(client)

    share = _equal_share(per_label, holders, classes)
    groups: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for lab, clients in enumerate(holders):
        idx = per_label[lab]
        for k, client in enumerate(clients):
            groups[client].append(idx[k * share:(k + 1) * share])
    return _finish([np.concatenate(g) for g in groups])


def _equal_share(per_label: list[np.ndarray], holders: list[list[int]], classes: int) -> int:
    """q: the most samples every label can give each of its holders (ConfigError where a label cannot give one)."""
    share = min(len(per_label[lab]) // len(h) for lab, h in enumerate(holders) if h)
    if share == 0:
        held_labels = [lab for lab, h in enumerate(holders) if h]
        worst = min(held_labels, key=lambda lab: len(per_label[lab]) / len(holders[lab]))
        raise ConfigError(
            "partition.classes",
            classes,
            f"infeasible: a label with {len(per_label[worst])} samples would be shared by "
            f"{len(holders[worst])} clients; use fewer clients or fewer classes per client",
        )
    return share


PARTITIONERS.add("classes_per_client", classes_per_client,
                 {"classes": integer("distinct labels per client", lo=1)})


def shards(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, shards_per_client: int = 2
) -> list[np.ndarray]:
    """McMahan et al. (2017): sort by label, cut into equal shards, deal each client some shards.

    There are num_clients*shards_per_client shards of floor(n / shards) samples;
    the last shard also takes the remainder, so every sample is assigned once.
    With shards no larger than a label's count, most shards hold one label, so a
    client sees at most about `shards_per_client` labels.
    """
    n = len(labels)
    shards_per_client = _int_param("partition.shards_per_client", shards_per_client, 1, n // num_clients)
    num_shards = num_clients * shards_per_client
    shard_size = n // num_shards

    order = _label_sorted_order(labels, rng)
    bounds = [k * shard_size for k in range(num_shards)] + [n]
    pieces = [order[bounds[k]:bounds[k + 1]] for k in range(num_shards)]

    dealt = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    return _finish([np.concatenate([pieces[s] for s in row]) for row in dealt])


PARTITIONERS.add("shards", shards,
                 {"shards_per_client": integer("label-sorted shards dealt to each client", lo=1)})


def _dirichlet_draw(
    per_label: list[np.ndarray], num_clients: int, alpha: float, rng: np.random.Generator
) -> list[list[np.ndarray]]:
    groups: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for idx in per_label:
        proportions = rng.dirichlet(np.full(num_clients, alpha))
        cuts = (np.cumsum(proportions) * len(idx)).astype(np.int64)[:-1]
        for client, piece in enumerate(np.split(idx, cuts)):
            groups[client].append(piece)
    return groups


def dirichlet(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, alpha: float, min_size: int = 10
) -> list[np.ndarray]:
    """Label skew (Hsu et al. 2019; FedNova uses alpha=0.1): each label's samples
    are split across clients in proportions drawn from Dir(alpha * 1).

    Small alpha concentrates each label on few clients; large alpha tends to IID.
    The whole draw is repeated until every client has at least `min_size`
    samples, up to DIRICHLET_MAX_TRIES times. Every sample is assigned once.
    """
    n = len(labels)
    alpha = _positive_float("partition.alpha", alpha)
    min_size = _int_param("partition.min_size", min_size, 1, n // num_clients)

    per_label = _indices_by_label(labels, rng)
    for _ in range(DIRICHLET_MAX_TRIES):
        groups = [np.concatenate(g) for g in _dirichlet_draw(per_label, num_clients, alpha, rng)]
        if min(len(g) for g in groups) >= min_size:
            return _finish(groups)
    raise ConfigError(
        "partition.min_size",
        min_size,
        f"infeasible for alpha={alpha} and {num_clients} clients: no draw in "
        f"{DIRICHLET_MAX_TRIES} gave every client that many samples; lower min_size, "
        "raise alpha or use fewer clients",
    )


PARTITIONERS.add("dirichlet", dirichlet,
                 {"alpha": number("Dir(alpha) label proportions; small is skewed", lo=0, lo_open=True),
                  "min_size": integer("redraw until every client has this many samples", lo=1)})


# How `powerlaw` draws each client's weight (partition.sizes): "ranked", rank^-exponent over a seeded permutation
# of the ranks (the same sizes for every seed, dealt to different clients); "drawn", i.i.d. Pareto weights of tail
# index 1 / exponent, whose sorted values fall like rank^-exponent on average and whose sizes depend on the seed,
# so a seed can be chosen by the size statistics (studies/data_draws.py).
POWERLAW_SIZES = ("ranked", "drawn")


def _powerlaw_weights(num_clients: int, exponent: float, law: str, rng: np.random.Generator) -> np.ndarray:
    if law == "ranked":
        ranks = rng.permutation(num_clients) + 1
        return ranks.astype(np.float64) ** -exponent
    # numpy's pareto is the Lomax law; + 1 makes it Pareto with minimum 1: P(w > x) = x^(-1 / exponent)
    return rng.pareto(1.0 / exponent, num_clients) + 1.0


def _powerlaw_sizes(
    n: int, num_clients: int, exponent: float, min_size: int, rng: np.random.Generator, law: str = "ranked"
) -> np.ndarray:
    """Sizes min_size + (share of the rest proportional to the clients' weights), summing to n."""
    weights = _powerlaw_weights(num_clients, exponent, law, rng)
    rest = n - num_clients * min_size
    ideal = rest * weights / weights.sum()
    sizes = np.floor(ideal).astype(np.int64)
    # Largest remainder rounding: hand out the leftover units where floor lost most.
    leftover = rest - int(sizes.sum())
    sizes[np.argsort(-(ideal - sizes), kind="stable")[:leftover]] += 1
    return sizes + min_size


def _powerlaw_params(n: int, num_clients: int, exponent: Any, min_size: Any, sizes: Any) -> tuple[float, int, str]:
    exponent = _positive_float("partition.exponent", exponent)
    min_size = _int_param("partition.min_size", min_size, 1, n // num_clients)
    require(sizes in POWERLAW_SIZES, "partition.sizes", sizes, "one of: " + ", ".join(POWERLAW_SIZES))
    return exponent, min_size, sizes


def powerlaw(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    *,
    exponent: float = 1.5,
    min_size: int = 1,
    label_sorted: bool = False,
    sizes: str = "ranked",
) -> list[np.ndarray]:
    """Unbalanced sizes (Li et al. 2020, "unbalanced (power law)").

    Client sizes are min_size plus a share of the remaining samples proportional
    to each client's weight: rank^-exponent, the ranks being a seeded permutation
    of 1..num_clients (sizes="ranked"), or a Pareto draw of tail index
    1/exponent (sizes="drawn": the sizes themselves depend on the seed).
    Samples are dealt in shuffled order (size skew only) or, with
    label_sorted=True, in label-sorted order so clients also see few labels.
    Every sample is assigned once.
    """
    n = len(labels)
    exponent, min_size, sizes = _powerlaw_params(n, num_clients, exponent, min_size, sizes)
    label_sorted = _bool_param("partition.label_sorted", label_sorted)

    counts = _powerlaw_sizes(n, num_clients, exponent, min_size, rng, sizes)
    order = _label_sorted_order(labels, rng) if label_sorted else rng.permutation(n)
    return _finish(_split_by_sizes(order, counts))


def powerlaw_sizes(
    n: int, num_clients: int, seed: int, *, exponent: float = 1.5, min_size: int = 1, sizes: str = "ranked"
) -> np.ndarray:
    """The client sizes `partition("powerlaw", labels, num_clients, seed, ...)` gives any n labels, in client
    order, without the labels: the sizes are the partition's first draw, so its seed can be chosen by them."""
    exponent, min_size, sizes = _powerlaw_params(n, num_clients, exponent, min_size, sizes)
    return _powerlaw_sizes(n, num_clients, exponent, min_size, np.random.default_rng(seed), sizes)


PARTITIONERS.add("powerlaw", powerlaw,
                 {"exponent": number("client sizes proportional to rank^-exponent", lo=0, lo_open=True),
                  "min_size": integer("samples every client gets first", lo=1),
                  "label_sorted": boolean("deal in label-sorted order (label skew too)"),
                  "sizes": choice("ranked: rank^-exponent over a seeded permutation (the same sizes for every "
                                  "seed) | drawn: Pareto weights of tail index 1/exponent (sizes depend on the seed)",
                                  POWERLAW_SIZES)})


def natural(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, client_ids: Any = None
) -> list[np.ndarray]:
    """Data generated one generator per client: group samples by their owner.

    `client_ids[i]` is the owner of sample i; clients come out in sorted owner
    order (so owners 0..N-1 map to clients 0..N-1). There must be exactly
    `num_clients` distinct owners. `rng` is unused: the split is given.
    """
    if client_ids is None:
        raise ConfigError("partition.client_ids", None, "required by 'natural': the owner of each sample")
    client_ids = np.asarray(client_ids)
    require(
        client_ids.ndim == 1 and len(client_ids) == len(labels),
        "partition.client_ids",
        f"array of shape {client_ids.shape}",
        f"must be 1-D with one owner per sample ({len(labels)})",
    )
    owners, inverse = np.unique(client_ids, return_inverse=True)
    require(
        len(owners) == num_clients,
        "partition.client_ids",
        f"{len(owners)} distinct owners",
        f"must name exactly num_clients={num_clients} owners",
    )
    inverse = inverse.reshape(-1)
    order = np.argsort(inverse, kind="stable")
    return _finish(_split_by_sizes(order, np.bincount(inverse, minlength=num_clients)))


PARTITIONERS.add("natural", natural, {})  # client_ids come from the generated data set, not from the config
