"""Richardson-Romberg extrapolation (Mangold et al.): two coupled runs at (gamma, H) and at 2 gamma (or 2H), one
estimate a theta^(1) + b theta^(2) with the first-order bias cancelled. The coupled replicas and the recorded
`rr` series are algorithms/series.py's; the weights are here.
"""

from __future__ import annotations


def rr_coefficients(kind: str, H: int) -> tuple[float, float]:
    """Weights (a, b) of the Richardson-Romberg estimate a theta^(1) + b theta^(2).

    Over gamma: 2 theta^(gamma) - theta^(2 gamma). Over H (PAPERS.md's consistent form of
    Mangold et al.'s Remark 1): ((2H-1)/H) theta^(H) - ((H-1)/H) theta^(2H). The weights sum to 1
    and cancel a first-order bias c (H-1): (2H-1)(H-1)/H - (H-1)(2H-1)/H = 0.
    """
    if kind == "gamma":
        return 2.0, -1.0
    return (2 * H - 1) / H, -(H - 1) / H
