"""The server's Delta from the clients' own updates, for an aggregator that sees them (contracts.UpdateAggregator).

The shards send each trained (replica, client) entry's Delta_k (core/executors.py, RoundPlan.send_updates) in
whatever order and grouping their shards and chunks gave; here they are put in one order, by (replica, client),
so the aggregate never depends on the number of shards, their chunks or the executor. An aggregator that reads
coordinate chunks (base/columns.py ColumnAggregator: the built-in robust rules) gets the rows as they came,
without a float64 copy of them all, in chunks that fit the memory budget; any other gets the [n, dim] matrix.
"""

from __future__ import annotations

import numpy as np
import torch

from fedharness.base import streams
from fedharness.base.columns import ColumnAggregator, KeyedAggregator, UpdateColumns
from fedharness.contracts import UpdateAggregator
from fedharness.core.executors import RoundPlan, UpdateChunk


def client_rows(plan: RoundPlan, r: int) -> tuple[np.ndarray, np.ndarray]:
    """Replica r's clients that returned (coefficient != 0), ascending, and each one's weight: the sum of its
    draws' coefficients (a client drawn twice, or a dropped draw re-pointed at it, is one update)."""
    kept = plan.coef[r] != 0
    ids, inverse = np.unique(plan.clients[r][kept], return_inverse=True)
    return ids, np.bincount(inverse, weights=plan.coef[r][kept], minlength=len(ids))


def replica_seed(plan: RoundPlan, r: int) -> int:
    """Replica r's seed: the run's, or its slot's in a batch of slots."""
    return int(plan.seed) if np.ndim(plan.seed) == 0 else int(plan.seed[r])


def aggregate_updates(aggregator: UpdateAggregator, plan: RoundPlan, chunks: list[UpdateChunk],
                      x: torch.Tensor, budget: int | None = None) -> torch.Tensor:
    """Delta [R, dim] float64 on x's device: `aggregator.aggregate` of each replica's rows; 0 for a replica none of
    whose draws returned (dropout). `budget`: bytes the aggregation's working memory may use (None: no bound)."""
    R, dim = x.shape
    out = torch.zeros(R, dim, dtype=torch.float64, device=x.device)
    where = {(int(r), int(k)): (c, i) for c, chunk in enumerate(chunks)  # no concatenated copy of every update
             for i, (r, k) in enumerate(zip(chunk.replica, chunk.clients))}
    for r in range(R):
        ids, weights = client_rows(plan, r)
        if len(ids) == 0:
            continue
        missing = [int(k) for k in ids if (r, int(k)) not in where]
        if missing:  # a shard lost an entry: a bug, never a silently smaller sample
            raise RuntimeError(f"round {plan.round}: no update came back for replica {r}, clients {missing}")
        rows = [chunks[c].delta[i] for c, i in (where[(r, int(k))] for k in ids)]
        w = torch.as_tensor(weights, dtype=torch.float64, device=x.device)
        if isinstance(aggregator, KeyedAggregator) and aggregator.bucket_size > 1:  # bucketing: this replica's and round's draw
            key = streams.stream_key(replica_seed(plan, r), streams.BUCKETS, int(plan.stream_replicas[r]), plan.round, 0)
            out[r] = aggregator.aggregate_keyed(torch.stack(rows).to(device=x.device, dtype=torch.float64), w, key)
        elif isinstance(aggregator, ColumnAggregator):
            out[r] = aggregator.aggregate_columns(UpdateColumns.within(rows, budget, x.device), w)
        else:
            out[r] = aggregator.aggregate(torch.stack(rows).to(device=x.device, dtype=torch.float64), w)
    return out
