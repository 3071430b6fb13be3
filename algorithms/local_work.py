"""How many local steps tau_k each sampled client makes in a round.

Random local work is drawn from the LOCAL_WORK stream keyed by (seed, replica, round,
client): a client's tau does not depend on who else was sampled, on the executor or
on a resume, and a client drawn twice in a round makes the same steps both times.
"""

from __future__ import annotations

import numpy as np

from fedharness.contracts import LocalWork
from fedharness.registry.groups import part, part_names
from fedharness.base import streams
from fedharness.keys import Key, boolean, choice, integer, number

KEYS: dict[str, Key] = {  # harness/config/schema.py's rules add steps_low <= steps_high and the like
    "local_work": choice("how many local steps each client makes", part_names("local_work")),
    "local_steps": integer("E (Li et al.), K (Yang et al.), H (Mangold et al.): local steps", lo=1,
                           batchable=True),
    "local_epochs": integer("local_work=epochs: local_epochs * ceil(n_k / b) steps", lo=1),
    "steps_low": integer("local_work=random_steps: tau ~ U{steps_low..steps_high}", lo=1),
    "steps_high": integer("local_work=random_steps: upper end", lo=1),
    "epochs_low": integer("local_work=random_epochs: E ~ U{epochs_low..epochs_high}", lo=1),
    "epochs_high": integer("local_work=random_epochs: upper end", lo=1),
    "steps_mean": number("local_work=gaussian_steps: mean of N(steps_mean, steps_std^2)", lo=0, lo_open=True),
    "steps_std": number("local_work=gaussian_steps: standard deviation", lo=0),
    "steps_min": integer("local_work=gaussian_steps: clipped below at", lo=1),
    "steps_max": integer("local_work=gaussian_steps: clipped above at", lo=1),
    "local_work_min": boolean("FedAvg-min: every sampled client makes the round's minimum tau"),
}


def _key(seed: int, replicas: np.ndarray, rnd: int, clients: np.ndarray) -> np.ndarray:
    return streams.stream_key(seed, streams.LOCAL_WORK, np.asarray(replicas)[:, None], rnd, clients)


def _uniform_ints(seed: int, replicas: np.ndarray, rnd: int, clients: np.ndarray, low: int, high: int) -> np.ndarray:
    """One integer uniform on {low, ..., high} per (replica, client) entry."""
    return low + streams.integers(_key(seed, replicas, rnd, clients), 1, high - low + 1)[..., 0]


def _epoch_steps(clients: np.ndarray, sizes: np.ndarray, batch_size: int) -> np.ndarray:
    return -(-sizes[clients] // batch_size)


@part("local_work", "steps")
class FixedSteps(LocalWork):
    """Every client makes the same number of local steps."""

    def __init__(self, local_steps: int):
        self.local_steps = local_steps

    def steps(self, seed: int, replicas: np.ndarray, rnd: int, clients: np.ndarray, sizes: np.ndarray,
              batch_size: int) -> np.ndarray:
        return np.full(clients.shape, self.local_steps, dtype=np.int64)


@part("local_work", "epochs")
class Epochs(LocalWork):
    """E passes over the client's data: E * ceil(n_k / b) steps."""

    def __init__(self, local_epochs: int):
        self.local_epochs = local_epochs

    def steps(self, seed: int, replicas: np.ndarray, rnd: int, clients: np.ndarray, sizes: np.ndarray,
              batch_size: int) -> np.ndarray:
        return self.local_epochs * _epoch_steps(clients, sizes, batch_size)


@part("local_work", "random_steps")
class RandomSteps(LocalWork):
    """tau_k uniform on {steps_low, ..., steps_high}, drawn per client per round."""

    def __init__(self, steps_low: int, steps_high: int):
        self.low, self.high = int(steps_low), int(steps_high)

    def steps(self, seed: int, replicas: np.ndarray, rnd: int, clients: np.ndarray, sizes: np.ndarray,
              batch_size: int) -> np.ndarray:
        return _uniform_ints(seed, replicas, rnd, clients, self.low, self.high)


@part("local_work", "random_epochs")
class RandomEpochs(LocalWork):
    """E_k uniform on {epochs_low, ..., epochs_high} per client per round: E_k * ceil(n_k / b) steps.

    FedNova's E_i(t) ~ U(2, 5) experiments.
    """

    def __init__(self, epochs_low: int, epochs_high: int):
        self.low, self.high = int(epochs_low), int(epochs_high)

    def steps(self, seed: int, replicas: np.ndarray, rnd: int, clients: np.ndarray, sizes: np.ndarray,
              batch_size: int) -> np.ndarray:
        epochs = _uniform_ints(seed, replicas, rnd, clients, self.low, self.high)
        return epochs * _epoch_steps(clients, sizes, batch_size)


@part("local_work", "gaussian_steps")
class ClippedGaussianSteps(LocalWork):
    """tau_k = clip(round(mean + std * z), min, max), z ~ N(0, 1) per client per round."""

    def __init__(self, steps_mean: float, steps_std: float, steps_min: int, steps_max: int):
        self.mean, self.std = float(steps_mean), float(steps_std)
        self.min, self.max = int(steps_min), int(steps_max)

    def steps(self, seed: int, replicas: np.ndarray, rnd: int, clients: np.ndarray, sizes: np.ndarray,
              batch_size: int) -> np.ndarray:
        z = streams.normal(_key(seed, replicas, rnd, clients), 1)[..., 0]
        return np.clip(np.rint(self.mean + self.std * z), self.min, self.max).astype(np.int64)


class MinOfSelection(LocalWork):
    """FedAvg-min (Wang et al.): every sampled client of a replica makes the round's minimum tau."""

    def __init__(self, inner: LocalWork):
        self.inner = inner

    def steps(self, seed: int, replicas: np.ndarray, rnd: int, clients: np.ndarray, sizes: np.ndarray,
              batch_size: int) -> np.ndarray:
        tau = self.inner.steps(seed, replicas, rnd, clients, sizes, batch_size)
        return np.broadcast_to(tau.min(axis=1, keepdims=True), tau.shape).astype(np.int64)


def with_min(inner: LocalWork, local_work_min: bool = False) -> LocalWork:
    """The local work itself, or its FedAvg-min version when `algorithm.local_work_min` is true."""
    return MinOfSelection(inner) if local_work_min else inner
