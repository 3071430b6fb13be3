"""Problems: a dataset split across clients plus a model and loss, or an analytic objective.

`build_problem` is the one place the settings become a Problem. Every data set, model and partitioner is an option
of its registry (fedharness.registry.groups: DATASETS, MODELS, PARTITIONERS), registered beside its definition
with its keys, as a user's is (fedharness.extend), and built by signature binding: its factory is called with the
keys of its config section and the context values below that its parameters name.

* a data set's context: `seed` (the data's: dataset.data_seed, else the run's), `run_seed`, `batch_size`,
  `dtype`, `device`, `memory_budget` (bytes) and `model(in_shape, num_classes)`, the Model the config names. It
  returns a Problem (the analytic and lazily generated data sets), PooledData (samples a partitioner splits), or,
  a user's, its (train, test) pair.
* a model's: `in_shape` and `num_classes`. It returns a Model, or an nn.Module made a NetObjective here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedharness.contracts import ClientEvaluation, Model, Problem
# The modules that register the built-ins, in the order `fedharness list` shows them.
from fedharness.problems import objectives, nets, text_nets  # noqa: F401  (objectives first: auto, logreg, linreg)
from fedharness.problems import synthetic, lazy, blobs, quadratic, quadratic_lazy, li_toy, loaders  # noqa: F401
from fedharness.problems import leaf, tff, hf  # noqa: F401  (federated files: natural clients)
from fedharness.problems.client_eval import client_test_index
from fedharness.problems.data import DataProblem, eval_sample_size
from fedharness.problems.federated import select_owners
from fedharness.problems.nets import require_net
from fedharness.problems.quadratic import QuadraticProblem
from fedharness.problems.unseen import unseen_order
from fedharness.problems.objectives import NetObjective, refuse_linear_on_tokens
from fedharness.problems.pooled import PooledData
from fedharness.problems.user import user_pooled
from fedharness.base.runtime import autocast_dtype, memory_budget_bytes
from fedharness.errors import ConfigError, require
from fedharness.partitions import partition
from fedharness.registry.groups import DATASETS, MODELS
from fedharness.settings import RunSettings

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def build_model(settings: RunSettings, in_shape: tuple[int, ...], num_classes: int, tokens: bool = False,
                token_vocab: int | None = None) -> Model:
    """The Model `settings.model` names, for samples of shape `in_shape` and `num_classes` classes; `tokens`: the
    samples are int64 token ids (a text data set's), which a network takes as they are, `token_vocab` of them
    (a model naming a token_vocab parameter gets it: an embedding's rows)."""
    option = settings.model
    made = MODELS.build(option.name, option.params,
                        {"in_shape": in_shape, "num_classes": num_classes, "token_vocab": token_vocab})
    if isinstance(made, Model):
        if tokens:
            refuse_linear_on_tokens(made, option.name)
        return made
    net = require_net(option.name, made)
    kernel = "vmap" if settings.kernel == "auto" else settings.kernel  # auto: core/kernels.py resolves it for the run
    return NetObjective(net, option.name, option.params.get("l2", 0.0), in_shape, autocast_dtype(settings.precision),
                        kernel, option.params.get("buffers", "average"),  # a `_target_` model may leave these out
                        tokens, option.params.get("head"))


def _partition_name(settings: RunSettings, pooled: PooledData) -> str:
    """`partition=auto` is natural where the data has owners, else iid."""
    name = settings.partition.name
    return name if name != "auto" else ("natural" if pooled.owner is not None else "iid")


def _clients(settings: RunSettings, pooled: PooledData, seed: int) -> tuple[PooledData, int]:
    """The samples a run splits and its number of clients: under partition=natural, dataset.num_clients of the
    data's owners (drawn by the data seed) or all of them (null); another partition makes num_clients clients,
    null: as many as the data has owners."""
    count = settings.dataset.num_clients
    if _partition_name(settings, pooled) == "natural":
        if pooled.owner is None:
            raise ConfigError("partition", "natural", f"dataset {settings.dataset.name} gives no owner per sample: "
                              "its factory returns (x, y, owner) triples for natural clients; or one of: "
                              "iid, classes_per_client, shards, dirichlet, powerlaw")
        return (pooled, len(np.unique(pooled.owner))) if count is None else (select_owners(pooled, count, seed), count)
    return pooled, len(np.unique(pooled.owner)) if count is None else count


def _partition(settings: RunSettings, pooled: PooledData, num_clients: int, seed: int) -> list:
    """The clients' sample indices."""
    name = _partition_name(settings, pooled)
    params = {k: v for k, v in settings.partition.params.items() if k != "_target_"}
    if name == "natural":  # harness/config/schema.py refuses it for the built-in data sets without owners
        params["client_ids"] = pooled.owner
    return partition(name, pooled.y, num_clients, seed, **params)


def build_problem(settings: RunSettings, batch_size: int) -> Problem:
    """The Problem of validated settings, built with its `memory_budget` in bytes (`memory_budget_gb`; executors
    and evaluation split their batches to fit it). The schema has checked every key and the rules between them
    (e.g. the analytic data sets are their own model)."""
    option = settings.dataset
    seed = settings.data_seed
    dtype = DTYPES[settings.dtype]
    budget = memory_budget_bytes(settings.memory_budget_gb, torch.device(settings.device))
    context: dict[str, Any] = {
        "seed": seed, "run_seed": settings.seed, "batch_size": batch_size, "dtype": dtype, "device": settings.device,
        "memory_budget": budget, "model": lambda in_shape, num_classes: build_model(settings, in_shape, num_classes),
        "eval_clients": settings.eval.clients}
    made = DATASETS.build(option.name, option.params, context)
    unseen = option.params.get("unseen_clients") or 0
    if isinstance(made, Problem):
        require(not settings.eval.per_client or isinstance(made, ClientEvaluation), "eval.per_client", True,
                f"false: dataset={option.name} has no held-out data per client (per-client evaluation needs a data "
                "set with a test set)")
        require(not unseen or isinstance(made, QuadraticProblem), "dataset.unseen_clients", unseen,
                f"0: dataset={option.name} cannot set clients apart (quadratic and the data sets of samples can)")
        return made.unseen_last(*unseen_order(seed, made.num_clients, unseen)) if unseen else made
    pooled = made if isinstance(made, PooledData) else user_pooled(option.name, made)
    pooled, num_clients = _clients(settings, pooled, seed)
    y, yt = pooled.y, pooled.y_test
    # integer samples without a pixel scale are token ids (a text task's): int64 from a user, uint8 from a loader
    tokens = np.issubdtype(pooled.x.dtype, np.integer) and pooled.x_scale is None
    # the largest token id, read once (a pass over every sample) and only where a fallback below needs it
    unknown = pooled.num_classes is None or pooled.token_vocab is None
    top_token = int(max(a.max() for a in (pooled.x, pooled.x_test) if a is not None)) if tokens and unknown else -1
    num_classes = pooled.num_classes  # a data set that knows its classes (a vocabulary) says so
    if num_classes is None:  # a user data set may have no test; a vocabulary covers the input tokens too
        num_classes = max(top_token, *(int(a.max()) for a in (y, yt) if a is not None)) + 1
    token_vocab = pooled.token_vocab  # a loader's vocabulary; a user's token ids: the largest + 1
    if tokens and token_vocab is None:
        token_vocab = top_token + 1
    objective = build_model(settings, tuple(pooled.x.shape[1:]), num_classes, tokens, token_vocab)
    index = _partition(settings, pooled, num_clients, seed)
    order, training = unseen_order(seed, num_clients, unseen)
    held_out = _held_out(settings, pooled, index, seed)
    index = [index[k] for k in order]  # the unseen clients numbered last (problems/unseen.py)
    held_out = None if held_out is None else [held_out[k] for k in order]
    samples = eval_sample_size(settings.eval.samples, sum(len(ix) for ix in index[:training]))
    problem = DataProblem(objective, pooled.x, y, index, pooled.x_test, yt, batch_size, dtype, settings.device,
                          budget, held_out, x_scale=pooled.x_scale,
                          eval_samples=samples, eval_seed=seed, training_clients=training if unseen else None)
    names = _client_names(settings, pooled)
    problem.client_names = None if names is None else [names[k] for k in order]
    return problem


def _client_names(settings: RunSettings, pooled: PooledData) -> list[str] | None:
    """Each client's owner where clients are named owners (partition=natural: client i is the i-th owner in sorted
    code order, partitions/core.py natural); None otherwise."""
    if pooled.owner_names is None or _partition_name(settings, pooled) != "natural":
        return None
    return [str(pooled.owner_names[code]) for code in np.unique(pooled.owner)]


def _held_out(settings: RunSettings, pooled: PooledData, index: list, seed: int) -> list | None:
    """eval.per_client's held-out samples of each client (problems/client_eval.py); None when it is off."""
    per_client, count = settings.eval.per_client, settings.eval.clients
    if not per_client:
        return None
    require(pooled.y_test is not None, "eval.per_client", True,
            f"false: dataset={settings.dataset.name} has no test set to hold out per client")
    require(count is None or count <= len(index), "eval.clients", count,
            f"null (every client) or at most the {len(index)} clients")
    return client_test_index(pooled, index, _partition_name(settings, pooled) == "natural", seed)
