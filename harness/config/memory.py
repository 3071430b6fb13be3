"""A config's memory, estimated before anything is allocated: refuse what cannot fit, naming the key.

The estimate counts the big arrays only: the clients' data (num_clients x samples x features, generated in
float64 and copied once into the run's dtype) and the model copies the batched clients hold (replicas x
(clients per round + a few server copies) x parameters). It errs low, so it refuses only configs that
certainly cannot run; a config near the limit may still fail.
"""

from __future__ import annotations

import math

import torch

from fedharness.base.runtime import available_ram
from fedharness.errors import ConfigError
from fedharness.problems.lazy import DEFAULT_EVAL_CLIENTS
from fedharness.problems.nets import build_net, count_params
from fedharness.problems.text_nets import TOKEN_MODELS
from fedharness.settings import PartSettings, RunSettings

# n_k ~ lognormal(4, 2) + 50 has mean exp(4 + 2^2 / 2) + 50 (Li et al.'s Synthetic).
SYNTHETIC_MEAN_SAMPLES = math.exp(6.0) + 50
SYNTHETIC_FEATURES, SYNTHETIC_CLASSES = 60, 10
IMAGE_SHAPES = {"digits": ((1, 8, 8), 10), "mnist": ((1, 28, 28), 10), "fashion_mnist": ((1, 28, 28), 10),
                "cifar10": ((3, 32, 32), 10)}
SERVER_COPIES = 4  # x, the aggregate, server optimizer state, the reference


def data_bytes(dataset: PartSettings, eval_clients: int | None = None) -> float:
    """The clients' arrays in float64 plus one copy in the run's dtype (counted as float64: an upper end)."""
    name, n = dataset.name, dataset.num_clients
    if name == "synthetic":
        size = dataset.samples_per_client or SYNTHETIC_MEAN_SAMPLES
        return 2 * n * size * (SYNTHETIC_FEATURES + 1) * 8
    if name == "synthetic_lazy":
        size = dataset.samples_per_client or SYNTHETIC_MEAN_SAMPLES
        evaluated = DEFAULT_EVAL_CLIENTS if eval_clients is None else eval_clients
        return min(n, evaluated) * size * (SYNTHETIC_FEATURES + 1) * 8
    if name == "blobs":
        return 2 * n * dataset.samples_per_client * 1.1 * (dataset.dim + 1) * 8
    if name == "quadratic":
        return 2 * n * (dataset.dim ** 2 + dataset.dim) * 8
    if name == "quadratic_lazy":
        return 0.0  # clients drawn when sampled: nothing stored per client
    if name == "li_toy":
        dim = n * dataset.block + 1
        return 2 * n * (dim ** 2 + dim) * 8
    return 0.0  # files on disk: their size does not depend on the config


def model_params(run: RunSettings) -> int:
    """Parameters of the model (0 where it cannot be told without the data)."""
    dataset, model = run.dataset, run.model.name
    if dataset.name in ("quadratic", "quadratic_lazy"):
        return dataset.dim
    if dataset.name == "li_toy":
        return dataset.num_clients * dataset.block + 1
    if dataset.name in ("synthetic", "synthetic_lazy"):
        shape, classes = (SYNTHETIC_FEATURES,), SYNTHETIC_CLASSES
    elif dataset.name == "blobs":
        shape, classes = (dataset.dim,), 2
    elif dataset.name in IMAGE_SHAPES:
        shape, classes = IMAGE_SHAPES[dataset.name]
    else:
        return 0
    if model in ("auto", "logreg", "linreg"):
        return (math.prod(shape) + 1) * classes
    if model in TOKEN_MODELS:  # these data sets have no token ids: the model's build names the mismatch
        return 0
    with torch.device("meta"):  # shapes only: nothing is allocated
        return count_params(build_net(model, shape, classes))


def check_memory(run: RunSettings) -> None:
    """Refuse settings whose arrays exceed the available memory, naming the key that dominates."""
    data = data_bytes(run.dataset, run.eval.clients)
    algorithm = run.algorithm
    batched = algorithm.clients_per_round if algorithm.sampler != "full" else run.dataset.num_clients
    batched = algorithm.clients_per_round if batched is None else batched  # null: the data's clients, unknown yet
    width = 8 if run.dtype == "float64" else 4
    models = run.replicas * (batched + SERVER_COPIES) * model_params(run) * width
    have = available_ram()
    if data + models <= have:
        return
    need = f"needs about {(data + models) / 2**30:.3g} GiB; {have / 2**30:.3g} GiB of memory is available"
    if data >= models:
        key = "dataset.num_clients"
        raise ConfigError(key, run.dataset.num_clients, f"too many clients for this machine: the data {need}")
    raise ConfigError("replicas", run.replicas, f"too many replicas for this machine: "
                      f"replicas x (clients per round + {SERVER_COPIES}) model copies {need}")
