"""Aggregators that see the updates (contracts.UpdateAggregator): robust and clipped rules.

Each receives one replica's updates [n, dim] float64, one row per sampled client that returned, ordered by
client id, and their weights c_k (the sum of the client's draws' q_k, as FedAvg gives them). Median, trimmed
mean and Krum treat every returned client alike, as the Byzantine-robust literature does (scheme I's draws,
proportional to p_k, carry the data weights); the clipped mean keeps FedAvg's weights.

The geometric median (RFA) and centered clipping need whole vectors at every iteration, so they hold a replica's
updates in memory (no column chunks). These two, the median, the trimmed mean and Krum may first average random
buckets of `bucket_size` updates (Karimireddy, He and Jaggi 2022; the bucketed rule then holds the replica's updates
in memory too): the permutation is drawn from the replica's and round's stream (core/updates.py
hands the key: base/columns.py KeyedAggregator), so it is the same at any shard count and on resume.

The coordinate-wise rules, Krum and the clipped mean also read their updates a coordinate chunk at a time (`aggregate_columns`, base/columns.py), so the driver
aggregates within memory_budget_gb: median and trimmed mean per chunk; Krum's distances and the clipped mean's
norms accumulated unit by unit, then a second pass for the average. A column's sums add rows one after the other
(`_row_sum`), so the result has the same bits at any chunk width, and `aggregate` is the one-chunk case.
"""

from __future__ import annotations

from abc import abstractmethod

import numpy as np
import torch

from fedharness.algorithms.aggregators import WeightedAverage
from fedharness.base import streams
from fedharness.base.columns import UpdateColumns
from fedharness.contracts import Coefficients, UpdateAggregator, WeightStats
from fedharness.registry.groups import part
from fedharness.keys import Key, integer, number

KEYS: dict[str, Key] = {
    "trim": number("trimmed_mean: fraction of the updates dropped at each end, per coordinate", lo=0, hi=0.5,
                   hi_open=True),
    "byzantine": integer("krum: f, the Byzantine clients tolerated (a score sums n - f - 2 distances)", lo=0),
    "krum_select": integer("krum: m, the best-scored updates averaged (1: Krum, > 1: multi-Krum)", lo=1),
    "clip_norm": number("clipped_mean: each update clipped to this l2 norm before FedAvg's weighted sum", lo=0,
                        lo_open=True),
    "rfa_iters": integer("geometric_median: smoothed Weiszfeld iterations (Pillutla et al.)", lo=1),
    "rfa_nu": number("geometric_median: the smoothing nu, a floor on each distance", lo=0, lo_open=True),
    "cc_tau": number("centered_clip: the clipping radius tau around the center", lo=0, lo_open=True),
    "cc_iters": integer("centered_clip: clipping iterations L", lo=1),
    "bucket_size": integer("median, trimmed_mean, krum, geometric_median, centered_clip: average random buckets "
                           "of s updates first (Karimireddy et al. 2022); 1: no bucketing", lo=1),
}


def _sorted(updates: torch.Tensor) -> torch.Tensor:
    return torch.sort(updates, dim=0).values


def _row_sum(rows: torch.Tensor) -> torch.Tensor:
    """Sum over rows, one row after the other: elementwise additions, so a column's bits do not depend on how
    many columns are summed beside it (torch's reductions change their order with the width)."""
    total = rows[0].clone()
    for row in rows[1:]:
        total += row
    return total


class FedAvgWeights(UpdateAggregator):
    """Hands `aggregate` FedAvg's weights q_k, and records FedAvg's diagnostics of them (tau_eff, chi2, slowdown:
    the local work's, whatever the rule then does with the updates)."""

    def coefficients(self, q: np.ndarray, stats: WeightStats, tau: np.ndarray) -> Coefficients:
        return WeightedAverage().coefficients(q, stats, tau)


@part("aggregator", "mean")
class WeightedMean(FedAvgWeights):
    """FedAvg's Delta = sum_k c_k Delta_k from the updates themselves, at the server: the baseline an attack that
    forges updates at the server (algorithms/byzantine.py) is compared with (fedavg reduces them on the shards)."""

    def aggregate(self, updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.aggregate_columns(UpdateColumns.whole(updates), weights)

    def aggregate_columns(self, updates: UpdateColumns, weights: torch.Tensor) -> torch.Tensor:
        factor = weights.to(torch.float64)[:, None]
        return updates.map(lambda chunk: _row_sum(factor * chunk))


class OnBuckets:
    """Optional bucketing (Karimireddy et al. 2022) for a rule whose `aggregate` reads [n, dim]: with a key (core/
    updates.py hands one when bucket_size > 1), the rule runs on the means of random buckets of the updates."""

    bucket_size = 1

    def aggregate_keyed(self, updates: torch.Tensor, weights: torch.Tensor, key) -> torch.Tensor:
        return self.aggregate(*bucket(updates, weights, self.bucket_size, key))


@part("aggregator", "median")
class CoordinateMedian(OnBuckets, FedAvgWeights):
    """Coordinate-wise median (Yin et al. 2018); an even count takes the mean of the two middle values."""

    def __init__(self, bucket_size: int = 1):
        self.bucket_size = int(bucket_size)

    def aggregate(self, updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.aggregate_columns(UpdateColumns.whole(updates), weights)

    def aggregate_columns(self, updates: UpdateColumns, weights: torch.Tensor) -> torch.Tensor:
        return updates.map(self._median)

    @staticmethod
    def _median(chunk: torch.Tensor) -> torch.Tensor:
        s, n = _sorted(chunk), len(chunk)
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


@part("aggregator", "trimmed_mean")
class TrimmedMean(OnBuckets, FedAvgWeights):
    """Coordinate-wise trimmed mean (Yin et al. 2018): per coordinate, the floor(trim n) largest and smallest
    values are dropped and the rest averaged."""

    def __init__(self, trim: float = 0.1, bucket_size: int = 1):
        self.trim, self.bucket_size = float(trim), int(bucket_size)

    def aggregate(self, updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.aggregate_columns(UpdateColumns.whole(updates), weights)

    def aggregate_columns(self, updates: UpdateColumns, weights: torch.Tensor) -> torch.Tensor:
        n = updates.n
        cut = int(self.trim * n)  # trim < 0.5, so at least one value is left
        return updates.map(lambda chunk: _row_sum(_sorted(chunk)[cut:n - cut]) / (n - 2 * cut))


@part("aggregator", "krum")
class Krum(OnBuckets, FedAvgWeights):
    """Krum / multi-Krum (Blanchard et al. 2017): each update's score is the sum of its squared distances to its
    n - f - 2 nearest others; the mean of the m best-scored updates (ties: the lower row) is the Delta.

    A round with fewer updates than that needs (dropout, duplicate draws) is not refused mid-run: as Flower's
    Krum does, a score then sums the nearest max(1, n - f - 2) distances, and min(m, n) updates are averaged.
    """

    def __init__(self, byzantine: int = 0, krum_select: int = 1, bucket_size: int = 1):
        self.f, self.m, self.bucket_size = int(byzantine), int(krum_select), int(bucket_size)

    def aggregate(self, updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.aggregate_columns(UpdateColumns.whole(updates), weights)

    def aggregate_columns(self, updates: UpdateColumns, weights: torch.Tensor) -> torch.Tensor:
        n = updates.n
        near = min(max(1, n - self.f - 2), n - 1)  # n = 1: no other update, score 0
        gram = torch.zeros(n, n, dtype=torch.float64, device=updates.device)
        for unit in updates.units():  # the distances accumulate unit by unit: the same bits at any chunk width
            gram += unit @ unit.T
        sq = gram.diagonal()
        dist = (sq[:, None] + sq[None, :] - 2 * gram).clamp_min(0)
        dist.fill_diagonal_(float("inf"))  # an update is not its own neighbour
        scores = torch.sort(dist, dim=1).values[:, :near].sum(1)
        best = torch.argsort(scores, stable=True)[:self.m]
        return updates.map(lambda chunk: _row_sum(chunk[best]) / len(best))


@part("aggregator", "clipped_mean")
class ClippedMean(FedAvgWeights):
    """FedAvg of clipped updates: Delta = sum_k c_k min(1, clip_norm / ||Delta_k||) Delta_k."""

    def __init__(self, clip_norm: float = 1.0):
        self.clip_norm = float(clip_norm)

    def aggregate(self, updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.aggregate_columns(UpdateColumns.whole(updates), weights)

    def aggregate_columns(self, updates: UpdateColumns, weights: torch.Tensor) -> torch.Tensor:
        norms = torch.zeros(updates.n, dtype=torch.float64, device=updates.device)
        for unit in updates.units():  # unit by unit (hypot of the norms so far and the unit's): any chunk width
            norms = torch.hypot(norms, unit.norm(dim=1))
        scale = (self.clip_norm / norms.clamp_min(torch.finfo(norms.dtype).tiny)).clamp(max=1.0)
        factor = (weights.to(norms) * scale)[:, None]
        return updates.map(lambda chunk: _row_sum(factor * chunk))  # products, then sums: no fused multiply-add


# --- rules on whole updates: the geometric median (RFA) and centered clipping, optionally on buckets ------------

def bucket(updates: torch.Tensor, weights: torch.Tensor, size: int, key) -> tuple[torch.Tensor, torch.Tensor]:
    """Random buckets of `size` rows (the last may be smaller): each bucket's weighted mean and summed weight.
    The permutation sorts one uniform per row drawn from `key`."""
    n = len(updates)
    if size <= 1 or n <= 1:
        return updates, weights
    order = torch.as_tensor(np.argsort(streams.uniform(np.asarray(key), n), kind="stable"), device=updates.device)
    rows, w = updates[order], weights[order]
    means, totals = [], []
    for start in range(0, n, size):
        wb = w[start:start + size]
        means.append((wb[:, None] * rows[start:start + size]).sum(0) / wb.sum())
        totals.append(wb.sum())
    return torch.stack(means), torch.stack(totals)


class Bucketed(OnBuckets, FedAvgWeights):
    """A rule on (optionally bucketed) updates: `rule(updates, weights)` after `bucket`."""

    def aggregate(self, updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Without a key (a direct call, or bucket_size 1): no bucketing."""
        return self.rule(updates, weights)

    @abstractmethod
    def rule(self, updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """One replica's Delta [dim] from its (bucketed) updates and weights."""


@part("aggregator", "geometric_median")
class GeometricMedian(Bucketed):
    """RFA (Pillutla, Kakade and Harchaoui 2022): the weighted geometric median argmin_v sum_k a_k ||v - Delta_k||,
    a_k = c_k / sum c, by the smoothed Weiszfeld iteration from the weighted mean:
    beta_k = a_k / max(nu, ||v - Delta_k||), v <- sum_k beta_k Delta_k / sum_k beta_k."""

    def __init__(self, rfa_iters: int = 8, rfa_nu: float = 1e-6, bucket_size: int = 1):
        self.iters, self.nu, self.bucket_size = int(rfa_iters), float(rfa_nu), int(bucket_size)

    def rule(self, updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        a = weights / weights.sum()
        v = (a[:, None] * updates).sum(0)
        for _ in range(self.iters):
            beta = a / (updates - v).norm(dim=1).clamp_min(self.nu)
            v = (beta[:, None] * updates).sum(0) / beta.sum()
        return v


@part("aggregator", "centered_clip")
class CenteredClip(Bucketed):
    """Centered clipping (Karimireddy, He and Jaggi 2021): L times v <- v + (1/n) sum_k clip_tau(Delta_k - v),
    clip_tau(z) = z min(1, tau / ||z||). The center starts at the round's coordinate-wise median: the harness's
    aggregators keep no state between rounds (the paper starts from the previous round's aggregate, its momentum)."""

    def __init__(self, cc_tau: float = 1.0, cc_iters: int = 3, bucket_size: int = 1):
        self.tau, self.iters, self.bucket_size = float(cc_tau), int(cc_iters), int(bucket_size)

    def rule(self, updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        s, n = torch.sort(updates, dim=0).values, len(updates)
        v = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
        for _ in range(self.iters):
            z = updates - v
            scale = (self.tau / z.norm(dim=1).clamp_min(torch.finfo(z.dtype).tiny)).clamp(max=1.0)
            v = v + (scale[:, None] * z).mean(0)
        return v
