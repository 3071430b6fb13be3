"""A user's data set: its factory returns (train, test), each (x, y) arrays or a torch Dataset, made arrays once;
(x, y, owner) triples, or a Dataset yielding them, also say each sample's owner (partition=natural: one client per
owner, each client's test samples those with its owner)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedharness.errors import require
from fedharness.problems.pooled import PooledData


def _arrays(name: str, part: str, data: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    if isinstance(data, torch.utils.data.Dataset):
        items = [data[i] for i in range(len(data))]
        require(all(isinstance(it, (tuple, list)) and len(it) in (2, 3) for it in items)
                and len({len(it) for it in items}) <= 1, "dataset", name,
                f"its {part} Dataset must yield (x, y) pairs or (x, y, owner) triples")
        x = np.stack([np.asarray(it[0]) for it in items]) if items else np.empty((0,))
        y = np.array([np.asarray(it[1]).item() for it in items])
        owner = np.array([np.asarray(it[2]).item() for it in items]) if items and len(items[0]) == 3 else None
    else:
        require(isinstance(data, (tuple, list)) and len(data) in (2, 3), "dataset", name,
                f"its factory must return (train, test), each an (x, y) pair (or (x, y, owner) triple) of arrays "
                f"or a torch Dataset (test may be None); got {type(data).__name__} for {part}")
        x, y = (np.asarray(d) for d in data[:2])
        owner = np.asarray(data[2]) if len(data) == 3 else None
    require(len(x) > 0 and len(x) == len(y) and y.ndim == 1, "dataset", name,
            f"{part}: x and y must be non-empty with one label per sample, got shapes {x.shape} and {y.shape}")
    require(np.issubdtype(y.dtype, np.integer) and y.min() >= 0, "dataset", name,
            f"{part}: labels must be integers >= 0 (class indices), got {y.dtype} from {y.min()} to {y.max()}")
    require(owner is None or owner.shape == y.shape, "dataset", name,
            f"{part}: one owner per sample, got shape {None if owner is None else owner.shape} for {len(y)} samples")
    x = x if np.issubdtype(x.dtype, np.floating) else x.astype(np.float32)
    return x, y.astype(np.int64, copy=False), owner


def user_pooled(name: str, out: Any) -> PooledData:
    """The pooled arrays of what a user's data set factory returned (registry.groups.DATASETS built it)."""
    require(isinstance(out, (tuple, list)) and len(out) == 2, "dataset", name,
            "its factory must return (train, test), each an (x, y) pair (or (x, y, owner) triple) of arrays or a "
            "torch Dataset (test may be None)")
    train, test = out
    x, y, owner = _arrays(name, "train", train)
    xt, yt, test_owner = (None, None, None) if test is None else _arrays(name, "test", test)
    return PooledData(x, y, xt, yt, owner, test_owner)
