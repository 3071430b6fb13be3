"""Problems: a dataset split across clients plus a model and loss, or an analytic objective.

`build_problem` is the one place a config becomes a Problem. The keys of each option are declared beside its
builder (the `KEYS` of synthetic.py, lazy.py, blobs.py, quadratic.py, quadratic_lazy.py, li_toy.py,
loaders.py; `objectives.L2`), collected below for harness/config/schema.py, which checks a config against them before
anything is built.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedharness.contracts import Problem
from fedharness.keys import Key, integer
from fedharness.problems import blobs, lazy, li_toy, loaders, quadratic, quadratic_lazy, synthetic
from fedharness.problems.data import DataProblem
from fedharness.problems.lazy import build_lazy_synthetic
from fedharness.problems.li_toy import LiToyProblem
from fedharness.problems.loaders import LOADERS, load_pooled
from fedharness.problems.nets import NETS, build_net
from fedharness.problems.objectives import BUFFERS, L2, LinearRegression, NetObjective, SoftmaxRegression
from fedharness.problems.quadratic import make_quadratic
from fedharness.problems.quadratic_lazy import QuadraticPopulation
from fedharness.problems.user import USER_DATASETS, load_user_dataset
from fedharness.base.runtime import autocast_dtype, memory_budget_bytes
from fedharness.partitions import partition

GENERATED = ("synthetic", "synthetic_lazy", "blobs")
ANALYTIC = ("quadratic", "quadratic_lazy", "li_toy")
DATASETS = [*GENERATED, *ANALYTIC, *LOADERS.keys()]  # lists: fedharness.extend registers more
LINEAR_MODELS = {"logreg": SoftmaxRegression, "linreg": LinearRegression}
MODELS = ["auto", *LINEAR_MODELS, *NETS, "quadratic"]

# Every dataset's keys (build_problem reads num_clients and data_seed; the option's own from its module), and
# every model's. A user's registered data set or model has none declared: its keys go to its factory unchecked.
NUM_CLIENTS = integer("N, the number of clients", lo=1)
DATA_SEED = integer("seed of the data", lo=0, null="use the run's seed")
DATASET_KEYS: dict[str, dict[str, Key]] = {
    name: {"num_clients": NUM_CLIENTS, "data_seed": DATA_SEED, **keys}
    for name, keys in {"synthetic": synthetic.KEYS, "synthetic_lazy": lazy.KEYS, "blobs": blobs.KEYS,
                       "quadratic": quadratic.KEYS, "quadratic_lazy": quadratic_lazy.KEYS, "li_toy": li_toy.KEYS,
                       **dict.fromkeys(LOADERS, loaders.KEYS)}.items()
}
MODEL_KEYS: dict[str, dict[str, Key]] = {**{name: {"l2": L2} for name in MODELS if name != "quadratic"},
                                        "resnet18_bn": {"l2": L2, "buffers": BUFFERS}, "quadratic": {}}
NET_OWN_KEYS = ("name", "l2", "buffers", "_target_")  # read by the harness; a user model's other keys are its own


def _pooled(dcfg: dict[str, Any], seed: int):
    """Pooled arrays (x, y, x_test, y_test) and, for generated data, each sample's owner."""
    name = dcfg["name"]
    if name == "blobs":  # Mangold et al.'s noisy / heterogeneous logistic-regression data
        x, y, owner, xt, yt = blobs.generate(dcfg["num_clients"], dcfg["variant"], dcfg["dim"],
                                             dcfg["samples_per_client"], dcfg.get("std"), dcfg["shift"], seed)
        return x, y, xt, yt, owner
    if name == "synthetic":
        x, y, owner, xt, yt = synthetic.generate(dcfg["num_clients"], dcfg["alpha"], dcfg["beta"], seed,
                                                 dcfg["samples_per_client"])
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
    params = {k: v for k, v in mcfg.items() if k not in NET_OWN_KEYS}  # a user model's own keys
    kernel = "vmap" if kernel == "auto" else kernel  # auto: harness/core/kernels.py resolves it for the run
    return NetObjective(build_net(model, in_shape, num_classes, **params), model, l2, in_shape, autocast, kernel,
                        mcfg.get("buffers", "average"))


def _partition(pcfg: dict[str, Any], y: np.ndarray, owner, num_clients: int, seed: int) -> list[np.ndarray]:
    params = {k: v for k, v in pcfg.items() if k not in ("name", "_target_")}
    name = pcfg["name"]
    if name == "auto":
        name = "natural" if owner is not None else "iid"
    if name == "natural":  # harness/config/schema.py allows it for generated data sets only
        params["client_ids"] = owner
    return partition(name, y, num_clients, seed, **params)


def build_problem(cfg: dict[str, Any], batch_size: int) -> Problem:
    """The Problem of a validated run config (`dataset`, `partition`, `model`, `dtype`, `device`, `seed`), built
    with its `memory_budget` in bytes (`memory_budget_gb`; executors and evaluation split their batches to fit it).
    The schema has checked every key and the rules between them (e.g. the analytic data sets are their own model)."""
    dcfg, mcfg = cfg["dataset"], cfg["model"]
    dtype = {"float32": torch.float32, "float64": torch.float64}[cfg["dtype"]]
    budget = memory_budget_bytes(cfg["memory_budget_gb"], torch.device(cfg["device"]))
    data_seed = cfg["seed"] if dcfg.get("data_seed") is None else dcfg["data_seed"]
    num_clients = dcfg["num_clients"]
    if dcfg["name"] == "quadratic":
        return make_quadratic(num_clients, dcfg["dim"], dcfg["spread"], dcfg["curvature"], dcfg["mu"],
                              dcfg["L"], dcfg["noise"], data_seed, dtype, cfg["device"], budget)
    if dcfg["name"] == "quadratic_lazy":  # clients generated when sampled (harness/problems/quadratic_lazy.py)
        return QuadraticPopulation(num_clients, dcfg["dim"], dcfg["spread"], dcfg["mu"], dcfg["L"],
                                   dcfg["curvature_spread"], dcfg["noise"], data_seed, cfg["seed"],
                                   dcfg["eval_clients"], dtype, cfg["device"], budget)
    if dcfg["name"] == "li_toy":
        return LiToyProblem(num_clients, dcfg["block"], dcfg["mu"], dcfg["noise"], dtype, cfg["device"], budget)
    model = "logreg" if mcfg["name"] == "auto" else mcfg["name"]
    if dcfg["name"] == "synthetic_lazy":  # clients generated when sampled (harness/problems/lazy.py)
        return build_lazy_synthetic(cfg, batch_size, lambda shape, classes: _objective(
            model, mcfg, shape, classes, autocast_dtype(cfg["precision"]), cfg.get("kernel", "auto")), data_seed, dtype,
            budget)
    x, y, xt, yt, owner = _pooled(dcfg, data_seed)
    num_classes = int(y.max() if yt is None else max(y.max(), yt.max())) + 1  # a user data set may have no test
    objective = _objective(model, mcfg, tuple(x.shape[1:]), num_classes, autocast_dtype(cfg["precision"]),
                           cfg.get("kernel", "auto"))
    index = _partition(cfg["partition"], y, owner, num_clients, data_seed)
    return DataProblem(objective, x, y, index, xt, yt, batch_size, dtype, cfg["device"], budget)
