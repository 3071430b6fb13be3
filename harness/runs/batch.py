"""Which runs can train as one batch: several runs that differ only in batchable keys (step sizes, E, mu, momenta,
schedule parameters, seed), one slot of the replica axis per run (docs/tuning.md, Batched trials), and the settings
the batch is built from. harness/runs/execute.py trains and records them (a solo run is a batch of one slot).

Each slot is recorded as its own run in runs/ and rounds/, exactly as if run alone, plus the `batch_id` of the
batch it ran in. A slot that diverges, is pruned (its reporter raises optuna.TrialPruned), fails, or finishes
its rounds leaves the batch without disturbing the others.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from fedharness.algorithms.solvers import PER_COPY, LocalSGD
from fedharness.contracts import Callback
from fedharness.base.mappings import differences
from fedharness.config.schema import batchable_keys
from fedharness.errors import ConfigError, require
from fedharness.settings import PartSettings, RunSettings

# The keys a slot may set on its own; every other key must be equal across the slots of one batch.
# (`seed` also picks the data unless dataset.data_seed is set, so slots of different seeds share a batch only then.)
BATCHABLE_KEYS = batchable_keys()  # declared on their Keys: Key(..., batchable=True)
# Recorded per run but no part of what is computed: the study, a tuning trial's number, its W&B tag `trial=<n>`.
RECORDED_PER_SLOT = ("study", "trial", "wandb.tags")


@dataclass
class Slot:
    """One run of a batch: its settings as if run alone, its run id (default: a new one), `on_eval(rows, state)`
    after each evaluation, a user's `callbacks` (named in its runs/ row) and the caller's own `hooks` (a tuner's
    reporter, a progress bar). An exception from any of them ends this slot only: status pruned for
    optuna.TrialPruned, else failed."""

    settings: RunSettings
    run_id: str | None = None
    on_eval: Callable[[list[dict], Any], None] | None = None
    callbacks: Sequence[Callback] = ()
    hooks: Sequence[Callback] = ()


def batch_key(settings: RunSettings) -> str:
    """The run's config without the keys a slot may set on its own, as text: runs with equal keys can share a
    batch. The data seed stays in it (the run's seed where dataset.data_seed is null)."""
    config = copy.deepcopy(settings.config)
    if isinstance(config.get("dataset"), dict) and config["dataset"].get("data_seed") is None:
        config["dataset"]["data_seed"] = settings.seed
    for dotted in (*BATCHABLE_KEYS, *RECORDED_PER_SLOT):
        *parents, leaf = dotted.split(".")
        node = config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return json.dumps(config, sort_keys=True, default=str)


def batchable(a: RunSettings, b: RunSettings) -> bool:
    """Whether the two runs can train in one batch."""
    return batch_key(a) == batch_key(b)


def check_batch(settings: Sequence[RunSettings]) -> None:
    """ConfigError naming the first key that keeps these runs from one batch."""
    first = settings[0]
    key = batch_key(first)
    for s in settings:
        require(s.checkpoint_every == 0, "checkpoint_every", s.checkpoint_every,
                "0 in a batched run (a batch is not checkpointed; run it alone to checkpoint)")
        require(s.resume is None, "resume", s.resume, "null in a batched run (a batch is not checkpointed)")
        params = s.algorithm.params
        require(params.get("rr", "none") == "none", "algorithm.rr", params.get("rr"),
                "none in a batched run (Richardson-Romberg couples replicas; run it alone)")
        require(not params.get("average", False), "algorithm.average", params.get("average"),
                "false in a batched run (run Polyak averaging alone)")
        require(not params.get("last_two", False), "algorithm.last_two", params.get("last_two"),
                "false in a batched run (series are a run's alone; FedExP's rows then hold its iterate only)")
        require(s.dp.target_epsilon is None or s.rounds == first.rounds, "rounds", s.rounds,
                f"equal in every run of a batch with dp.target_epsilon (the first has {first.rounds}): the noise "
                "multiplier is calibrated to the rounds")
        if batch_key(s) != key:
            raise _refusal(first, s)


def _refusal(first: RunSettings, other: RunSettings) -> ConfigError:
    """The error naming the first key that keeps `other` out of `first`'s batch."""
    for key, value0, value in differences(first.config, other.config):
        if key not in BATCHABLE_KEYS and key not in RECORDED_PER_SLOT:
            return ConfigError(key, value, f"equal in every run of a batch (the first has {value0!r}); only "
                                           f"{', '.join(BATCHABLE_KEYS)} may differ")
    # Equal configs but for the seed, which also picks the data while dataset.data_seed is null.
    return ConfigError("seed", other.seed, f"equal in every run of a batch (the first has {first.seed}) while "
                                           "dataset.data_seed is null, since the seed then also draws the data; "
                                           "set dataset.data_seed (e.g. dataset.data_seed=0) to batch runs that "
                                           "differ only in seed")


def batch_settings(settings: Sequence[RunSettings]) -> RunSettings:
    """The settings the batch is built from (problem, threads, kernel, reference, the shards' solver): the first
    slot's, with every slot's replicas, the most rounds, and each per-copy solver key at its largest value (a solo
    run's own)."""
    if len(settings) == 1:
        return settings[0]
    algorithm = settings[0].algorithm.as_dict()
    for name in PER_COPY:
        if name in algorithm:
            algorithm[name] = max(s.algorithm.params[name] for s in settings)
    return settings[0].replace(replicas=sum(s.replicas for s in settings), rounds=max(s.rounds for s in settings),
                               algorithm=PartSettings.of(algorithm))


def per_copy_values(settings: Sequence[RunSettings], trainer) -> dict[str, np.ndarray]:
    """Each per-copy solver key whose value differs across the slots: [slots] values."""
    out = {}
    for name in PER_COPY:
        values = [s.algorithm.params.get(name) for s in settings]
        if values[0] is not None and len(set(values)) > 1:
            require(isinstance(trainer, LocalSGD), f"algorithm.{name}", values,
                    f"equal in every slot: solver {settings[0].algorithm.params.get('solver')} takes no per-copy "
                    f"{name}")
            out[name] = np.array(values, dtype=np.float64)
    return out
