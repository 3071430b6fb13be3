"""A user's data set: its factory returns (train, test), each (x, y) arrays or a torch Dataset, made arrays once."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedharness.errors import require
from fedharness.problems.pooled import PooledData


def _arrays(name: str, part: str, data: Any) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(data, torch.utils.data.Dataset):
        items = [data[i] for i in range(len(data))]
        require(all(isinstance(it, (tuple, list)) and len(it) == 2 for it in items), "dataset", name,
                f"its {part} Dataset must yield (x, y) pairs")
        x = np.stack([np.asarray(a) for a, _ in items]) if items else np.empty((0,))
        y = np.array([np.asarray(b).item() for _, b in items])
    else:
        require(isinstance(data, (tuple, list)) and len(data) == 2, "dataset", name,
                f"its factory must return (train, test), each an (x, y) pair of arrays or a torch Dataset "
                f"(test may be None); got {type(data).__name__} for {part}")
        x, y = (np.asarray(d) for d in data)
    require(len(x) > 0 and len(x) == len(y) and y.ndim == 1, "dataset", name,
            f"{part}: x and y must be non-empty with one label per sample, got shapes {x.shape} and {y.shape}")
    require(np.issubdtype(y.dtype, np.integer) and y.min() >= 0, "dataset", name,
            f"{part}: labels must be integers >= 0 (class indices), got {y.dtype} from {y.min()} to {y.max()}")
    kept = np.issubdtype(x.dtype, np.floating) or x.dtype == np.int64  # int64: token ids, for a text model
    return (x if kept else x.astype(np.float32)), y.astype(np.int64, copy=False)


def user_pooled(name: str, out: Any) -> PooledData:
    """The pooled arrays of what a user's data set factory returned (registry.groups.DATASETS built it)."""
    require(isinstance(out, (tuple, list)) and len(out) == 2, "dataset", name,
            "its factory must return (train, test), each an (x, y) pair of arrays or a torch Dataset "
            "(test may be None)")
    train, test = out
    x, y = _arrays(name, "train", train)
    xt, yt = (None, None) if test is None else _arrays(name, "test", test)
    return PooledData(x, y, xt, yt)
