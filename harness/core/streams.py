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


def _u64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64).astype(np.uint64)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _C1
    z = (z ^ (z >> np.uint64(27))) * _C2
    return z ^ (z >> np.uint64(31))


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
        bits = _mix(key[..., None] ^ ctr)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def seeds(key: np.ndarray, count: int) -> np.ndarray:
    """`count` int64 seeds in [0, 2^63) per key (for a torch generator): shape key.shape + (count,)."""
    with np.errstate(over="ignore"):
        ctr = (np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN)
        bits = _mix(key[..., None] ^ ctr)
    return (bits >> np.uint64(1)).astype(np.int64)


def integers(key: np.ndarray, count: int, high) -> np.ndarray:
    """`count` integers in [0, high) per key; `high` broadcasts against key."""
    u = uniform(key, count)
    out = np.floor(u * np.asarray(high, dtype=np.float64)[..., None]).astype(np.int64)
    return np.minimum(out, np.asarray(high, dtype=np.int64)[..., None] - 1)


def normal(key: np.ndarray, count: int) -> np.ndarray:
    """`count` standard normals per key (Box-Muller on two uniform streams)."""
    u = uniform(key, 2 * count)
    u1 = 1.0 - u[..., :count]  # in (0, 1], so log is finite
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u[..., count:])
