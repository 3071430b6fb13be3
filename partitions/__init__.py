"""Partitioners that split a pooled labelled dataset across clients.

    from fedharness.partitions import partition
    parts = partition("dirichlet", labels, num_clients=100, seed=0, alpha=0.1)

`parts` is a list of `num_clients` sorted int64 index arrays into `labels`.
Every sample is in exactly one client, except under `classes_per_client`,
which drops a remainder to make clients equal (see its docstring).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import numpy as np

from fedharness.errors import ConfigError, require
from fedharness.partitions import core  # noqa: F401  (the built-ins register themselves there)
from fedharness.registry.groups import PARTITIONERS

__all__ = ["PARTITIONERS", "partition"]


def _check_params(name: str, fn: Callable[..., Any], params: dict[str, Any]) -> None:
    """Unknown or missing parameters become ConfigErrors instead of TypeErrors."""
    accepted = {
        p.name: p for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    listed = ", ".join(accepted) if accepted else "none"
    for key, value in params.items():
        if key not in accepted:
            raise ConfigError(f"partition.{key}", value, f"not a parameter of '{name}'; its parameters: {listed}")
    for key, p in accepted.items():
        if p.default is inspect.Parameter.empty and key not in params:
            raise ConfigError(f"partition.{key}", None, f"required by the '{name}' partition")


def partition(name: str, labels: np.ndarray, num_clients: int, seed: int, **params: Any) -> list[np.ndarray]:
    """Split the samples behind `labels` across `num_clients` clients with partitioner `name`.

    Validates everything before drawing, and raises ConfigError naming the
    offending key. Same seed, same split.
    """
    if name not in PARTITIONERS:
        raise ConfigError("partition", name, PARTITIONERS.keys())
    labels = np.asarray(labels)
    require(labels.ndim == 1 and len(labels) > 0, "dataset.labels", f"array of shape {labels.shape}",
            "must be a non-empty 1-D array")
    n = len(labels)
    is_int = isinstance(num_clients, (int, np.integer)) and not isinstance(num_clients, bool)
    require(is_int and 1 <= num_clients <= n, "dataset.num_clients", num_clients,
            f"must be an integer between 1 and the number of samples ({n})")
    is_seed = isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) and seed >= 0
    require(is_seed, "seed", seed, "must be a non-negative integer")

    fn = PARTITIONERS[name]
    _check_params(name, fn, params)
    parts = fn(labels, int(num_clients), np.random.default_rng(int(seed)), **params)
    assert len(parts) == num_clients, f"partitioner '{name}' returned {len(parts)} parts"
    return parts
