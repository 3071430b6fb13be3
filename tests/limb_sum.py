"""The former exact sums (fedharness.core.exact_sum before the compact grid): the oracle of the tests.

Exact 240-bit sums of float64 terms on the grid 2^-100, 56 bytes a parameter. Kept here only as the oracle of the
unit tests of exactness (tests/test_same_bits.py), which run on the product's compact sums and compare them with it.

Floating-point addition is not associative, so a sum over clients that shards compute in pieces, in
whatever order their clients come, changes in its last bits with the number of shards; over thousands of
rounds (SCAFFOLD's control variates subtract nearly equal quantities) the third digit moves. Here each
term is first rounded to a fixed grid, g = 2^-GRID_EXP, and written exactly as LIMBS integers of
LIMB_BITS bits (held in float64, which represents such integers exactly):

    x ~ sum_i l_i 2^(LIMB_BITS i) g,   0 <= l_i < 2^LIMB_BITS for i < LIMBS - 1, the top limb signed,

so |x| < 2^(LIMBS LIMB_BITS - GRID_EXP) = 2^140 (beyond float32's range) and every term's rounding depends on
that term alone. Integer addition is exact and associative, so partial sums from any split into shards, added
in any order, are the same integers, and `from_limbs` turns them into the same float64 bits. A float64 limb
sum stays exact for MAX_TERMS = 2^13 terms per element (carries are normalised before that, and a row takes
at most that many terms in a round). A term that is not finite or too large for the limbs (|x| >= 2^140 ~
1.4e42: a diverged run) goes into a float64 `overflow` sum as an infinity of its sign (NaN stays NaN), so that
sum only ever holds inf, -inf, NaN or zeros, whose sum is order-independent too (NaN if any NaN or both
infinities, else the infinity): a float64 run whose client update reaches 2^140 is diverged.

The cost is elementwise work on every term (a dozen passes), in blocks small enough that the temporaries are
reused rather than freshly mapped: see docs/performance.md for what it adds to a round.

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
MAX_TERMS = 2 ** (53 - LIMB_BITS)  # terms per element whose limbs a float64 sums exactly (8192)
_LIMB = float(2 ** LIMB_BITS)
_TOP = 2.0 ** (LIMBS * LIMB_BITS - GRID_EXP)  # terms at or above this (in magnitude) overflow the limbs
_UNITS = torch.tensor([2.0 ** (-LIMB_BITS * i) for i in range(LIMBS)], dtype=torch.float64)
_BLOCK = 1 << 14  # elements converted at once: small temporaries are reused, large ones cost page faults


def to_limbs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A float tensor [...] as limbs [LIMBS, ...] (float64 integers, least significant first: each in
    [0, 2^LIMB_BITS) but the top one, which carries the sign) and its overflow terms (None: there are none)."""
    x = x.double()
    overflow = None
    if x.numel() and not bool(x.abs().max() < _TOP):  # NaN compares False: the slow path
        fits = torch.isfinite(x) & (x.abs() < _TOP)
        overflow = torch.where(fits, torch.zeros_like(x), x * math.inf)  # +-inf (NaN stays NaN)
        x = torch.where(fits, x, torch.zeros_like(x))
    a = torch.round(x * 2.0 ** GRID_EXP)  # exact: a power of 2; |a| < 2^240 with at most 53 significant bits
    # q_i = floor(a / 2^(LIMB_BITS i)) for all limbs at once, then limb_i = q_i - 2^LIMB_BITS q_(i+1). Every
    # step is exact: each q_i and each difference is an integer a float64 holds.
    q = torch.floor(a * _UNITS.to(a.device).view(-1, *([1] * a.dim())))
    q[:-1] -= q[1:] * _LIMB
    return q, overflow


def normalize(limbs: torch.Tensor) -> torch.Tensor:
    """The same integer with every limb but the top one in [0, 2^LIMB_BITS): its one representation."""
    limbs = limbs.clone()
    for i in range(LIMBS - 1):
        carry = torch.floor(limbs[i] / _LIMB)
        limbs[i] -= carry * _LIMB
        limbs[i + 1] += carry
    return limbs


def from_limbs(limbs: torch.Tensor, overflow: torch.Tensor) -> torch.Tensor:
    """float64 of a limb sum, from its one representation, so equal integer sums give equal bits."""
    limbs = normalize(limbs)
    value = limbs[LIMBS - 1]
    for i in reversed(range(LIMBS - 1)):
        value = value * _LIMB + limbs[i]
    return value * 2.0 ** -GRID_EXP + overflow


@dataclass
class LimbSum:
    """A sum over terms of shape [rows, *shape] (rows: replicas), exact and order-independent.

    `add_rows(index, terms)` adds terms[j] into row index[j]; `add(other)` merges another partial sum
    (another shard's); `value()` is the float64 sum. Both kinds of addition commute bit for bit. Each limb is
    a float64 integer sum, exact for up to MAX_TERMS terms per element: carries are normalised before that.
    """

    limbs: torch.Tensor  # [LIMBS, rows, *shape] float64 integers
    overflow: torch.Tensor  # [rows, *shape] float64: inf/nan terms only
    terms: int = 0  # terms added since the last normalisation (a bound on any element's count)

    @classmethod
    def zeros(cls, shape: tuple[int, ...], device: torch.device | str = "cpu") -> "LimbSum":
        return cls(torch.zeros((LIMBS, *shape), dtype=torch.float64, device=device),
                   torch.zeros(shape, dtype=torch.float64, device=device))

    def add_rows(self, index: torch.Tensor, terms: torch.Tensor) -> "LimbSum":
        step = MAX_TERMS // 2  # more terms at once could pass the exact range of one limb sum
        if len(index) > step:
            for start in range(0, len(index), step):
                self.add_rows(index[start:start + step], terms[start:start + step])
            return self
        flat, limbs, overflow = terms.reshape(len(index), -1), self.limbs.flatten(2), self.overflow.flatten(1)
        cols = max(1, min(flat.shape[1], _BLOCK))
        rows = max(1, _BLOCK // cols)  # blocks of about _BLOCK elements over rows too: 640 clients of W1's
        for first in range(0, len(index), rows):  # 64 replicas converted at once took 2.8x as long
            block = slice(first, first + rows)
            for start in range(0, flat.shape[1], cols):
                part = slice(start, start + cols)
                add, over = to_limbs(flat[block, part])
                limbs[:, :, part].index_add_(1, index[block], add)
                if over is not None:
                    overflow[:, part].index_add_(0, index[block], over)
        return self._counted(len(index))

    def add(self, other: "LimbSum") -> "LimbSum":
        self.limbs += other.limbs.to(self.limbs.device)
        self.overflow += other.overflow.to(self.overflow.device)
        return self._counted(other.terms)

    def _counted(self, added: int) -> "LimbSum":
        self.terms += added
        if self.terms > MAX_TERMS // 2:
            self.limbs, self.terms = normalize(self.limbs), 1  # normalised limbs hold less than one term's worth
        return self

    def value(self) -> torch.Tensor:
        return from_limbs(self.limbs, self.overflow)

    def to(self, device: torch.device | str) -> "LimbSum":
        return LimbSum(self.limbs.to(device), self.overflow.to(device), self.terms)

    @property
    def nbytes(self) -> int:
        return self.limbs.numel() * 8 + self.overflow.numel() * 8
