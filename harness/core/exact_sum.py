"""Sums whose bits do not depend on the order of the terms: where client contributions meet.

Floating-point addition is not associative, so a sum over clients that shards compute in pieces, in
whatever order their clients come, changes in its last bits with the number of shards; over thousands of
rounds (SCAFFOLD's control variates subtract nearly equal quantities) the third digit moves. Here each
term is first rounded to a fixed grid, g = 2^-GRID_EXP, and written exactly as LIMBS signed integers of
LIMB_BITS bits:

    x ~ sign(x) * sum_i l_i 2^(LIMB_BITS i) g,   0 <= l_i < 2^LIMB_BITS,

so |x| < 2^(LIMBS LIMB_BITS - GRID_EXP) = 2^140 (beyond float32's range) and every term's rounding depends on
that term alone.
Integer addition is exact and associative, so partial sums from any split into shards, added in any order,
are the same integers, and `to_float` turns them into the same float64 bits. Up to 2^(63 - LIMB_BITS) =
2^23 terms per element fit in int64 without a carry. A term that is not finite or too large for the limbs
(|x| >= 2^140 ~ 1.4e42: a diverged run) goes into a float64 `overflow` sum as an infinity of its sign (NaN
stays NaN), so that sum only ever holds inf, -inf, NaN or zeros, whose sum is order-independent too (NaN if any
NaN or both infinities, else the infinity): a float64 run whose client update reaches 2^140 is diverged.

Rounding to g = 2^-100 changes a term only where |x| < 2^-47 (a float64 below that has bits finer than g),
by at most g / 2 = 2^-101 absolute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LIMB_BITS = 40
LIMBS = 6
GRID_EXP = 100
_LIMB = float(2 ** LIMB_BITS)
_TOP = 2.0 ** (LIMBS * LIMB_BITS - GRID_EXP)  # terms at or above this (in magnitude) overflow the limbs


def to_limbs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float tensor [...] as int64 limbs [LIMBS, ...] (least significant first) and its overflow terms [...]."""
    x = x.double()
    fits = torch.isfinite(x) & (x.abs() < _TOP)
    overflow = torch.where(fits, torch.zeros_like(x), x * math.inf)  # +-inf (NaN stays NaN): order-independent
    a = torch.round(torch.where(fits, x, torch.zeros_like(x)).abs() * 2.0 ** GRID_EXP)  # exact: a power of 2
    sign = torch.sign(x).to(torch.int64)
    limbs = torch.empty((LIMBS, *x.shape), dtype=torch.int64, device=x.device)
    for i in reversed(range(LIMBS)):  # each step is exact: a's bits lie in one 53-bit window
        unit = _LIMB ** i
        high = torch.floor(a / unit)
        limbs[i] = high.to(torch.int64) * sign
        a = a - high * unit
    return limbs, overflow


def from_limbs(limbs: torch.Tensor, overflow: torch.Tensor) -> torch.Tensor:
    """float64 of a limb sum: carries normalised first, so equal integer sums give equal bits."""
    limbs = limbs.clone()
    base = 1 << LIMB_BITS
    for i in range(LIMBS - 1):
        carry = torch.div(limbs[i], base, rounding_mode="floor")
        limbs[i] -= carry * base
        limbs[i + 1] += carry
    value = limbs[LIMBS - 1].double()
    for i in reversed(range(LIMBS - 1)):
        value = value * _LIMB + limbs[i].double()
    return value * 2.0 ** -GRID_EXP + overflow


@dataclass
class ExactSum:
    """A sum over terms of shape [rows, *shape] (rows: replicas), exact and order-independent.

    `add_rows(index, terms)` adds terms[j] into row index[j]; `add(other)` merges another partial sum
    (another shard's); `value()` is the float64 sum. Both kinds of addition commute bit for bit.
    """

    limbs: torch.Tensor  # [LIMBS, rows, *shape] int64
    overflow: torch.Tensor  # [rows, *shape] float64: inf/nan/huge terms only

    @classmethod
    def zeros(cls, shape: tuple[int, ...], device: torch.device | str = "cpu") -> "ExactSum":
        return cls(torch.zeros((LIMBS, *shape), dtype=torch.int64, device=device),
                   torch.zeros(shape, dtype=torch.float64, device=device))

    def add_rows(self, index: torch.Tensor, terms: torch.Tensor) -> "ExactSum":
        limbs, overflow = to_limbs(terms)
        self.limbs.index_add_(1, index, limbs)
        self.overflow.index_add_(0, index, overflow)
        return self

    def add(self, other: "ExactSum") -> "ExactSum":
        self.limbs += other.limbs.to(self.limbs.device)
        self.overflow += other.overflow.to(self.overflow.device)
        return self

    def value(self) -> torch.Tensor:
        return from_limbs(self.limbs, self.overflow)

    def to(self, device: torch.device | str) -> "ExactSum":
        return ExactSum(self.limbs.to(device), self.overflow.to(device))

    @property
    def nbytes(self) -> int:
        return self.limbs.numel() * 8 + self.overflow.numel() * 8
