"""Problems: a dataset split across clients plus a model and loss, or an analytic objective.

`build_problem` is the one place a config becomes a Problem; it validates every key
before any array is built, so bad input stops before work starts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedharness.errors import ConfigError, require
from fedharness.problems import blobs, synthetic
from fedharness.problems.data import DataProblem
from fedharness.problems.li_toy import LiToyProblem
from fedharness.problems.loaders import LOADERS, load_pooled
from fedharness.problems.nets import NETS, build_net
from fedharness.problems.objectives import LinearRegression, NetObjective, SoftmaxRegression
from fedharness.problems.quadratic import make_quadratic
from fedharness.problems.user import USER_DATASETS, load_user_dataset
from fedharness.core.runtime import autocast_dtype, memory_budget_bytes
from fedharness.partitions import PARTITIONERS, partition

GENERATED = ("synthetic", "synthetic_lazy", "blobs")
ANALYTIC = ("quadratic", "li_toy")
DATASETS = [*GENERATED, *ANALYTIC, *LOADERS.keys()]  # lists: fedharness.extend registers more
LINEAR_MODELS = {"logreg": SoftmaxRegression, "linreg": LinearRegression}
MODELS = ["auto", *LINEAR_MODELS, *NETS, "quadratic"]
CURVATURES = ("identity", "diagonal", "random")


def _pooled(dcfg: dict[str, Any], seed: int):
    """Pooled arrays (x, y, x_test, y_test) and, for generated data, each sample's owner."""
    name = dcfg["name"]
    if name == "blobs":  # Mangold et al.'s noisy / heterogeneous logistic-regression data
        x, y, owner, xt, yt = blobs.generate(dcfg["num_clients"], dcfg["variant"], dcfg["dim"],
                                             dcfg["samples_per_client"], dcfg.get("std"), dcfg["shift"], seed)
        return x, y, xt, yt, owner
    if name == "synthetic":
        size = dcfg.get("samples_per_client")
        require(size is None or (isinstance(size, int) and size >= 2), "dataset.samples_per_client", size,
                "null (lognormal(4, 2) + 50 sizes) or an integer >= 2")
        x, y, owner, xt, yt = synthetic.generate(dcfg["num_clients"], dcfg["alpha"], dcfg["beta"], seed, size)
        return x, y, xt, yt, owner
    if name in USER_DATASETS:
        x, y, xt, yt = load_user_dataset(name, dcfg, seed)
    else:
        x, y, xt, yt = load_pooled(name, dcfg.get("data_dir", "data"), bool(dcfg.get("download", False)))
    return x, y, xt, yt, None


def _objective(model: str, mcfg: dict[str, Any], in_shape: tuple[int, ...], num_classes: int,
               autocast: torch.dtype | None, kernel: str):
    l2 = mcfg.get("l2", 0.0)
    if model in LINEAR_MODELS:
        return LINEAR_MODELS[model](in_shape, num_classes, l2)
    params = {k: v for k, v in mcfg.items() if k not in ("name", "l2", "_target_")}  # a user model's own keys
    kernel = "vmap" if kernel == "auto" else kernel  # auto: harness/core/kernels.py resolves it for the run
    return NetObjective(build_net(model, in_shape, num_classes, **params), model, l2, in_shape, autocast, kernel)


def _partition(pcfg: dict[str, Any], y: np.ndarray, owner, num_clients: int, seed: int) -> list[np.ndarray]:
    params = {k: v for k, v in pcfg.items() if k not in ("name", "_target_")}
    name = pcfg["name"]
    if name == "auto":
        name = "natural" if owner is not None else "iid"
    if name == "natural":
        if owner is None:
            raise ConfigError("partition", "natural", "needs a generated dataset (synthetic); "
                              f"use one of: {', '.join(k for k in PARTITIONERS if k != 'natural')}")
        params["client_ids"] = owner
    return partition(name, y, num_clients, seed, **params)


def build_problem(cfg: dict[str, Any], batch_size: int):
    """The Problem of a run config (`dataset`, `partition`, `model`, `dtype`, `device`, `seed`), with its
    `memory_budget` in bytes (`memory_budget_gb`; executors and evaluation split their batches to fit it)."""
    problem = _build_problem(cfg, batch_size)
    problem.memory_budget = memory_budget_bytes(cfg, problem.device)
    return problem


def _build_problem(cfg: dict[str, Any], batch_size: int):
    dcfg, mcfg = cfg["dataset"], cfg["model"]
    if dcfg["name"] not in DATASETS:
        raise ConfigError("dataset", dcfg["name"], DATASETS)
    if mcfg["name"] not in MODELS:
        raise ConfigError("model", mcfg["name"], MODELS)
    dtype = {"float32": torch.float32, "float64": torch.float64}[cfg["dtype"]]
    data_seed = cfg["seed"] if dcfg.get("data_seed") is None else dcfg["data_seed"]
    num_clients = dcfg["num_clients"]
    require(isinstance(num_clients, int) and num_clients >= 1, "dataset.num_clients", num_clients,
            "must be an integer >= 1")
    if dcfg["name"] == "quadratic":
        require(mcfg["name"] in ("auto", "quadratic"), "model", mcfg["name"],
                "the quadratic dataset is its own model: use model=auto or model=quadratic")
        require(dcfg["curvature"] in CURVATURES, "dataset.curvature", dcfg["curvature"],
                "one of: " + ", ".join(CURVATURES))
        require(0 < dcfg["mu"] <= dcfg["L"], "dataset.mu", dcfg["mu"], f"must satisfy 0 < mu <= L = {dcfg['L']}")
        require(dcfg["noise"] >= 0, "dataset.noise", dcfg["noise"], "must be >= 0")
        return make_quadratic(num_clients, dcfg["dim"], dcfg["spread"], dcfg["curvature"], dcfg["mu"],
                              dcfg["L"], dcfg["noise"], data_seed, dtype, cfg["device"])
    if dcfg["name"] == "li_toy":
        require(mcfg["name"] in ("auto", "quadratic"), "model", mcfg["name"],
                "the li_toy dataset is its own model: use model=auto or model=quadratic")
        return LiToyProblem(num_clients, dcfg["block"], dcfg["mu"], dcfg.get("noise", 0.0), dtype, cfg["device"])
    model = "logreg" if mcfg["name"] == "auto" else mcfg["name"]
    require(model != "quadratic", "model", model, "only the quadratic dataset uses model=quadratic")
    require(mcfg.get("l2", 0.0) >= 0, "model.l2", mcfg.get("l2"), "must be >= 0")
    if dcfg["name"] == "synthetic_lazy":  # clients generated when sampled (harness/problems/lazy.py)
        from fedharness.problems.lazy import build_lazy_synthetic

        return build_lazy_synthetic(cfg, batch_size, lambda shape, classes: _objective(
            model, mcfg, shape, classes, autocast_dtype(cfg), cfg.get("kernel", "auto")), data_seed, dtype)
    x, y, xt, yt, owner = _pooled(dcfg, data_seed)
    num_classes = int(y.max() if yt is None else max(y.max(), yt.max())) + 1  # a user data set may have no test
    objective = _objective(model, mcfg, tuple(x.shape[1:]), num_classes, autocast_dtype(cfg),
                           cfg.get("kernel", "auto"))
    index = _partition(cfg["partition"], y, owner, num_clients, data_seed)
    return DataProblem(objective, x, y, index, xt, yt, batch_size, dtype, cfg["device"])
