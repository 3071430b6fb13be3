"""A run's update stages in order (contracts.UpdateStage): what happens to the clients' updates between their
training and the server optimizer (docs/architecture.md, "Update stages").

    client work (in the shards, per update, in order)  ->  the shards' exact sums, or the updates themselves
    ->  on_updates (at the driver, in order; only with an aggregator that sees them)  ->  the aggregator
    ->  on_aggregate (in order)  ->  the server optimizer

The engine calls each of these once a round, whatever the stages are; with none, each is a no-op.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from fedharness.contracts import ClientWork, RoundPlan, UpdateChunk, UpdateStage


class Stages:
    """The run's stages, in the order its `stages` key gives."""

    def __init__(self, stages: Sequence[UpdateStage] = ()):
        self.stages = tuple(stages)

    def init_counters(self, replicas: int) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for stage in self.stages:
            out.update(stage.init_counters(replicas))
        return out

    def client_work(self, plan: RoundPlan, counters: Mapping[str, np.ndarray]) -> tuple[ClientWork, ...]:
        """Each stage's work in the shards this round, in order (the stages that have none left out)."""
        works = (stage.client_work(plan, counters) for stage in self.stages)
        return tuple(w for w in works if w is not None)

    def on_updates(self, plan: RoundPlan, updates: list[UpdateChunk]) -> list[UpdateChunk]:
        for stage in self.stages:
            updates = stage.on_updates(plan, updates)
        return updates

    def on_aggregate(self, plan: RoundPlan, delta: torch.Tensor, counts: Mapping[str, np.ndarray],
                     counters: dict[str, np.ndarray]) -> torch.Tensor:
        for stage in self.stages:
            delta = stage.on_aggregate(plan, delta, counts, counters)
        return delta

    def upload_bytes(self, dim: int, value_bytes: int) -> int:
        """The bytes one client's update takes as sent: the last stage that encodes it says (a compressor), else
        the dense update's dim x value_bytes."""
        size = dim * value_bytes
        for stage in self.stages:
            encoded = stage.upload_bytes(dim, value_bytes)
            size = size if encoded is None else int(encoded)
        return size

    def row_values(self, rounds: int) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for stage in self.stages:
            out.update(stage.row_values(rounds))
        return out
