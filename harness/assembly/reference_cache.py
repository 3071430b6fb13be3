"""A cache of exact references (w*, F*, per-client F_k*), outside any results directory.

Solving for w* takes seconds to minutes; a tuning study or a sweep asks for the same
problem again and again, often with only the training seed changed. The key is what defines
the objective: the data (the dataset config less the keys that do not change the samples,
with the seed the data are drawn from: `dataset.data_seed`, or the run's seed when that is
null), the partition and the model, plus the source of the code that defines objectives and
solves them, so an edit to that code never reads a stale entry. A solve that failed is cached
too, with its time bound, so the next run with no larger bound does not wait for it again.
The cache lives in $FEDHARNESS_CACHE (default ~/.cache/fedharness), never in results_dir: a
run stopped by bad input leaves no file there.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import importlib.util
from pathlib import Path
from typing import Any, Callable

import numpy as np

from fedharness.base.files import atomic_write, cache_dir
from fedharness.references.solve import Reference, SolveFailed

FORMAT = 2  # bump when the meaning of a cached entry changes
_HERE = Path(__file__).resolve().parents[1]  # harness/
_PARTITIONS = Path(importlib.util.find_spec("fedharness.partitions").origin).parent  # the checkout's or the wheel's
_SOURCES = sorted([*(_HERE / "problems").glob("*.py"), *_PARTITIONS.glob("*.py"),
                   *(_HERE / "references").glob("*.py")])
# dataset keys that change how data are fetched or evaluated, not the training samples
NOT_DATA = ("data_seed", "download", "cache_mb")


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    h = hashlib.sha256()
    for path in _SOURCES:
        h.update(path.read_bytes())
    return h.hexdigest()


def objective_key(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config that defines the objective: data, the seed they are drawn from, partition, model."""
    dcfg = cfg["dataset"]
    data_seed = cfg.get("seed") if dcfg.get("data_seed") is None else dcfg["data_seed"]
    return {"dataset": {k: v for k, v in dcfg.items() if k not in NOT_DATA}, "data_seed": data_seed,
            "partition": cfg.get("partition"), "model": cfg.get("model")}


def _key(cfg: dict[str, Any], what: str) -> str:
    text = json.dumps({"what": what, "format": FORMAT, "code": _code_digest(), **objective_key(cfg)},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _path(cfg: dict[str, Any], what: str) -> Path:
    return cache_dir() / "references" / f"{what}-{_key(cfg, what)}.npz"


def _save(path: Path, **arrays: np.ndarray) -> None:
    atomic_write(path, lambda f: np.savez(f, **arrays))


def _cached(path: Path, timeout_s: float | None, solve: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays stored at `path`, else `solve()`'s (stored). A stored failure is raised again unless
    this call allows more time than the failed solve had; a new failure is stored and raised."""
    if path.exists():
        z = dict(np.load(path))
        if "failed" not in z:
            return z
        stored = float(z["timeout_s"])  # nan: the failed solve had no time bound
        if math.isnan(stored) or (timeout_s is not None and timeout_s <= stored):
            raise SolveFailed(str(z["failed"]))
    try:
        arrays = solve()
    except SolveFailed as err:
        _save(path, failed=np.array(str(err)), timeout_s=np.array(math.nan if timeout_s is None else timeout_s))
        raise
    _save(path, **arrays)
    return arrays


def cached_reference(cfg: dict[str, Any], solve: Callable[[], Reference], timeout_s: float | None = None) -> Reference:
    """The reference of `cfg`'s objective; SolveFailed if its solve failed (now, or before within as much time)."""
    def arrays() -> dict[str, np.ndarray]:
        ref = solve()
        return {"w_star": ref.w_star, "f_star": np.array(ref.f_star), "grad_norm": np.array(ref.grad_norm)}

    z = _cached(_path(cfg, "reference"), timeout_s, arrays)
    return Reference(z["w_star"], float(z["f_star"]), float(z["grad_norm"]))


def cached_client_minima(cfg: dict[str, Any], solve: Callable[[], np.ndarray | None],
                         timeout_s: float | None = None) -> np.ndarray | None:
    """Every client's F_k* (None where a minimum is not attained); SolveFailed like `cached_reference`."""
    def arrays() -> dict[str, np.ndarray]:
        minima = solve()
        return {"minima": np.zeros(0) if minima is None else minima, "attained": np.array(minima is not None)}

    z = _cached(_path(cfg, "client_minima"), timeout_s, arrays)
    return z["minima"] if bool(z["attained"]) else None
