"""Counter-based random streams keyed by (seed, tag, replica, round, client, counter).

Every random number the engine uses is a pure function of its key, never of the
order in which workers ask for it. That is what makes a run give the same
trajectory with 1 shard or 16, inline or on Ray, fresh or resumed. The hash is
SplitMix64's finalizer applied to a chain of keys, vectorized with numpy's
wrapping uint64 arithmetic.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)

# Stream tags: one per kind of randomness, so no two uses ever share numbers.
SAMPLE, BATCH, LOCAL_WORK, NOISE, INIT, DROPOUT = 1, 2, 3, 4, 5, 6
# Generated data sets (problems/synthetic.py): a client's size, its parameters, one sample (row).
DATA_SIZE, DATA_CLIENT, DATA_ROW = 7, 8, 9
# Population metrics: the clients a train loss is estimated on (problems/estimate.py); the lazy quadratic
# population's clients (problems/quadratic_lazy.py).
EVAL_SAMPLE, POPULATION = 10, 11
# Adversaries (algorithms/byzantine.py): which sampled clients are Byzantine, what a noise attack sends, the buckets of
# a bucketed robust rule.
BYZANTINE, ATTACK_NOISE, BUCKETS = 12, 13, 14
# Client-level DP (algorithms/privacy.py): the Gaussian noise on a round's sum and on adaptive clipping's count.
DP_NOISE = 20
# Compressed updates (algorithms/compression.py): random-k's coordinates, QSGD's stochastic rounding.
COMPRESS = 21
# Clients' systems profiles (algorithms/systems.py): a client's speed and bandwidth, its availability phase, the
# trace entry it maps to.
SYSTEMS = 22
# eval.personal's fine-tuning (core/personal.py): its minibatches are the training streams of a seed of its own.
FINETUNE = 23
# dataset.unseen_clients (problems/unseen.py): which clients never train.
UNSEEN = 24


def _u64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64).astype(np.uint64)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _C1
    z = (z ^ (z >> np.uint64(27))) * _C2
    return z ^ (z >> np.uint64(31))


def _mix_in_place(z: np.ndarray) -> np.ndarray:
    """_mix computed in z itself (at least one dimension: in-place ufuncs on a 0-d array return scalars), with one
    temporary: the same bits, without the five fresh arrays _mix makes (minibatch draws are most of a round's
    hashing)."""
    t = np.empty_like(z)
    for shift, mult in ((30, _C1), (27, _C2), (31, None)):
        np.right_shift(z, np.uint64(shift), out=t)
        z ^= t
        if mult is not None:
            z *= mult
    return z


def stream_key(seed: int, tag: int, replica, rnd, client) -> np.ndarray:
    """Key of the stream for each (replica, round, client), broadcast together."""
    with np.errstate(over="ignore"):
        h = _mix(_u64(seed) * _GOLDEN + _u64(tag))
        for part in (replica, rnd, client):
            h = _mix(h ^ (_u64(part) + np.uint64(1)) * _GOLDEN)
        return h


def uniform(key: np.ndarray, count: int) -> np.ndarray:
    """`count` uniforms in [0, 1) per key: shape key.shape + (count,), float64."""
    with np.errstate(over="ignore"):
        ctr = (np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN)
        bits = _mix_in_place(key[..., None] ^ ctr)
    bits >>= np.uint64(11)
    out = bits.astype(np.float64)
    out *= 1.0 / (1 << 53)
    return out


def seeds(key: np.ndarray, count: int) -> np.ndarray:
    """`count` int64 seeds in [0, 2^63) per key (for a torch generator): shape key.shape + (count,)."""
    with np.errstate(over="ignore"):
        ctr = (np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN)
        bits = _mix_in_place(key[..., None] ^ ctr)
    bits >>= np.uint64(1)
    return bits.astype(np.int64)


def integers(key: np.ndarray, count: int, high) -> np.ndarray:
    """`count` integers in [0, high) per key; `high` broadcasts against key."""
    u = uniform(key, count)
    u *= np.asarray(high, dtype=np.float64)[..., None]
    out = np.floor(u, out=u).astype(np.int64)
    return np.minimum(out, np.asarray(high, dtype=np.int64)[..., None] - 1, out=out)


def normal(key: np.ndarray, count: int) -> np.ndarray:
    """`count` standard normals per key (Box-Muller on two uniform streams)."""
    u = uniform(key, 2 * count)
    u1 = 1.0 - u[..., :count]  # in (0, 1], so log is finite
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u[..., count:])


def step_normals(key: np.ndarray, tau, steps: int, size: int) -> np.ndarray:
    """[M, steps, size] standard normals: copy m's first tau[m] steps from normal(key[m], tau[m] * size) (its own
    local steps, so they depend on neither the copies it trains beside nor the longest of them: the same in any
    shard or batch), zeros after. tau None: every copy draws `steps`."""
    if tau is None:
        return normal(key, steps * size).reshape(len(key), steps, size)
    out = np.zeros((len(key), steps, size))
    for t in np.unique(tau):
        rows = np.flatnonzero(tau == t)
        out[rows, :t] = normal(key[rows], int(t) * size).reshape(len(rows), int(t), size)
    return out


def uniform_pair(seed: int, tag: int, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two uniforms per index (float64 with 32 random bits: the first in (0, 1), the second in [0, 1)) from
    one hash of (seed, tag, index), computed in place: the cheapest stream, for one draw per client over a
    whole population (10^8 clients in a few seconds)."""
    base = stream_key(seed, tag, 0, 0, 0)
    shape = np.shape(index)
    z = _u64(index).reshape(-1)  # 1-d: in-place ufuncs on a 0-d array would return scalars
    with np.errstate(over="ignore"):
        z += np.uint64(1)
        z *= _GOLDEN
        z ^= base
        _mix_in_place(z)
    t = np.empty_like(z)
    first = (z >> np.uint64(32)).view(np.int64).astype(np.float64)
    first += 0.5
    first *= 2.0 ** -32
    np.bitwise_and(z, np.uint64(0xFFFFFFFF), out=t)
    second = t.view(np.int64).astype(np.float64)
    second *= 2.0 ** -32
    return first.reshape(shape), second.reshape(shape)
