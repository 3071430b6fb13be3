"""Compressed client updates: what each client sends in place of its update, and the bytes it takes.

An update stage (contracts.UpdateStage, `stages: [..., compress]`), chosen with `compress=NAME`. In the shards,
each trained client's update v (after the stages before it: DP's clipping) becomes C(v), which the server decodes;
the shards keep summing the decoded updates exactly (the same bits at any shard count), and `bytes_up` counts what
a deployment would send, `encoded_bytes` of each compressor (value_bytes: a float of the run's dtype, 4 in float32):

    topk     the k = round(ratio d) largest |v_i| (at least 1)   k (4 + value_bytes): int32 indices and values
    randomk  k coordinates drawn without replacement, unscaled   k value_bytes + 8: the values and the 8-byte seed
             (Stich et al. 2018's rand_k)                        the server draws the same coordinates from
    qsgd     ||v||_2 sign(v_i) l_i / s, l_i in 0..s rounded      value_bytes + ceil(d (1 + ceil(log2(s + 1))) / 8):
             stochastically, unbiased (Alistarh et al. 2017)     the norm once, a sign bit and a level a coordinate
    sign     (||v||_1 / d) sign(v_i), sign(0) = +1               value_bytes + ceil(d / 8): the scale and a bit a
             (Karimireddy et al. 2019's scaled sign)             coordinate

Error feedback (`compress.error_feedback=true`; Stich et al. 2018, Karimireddy et al. 2019, EF-SGD): the client
sends C(v + e) and keeps e' = v + e - C(v + e), its residual, which its shard keeps with its other state (as
SCAFFOLD's c_i): checkpointed, resumed, following the client at any shard count; a client's first residual is 0.
Residuals are kept only for clients that have taken part (assembly/build.py bounds them by memory_budget_gb).
Random draws come from the counter-based streams keyed by (seed, replica, round, client).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fedharness.base import streams
from fedharness.contracts import SHARDS, ClientSlot, ClientWork, Compressor, RoundPlan, UpdateStage
from fedharness.keys import integer, number
from fedharness.registry.groups import COMPRESSORS

RESIDUAL = "ef_residual"  # the name of each client's error-feedback residual in its shard's client state
INDEX_BYTES = 4  # a coordinate's index: int32
SEED_BYTES = 8  # random-k's coordinates: the server draws them from the same 64-bit seed

RATIO = {"ratio": number("the share k / d of the coordinates sent (k = ratio d rounded, at least 1)", lo=0, hi=1,
                         lo_open=True)}
LEVELS = {"levels": integer("s, the quantization levels above 0 of each |v_i| / ||v||_2", lo=1)}


def kept_count(ratio: float, dim: int) -> int:
    """k: ratio d rounded to the nearest integer, within 1..d."""
    return max(1, min(dim, round(ratio * dim)))


def tree_sums(x: torch.Tensor) -> torch.Tensor:
    """[m]: each row of x [m, n] summed by halves (zero-padded to a power of two, then x[:, :h] + x[:, h:] until one
    column is left): a fixed order, so the bits are a function of the row alone, which numpy reproduces term by
    term (torch's own reductions group terms as their vector width and thread count choose)."""
    size = 1 << max(0, (x.shape[1] - 1).bit_length())
    x = torch.nn.functional.pad(x, (0, size - x.shape[1]))
    while x.shape[1] > 1:
        half = x.shape[1] // 2
        x = x[:, :half] + x[:, half:]
    return x[:, 0]


def keep_columns(v: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """v with every entry but those at `index` [m, k] (per row) set to 0."""
    out = torch.zeros_like(v)
    return out.scatter_(1, index, v.gather(1, index))


@COMPRESSORS.register("topk", keys=RATIO)
@dataclass(frozen=True)
class TopK(Compressor):
    """Top-k sparsification: the k largest coordinates in absolute value (Stich et al. 2018)."""

    ratio: float

    def compress(self, v: torch.Tensor, keys: np.ndarray) -> torch.Tensor:
        return keep_columns(v, torch.topk(v.abs(), kept_count(self.ratio, v.shape[1]), dim=1).indices)

    def encoded_bytes(self, dim: int, value_bytes: int) -> int:
        return kept_count(self.ratio, dim) * (INDEX_BYTES + value_bytes)


@COMPRESSORS.register("randomk", keys=RATIO)
@dataclass(frozen=True)
class RandomK(Compressor):
    """Random-k sparsification: k coordinates drawn without replacement from the client's stream, unscaled."""

    ratio: float

    def compress(self, v: torch.Tensor, keys: np.ndarray) -> torch.Tensor:
        k = kept_count(self.ratio, v.shape[1])
        chosen = np.argpartition(streams.uniform(keys, v.shape[1]), k - 1, axis=1)[:, :k]  # the k smallest draws
        return keep_columns(v, torch.as_tensor(chosen, device=v.device))

    def encoded_bytes(self, dim: int, value_bytes: int) -> int:
        return kept_count(self.ratio, dim) * value_bytes + SEED_BYTES


@COMPRESSORS.register("qsgd", keys=LEVELS)
@dataclass(frozen=True)
class QSGD(Compressor):
    """QSGD's stochastic quantization to s levels (Alistarh et al. 2017): unbiased, the norm sent once."""

    levels: int

    def compress(self, v: torch.Tensor, keys: np.ndarray) -> torch.Tensor:
        norm = tree_sums(v * v).sqrt()[:, None]
        scaled = v.abs() / norm.clamp_min(torch.finfo(torch.float64).tiny) * self.levels  # in [0, s]
        low = scaled.floor()
        up = torch.as_tensor(streams.uniform(keys, v.shape[1]), device=v.device) < scaled - low
        return norm * v.sign() * (low + up) / self.levels

    def encoded_bytes(self, dim: int, value_bytes: int) -> int:
        return value_bytes + math.ceil(dim * (1 + math.ceil(math.log2(self.levels + 1))) / 8)


@COMPRESSORS.register("sign", keys={})
@dataclass(frozen=True)
class ScaledSign(Compressor):
    """Scaled sign (Karimireddy et al. 2019): one bit a coordinate and the mean |v_i| as the scale."""

    def compress(self, v: torch.Tensor, keys: np.ndarray) -> torch.Tensor:
        scale = (tree_sums(v.abs()) / v.shape[1])[:, None]
        return torch.where(v >= 0, scale, -scale)

    def encoded_bytes(self, dim: int, value_bytes: int) -> int:
        return value_bytes + math.ceil(dim / 8)


@dataclass(frozen=True)
class CompressUpdates(ClientWork):
    """The client side of a compressed round: each update replaced by what its client sends, decoded; with
    error feedback (`kept` set), the client's residual added first and the new one returned to be kept."""

    compressor: Compressor
    seed: int | np.ndarray  # the run's seed, or in a batch of slots each executor row's [R]
    stream_replicas: np.ndarray
    round: int
    kept: str | None = None

    def transform(self, delta: torch.Tensor, replica: np.ndarray, clients: np.ndarray, *kept: list) -> tuple:
        seed = self.seed if np.ndim(self.seed) == 0 else np.asarray(self.seed)[replica]
        keys = streams.stream_key(seed, streams.COMPRESS, self.stream_replicas[replica], self.round, clients)
        v = delta if not kept else with_residuals(delta, kept[0])
        sent = self.compressor.compress(v, np.broadcast_to(keys, (len(clients),)))
        if not kept:
            return sent, {}
        return sent, {}, v - sent  # what the compression left out: exact where it keeps v's own entries


def with_residuals(delta: torch.Tensor, residuals: list) -> torch.Tensor:
    """delta [m, dim] float64 plus each entry's kept residual (None: a client's first round, nothing kept), added
    row by row into one copy: a stacked [m, dim] temporary cost more than the additions (the allocator returns
    and pages in its megabytes every round)."""
    if all(r is None for r in residuals):
        return delta
    v = delta.clone()
    for row, r in zip(v, residuals):
        if r is not None:
            row.add_(r.to(delta.device))
    return v


@dataclass(frozen=True)
class Compression(UpdateStage):
    """Compressed client updates as an update stage: `compressor`, with or without error feedback."""

    compressor: Compressor
    error_feedback: bool = False
    place = SHARDS  # each update compressed in its shard alone (its residual is the client's own slot)

    def client_slots(self, problem) -> tuple[ClientSlot, ...]:
        """Error feedback's residual: float64 [dim] a client, none before its first round (KeepsClientState)."""
        return (ClientSlot(RESIDUAL, (problem.dim,), torch.float64),) if self.error_feedback else ()

    def client_work(self, plan: RoundPlan, counters) -> CompressUpdates:
        return CompressUpdates(self.compressor, plan.seed, plan.stream_replicas, plan.round,
                               RESIDUAL if self.error_feedback else None)

    def upload_bytes(self, dim: int, value_bytes: int) -> int:
        return int(self.compressor.encoded_bytes(dim, value_bytes))
