"""One replica's client updates read a coordinate chunk at a time, so the driver aggregates within its budget.

An aggregator that sees the updates (contracts.UpdateAggregator) would hold every update as one float64 matrix
[n, dim], plus its sorted copy and the sort's indices: for ResNet-18 and 50 clients, 13 GB. One that also has
`aggregate_columns` (ColumnAggregator, algorithms/robust.py) reads `UpdateColumns.chunks()` instead: float64
blocks [n, width] of at most `memory_budget_gb` with their temporaries (WORKING_BYTES a row and coordinate).

Chunk widths are multiples of UNIT coordinates, and what a rule accumulates over coordinates (Krum's distances,
the clipped mean's norms) it accumulates unit by unit (`units()`), each unit a contiguous [n, UNIT] block: so the
budget changes how many units a chunk holds, never the bits of the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence, runtime_checkable

import torch

UNIT = 4096  # coordinates: the grain of every accumulation over coordinates
WORKING_BYTES = 32  # per row and coordinate: the float64 block, its sorted copy and the sort's int64 indices, a sum


@dataclass
class UpdateColumns:
    """n updates of dim coordinates (`rows`, any dtype, one per client in client-id order) read as float64
    blocks of `width` coordinates on `device`."""

    rows: Sequence[torch.Tensor]
    width: int
    device: torch.device | str = "cpu"

    @classmethod
    def whole(cls, updates: torch.Tensor) -> "UpdateColumns":
        """All of [n, dim] in one chunk (no budget)."""
        return cls(list(updates), max(1, updates.shape[1]), updates.device)

    @classmethod
    def within(cls, rows: Sequence[torch.Tensor], budget: int | None, device: torch.device | str) -> "UpdateColumns":
        """Chunks of as many UNITs as `budget` bytes hold (at least one; None: one chunk)."""
        dim = rows[0].shape[0]
        if budget is None:
            return cls(rows, max(1, dim), device)
        units = max(1, budget // (WORKING_BYTES * len(rows) * UNIT))
        return cls(rows, int(min(units * UNIT, max(1, dim))), device)

    @property
    def n(self) -> int:
        return len(self.rows)

    @property
    def dim(self) -> int:
        return self.rows[0].shape[0]

    def chunks(self) -> Iterator[tuple[slice, torch.Tensor]]:
        """(columns, [n, width] float64 contiguous) from the first coordinate to the last."""
        for start in range(0, self.dim, self.width):
            cols = slice(start, min(start + self.width, self.dim))
            yield cols, torch.stack([row[cols] for row in self.rows]).to(device=self.device, dtype=torch.float64)

    def units(self) -> Iterator[torch.Tensor]:
        """The contiguous [n, <= UNIT] blocks of every chunk, in coordinate order: the same blocks at any width."""
        for _, chunk in self.chunks():
            for start in range(0, chunk.shape[1], UNIT):
                yield chunk[:, start:start + UNIT].contiguous()

    def map(self, per_chunk: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """[dim] float64: per_chunk([n, width]) -> [width] for each chunk, side by side (a coordinate-wise rule)."""
        out = torch.empty(self.dim, dtype=torch.float64, device=self.device)
        for cols, chunk in self.chunks():
            out[cols] = per_chunk(chunk)
        return out


@runtime_checkable
class ColumnAggregator(Protocol):
    """An UpdateAggregator that also reads its updates a chunk at a time, with the bits `aggregate` gives."""

    def aggregate_columns(self, updates: UpdateColumns, weights: torch.Tensor) -> torch.Tensor:
        """One replica's Delta [dim] float64, as `aggregate` would give it for the whole matrix."""


@runtime_checkable
class KeyedAggregator(Protocol):
    """An UpdateAggregator that draws random numbers of its own (bucketing's permutation): core/updates.py hands it
    the replica's and round's stream key, so the draw is the same at any shard count and on resume. Only with
    bucket_size > 1: otherwise its `aggregate` (or `aggregate_columns`) needs no key."""

    bucket_size: int

    def aggregate_keyed(self, updates: torch.Tensor, weights: torch.Tensor, key) -> torch.Tensor:
        """`aggregate`, with `key` (a uint64 numpy scalar array, base/streams.py) for the rule's own draws."""
