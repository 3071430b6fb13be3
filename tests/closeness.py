"""Closeness relative to the magnitude compared: float error scales with the largest value, not with 1.

And the bound that comparisons against an independent computation (numpy, scipy, a test's own torch code) use:
the two may add the same terms in another order, with other kernels (OpenBLAS and ATen pick theirs by CPU), so
they agree to a rounding bound, never to the bit. Exact bits are promised only product against product."""

from __future__ import annotations

import numpy as np
import torch

EPS64 = float(np.finfo(np.float64).eps)


def assert_close_to_scale(actual, expected, rtol: float) -> None:
    """|actual - expected| <= rtol * max|expected| elementwise (so entries near 0 of a large vector pass too)."""
    actual, expected = torch.as_tensor(np.asarray(actual)), torch.as_tensor(np.asarray(expected))
    scale = float(expected.abs().max())
    assert scale > 0, "comparing against all zeros: nothing to scale by"
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale)


def sum_rounding(terms, axis: int = 0, eps: float = EPS64) -> np.ndarray:
    """A bound on |computed - exact| for one computed sum of n terms along `axis` (each term possibly a rounded
    product, as in a dot product): n eps sum|t_i|. Any order and blocking, with or without fused multiply-adds, is
    within it (Higham, Accuracy and Stability of Numerical Algorithms, 2002, sec. 3.1 and 4.2: gamma_n sum|t_i|
    with gamma_n = n u / (1 - n u) <= n eps while n eps <= 1, u = eps / 2). Two independent computations of the
    same sum differ by at most twice this."""
    terms = np.abs(np.asarray(terms, dtype=np.float64))
    return terms.shape[axis] * eps * terms.sum(axis)


def mean_rounding(values, eps: float = EPS64) -> float:
    """A bound on |computed - exact| for one computed mean of n values: (n + 1) eps mean|x| (the sum's n eps
    sum|x| (sum_rounding) over n, and the division's eps/2 |mean| <= eps/2 mean|x|). Two computations of the mean
    (a table's and a test's own) differ by at most twice this."""
    values = np.abs(np.asarray(values, dtype=np.float64))
    return float((sum_rounding(values, eps=eps) + eps * values.sum()) / len(values))
