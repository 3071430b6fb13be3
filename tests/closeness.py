"""Closeness relative to the magnitude compared: float error scales with the largest value, not with 1."""

from __future__ import annotations

import numpy as np
import torch


def assert_close_to_scale(actual, expected, rtol: float) -> None:
    """|actual - expected| <= rtol * max|expected| elementwise (so entries near 0 of a large vector pass too)."""
    actual, expected = torch.as_tensor(np.asarray(actual)), torch.as_tensor(np.asarray(expected))
    scale = float(expected.abs().max())
    assert scale > 0, "comparing against all zeros: nothing to scale by"
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale)
