"""Sums whose bits do not depend on the order of the terms: where client contributions meet, 8 bytes a parameter.

Floating-point addition is not associative, so a sum over clients that shards compute in pieces, in whatever
order their clients come, changes in its last bits with the number of shards; over thousands of rounds
(SCAFFOLD's control variates subtract nearly equal quantities) the third digit moves. Here every term is
rounded to a fixed-point grid and added as an integer held in a float64 word, below 2^53 where float64 addition
is exact: so partial sums from any split into shards, added in any order, are the same integers, and `value`
turns them into the same float64 bits.

The grid. A term's rounding may depend only on the term and on what every shard knows before it converts
anything: the round's model x (or, for a solver's sum such as SCAFFOLD's "control", the server tensor that sum
updates) and the round's clients per replica K. Each (replica, block of BLOCK coordinates) gets the step

    g = 2^(e + MARGIN_BITS - L),   e = max(FLOOR_EXP, the exponent of max |reference| over the block),
    L = 53 - bitlength(K),

so a term below 2^MARGIN_BITS times the block's largest reference value is an integer of |n| < 2^L, and K of
them add up below 2^53 (the `low` word: the 8 bytes a parameter a shard's reply carries). The grid is a
function of x, which every shard receives and every checkpoint holds, so a resume and a restarted shard convert
exactly as before, and there is no state to agree on.

Precision kept (tests/test_compact_sums.py; docs/performance.md, Exact sums): a term moves by at most g / 2, a
round's sum by at most K g / 2 < 2^(e + MARGIN_BITS + 2 bitlength(K) - 54): 2^-43 of the block's largest
reference value for K = 10. Measured against float64 sums of the same terms, 30 rounds: W1's delta and
SCAFFOLD's delta and control variates within 5e-14 of the block's largest reference value, the CNN's delta
(K = 3) within 4e-15. It degrades (a) for coordinates far smaller than the largest reference value of their
block (the error is absolute, relative to the block), (b) with K (each doubling costs two bits), (c) for
references below 2^FLOOR_EXP (~1e-6, and zero), whose step is that of 2^FLOOR_EXP (finer: the first round from
a zero start).

Larger terms, still exact and split-independent: a term of |n| >= 2^L (an update above 2^MARGIN_BITS times the
model's scale: the first round from a zero start) is split exactly into n = high 2^L + low, and the reply carries
a second word, `high`, in that round; one of |n| >= 2^(2L) (2^L times the block's reference: a diverged run), or
not finite, goes into a float64 `overflow` sum as an infinity of its sign (NaN stays NaN), whose sum is
order-independent too.

`FloatSum` is the `sums: float` alternative: plain float64 index_add, whose bits depend on the split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 1024  # coordinates sharing one grid step
MARGIN_BITS = 2  # a term up to 2^MARGIN_BITS times its block's largest reference value fits the low word
FLOOR_EXP = -20  # references below 2^FLOOR_EXP (and zero) get the step of 2^FLOOR_EXP
WORD_BITS = 53  # a sum of words stays an integer a float64 holds exactly
_CHUNK = 1 << 18  # elements converted at once (2 MB temporaries: fewer passes of small ops; 1 << 20 gains little)


@dataclass
class Grid:
    """The fixed-point step of each element of a [R, dim] sum: terms are rounded to integers n = round(x scale)."""

    scale: torch.Tensor  # [R, dim] float64 powers of two: 1 / g; [R, 1] when dim <= BLOCK (one block)
    low_bits: int  # L: terms of |n| < 2^L go in the low word, K of them stay below 2^53
    high_bits: int  # |high| < 2^high_bits, so K high words stay below 2^53 too

    @classmethod
    def of(cls, reference: torch.Tensor, terms: int) -> "Grid":
        """The grid of a sum over at most `terms` terms per element that updates `reference` [R, dim]."""
        rows, dim = reference.shape
        head = max(1, int(terms)).bit_length()
        low_bits = WORD_BITS - head
        reference = reference.detach()
        if dim <= BLOCK:  # one block a row: R exponents worked out on the host, a few ops instead of a dozen
            steps = [[2.0 ** (low_bits - MARGIN_BITS - _exponent(v))] for v in reference.abs().amax(-1).tolist()]
            return cls(torch.tensor(steps, dtype=torch.float64, device=reference.device), low_bits, WORD_BITS - head)
        ref = torch.nan_to_num(_block_max(reference).double(), nan=0.0, posinf=0.0)
        e = torch.frexp(ref).exponent.clamp_min(FLOOR_EXP)  # max |reference| < 2^e (frexp(0) gives 0)
        e = torch.where(ref > 0, e, torch.full_like(e, FLOOR_EXP))
        scale = torch.exp2((low_bits - MARGIN_BITS - e).double())  # [R, blocks]
        scale = scale[:, :, None].expand(-1, -1, BLOCK).reshape(rows, -1)[:, :dim]
        return cls(scale, low_bits, WORD_BITS - head)

    def columns(self, part: slice) -> torch.Tensor:
        """The scale of columns `part`: [R, width], or [R, 1] for a one-block grid (it broadcasts)."""
        return self.scale if self.scale.shape[1] == 1 else self.scale[:, part]

    def to(self, device: torch.device | str) -> "Grid":
        return Grid(self.scale.to(device), self.low_bits, self.high_bits)


def _block_max(reference: torch.Tensor) -> torch.Tensor:
    """[R, blocks]: max |reference| over each BLOCK coordinates (the last block may be shorter) as the larger of
    max and -min, read through views: no |x| or padded copy of the model (ResNet-18's grid: 0.10 s on the CPU
    with them, 0.015 s without)."""
    whole = reference.shape[1] - reference.shape[1] % BLOCK
    blocks, tail = reference[:, :whole].unflatten(1, (-1, BLOCK)), reference[:, whole:]
    most = torch.cat([blocks.amax(-1), tail.amax(-1, keepdim=True)], 1) if tail.shape[1] else blocks.amax(-1)
    least = torch.cat([blocks.amin(-1), tail.amin(-1, keepdim=True)], 1) if tail.shape[1] else blocks.amin(-1)
    return torch.maximum(most, -least)  # NaN stays NaN


def _exponent(largest: float) -> int:
    """e with largest < 2^e, at least FLOOR_EXP; FLOOR_EXP for 0 and for what is not finite (Grid.of's rule)."""
    if not (math.isfinite(largest) and largest > 0):
        return FLOOR_EXP
    return max(FLOOR_EXP, math.frexp(largest)[1])


class Grids:
    """The grid of each of a round's sums, built on first use from what the sum updates: "delta" from the model
    x, a solver's sum from the server tensor of its name in the round's context (SCAFFOLD's "control"), any
    other from zeros (the FLOOR_EXP step). Every shard and the driver build the same grids."""

    def __init__(self, x: torch.Tensor, ctx: dict[str, torch.Tensor], terms: int):
        self.x, self.ctx, self.terms = x, ctx, int(terms)
        self.built: dict[str, Grid] = {}

    def __getitem__(self, name: str) -> Grid:
        if name not in self.built:
            ref = self.x if name == "delta" else self.ctx.get(name)
            if ref is None or tuple(ref.shape) != tuple(self.x.shape):
                ref = torch.zeros_like(self.x)
            self.built[name] = Grid.of(ref.to(self.x.device), self.terms)
        return self.built[name]

    def to(self, device: torch.device | str) -> "Grids":
        moved = Grids(self.x.to(device), self.ctx, self.terms)
        moved.built = {name: grid.to(device) for name, grid in self.built.items()}
        return moved


class NumpyWire:
    """Pickles a sum's tensors as numpy arrays: Ray's object store writes and reads those without pickling their
    bytes (a torch tensor is pickled: for ResNet-18's 89 MB a put took 0.16-0.37 s against 0.01-0.02 s, a get
    0.12 s against 1 ms). What arrives is read-only shared memory, so it is copied once, into tensors the
    driver can add into."""

    def __getstate__(self) -> dict:
        return {name: None if t is None else t.detach().cpu().numpy() for name, t in vars(self).items()}

    def __setstate__(self, state: dict) -> None:
        for name, array in state.items():
            setattr(self, name, None if array is None else torch.from_numpy(np.array(array)))


@dataclass
class ExactSum(NumpyWire):
    """A sum over terms of shape [R, dim] (R: replicas) on a Grid, exact and order-independent.

    `add_rows(index, terms, grid)` adds terms[j] into row index[j]; `add(other)` merges another partial sum
    (another shard's, on the same grid); `value(grid)` is the float64 sum. Both kinds of addition commute bit
    for bit. The words are the whole reply: the grid is not sent, every side builds it from x.
    """

    low: torch.Tensor  # [R, dim] float64 integers (exact: below 2^53)
    high: torch.Tensor | None = None  # [R, dim] float64 integers, in units of 2^L steps; None: no term needed it
    overflow: torch.Tensor | None = None  # [R, dim] float64: +-inf/nan terms only; None: there were none

    @classmethod
    def zeros(cls, shape: tuple[int, ...], device: torch.device | str = "cpu") -> "ExactSum":
        return cls(torch.zeros(shape, dtype=torch.float64, device=device))

    def add_rows(self, index: torch.Tensor, terms: torch.Tensor, grid: Grid) -> "ExactSum":
        """terms [n, dim] (float64) into rows index [n], each rounded on its own to the grid."""
        if not terms.numel():
            return self
        one_row = grid.scale.shape[0] == 1  # one replica: the scale broadcasts, no gather
        dim = terms.shape[1]
        cols = max(1, min(dim, _CHUNK // len(index)))
        for start in range(0, dim, cols):
            part = slice(start, min(start + cols, dim))
            whole = cols == dim  # one pass (small models): no column views
            scale = grid.columns(part) if one_row else grid.columns(part)[index]
            n = torch.mul(terms if whole else terms[:, part], scale).round_()
            least, most = torch.aminmax(n)
            if -2.0 ** grid.low_bits < least.item() and most.item() < 2.0 ** grid.low_bits:
                (self.low if whole else self.low[:, part]).index_add_(0, index, n)  # below 2^53: exact in any order
            else:  # NaN compares False: here too
                self._add_wide(index, part, terms[:, part], n, grid)
        return self

    def _add_wide(self, index: torch.Tensor, part: slice, terms: torch.Tensor, n: torch.Tensor, grid: Grid) -> None:
        """Terms beyond the low word: n = high 2^L + low exactly; beyond the high word (or not finite): overflow."""
        fits = torch.isfinite(n) & (n.abs() < 2.0 ** (grid.low_bits + grid.high_bits))
        if not bool(fits.all()):
            if self.overflow is None:
                self.overflow = torch.zeros(self.low.shape, dtype=torch.float64, device=self.low.device)
            inf = torch.where(fits, torch.zeros_like(terms), terms * float("inf"))  # +-inf (NaN stays NaN)
            self.overflow[:, part].index_add_(0, index, inf)
            n = torch.where(fits, n, torch.zeros_like(n))
        high = torch.round(n * 2.0 ** -grid.low_bits)  # exact: a power of two, then an integer
        low = n - high * 2.0 ** grid.low_bits  # exact: an integer of at most 2^(L-1)
        if self.high is None:
            self.high = torch.zeros_like(self.low)
        self.high[:, part].index_add_(0, index, high)
        self.low[:, part].index_add_(0, index, low)

    def add(self, other: "ExactSum") -> "ExactSum":
        self.low += other.low.to(self.low.device)
        self.high = _plus(self.high, other.high)
        self.overflow = _plus(self.overflow, other.overflow)
        return self

    def value(self, grid: Grid) -> torch.Tensor:
        """float64 of the integer sum, a function of the integers alone: equal sums give equal bits."""
        total = self.low if self.high is None else self.high * 2.0 ** grid.low_bits + self.low
        total = total / grid.scale  # exact: a power of two
        return total if self.overflow is None else total + self.overflow

    def to(self, device: torch.device | str) -> "ExactSum":
        move = (lambda t: None if t is None else t.to(device))
        return ExactSum(self.low.to(device), move(self.high), move(self.overflow))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.low, self.high, self.overflow) if t is not None)


def _plus(mine: torch.Tensor | None, other: torch.Tensor | None) -> torch.Tensor | None:
    if other is None:
        return mine
    other = other.to(mine.device) if mine is not None else other
    return other.clone() if mine is None else mine.add_(other)


@dataclass
class FloatSum(NumpyWire):
    """`sums: float`: float64 index_add, the bits depending on the order of the additions (the shard split)."""

    total: torch.Tensor  # [R, dim] float64

    @classmethod
    def zeros(cls, shape: tuple[int, ...], device: torch.device | str = "cpu") -> "FloatSum":
        return cls(torch.zeros(shape, dtype=torch.float64, device=device))

    def add_rows(self, index: torch.Tensor, terms: torch.Tensor, grid: Grid | None) -> "FloatSum":
        self.total.index_add_(0, index, terms)
        return self

    def add(self, other: "FloatSum") -> "FloatSum":
        self.total += other.total.to(self.total.device)
        return self

    def value(self, grid: Grid | None) -> torch.Tensor:
        return self.total

    def to(self, device: torch.device | str) -> "FloatSum":
        return FloatSum(self.total.to(device))

    @property
    def nbytes(self) -> int:
        return self.total.numel() * 8
