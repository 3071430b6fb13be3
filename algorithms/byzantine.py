"""The Byzantine clients of a round and what they send (`attack=NAME`, `attack.fraction`): the attack as an update
stage (contracts.UpdateStage).

In each replica, floor(fraction n) of the n clients that returned are Byzantine: those with the smallest uniform of
the stream keyed by (seed, BYZANTINE, replica, round, client), ties to the lower id. The draw depends on nothing but
those keys and the set of returned clients, so the same clients are Byzantine with 1 shard or 16, inline or on Ray,
fresh or resumed. With `attack.fixed` the draw is once per replica instead, over the N training clients with round
key FIXED_ROUND (`fixed_byzantine`): those clients are Byzantine in every round they return, as the malicious
devices of Li et al. 2021. An attack that forges updates (contracts.Attack) replaces theirs at the driver, where the
shards' updates meet the aggregator (`on_updates`), so it needs an aggregator that sees them ("updates"); a data
poisoning attack (contracts.DataPoisoning: label_flip) has them train on its view of the data in the shards
(`client_work`) and needs what that view needs ("labels").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedharness.base import streams
from fedharness.contracts import Attack, ClientWork, DataPoisoning, Problem, RoundPlan, UpdateChunk, UpdateStage


@dataclass(frozen=True)
class Adversary(UpdateStage):
    """The run's attack and the share of each round's returned clients it controls."""

    attack: Attack
    fraction: float
    fixed: bool = False  # attack.fixed: the same clients every round (fixed_byzantine)
    clients: int = 0  # the training clients the fixed ones are drawn from

    def mask(self, seed: int, replica: int, rnd: int, ids: np.ndarray) -> np.ndarray:
        """[n] bool over `ids` (one replica's returned clients): the Byzantine ones of round `rnd`."""
        if self.fixed:
            return np.isin(ids, fixed_byzantine(self.fraction, seed, replica, self.clients))
        return byzantine_mask(self.fraction, seed, replica, rnd, ids)

    @property
    def flips_labels(self) -> bool:
        """Whether the Byzantine clients poison their training (label_flip) rather than forge their updates."""
        return isinstance(self.attack, DataPoisoning)

    @property
    def needs(self) -> frozenset[str]:  # type: ignore[override]
        return self.attack.needs if self.flips_labels else frozenset({"updates"})

    def client_work(self, plan: RoundPlan, counters) -> ClientWork | None:
        if not self.flips_labels:
            return None
        return PoisonedClients(byzantine_draws(self, plan), plan.clients, self.attack)

    def on_updates(self, plan: RoundPlan, updates: list[UpdateChunk]) -> list[UpdateChunk]:
        return updates if self.flips_labels else forge_updates(self, plan, updates)


@dataclass(frozen=True)
class PoisonedClients(ClientWork):
    """A round's Byzantine draws [R, K] (of the plan's clients [R, K]) that train on the attack's view."""

    poisoned: np.ndarray
    clients: np.ndarray
    attack: DataPoisoning

    @property
    def view(self) -> str:  # type: ignore[override]
        return self.attack.view

    def view_of(self, problem: Problem) -> Problem:
        return self.attack.view_of(problem)

    def chosen(self, replica: np.ndarray, clients: np.ndarray) -> np.ndarray:
        rows, cols = np.nonzero(self.poisoned)
        bad = set(zip(rows.tolist(), self.clients[rows, cols].tolist()))
        return np.array([(int(r), int(k)) in bad for r, k in zip(replica, clients)], dtype=bool)


def byzantine_mask(fraction: float, seed: int, replica: int, rnd: int, ids: np.ndarray) -> np.ndarray:
    """[n] bool over `ids` (one replica's returned clients): the floor(fraction n) Byzantine ones."""
    count = int(np.floor(fraction * len(ids) + 1e-9))  # 0.2 x 10 is 2, not 1.9999
    u = streams.uniform(streams.stream_key(seed, streams.BYZANTINE, replica, rnd, ids), 1)[:, 0]
    mask = np.zeros(len(ids), dtype=bool)
    mask[np.lexsort((ids, u))[:count]] = True
    return mask


FIXED_ROUND = -1  # attack.fixed's round key: no round of training has it


def fixed_byzantine(fraction: float, seed: int, replica: int, clients: int) -> np.ndarray:
    """attack.fixed: the floor(fraction N) Byzantine training clients of a replica, ascending (N = `clients`)."""
    ids = np.arange(clients)
    return ids[byzantine_mask(fraction, seed, replica, FIXED_ROUND, ids)]


def byzantine_draws(adversary: Adversary, plan: RoundPlan) -> np.ndarray:
    """[R, K] bool: the plan's draws that belong to a Byzantine client (every draw of one drawn twice)."""
    out = np.zeros(plan.clients.shape, dtype=bool)
    for r in range(len(plan.clients)):
        ids, _ = plan.returned(r)
        bad = adversary.mask(plan.replica_seed(r), int(plan.stream_replicas[r]), plan.round, ids)
        out[r] = np.isin(plan.clients[r], ids[bad]) & (plan.coef[r] != 0)
    return out


def forge_updates(adversary: Adversary, plan: RoundPlan, chunks: list[UpdateChunk]) -> list[UpdateChunk]:
    """The chunks with each replica's Byzantine rows replaced by what the attack sends (in place, rounded to the
    updates' dtype). Omniscient attacks see the replica's honest rows of the round."""
    where = {(int(r), int(k)): (c, i) for c, chunk in enumerate(chunks)
             for i, (r, k) in enumerate(zip(chunk.replica, chunk.clients))}
    for r in range(len(plan.clients)):
        ids, _ = plan.returned(r)
        seed, replica = plan.replica_seed(r), int(plan.stream_replicas[r])
        bad = adversary.mask(seed, replica, plan.round, ids)
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
