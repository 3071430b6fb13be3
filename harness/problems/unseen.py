"""dataset.unseen_clients: a seeded share of the clients never sampled for training, evaluated apart (the
participation gap of Yuan et al., ICLR 2022; docs/results.md, Unseen clients).

floor(fraction N) clients, drawn uniformly by the data seed, leave the training population. They are numbered last:
client ids 0..N_train-1 are the training clients in their partition order, N_train..N-1 the unseen ones in theirs,
so the samplers draw from ids below N_train (contracts.training_clients) with the weights renormalized over them,
and the objective (train_loss, F*, w*, subopt, dist_to_opt) is the training clients' alone. Per-client evaluation
scores the unseen clients with every protocol and records them in unseen_client_* columns.
"""

from __future__ import annotations

import math

import numpy as np

from fedharness.base import streams


def unseen_order(seed: int, num_clients: int, fraction: float) -> tuple[np.ndarray, int]:
    """The clients in their new numbering (training ones first, then the unseen, each in ascending order) and how
    many train: a pure function of (data seed, N, fraction)."""
    unseen = math.floor(fraction * num_clients)
    keys = streams.uniform(streams.stream_key(seed, streams.UNSEEN, 0, 0, 0), num_clients)
    left = np.zeros(num_clients, dtype=bool)
    left[np.argsort(keys, kind="stable")[:unseen]] = True
    order = np.concatenate([np.flatnonzero(~left), np.flatnonzero(left)]).astype(np.int64)
    return order, num_clients - unseen
