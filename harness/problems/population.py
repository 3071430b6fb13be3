"""Client sizes n_k and weights p_k = n_k / n of a population too large for per-client arrays (N up to 10^8).

A lazily generated data set knows n_k as a pure function of k (drawn from the counter-based streams), so
nothing per client has to be stored: `ClientSizes` computes n_k for the clients asked about. Drawing clients
with probability p_k (Li et al.'s scheme I) needs cumulative sums; they are kept per block of BLOCK clients
(8 bytes per block: 3 MB at N = 10^8), built once in vectorized chunks, and a draw recomputes the sizes of
the one block it lands in. With a constant size everything is a closed form and the set-up is O(1).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

BLOCK = 256  # clients per cumulative sum: memory N / BLOCK * 8 bytes (3 MB at 10^8); a draw recomputes BLOCK sizes
CHUNK = 1 << 16  # clients whose sizes are computed at once while building the block sums (a multiple of BLOCK)

SizeFn = Callable[[np.ndarray], np.ndarray]  # int64 client indices (any shape) -> their int64 n_k


class ClientSizes:
    """n_k of clients 0..N-1: `sizes[clients]`, `len(sizes)`, `sizes.total`, `sizes.draw(u)`.

    Exactly one of `size_of` (n_k as a vectorized pure function of k) and `constant` is given.
    `np.asarray(sizes)` materialises all N sizes (for small N and tests only).
    """

    def __init__(self, num_clients: int, size_of: SizeFn | None = None, constant: int | None = None):
        if (size_of is None) == (constant is None):
            raise ValueError("ClientSizes needs exactly one of size_of and constant")
        self.num_clients, self.size_of, self.constant = int(num_clients), size_of, constant
        if constant is not None:
            self.block_ends = None
            self.total = self.num_clients * int(constant)
            return
        ends = []  # cumulative size at the end of each block
        carry = 0
        for start in range(0, self.num_clients, CHUNK):
            sizes = size_of(np.arange(start, min(start + CHUNK, self.num_clients), dtype=np.int64))
            block_sums = np.add.reduceat(sizes, np.arange(0, len(sizes), BLOCK))
            cum = np.cumsum(block_sums) + carry
            ends.append(cum)
            carry = int(cum[-1])
        self.block_ends = np.concatenate(ends)
        self.total = carry

    def __len__(self) -> int:
        return self.num_clients

    def __getitem__(self, clients) -> np.ndarray:
        clients = np.asarray(clients, dtype=np.int64)
        if self.constant is not None:
            return np.full(clients.shape, self.constant, dtype=np.int64)
        return np.asarray(self.size_of(clients), dtype=np.int64)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[np.arange(self.num_clients)]
        return out if dtype is None else out.astype(dtype)

    def nbytes(self) -> int:
        """Bytes held for the population (the block sums), whatever N is."""
        return 0 if self.block_ends is None else self.block_ends.nbytes

    def draw(self, u: np.ndarray) -> np.ndarray:
        """One client per uniform in [0, 1), with probability n_k / total: the k with C_{k-1} <= u total < C_k
        (C the cumulative sizes), as searchsorted(cumsum(p), u, "right") picks it."""
        u = np.asarray(u, dtype=np.float64)
        target = np.minimum(np.floor(u * self.total).astype(np.int64), self.total - 1)
        if self.constant is not None:
            return target // self.constant
        block = np.searchsorted(self.block_ends, target, side="right")
        before = np.where(block > 0, self.block_ends[np.maximum(block - 1, 0)], 0)
        members = block[..., None] * BLOCK + np.arange(BLOCK)  # the block's clients (past N in the last block)
        valid = members < self.num_clients
        sizes = np.where(valid, self[np.where(valid, members, 0)], 0)
        within = (np.cumsum(sizes, axis=-1) <= (target - before)[..., None]).sum(axis=-1)
        return block * BLOCK + within


class ClientWeights:
    """p_k = n_k / n of a ClientSizes: `p[clients]` (float64), `len(p)`, `p.draw(u)`; np.asarray materialises."""

    def __init__(self, sizes: ClientSizes):
        self.sizes = sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, clients) -> np.ndarray:
        return self.sizes[clients] / self.sizes.total

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.asarray(self.sizes) / self.sizes.total
        return out if dtype is None else out.astype(dtype)

    def draw(self, u: np.ndarray) -> np.ndarray:
        return self.sizes.draw(u)


def draw_by_weight(p, u: np.ndarray) -> np.ndarray:
    """Clients drawn with probability p_k, one per uniform u in [0, 1): blockwise for ClientWeights (no O(N)
    pass), by the cumulative sums of an array otherwise."""
    if isinstance(p, ClientWeights):
        return p.draw(u)
    cdf = np.cumsum(p)
    return np.minimum(np.searchsorted(cdf / cdf[-1], u, side="right"), len(p) - 1)


def total_size(sizes) -> int:
    """n = sum_k n_k of a ClientSizes or an array."""
    return sizes.total if isinstance(sizes, ClientSizes) else int(np.sum(sizes))
