"""A config's memory, estimated before anything is allocated: refuse what cannot fit, naming the key.

The estimate counts the big arrays only: the clients' data (num_clients x samples x features, generated in
float64 and copied once into the run's dtype) and the model copies the batched clients hold (replicas x
(clients per round + a few server copies) x parameters). It errs low, so it refuses only configs that
certainly cannot run; a config near the limit may still fail.
"""

from __future__ import annotations

import math
from typing import Any

from fedharness.core.runtime import available_ram
from fedharness.errors import ConfigError

# n_k ~ lognormal(4, 2) + 50 has mean exp(4 + 2^2 / 2) + 50 (Li et al.'s Synthetic).
SYNTHETIC_MEAN_SAMPLES = math.exp(6.0) + 50
SYNTHETIC_FEATURES, SYNTHETIC_CLASSES = 60, 10
IMAGE_SHAPES = {"digits": ((1, 8, 8), 10), "mnist": ((1, 28, 28), 10), "fashion_mnist": ((1, 28, 28), 10),
                "cifar10": ((3, 32, 32), 10)}
SERVER_COPIES = 4  # x, the aggregate, server optimizer state, the reference


def data_bytes(dcfg: dict[str, Any]) -> float:
    """The clients' arrays in float64 plus one copy in the run's dtype (counted as float64: an upper end)."""
    name, n = dcfg["name"], dcfg["num_clients"]
    if name == "synthetic":
        size = dcfg.get("samples_per_client") or SYNTHETIC_MEAN_SAMPLES
        return 2 * n * size * (SYNTHETIC_FEATURES + 1) * 8
    if name == "synthetic_lazy":
        size = dcfg.get("samples_per_client") or SYNTHETIC_MEAN_SAMPLES
        return min(n, dcfg["eval_clients"]) * size * (SYNTHETIC_FEATURES + 1) * 8
    if name == "blobs":
        return 2 * n * dcfg["samples_per_client"] * 1.1 * (dcfg["dim"] + 1) * 8
    if name == "quadratic":
        return 2 * n * (dcfg["dim"] ** 2 + dcfg["dim"]) * 8
    if name == "li_toy":
        dim = n * dcfg["block"] + 1
        return 2 * n * (dim ** 2 + dim) * 8
    return 0.0  # files on disk: their size does not depend on the config


def model_params(cfg: dict[str, Any]) -> int:
    """Parameters of the model (0 where it cannot be told without the data)."""
    dcfg, model = cfg["dataset"], cfg["model"]["name"]
    if dcfg["name"] == "quadratic":
        return dcfg["dim"]
    if dcfg["name"] == "li_toy":
        return dcfg["num_clients"] * dcfg["block"] + 1
    if dcfg["name"] in ("synthetic", "synthetic_lazy"):
        shape, classes = (SYNTHETIC_FEATURES,), SYNTHETIC_CLASSES
    elif dcfg["name"] == "blobs":
        shape, classes = (dcfg["dim"],), 2
    elif dcfg["name"] in IMAGE_SHAPES:
        shape, classes = IMAGE_SHAPES[dcfg["name"]]
    else:
        return 0
    if model in ("auto", "logreg", "linreg"):
        return (math.prod(shape) + 1) * classes
    import torch

    from fedharness.problems.nets import build_net, count_params

    with torch.device("meta"):  # shapes only: nothing is allocated
        return count_params(build_net(model, shape, classes))


def check_memory(cfg: dict[str, Any]) -> None:
    """Refuse a config whose arrays exceed the available memory, naming the key that dominates."""
    data = data_bytes(cfg["dataset"])
    acfg = cfg["algorithm"]
    batched = acfg["clients_per_round"] if acfg["sampler"] != "full" else cfg["dataset"]["num_clients"]
    width = 8 if cfg["dtype"] == "float64" else 4
    models = cfg["replicas"] * (batched + SERVER_COPIES) * model_params(cfg) * width
    have = available_ram()
    if data + models <= have:
        return
    need = f"needs about {(data + models) / 2**30:.3g} GiB; {have / 2**30:.3g} GiB of memory is available"
    if data >= models:
        key = "dataset.num_clients"
        raise ConfigError(key, cfg["dataset"]["num_clients"], f"too many clients for this machine: the data {need}")
    raise ConfigError("replicas", cfg["replicas"], f"too many replicas for this machine: "
                      f"replicas x (clients per round + {SERVER_COPIES}) model copies {need}")
