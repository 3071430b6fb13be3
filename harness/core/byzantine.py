"""The Byzantine clients of a round and their forged updates (`attack=NAME`, `attack.fraction`).

In each replica, floor(fraction n) of the n clients that returned are Byzantine: those with the smallest uniform of
the stream keyed by (seed, BYZANTINE, replica, round, client), ties to the lower id. The draw depends on nothing
but those keys and the set of returned clients, so the same clients are Byzantine with 1 shard or 16, inline or on
Ray, fresh or resumed. Their updates are replaced here, in the driver, where the shards' updates meet the
aggregator (core/updates.py), so an attack needs an aggregator that sees the updates (the config refuses others).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedharness.base import streams
from fedharness.contracts import Attack
from fedharness.core.executors import RoundPlan, UpdateChunk
from fedharness.core.updates import client_rows, replica_seed


@dataclass(frozen=True)
class Adversary:
    """The run's attack and the share of each round's returned clients it controls."""

    attack: Attack
    fraction: float
    flips_labels: bool = False  # label_flip: the Byzantine clients train on flipped labels and send that update


def byzantine_mask(fraction: float, seed: int, replica: int, rnd: int, ids: np.ndarray) -> np.ndarray:
    """[n] bool over `ids` (one replica's returned clients): the floor(fraction n) Byzantine ones."""
    count = int(np.floor(fraction * len(ids) + 1e-9))  # 0.2 x 10 is 2, not 1.9999
    u = streams.uniform(streams.stream_key(seed, streams.BYZANTINE, replica, rnd, ids), 1)[:, 0]
    mask = np.zeros(len(ids), dtype=bool)
    mask[np.lexsort((ids, u))[:count]] = True
    return mask


def byzantine_draws(adversary: Adversary, plan: RoundPlan) -> np.ndarray:
    """[R, K] bool: the plan's draws that belong to a Byzantine client (every draw of one drawn twice)."""
    out = np.zeros(plan.clients.shape, dtype=bool)
    for r in range(len(plan.clients)):
        ids, _ = client_rows(plan, r)
        bad = byzantine_mask(adversary.fraction, replica_seed(plan, r), int(plan.stream_replicas[r]), plan.round, ids)
        out[r] = np.isin(plan.clients[r], ids[bad]) & (plan.coef[r] != 0)
    return out


def forge_updates(adversary: Adversary, plan: RoundPlan, chunks: list[UpdateChunk]) -> list[UpdateChunk]:
    """The chunks with each replica's Byzantine rows replaced by what the attack sends (in place, rounded to the
    updates' dtype). Omniscient attacks see the replica's honest rows of the round."""
    where = {(int(r), int(k)): (c, i) for c, chunk in enumerate(chunks)
             for i, (r, k) in enumerate(zip(chunk.replica, chunk.clients))}
    for r in range(len(plan.clients)):
        ids, _ = client_rows(plan, r)
        seed, replica = replica_seed(plan, r), int(plan.stream_replicas[r])
        bad = byzantine_mask(adversary.fraction, seed, replica, plan.round, ids)
        if not bad.any():
            continue
        spots = [where[(r, int(k))] for k in ids]
        rows = torch.stack([chunks[c].delta[i] for c, i in spots]).double()
        keys = streams.stream_key(seed, streams.ATTACK_NOISE, replica, plan.round, ids[bad])
        take = torch.as_tensor(bad)
        forged = adversary.attack.forge(rows[take], rows[~take], keys)
        for j, (c, i) in enumerate(s for s, b in zip(spots, bad) if b):
            chunks[c].delta[i] = forged[j].to(chunks[c].delta.dtype)
    return chunks
