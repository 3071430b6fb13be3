"""Partitioners: coverage, the shape each scheme promises, determinism, and config errors."""

from __future__ import annotations

import numpy as np
import pytest

from fedharness.errors import ConfigError
from fedharness.partitions import PARTITIONERS, partition

NUM_LABELS = 10
PER_LABEL = 600
N = NUM_LABELS * PER_LABEL


def balanced_labels() -> np.ndarray:
    """6000 samples, 600 per label, labels interleaved so index order says nothing."""
    rng = np.random.default_rng(123)
    return rng.permutation(np.repeat(np.arange(NUM_LABELS), PER_LABEL))


def mnist_like_labels() -> np.ndarray:
    """The MNIST training-set label counts: unequal classes."""
    counts = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    return np.random.default_rng(7).permutation(np.repeat(np.arange(10), counts))


def owners(num_clients: int, n: int = N) -> np.ndarray:
    return np.random.default_rng(5).integers(0, num_clients, size=n)


# (name, num_clients, params) for every scheme that must use every sample once.
COVERING = [
    ("iid", 100, {}),
    ("iid", 7, {}),
    ("shards", 100, {}),
    ("shards", 30, {"shards_per_client": 3}),
    ("shards", 7, {"shards_per_client": 4}),  # 28 shards do not divide 6000
    ("dirichlet", 10, {"alpha": 0.1}),
    ("dirichlet", 50, {"alpha": 1.0, "min_size": 5}),
    ("powerlaw", 100, {}),
    ("powerlaw", 40, {"exponent": 0.8, "min_size": 20, "label_sorted": True}),
    ("natural", 25, {"client_ids": owners(25)}),
]


def label_entropy(labels: np.ndarray, idx: np.ndarray) -> float:
    counts = np.bincount(labels[idx], minlength=NUM_LABELS)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


# --------------------------------------------------------------------------
# the output contract


@pytest.mark.parametrize("name,num_clients,params", COVERING)
def test_every_sample_exactly_once(name, num_clients, params):
    labels = balanced_labels()
    parts = partition(name, labels, num_clients, seed=0, **params)
    assert len(parts) == num_clients
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(N))


@pytest.mark.parametrize("name,num_clients,params", COVERING)
def test_parts_are_sorted_int64_and_nonempty(name, num_clients, params):
    parts = partition(name, balanced_labels(), num_clients, seed=1, **params)
    for p in parts:
        assert p.dtype == np.int64
        assert len(p) > 0
        assert np.all(np.diff(p) > 0)


def test_registry_names():
    assert set(PARTITIONERS) == {"iid", "classes_per_client", "shards", "dirichlet", "powerlaw", "natural"}


# --------------------------------------------------------------------------
# determinism


@pytest.mark.parametrize("name,num_clients,params", COVERING + [("classes_per_client", 100, {"classes": 2})])
def test_same_seed_same_output(name, num_clients, params):
    labels = balanced_labels()
    assert_same(partition(name, labels, num_clients, 42, **params), partition(name, labels, num_clients, 42, **params))


@pytest.mark.parametrize(
    "name,num_clients,params",
    [c for c in COVERING if c[0] != "natural"] + [("classes_per_client", 100, {"classes": 2})],
)
def test_different_seed_different_output(name, num_clients, params):
    labels = balanced_labels()
    a = partition(name, labels, num_clients, 0, **params)
    b = partition(name, labels, num_clients, 1, **params)
    assert any(not np.array_equal(x, y) for x, y in zip(a, b))


def test_natural_ignores_seed_and_groups_by_owner():
    ids = owners(25)
    parts = partition("natural", balanced_labels(), 25, 0, client_ids=ids)
    assert_same(parts, partition("natural", balanced_labels(), 25, 99, client_ids=ids))
    for k, p in enumerate(parts):
        np.testing.assert_array_equal(p, np.flatnonzero(ids == k))


def test_natural_accepts_non_integer_owner_ids():
    ids = np.array(["bob", "alice", "bob", "carol", "alice"])
    parts = partition("natural", np.zeros(5, dtype=int), 3, 0, client_ids=ids)
    assert [p.tolist() for p in parts] == [[1, 4], [0, 2], [3]]


# --------------------------------------------------------------------------
# iid


def test_iid_sizes_differ_by_at_most_one_and_mix_labels():
    labels = balanced_labels()
    parts = partition("iid", labels, 7, 0)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert all(len(np.unique(labels[p])) == NUM_LABELS for p in parts)


# --------------------------------------------------------------------------
# classes_per_client


@pytest.mark.parametrize("classes", [1, 2, 5, 10])
def test_classes_per_client_exact_labels_and_equal_sizes(classes):
    labels = balanced_labels()
    parts = partition("classes_per_client", labels, 100, 0, classes=classes)
    assert len(parts) == 100
    assert all(len(np.unique(labels[p])) == classes for p in parts)
    sizes = {len(p) for p in parts}
    assert len(sizes) == 1
    # Balanced labels and 100*classes slots over 10 labels: nothing needs to be dropped.
    assert sizes == {N // 100}
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(N))
    # Each label is held by the same number of clients, each with the same share.
    for p in parts:
        counts = np.bincount(labels[p], minlength=NUM_LABELS)
        assert set(counts[counts > 0].tolist()) == {len(p) // classes}
    holders = np.zeros(NUM_LABELS, dtype=int)
    for p in parts:
        holders[np.unique(labels[p])] += 1
    assert set(holders.tolist()) == {100 * classes // NUM_LABELS}


def test_classes_per_client_unequal_labels_drop_remainder_only():
    labels = mnist_like_labels()
    parts = partition("classes_per_client", labels, 100, 0, classes=2)
    # Li et al. (2020): MNIST, 100 devices, two digits each, 542 samples each.
    assert {len(p) for p in parts} == {542}
    assert all(len(np.unique(labels[p])) == 2 for p in parts)
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat)  # dropped, never duplicated


def test_classes_per_client_uneven_holders():
    # 7 clients x 3 classes = 21 slots over 10 labels: some labels held by 3 clients, some by 2.
    labels = balanced_labels()
    parts = partition("classes_per_client", labels, 7, 3, classes=3)
    assert all(len(np.unique(labels[p])) == 3 for p in parts)
    assert len({len(p) for p in parts}) == 1
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat)


# --------------------------------------------------------------------------
# shards


@pytest.mark.parametrize("shards_per_client", [1, 2, 3])
def test_shards_sizes_and_label_purity(shards_per_client):
    labels = balanced_labels()
    num_clients = 100
    shard_size = N // (num_clients * shards_per_client)
    assert PER_LABEL % shard_size == 0  # so every shard holds one label
    parts = partition("shards", labels, num_clients, 0, shards_per_client=shards_per_client)
    assert all(len(p) == shards_per_client * shard_size for p in parts)
    for p in parts:
        assert len(np.unique(labels[p])) <= shards_per_client
        # Each label occurs in whole shards.
        counts = np.bincount(labels[p])
        assert np.all(counts[counts > 0] % shard_size == 0)


def test_shards_last_shard_takes_remainder():
    labels = balanced_labels()
    parts = partition("shards", labels, 7, 0, shards_per_client=4)
    shard_size = N // 28
    sizes = sorted(len(p) for p in parts)
    assert sizes[:-1] == [4 * shard_size] * 6
    assert sizes[-1] == 4 * shard_size + N - 28 * shard_size


def test_shards_are_dealt_at_random():
    labels = balanced_labels()
    parts = partition("shards", labels, 100, 0)
    distinct = np.array([len(np.unique(labels[p])) for p in parts])
    # 20 shards per label: random dealing gives both shards one label only ~10% of the
    # time; dealing neighbouring shards to one client would give one label every time.
    assert 0.7 < np.mean(distinct == 2) <= 1.0


@pytest.mark.parametrize(
    "name,num_clients,params",
    [("shards", 100, {}), ("classes_per_client", 100, {"classes": 2}), ("dirichlet", 10, {"alpha": 0.5})],
)
def test_samples_within_a_label_are_chosen_at_random(name, num_clients, params):
    # A client's samples of one label should be scattered over that label's samples,
    # not a run of consecutive ones (which would copy any ordering of the source data).
    labels = balanced_labels()
    rank_in_label = np.empty(N, dtype=int)
    for lab in range(NUM_LABELS):
        rank_in_label[labels == lab] = np.arange(PER_LABEL)
    runs = 0
    pieces = 0
    for p in partition(name, labels, num_clients, 0, **params):
        for lab in np.unique(labels[p]):
            ranks = np.sort(rank_in_label[p[labels[p] == lab]])
            if len(ranks) > 1:
                pieces += 1
                runs += bool(np.all(np.diff(ranks) == 1))
    assert pieces > 0 and runs / pieces < 0.1


# --------------------------------------------------------------------------
# dirichlet


@pytest.mark.parametrize("alpha,num_clients,min_size", [(0.1, 10, 10), (0.5, 20, 50), (0.05, 5, 100)])
def test_dirichlet_min_size_held(alpha, num_clients, min_size):
    parts = partition("dirichlet", balanced_labels(), num_clients, 0, alpha=alpha, min_size=min_size)
    assert min(len(p) for p in parts) >= min_size


def test_dirichlet_small_alpha_is_more_skewed():
    labels = balanced_labels()
    ent = {}
    for alpha in (0.1, 100.0):
        parts = partition("dirichlet", labels, 10, 0, alpha=alpha)
        ent[alpha] = np.mean([label_entropy(labels, p) for p in parts])
    assert ent[0.1] < 0.7 * ent[100.0]
    # alpha=100 is close to IID: nearly uniform over 10 labels.
    assert ent[100.0] > 0.95 * np.log(NUM_LABELS)


def test_dirichlet_infeasible_min_size_gives_up():
    # 10 labels, alpha tiny: each label lands on ~one client, so 20 clients cannot all get 10 samples.
    labels = np.repeat(np.arange(10), 100)
    with pytest.raises(ConfigError, match=r"partition\.min_size.*infeasible"):
        partition("dirichlet", labels, 20, 0, alpha=0.001, min_size=10)


# --------------------------------------------------------------------------
# powerlaw


def test_powerlaw_sizes_follow_the_law():
    labels = balanced_labels()
    exponent, min_size = 1.5, 1
    parts = partition("powerlaw", labels, 100, 0, exponent=exponent, min_size=min_size)
    sizes = np.array(sorted((len(p) for p in parts), reverse=True))
    assert sizes.sum() == N and sizes.min() >= min_size
    weights = np.arange(1, 101, dtype=float) ** -exponent
    ideal = min_size + (N - 100 * min_size) * weights / weights.sum()
    assert np.all(np.abs(sizes - ideal) < 1.0 + 1e-9)


def test_powerlaw_min_size_and_client_order_shuffled():
    parts = partition("powerlaw", balanced_labels(), 40, 0, exponent=2.0, min_size=30)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 30
    assert sizes.max() > 10 * 30
    # Ranks are a permutation of clients, not client 0 always largest.
    firsts = {int(np.argmax([len(p) for p in partition("powerlaw", balanced_labels(), 40, s)])) for s in range(5)}
    assert len(firsts) > 1


def test_powerlaw_label_sorted_is_non_iid():
    labels = balanced_labels()
    mixed = partition("powerlaw", labels, 100, 0, exponent=0.5)
    sorted_ = partition("powerlaw", labels, 100, 0, exponent=0.5, label_sorted=True)
    ent_mixed = np.mean([label_entropy(labels, p) for p in mixed])
    ent_sorted = np.mean([label_entropy(labels, p) for p in sorted_])
    assert ent_sorted < 0.5 * ent_mixed


# --------------------------------------------------------------------------
# config errors


def expect_error(key: str, *args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        partition(*args, **kwargs)
    assert info.value.key == key
    assert f"'{key}'" in str(info.value)
    return info.value


def test_unknown_name_lists_registered_names():
    err = expect_error("partition", "lda", balanced_labels(), 10, 0)
    for name in PARTITIONERS:
        assert name in str(err)
    assert "lda" in str(err)


@pytest.mark.parametrize("classes", [0, 11, -1])
def test_classes_out_of_range(classes):
    err = expect_error("partition.classes", "classes_per_client", balanced_labels(), 100, 0, classes=classes)
    assert "between 1 and 10" in str(err)


def test_classes_counts_labels_present_not_max_label():
    labels = np.repeat(np.array([0, 3, 9]), 50)  # three distinct labels, max label 9
    expect_error("partition.classes", "classes_per_client", labels, 3, 0, classes=4)
    parts = partition("classes_per_client", labels, 3, 0, classes=3)
    assert all(len(np.unique(labels[p])) == 3 for p in parts)


def test_classes_infeasible_when_label_too_small_for_its_holders():
    labels = np.array([0] * 100 + [1] * 3)
    expect_error("partition.classes", "classes_per_client", labels, 10, 0, classes=1)


@pytest.mark.parametrize("alpha", [0.0, -1.0, float("nan"), float("inf"), "0.5", True])
def test_alpha_must_be_positive(alpha):
    expect_error("partition.alpha", "dirichlet", balanced_labels(), 10, 0, alpha=alpha)


def test_missing_required_param():
    expect_error("partition.alpha", "dirichlet", balanced_labels(), 10, 0)
    expect_error("partition.classes", "classes_per_client", balanced_labels(), 10, 0)
    expect_error("partition.client_ids", "natural", balanced_labels(), 10, 0)


def test_unknown_param_named():
    err = expect_error("partition.beta", "dirichlet", balanced_labels(), 10, 0, alpha=1.0, beta=2)
    assert "alpha" in str(err) and "min_size" in str(err)
    expect_error("partition.alpha", "iid", balanced_labels(), 10, 0, alpha=1.0)


@pytest.mark.parametrize("num_clients", [0, -3, N + 1, 2.5, True])
def test_num_clients_range(num_clients):
    expect_error("dataset.num_clients", "iid", balanced_labels(), num_clients, 0)


def test_num_clients_equal_to_n_is_allowed():
    parts = partition("iid", np.arange(5), 5, 0)
    assert sorted(len(p) for p in parts) == [1] * 5


@pytest.mark.parametrize(
    "name,params,key",
    [
        ("shards", {"shards_per_client": 0}, "partition.shards_per_client"),
        ("shards", {"shards_per_client": 601}, "partition.shards_per_client"),  # shards of size 0
        ("dirichlet", {"alpha": 1.0, "min_size": 601}, "partition.min_size"),  # 10*601 > n
        ("dirichlet", {"alpha": 1.0, "min_size": 0}, "partition.min_size"),
        ("powerlaw", {"exponent": 0.0}, "partition.exponent"),
        ("powerlaw", {"min_size": 601}, "partition.min_size"),
        ("powerlaw", {"label_sorted": "yes"}, "partition.label_sorted"),
    ],
)
def test_bad_params(name, params, key):
    expect_error(key, name, balanced_labels(), 10, 0, **params)


def test_natural_client_ids_checked():
    labels = balanced_labels()
    expect_error("partition.client_ids", "natural", labels, 10, 0, client_ids=owners(10)[:-1])
    expect_error("partition.client_ids", "natural", labels, 11, 0, client_ids=owners(10))


def test_bad_labels_and_seed():
    expect_error("dataset.labels", "iid", np.zeros((10, 2)), 2, 0)
    expect_error("dataset.labels", "iid", np.array([], dtype=int), 1, 0)
    expect_error("seed", "iid", balanced_labels(), 2, -1)
