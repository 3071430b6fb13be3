"""The server's Delta from the clients' own updates, for an aggregator that sees them (contracts.UpdateAggregator).

The shards send each trained (replica, client) entry's Delta_k (core/executors.py, RoundPlan.send_updates) in
whatever order and grouping their shards and chunks gave; here they are put in one order, by (replica, client),
so the aggregate never depends on the number of shards, their chunks or the executor. An aggregator that reads
coordinate chunks (base/columns.py ColumnAggregator: the built-in robust rules) gets the rows as they came,
without a float64 copy of them all, in chunks that fit the memory budget; any other gets the [n, dim] matrix.
"""

from __future__ import annotations

import torch

from fedharness.base import streams
from fedharness.base.columns import ColumnAggregator, KeyedAggregator, UpdateColumns
from fedharness.contracts import RoundPlan, UpdateAggregator, UpdateChunk


def aggregate_updates(aggregator: UpdateAggregator, plan: RoundPlan, chunks: list[UpdateChunk],
                      x: torch.Tensor, budget: int | None = None) -> torch.Tensor:
    """Delta [R, dim] float64 on x's device: `aggregator.aggregate` of each replica's rows; 0 for a replica none of
    whose draws returned (dropout). `budget`: bytes the aggregation's working memory may use (None: no bound)."""
    R, dim = x.shape
    out = torch.zeros(R, dim, dtype=torch.float64, device=x.device)
    where = {(int(r), int(k)): (c, i) for c, chunk in enumerate(chunks)  # no concatenated copy of every update
             for i, (r, k) in enumerate(zip(chunk.replica, chunk.clients))}
    for r in range(R):
        ids, weights = plan.returned(r)
        if len(ids) == 0:
            continue
        missing = [int(k) for k in ids if (r, int(k)) not in where]
        if missing:  # a shard lost an entry: a bug, never a silently smaller sample
            raise RuntimeError(f"round {plan.round}: no update came back for replica {r}, clients {missing}")
        rows = [chunks[c].delta[i] for c, i in (where[(r, int(k))] for k in ids)]
        w = torch.as_tensor(weights, dtype=torch.float64, device=x.device)
        if isinstance(aggregator, KeyedAggregator) and aggregator.bucket_size > 1:  # bucketing: this replica's and round's draw
            key = streams.stream_key(plan.replica_seed(r), streams.BUCKETS, int(plan.stream_replicas[r]), plan.round, 0)
            out[r] = aggregator.aggregate_keyed(torch.stack(rows).to(device=x.device, dtype=torch.float64), w, key)
        elif isinstance(aggregator, ColumnAggregator):
            out[r] = aggregator.aggregate_columns(UpdateColumns.within(rows, budget, x.device), w)
        else:
            out[r] = aggregator.aggregate(torch.stack(rows).to(device=x.device, dtype=torch.float64), w)
    return out
