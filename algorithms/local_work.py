"""How many local steps tau_k each sampled client makes in a round.

Random local work is drawn from the LOCAL_WORK stream keyed by (seed, replica, round,
client): a client's tau does not depend on who else was sampled, on the executor or
on a resume, and a client drawn twice in a round makes the same steps both times.
"""

from __future__ import annotations

import numpy as np

from fedharness.core import streams
from fedharness.errors import require


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _require_range(low, high, key_low: str, key_high: str) -> None:
    require(_is_int(low) and low >= 1, key_low, low, "must be an integer >= 1")
    require(_is_int(high) and high >= low, key_high, high, f"must be an integer >= {key_low} ({low})")


def _key(seed: int, replicas: np.ndarray, rnd: int, clients: np.ndarray) -> np.ndarray:
    return streams.stream_key(seed, streams.LOCAL_WORK, np.asarray(replicas)[:, None], rnd, clients)


def _uniform_ints(seed: int, replicas: np.ndarray, rnd: int, clients: np.ndarray, low: int, high: int) -> np.ndarray:
    """One integer uniform on {low, ..., high} per (replica, client) entry."""
    return low + streams.integers(_key(seed, replicas, rnd, clients), 1, high - low + 1)[..., 0]


def _epoch_steps(clients: np.ndarray, sizes: np.ndarray, batch_size: int) -> np.ndarray:
    return -(-sizes[clients] // batch_size)


class FixedSteps:
    """Every client makes the same number of local steps."""

    def __init__(self, local_steps: int):
        require(_is_int(local_steps) and local_steps >= 1, "algorithm.local_steps", local_steps,
                "must be an integer >= 1")
        self.local_steps = local_steps

    def steps(self, seed: int, replicas: np.ndarray, rnd: int, clients: np.ndarray, sizes: np.ndarray,
              batch_size: int) -> np.ndarray:
        return np.full(clients.shape, self.local_steps, dtype=np.int64)


class Epochs:
    """E passes over the client's data: E * ceil(n_k / b) steps."""

    def __init__(self, local_epochs: int):
        require(_is_int(local_epochs) and local_epochs >= 1, "algorithm.local_epochs", local_epochs,
                "must be an integer >= 1")
        self.local_epochs = local_epochs

    def steps(self, seed: int, replicas: np.ndarray, rnd: int, clients: np.ndarray, sizes: np.ndarray,
              batch_size: int) -> np.ndarray:
        return self.local_epochs * _epoch_steps(clients, sizes, batch_size)


class RandomSteps:
    """tau_k uniform on {steps_low, ..., steps_high}, drawn per client per round."""

    def __init__(self, steps_low: int, steps_high: int):
        _require_range(steps_low, steps_high, "algorithm.steps_low", "algorithm.steps_high")
        self.low, self.high = int(steps_low), int(steps_high)

    def steps(self, seed: int, replicas: np.ndarray, rnd: int, clients: np.ndarray, sizes: np.ndarray,
              batch_size: int) -> np.ndarray:
        return _uniform_ints(seed, replicas, rnd, clients, self.low, self.high)


class RandomEpochs:
    """E_k uniform on {epochs_low, ..., epochs_high} per client per round: E_k * ceil(n_k / b) steps.

    FedNova's E_i(t) ~ U(2, 5) experiments.
    """

    def __init__(self, epochs_low: int, epochs_high: int):
        _require_range(epochs_low, epochs_high, "algorithm.epochs_low", "algorithm.epochs_high")
        self.low, self.high = int(epochs_low), int(epochs_high)

    def steps(self, seed: int, replicas: np.ndarray, rnd: int, clients: np.ndarray, sizes: np.ndarray,
              batch_size: int) -> np.ndarray:
        epochs = _uniform_ints(seed, replicas, rnd, clients, self.low, self.high)
        return epochs * _epoch_steps(clients, sizes, batch_size)


class ClippedGaussianSteps:
    """tau_k = clip(round(mean + std * z), min, max), z ~ N(0, 1) per client per round."""

    def __init__(self, steps_mean: float, steps_std: float, steps_min: int, steps_max: int):
        require(_is_number(steps_mean) and steps_mean > 0, "algorithm.steps_mean", steps_mean, "must be a number > 0")
        require(_is_number(steps_std) and steps_std >= 0, "algorithm.steps_std", steps_std, "must be a number >= 0")
        _require_range(steps_min, steps_max, "algorithm.steps_min", "algorithm.steps_max")
        self.mean, self.std = float(steps_mean), float(steps_std)
        self.min, self.max = int(steps_min), int(steps_max)

    def steps(self, seed: int, replicas: np.ndarray, rnd: int, clients: np.ndarray, sizes: np.ndarray,
              batch_size: int) -> np.ndarray:
        z = streams.normal(_key(seed, replicas, rnd, clients), 1)[..., 0]
        return np.clip(np.rint(self.mean + self.std * z), self.min, self.max).astype(np.int64)


class MinOfSelection:
    """FedAvg-min (Wang et al.): every sampled client of a replica makes the round's minimum tau."""

    def __init__(self, inner):
        self.inner = inner

    def steps(self, seed: int, replicas: np.ndarray, rnd: int, clients: np.ndarray, sizes: np.ndarray,
              batch_size: int) -> np.ndarray:
        tau = self.inner.steps(seed, replicas, rnd, clients, sizes, batch_size)
        return np.broadcast_to(tau.min(axis=1, keepdims=True), tau.shape).astype(np.int64)


def with_min(local_work, enabled) -> object:
    """The local work itself, or its FedAvg-min version when `algorithm.local_work_min` is true."""
    require(isinstance(enabled, bool), "algorithm.local_work_min", enabled, "must be true or false")
    return MinOfSelection(local_work) if enabled else local_work
